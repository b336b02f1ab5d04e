"""Ad hoc experiment, not kept in the engine: Seer's high-priority draft band marked by
each response's TRUE length, the best any online mark could do at picking the long
responses. A response is high priority from its first chunk when its true length is at
least ``SEER_MARK_TOKENS``; ``priority_weight`` (Seer's lambda) weighs its draft nodes.
From the repository root:

    SEER_MARK_TOKENS=80000 python benchmarks/results/simulator/oracle-mark/oracle_mark.py \\
        simulate --setup kimi-k2 --iterations 2 --repeat-prompts --policy baseline,seer+history \\
        --speculative-config '{"priority_weight": 4}' --report OUT
"""

import os
import sys

from seer_engine.entrypoints.cli import main
from seer_engine.rollout import context_manager
from seer_engine.sim import simulator

TRUE_LENGTHS: dict[str, int] = {}
try:
    MARK_TOKENS = int(os.environ["SEER_MARK_TOKENS"])
except (KeyError, ValueError):
    sys.exit("set SEER_MARK_TOKENS to a whole number of tokens (responses at least that long are marked)")
_true_lengths = simulator.true_lengths


def true_lengths(groups, max_tokens):
    """Each iteration's lengths, kept where the patched mark can read them."""
    lengths = _true_lengths(groups, max_tokens)
    TRUE_LENGTHS.update(lengths)
    return lengths


def long_tail(self, sample):
    return TRUE_LENGTHS.get(sample.key, 0) >= MARK_TOKENS


simulator.true_lengths = true_lengths
context_manager.ContextManager.long_tail = long_tail

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
