"""Online estimate of each group's longest response, from what a scheduler can see.

A group's responses are modelled as log-normal around the group's log-median ``mu``
with a within-group spread ``sigma`` (the Qwen3 trace: sd of log length ~0.33 within
a group). What the scheduler sees of a group updates a posterior over ``mu`` on a
fixed grid:

- a finished response gives its exact length (one that hit ``max_tokens`` only says
  it was at least that long);
- a response in flight gives a lower bound: the tokens it had at its last chunk end;
- earlier iterations of the same prompt (the history store) give lengths seen
  before, down-weighted because the policy has changed since;
- the prior is this rollout's own population of groups, refitted as evidence comes
  in (empirical Bayes: a regression of the groups' posterior means on the log of
  their prompt's length, and the spread around it). Before any evidence, a longer
  prompt is assumed to mean a somewhat longer answer (``prompt_slope``; the Qwen3
  trace's log-log slope is ~0.7); the refit replaces that with what the rollout
  shows, and prompts of one length make it moot.

The estimate is the expected longest response of the group (capped at
``max_tokens``) under that posterior: finished responses count as they are, every
unfinished one as a draw above its lower bound. Nothing here ever sees a true
length: only finishes, progress at chunk ends, and history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DEFAULT_SIGMA = 0.33  # within-group sd of log length (trace: 0.34 +- 0.09 per group)
GRID = 40  # points of the mu grid
T_POINTS = 48  # points of the length grid for E[max]
_REFIT_EVERY = 400  # observations between refits of the population prior (after the first ones)


def _log_erfc(x: np.ndarray) -> np.ndarray:
    """log(erfc(x)), accurate in the far right tail (Chebyshev fit, relative error < 1.2e-7)."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))  # fmt: skip
    right = np.log(t) + poly
    left = np.log(np.maximum(2.0 - np.exp(right), 1e-300))
    return np.where(x >= 0, right, left)


def _log_sf(z: np.ndarray) -> np.ndarray:
    """log P(Z > z) for a standard normal."""
    return _log_erfc(z / math.sqrt(2.0)) - math.log(2.0)


def _cdf(z: np.ndarray) -> np.ndarray:
    return 1.0 - np.exp(_log_sf(z))


@dataclass
class _Group:
    n: int
    max_tokens: int
    log_prompt: float
    finished: dict[int, int] = field(default_factory=dict)  # sample index -> length
    progress: dict[int, int] = field(default_factory=dict)  # sample index -> tokens at its last chunk end
    history: list[tuple[int, float]] = field(default_factory=list)  # (length, weight) from earlier iterations
    loglik: np.ndarray | None = None  # over the mu grid, without the prior (None: stale)
    estimate: float | None = None  # E[longest] (None: stale)


