"""Ad hoc experiment, not kept: re-queued chunks ranked by the tokens their response has
already written (most first), ahead of fresh responses; the 120 s starvation guard still
applies. From the repository root:

    python benchmarks/results/simulator/tail/attained_service_order.py \\
        --setup kimi-k2 --policy context --last 3
"""

import sys
from pathlib import Path

from seer_engine.rollout import context_manager

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import sim_tail  # noqa: E402  (benchmarks/sim_tail.py)

_wait_order = context_manager.ContextManager.rank_key


def rank_key(self, sample):
    key = _wait_order(self, sample)
    if key[:2] == (2, 1) and sample.num_generated > 0:
        return (2, 0, -sample.num_generated, sample.group.order, sample.sample_index)
    return key


context_manager.ContextManager.rank_key = rank_key

if __name__ == "__main__":
    sys.exit(sim_tail.main(sys.argv[1:]))
