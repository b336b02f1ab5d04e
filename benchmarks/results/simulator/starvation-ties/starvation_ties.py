"""Ad hoc experiment, not kept in the engine: responses past the starvation guard that
waited equally long go in the policy's order instead of their arrival order. From the
repository root:

    python benchmarks/results/simulator/starvation-ties/starvation_ties.py \\
        simulate --setup moonlight --iterations 3 --repeat-prompts \\
        --policy baseline,context,context+history,oracle --report OUT
"""

import sys

from seer_engine.entrypoints.cli import main
from seer_engine.rollout.policies import RolloutPolicy


def priority(self, sample, now):
    if self.starving(sample.enqueued_at, now):
        return (0, sample.enqueued_at, self.rank_key(sample))
    return (1, self.rank_key(sample))


RolloutPolicy.priority = priority

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
