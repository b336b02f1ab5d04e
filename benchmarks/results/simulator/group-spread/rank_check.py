"""How the Context Manager's estimator ranks iteration 2's groups from iteration 1's
lengths alone (no simulation): the worst rank of a group that writes a response at the
cap in iteration 2. Written for commit 8c2d5fe, whose estimator reads each group's own
spread (``SIGMA_PRIOR_DOF``); "before" sets that prior's weight to 1e9, which gives
every group the population's spread, as the estimator before and after that commit does.

    git worktree add /tmp/gs8c 8c2d5fe   # with the built extensions copied in
    cd /tmp/gs8c && PYTHONPATH=. python .../rank_check.py > .../rank_check.txt
"""

from __future__ import annotations

import seer_engine.rollout.group_estimator as ge
from seer_engine.sim.setups import SETUPS
from seer_engine.sim.simulator import setup_groups


def ranks(groups, cap: int, dof: float) -> dict[str, int]:
    ge.SIGMA_PRIOR_DOF = dof
    est = ge.GroupMaxEstimator()
    for g in groups:
        est.register(g.group_id, len(g.lengths), cap, g.prompt_len)
    for g in groups:
        est.set_history(g.group_id, [(min(x, cap), 1.0) for x in g.lengths])
    est._refit_prior()
    value = {g.group_id: est.estimate(g.group_id) for g in groups}
    return {gid: i for i, gid in enumerate(sorted(value, key=lambda k: -value[k]))}


for setup, seed in (("kimi-k2", 0), ("kimi-k2", 1), ("kimi-k2", 2), ("moonlight", 0)):
    s = SETUPS[setup]
    first, second = setup_groups(s, seed, 0), setup_groups(s, seed, 1)
    capped = [g.group_id for g in second if max(g.lengths) >= s.max_tokens]
    worst = {name: max(ranks(first, s.max_tokens, dof)[gid] for gid in capped)
             for name, dof in (("before", 1e9), ("after", 7.0))}  # fmt: skip
    print(f"{setup} seed {seed}: {len(capped)} groups reach the cap; worst rank before {worst['before']}, "
          f"after {worst['after']} (of {len(first)})")  # fmt: skip
