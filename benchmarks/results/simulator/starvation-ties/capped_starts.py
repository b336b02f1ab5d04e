"""Ad hoc measurement behind the README's starvation-tie section: on qwen2vl-72b (seed 0,
iteration 1, ``context``), how many probes pass one chunk, and when the groups with a
response at the cap start their last sibling. ``--ties`` applies the same change as
``starvation_ties.py``. From the repository root:

    python benchmarks/results/simulator/starvation-ties/capped_starts.py [--ties]
"""

import argparse
import statistics
import sys
from pathlib import Path

from seer_engine.rollout.context_manager import PROBE_INDEX
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.types import sample_key
from seer_engine.sim.acceptance import acceptance_for
from seer_engine.sim.setups import SETUPS
from seer_engine.sim.simulator import policy_for, setup_groups, simulate, true_lengths

AT_ONCE_S = 60.0  # a last sibling started before this started with the first wave


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ties", action="store_true", help="equally old starving responses in the policy's order")
    args = p.parse_args()
    if args.ties:  # the patch itself lives in starvation_ties.py; importing it applies it
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import starvation_ties  # noqa: F401
    setup = SETUPS["qwen2vl-72b"]
    groups = setup_groups(setup, 0)
    lengths = true_lengths(groups, setup.max_tokens)
    probes = [lengths[sample_key(g.group_id, PROBE_INDEX)] for g in groups]
    past = sum(x > setup.chunk_tokens for x in probes)
    share = past / len(probes)
    print(f"probes past one {setup.chunk_tokens}-token chunk: {past} of {len(probes)} ({share:.0%})")
    policy = policy_for("context", groups, setup.max_tokens, setup.starvation_s, None)
    res = simulate(
        groups, policy, setup.profile, setup.instances, setup.max_tokens, setup.chunk_tokens,
        SeerPlacement(), acceptance=acceptance_for(None, setup.samples),
    )  # fmt: skip
    last_starts = []
    for gid, samples in res.samples.items():
        keys = [sample_key(gid, s.sample_index) for s in samples]
        if max(lengths[k] for k in keys) >= setup.max_tokens:
            last_starts.append(max(res.started_at[k] for k in keys))
    late = sorted(x for x in last_starts if x > AT_ONCE_S)
    print(f"makespan {res.metrics.makespan_s:,.0f} s; {len(last_starts)} groups with a response at the cap, "
          f"{len(late)} start their last sibling late: {late[0]:,.0f}-{late[-1]:,.0f} s "
          f"(median {statistics.median(late):,.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