class GroupMaxEstimator:
    """Per-group posterior over the log-median length; ``estimate(gid)``: the expected
    longest response. ``sigma``: within-group sd of log length."""

    def __init__(
        self, sigma: float = DEFAULT_SIGMA, history_weight: float = 1.0, prompt_slope: float = 0.5
    ) -> None:
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        self.sigma = sigma
        self.history_weight = history_weight
        self._groups: dict[str, _Group] = {}
        self._grid: np.ndarray | None = None  # mu values (log-median lengths)
        self._prior_mean: float | None = None  # at the mean log prompt length
        self._prior_slope = prompt_slope  # per unit of log prompt length
        self._prior_sd = 1.0
        self._log_prompt_sum = 0.0
        self._observations = 0
        self._next_refit = 50
        self.epoch = 0  # bumped whenever every group's estimate may have changed

    # -- evidence ------------------------------------------------------------------------

    def register(self, group_id: str, n: int, max_tokens: int, prompt_len: int = 0) -> None:
        log_prompt = math.log(max(prompt_len, 1))
        self._groups[group_id] = _Group(n, max_tokens, log_prompt)
        self._log_prompt_sum += log_prompt
        if self._grid is None:
            self._prior_mean = math.log(max_tokens) - 1.5
        self._cover(max_tokens)

    def _cover(self, max_tokens: int) -> None:
        """Stretch the grid of log-medians over a new, larger budget (a server's requests
        may ask for any max_tokens); every group's posterior is recomputed on it."""
        top = math.log(max(max_tokens, 2)) + 1.0
        if self._grid is not None and top <= self._grid[-1] + 1e-9:
            return
        self._grid = np.linspace(min(math.log(16.0), top - 3.0), top, GRID)
        for g in self._groups.values():
            g.loglik = g.estimate = None
        self.epoch += 1

    def raise_budget(self, group_id: str, max_tokens: int) -> None:
        g = self._groups[group_id]
        if max_tokens > g.max_tokens:
            g.max_tokens = max_tokens
            g.estimate = None
            self._cover(max_tokens)

    def set_history(self, group_id: str, lengths: list[tuple[int, float]]) -> None:
        """(length, weight) of this prompt's responses in earlier iterations: evidence
        worth ``history_weight`` x weight of a sibling's (the policy has moved since)."""
        g = self._groups[group_id]
        g.history = [(int(x), float(w) * self.history_weight) for x, w in lengths if x > 0]
        g.loglik = g.estimate = None

    def forget(self, group_id: str) -> None:
        g = self._groups.pop(group_id, None)
        if g is not None:
            self._log_prompt_sum -= g.log_prompt

    def observe_progress(self, group_id: str, index: int, generated: int) -> None:
        """A response is still running and has ``generated`` tokens (a chunk ended)."""
        g = self._groups[group_id]
        if index in g.finished or generated <= g.progress.get(index, 0):
            return
        g.progress[index] = generated
        self._changed(g)

    def observe_finished(self, group_id: str, index: int, length: int) -> None:
        g = self._groups[group_id]
        g.progress.pop(index, None)
        g.finished[index] = max(1, length)
        self._changed(g)

    def _changed(self, g: _Group) -> None:
        g.loglik = g.estimate = None
        self._observations += 1
        if self._observations >= self._next_refit:
            self._refit_prior()
            self._next_refit = self._observations + min(self._observations, _REFIT_EVERY)

    # -- estimates -----------------------------------------------------------------------

    def finished_max(self, group_id: str) -> int:
        g = self._groups[group_id]
        return max(g.finished.values(), default=0)

    def lower_bound(self, group_id: str) -> int:
        g = self._groups[group_id]
        return max(max(g.finished.values(), default=0), max(g.progress.values(), default=0))

    def estimate(self, group_id: str) -> float:
        """Expected longest response of the group (tokens, at most its max_tokens)."""
        g = self._groups[group_id]
        if g.estimate is None:
            g.estimate = self._expected_max(g)
        return g.estimate

    def posterior_mean(self, group_id: str) -> float:
        """Posterior mean of the group's log-median length."""
        w = self._posterior(self._groups[group_id])
        return float((w * self._grid).sum())

    def _loglik(self, g: _Group) -> np.ndarray:
        if g.loglik is None:
            grid, s = self._grid, self.sigma
            ll = np.zeros_like(grid)
            exact = [x for x in g.finished.values() if x < g.max_tokens]
            bounds = [x for x in g.finished.values() if x >= g.max_tokens] + list(g.progress.values())
            for x in exact:
                ll -= 0.5 * ((math.log(x) - grid) / s) ** 2
            for b in bounds:
                ll += _log_sf((math.log(b) - grid) / s)
            for x, weight in g.history:
                z = (math.log(x) - grid) / s
                ll += weight * (-0.5 * z**2 if x < g.max_tokens else _log_sf(z))
            g.loglik = ll
        return g.loglik

    def _prior(self, g: _Group) -> np.ndarray:
        center = self._prior_mean + self._prior_slope * (g.log_prompt - self._mean_log_prompt())
        return -0.5 * ((self._grid - center) / self._prior_sd) ** 2

    def _mean_log_prompt(self) -> float:
        return self._log_prompt_sum / max(1, len(self._groups))

    def _posterior(self, g: _Group) -> np.ndarray:
        lp = self._loglik(g) + self._prior(g)
        w = np.exp(lp - lp.max())
        return w / w.sum()

    def _expected_max(self, g: _Group) -> float:
        """E[longest response]: finished ones as they are, the rest drawn above their bounds."""
        cap = g.max_tokens
        done = max(g.finished.values(), default=0)
        pending = g.n - len(g.finished)
        if pending <= 0:
            return float(done)
        w = self._posterior(g)
        keep = w > 1e-4
        w, mu = w[keep] / w[keep].sum(), self._grid[keep]
        # Unfinished responses grouped by lower bound (siblings run in step, so few distinct ones).
        counts: dict[int, int] = {}
        for b in g.progress.values():
            counts[b] = counts.get(b, 0) + 1
        unstarted = pending - sum(counts.values())
        if unstarted > 0:
            counts[0] = counts.get(0, 0) + unstarted
        lo = max(done, min(counts), 1)
        t = np.linspace(lo, cap, T_POINTS)  # E[max] = lo + integral over [lo, cap] of P(max > t)
        log_t = np.log(t)[None, :]
        log_cdf = np.zeros((len(mu), T_POINTS))
        for b, k in counts.items():
            zt = (log_t - mu[:, None]) / self.sigma
            if b > 0:
                zb = (math.log(b) - mu[:, None]) / self.sigma
                sb = np.exp(_log_sf(zb))
                frac = np.clip((np.exp(_log_sf(zb)) - np.exp(_log_sf(zt))) / np.maximum(sb, 1e-300), 0, 1)
                frac = np.where(t[None, :] <= b, 0.0, frac)
            else:
                frac = _cdf(zt)
            log_cdf += k * np.log(np.maximum(frac, 1e-300))
        if done:
            log_cdf = np.where(t[None, :] < done, -np.inf, log_cdf)
        survive = 1.0 - np.exp(log_cdf)  # P(max > t | mu)
        step = (cap - lo) / (T_POINTS - 1)
        integral = step * (survive[:, :-1] + survive[:, 1:]).sum(axis=1) / 2
        return float(lo + (w * integral).sum())

    # -- the population prior ------------------------------------------------------------

    def _refit_prior(self) -> None:
        """Empirical Bayes: the prior over group log-medians is refitted to the mean and
        spread of the groups' posteriors (one EM step over the groups seen)."""
        groups = [g for g in self._groups.values() if g.finished or g.progress or g.history]
        if len(groups) < 8:
            return
        means, variances = [], []
        for g in groups:
            w = self._posterior(g)
            m = float((w * self._grid).sum())
            means.append(m)
            variances.append(float((w * (self._grid - m) ** 2).sum()))
        self.epoch += 1
        y = np.asarray(means)
        x = np.asarray([g.log_prompt for g in groups]) - self._mean_log_prompt()
        spread = float(((x - x.mean()) ** 2).mean())
        slope = float(((x - x.mean()) * (y - y.mean())).mean() / spread) if spread > 1e-4 else 0.0
        self._prior_slope = slope
        self._prior_mean = float(y.mean() - slope * x.mean())
        residual = y - self._prior_mean - slope * x
        self._prior_sd = max(0.1, math.sqrt(float((residual**2).mean()) + float(np.mean(variances))))
        for g in self._groups.values():
            g.estimate = None
