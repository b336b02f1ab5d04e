"""Ad hoc experiment, not kept: the adaptive budget values a request's k-th draft node by
the acceptance model's own increment A(k) - A(k-1) (a token tree's curve: about 0.35
more accepted tokens each time the budget doubles), scaled by the request's estimate,
instead of the chain's a^k. Everything else is ``seer_engine simulate``. From the
repository root:

    python benchmarks/results/simulator/priority-weight/curve_budget.py \\
        --setup kimi-k2 --iterations 2 --repeat-prompts --policy baseline,seer,seer+history --report OUT
"""

import sys

import numpy as np

from seer_engine.entrypoints.cli import main
from seer_engine.sim.acceptance import default_acceptance
from seer_engine.spec_decode import budget

_model = default_acceptance(8)
_curve = np.array([_model.accepted_per_step(k, 0.5, 0.0) for k in range(0, 64)])
INCREMENTS = np.maximum(np.diff(_curve), 1e-6)  # the k-th node's worth, k = 1, 2, ...
FIRST = INCREMENTS[0]  # a request whose estimate equals this gets the curve as it is


def allocate_rates(self, rates, max_nodes, weights=None):
    n = len(rates)
    if not n or max_nodes <= 0:
        return [0] * n
    cost = self.cost
    a = np.clip(np.asarray(rates, dtype=float), 0.0, 0.999)
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=float)
    gains = ((w * a / FIRST)[:, None] * INCREMENTS[None, :max_nodes]).ravel()
    rows = np.repeat(np.arange(n), max_nodes)
    start = cost.per_token_s * w.sum() / (cost.fixed_s + cost.per_token_s * n)
    worth = np.flatnonzero(gains > start)
    order = worth[np.argsort(-gains[worth], kind="stable")]
    g = gains[order]
    taken = np.arange(g.size)
    tokens = w.sum() + np.concatenate(([0.0], np.cumsum(g)[:-1]))
    seconds = cost.fixed_s + cost.per_token_s * (n + taken)
    pays = g * seconds > cost.per_token_s * tokens
    stop = g.size if pays.all() else int(np.argmin(pays))
    return np.bincount(rows[order[:stop]], minlength=n).tolist()


budget.AdaptiveBudget.allocate_rates = allocate_rates

if __name__ == "__main__":
    sys.exit(main(["simulate", *sys.argv[1:]]))
