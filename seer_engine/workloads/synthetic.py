"""A synthetic workload fitted to the Qwen3 trace, at any length scale.

The simulator models the paper's setups (max generation lengths of 65,536 / 40,960 /
98,304 tokens), far beyond the trace's; this generator reproduces the trace's
group-structured figures (``stats.README_FIGURES``) at such scales, and optionally
token ids whose sibling overlap grows with the group size as in the trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

# Fit note (lengths). log L = log mu_g + s_g * z - s_g^2 / 2 with z ~ N(0, 1):
# group means log mu_g ~ N(0, across_sigma^2), and a per-group spread
# s_g = within_sigma * exp(within_sigma_spread * N(0, 1)), because groups differ in
# how variable they are (in the trace the per-group sd of log length is 0.34 +- 0.09).
# Chosen by grid search (across 0.30..0.55, within 0.25..0.40, spread 0..0.5, then a
# finer grid averaged over two seeds of 8,000 groups) minimising the summed squared
# relative error of the five length figures against README_FIGURES at 50 samples
# per group (the trace's group size), after p99 -> max_len scaling and clipping.
# Population figures of the chosen point (4,000 groups x 50, three seeds, any of the
# paper's max_len): within_cv 0.33, across_cv 0.44-0.46, within_share 0.38-0.41,
# longest/mean 1.97-1.99, Spearman 0.68-0.70. A 90-group workload (the trace's
# size) scatters about as much as the trace itself would: Spearman sd ~0.06.
# Figures that are maxima over a group depend on its size. At 16 samples the model
# gives within_cv 0.32, longest/mean 1.71, Spearman 0.71, and the trace cut to its
# first 16 responses 0.32, 1.68, 0.79 (at 8: 0.30, 1.54, 0.73 against 0.30, 1.50, 0.80).
# With the same p99 the synthetic mean is ~10% below the trace's (its tail is a
# little heavier): p99/mean 3.2 against the trace's 2.9.
#
# Fit note (content). A response is a chain of phrase_len-token segments, each a
# phrase from its group's pool (prob. group_phrase_prob), from a workload-wide pool
# (global_phrase_prob) or fresh random tokens. Pools are sized so that any one
# sibling uses a given phrase with probability phrase_reuse: the overlap then grows
# with the number of siblings as in the trace (within 13% / 18% / 29% at 8 / 16 /
# 46 samples, cross 0.8% / 1.2% / 1.8%) and does not depend on the length scale.
# Only 8-grams wholly inside a shared phrase repeat, so
# within ~ (p_group + p_global) * (phrase_len - 7) / phrase_len * (1 - (1 - reuse)^(G-1)).
FIT: dict[str, float] = {
    "across_sigma": 0.44,
    "within_sigma": 0.325,
    "within_sigma_spread": 0.25,
    "group_phrase_prob": 0.36,
    "global_phrase_prob": 0.026,
    "phrase_reuse": 0.08,
    # Prompt lengths (tokens) of the trace: sd of their log 0.33; Pearson correlation of
    # log prompt length with a group's log mean response length 0.51 (Spearman 0.45).
    "prompt_len_sigma": 0.33,
    "prompt_len_corr": 0.5,
}


# Group means spread over e^(+-4 x across_sigma) around the median at two sd; past this
# the length scale leaves float range (and no workload spreads that far).
MAX_ACROSS_SIGMA = 4.0


@lru_cache(maxsize=32)
def _population_quantile(across: float, within: float, spread: float, quantile: float) -> float:
    """Quantile of the generative length distribution (median group mean = 1), by fixed-seed Monte Carlo.

    Scaling by the population quantile (not the sample's) keeps a small workload at
    the same scale as a large one drawn with the same seed.
    """
    rng = np.random.default_rng(0x5EE12)
    size = 1 << 18
    mu = across * rng.standard_normal(size)
    s = within * np.exp(spread * rng.standard_normal(size))
    return float(np.quantile(np.exp(mu + s * rng.standard_normal(size) - s * s / 2), quantile))


@lru_cache(maxsize=32)
def _scale_for_mean(across: float, within: float, spread: float, mean_len: float, max_len: int) -> float:
    """The scale that gives the generative lengths, clipped to ``max_len``, the population
    mean ``mean_len`` (fixed-seed Monte Carlo, bisection on the scale)."""
    if not 1 <= mean_len < max_len:
        raise ValueError(f"mean_len must be in [1, max_len={max_len}), got {mean_len}")
    rng = np.random.default_rng(0x5EE12)
    size = 1 << 18
    mu = across * rng.standard_normal(size)
    s = within * np.exp(spread * rng.standard_normal(size))
    unit = np.exp(mu + s * rng.standard_normal(size) - s * s / 2)
    lo, hi = 1e-9, 1.0
    while float(np.minimum(unit * hi, max_len).mean()) < mean_len:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(np.minimum(unit * mid, max_len).mean()) < mean_len else (lo, mid)
    return (lo + hi) / 2


def _pool_size(mean_len: float, phrase_len: int, prob: float, reuse: float) -> int:
    """Phrases in a pool from which a response of ``mean_len`` picks each with probability ``reuse``."""
    draws = mean_len / phrase_len * prob
    return max(1, math.ceil(draws / -math.log1p(-reuse)))


@dataclass(frozen=True, eq=False)
class SyntheticGroup:
    """A generated group: lengths up front, token ids generated on demand.

    Token ids of response i depend only on (seed, group index, i), so ``head(n)``
    views and workloads with more samples agree on the shared prefix.
    """

    group_id: str
    index: int
    lengths_full: tuple[int, ...]
    seed: int
    vocab_size: int | None = None
    prompt_len: int = 128
    phrase_len: int = 32
    group_phrase_prob: float = FIT["group_phrase_prob"]
    global_phrase_prob: float = FIT["global_phrase_prob"]
    group_pool_size: int = 64
    global_pool_size: int = 16
    first_token_id: int = 3
    samples: int | None = None
    iteration: int = 0  # > 0: the same prompt sampled again (fresh responses, same pools)
    _cache: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def num_samples(self) -> int:
        return self.samples if self.samples is not None else len(self.lengths_full)

    @property
    def lengths(self) -> list[int]:
        return list(self.lengths_full[: self.num_samples])

    def head(self, n: int) -> SyntheticGroup:
        """The first ``n`` responses, sharing generated token ids."""
        if not 1 <= n <= self.num_samples:
            raise ValueError(f"group {self.group_id!r} has {self.num_samples} responses, asked for {n}")
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "_cache"}
        return SyntheticGroup(**{**fields, "samples": n, "_cache": self._cache})

    def _rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.index, *stream])

    def _vocab(self) -> int:
        if self.vocab_size is None:
            raise ValueError("this synthetic workload was made without vocab_size, so it has lengths only")
        return self.vocab_size

    def _pools(self) -> tuple[np.ndarray, np.ndarray]:
        """This group's phrase pool and the workload-wide one (the same for every group of a seed)."""
        pools = self._cache.get("pools")
        if pools is None:
            vocab, low, width = self._vocab(), self.first_token_id, self.phrase_len
            shared = np.random.default_rng([self.seed, 0x610BA1, self.global_pool_size])
            glob = shared.integers(low, vocab, size=(self.global_pool_size, width))
            own = self._rng(1).integers(low, vocab, size=(self.group_pool_size, width))
            pools = self._cache["pools"] = (own, glob)
        return pools

    @property
    def prompt_token_ids(self) -> list[int]:
        """A deterministic random prompt of ``prompt_len`` tokens."""
        ids = self._cache.get("prompt")
        if ids is None:
            ids = self._cache["prompt"] = (
                self._rng(2).integers(self.first_token_id, self._vocab(), size=self.prompt_len).tolist()
            )
        return list(ids)

    def _response(self, i: int) -> np.ndarray:
        own, glob = self._pools()
        length = self.lengths_full[i]
        rng = self._rng(3, i, self.iteration) if self.iteration else self._rng(3, i)
        segments = -(-length // self.phrase_len)
        kind = rng.random(segments)
        rows = rng.integers(self.first_token_id, self._vocab(), size=(segments, self.phrase_len))
        use_glob = kind < self.global_phrase_prob
        use_own = ~use_glob & (kind < self.global_phrase_prob + self.group_phrase_prob)
        rows[use_own] = own[rng.integers(0, len(own), size=int(use_own.sum()))]
        rows[use_glob] = glob[rng.integers(0, len(glob), size=int(use_glob.sum()))]
        out = rows.reshape(-1)[:length].astype(np.int32)
        out.flags.writeable = False
        return out

    def response_token_arrays(self) -> list[np.ndarray]:
        """Token ids per response as read-only int32 arrays (the cached form: 4 bytes a token)."""
        cache = self._cache.setdefault("responses", {})
        for i in range(self.num_samples):
            if i not in cache:
                cache[i] = self._response(i)
        return [cache[i] for i in range(self.num_samples)]

    @property
    def response_token_ids(self) -> list[list[int]]:
        """Token ids per response, exactly ``lengths[i]`` long, siblings sharing phrases.

        Fresh lists on every call: at the paper's scales the ids are cached as int32
        arrays, since lists of Python ints would take ~9x the memory.
        """
        return [a.tolist() for a in self.response_token_arrays()]


def synthetic_workload(
    num_groups: int,
    samples: int,
    max_len: int,
    seed: int = 0,
    *,
    vocab_size: int | None = None,
    across_sigma: float = FIT["across_sigma"],
    within_sigma: float = FIT["within_sigma"],
    within_sigma_spread: float = FIT["within_sigma_spread"],
    scale_quantile: float = 0.99,
    mean_len: float | None = None,
    iteration: int = 0,
    drift: float = 0.0,
    prompt_len: int = 128,
    prompt_len_sigma: float = 0.0,
    prompt_len_corr: float = 0.0,
    phrase_len: int = 32,
    group_phrase_prob: float = FIT["group_phrase_prob"],
    global_phrase_prob: float = FIT["global_phrase_prob"],
    phrase_reuse: float = FIT["phrase_reuse"],
    first_token_id: int = 3,
) -> list[SyntheticGroup]:
    """Groups whose lengths (and optionally tokens) have the trace's statistics at any scale.

    Log-normal group means and log-normal within-group spread (see the fit notes
    above ``FIT``); lengths are scaled so the population's ``scale_quantile`` lands
    on ``max_len`` (the rule :func:`scale_lengths` uses for traces), or, given
    ``mean_len``, so that the population mean after clipping is ``mean_len`` (a
    setup calibrated to a measured mean length), and clipped to [1, max_len].
    Deterministic for a seed, and group g is the same whatever ``num_groups`` is.

    ``iteration``: the same prompts sampled again (an RL epoch revisiting its
    dataset): each group keeps its latent length distribution (group mean and
    spread) and draws fresh responses; ``drift`` moves each group's log mean by a
    random walk of that standard deviation per iteration (the policy changes
    between iterations). Iteration 0 is the workload of ``seed``.

    ``prompt_len`` is every prompt's length, or with ``prompt_len_sigma`` the median of
    log-normal prompt lengths whose log correlates ``prompt_len_corr`` with the group's
    log mean response length (the trace: ``FIT["prompt_len_sigma"]``,
    ``FIT["prompt_len_corr"]``).

    ``vocab_size`` enables ``prompt_token_ids`` and ``response_token_ids``, with ids
    in [first_token_id, vocab_size) so that special tokens such as EOS never occur
    inside a response.
    """
    if num_groups < 1 or samples < 1 or max_len < 1:
        raise ValueError(f"need num_groups, samples, max_len >= 1 (got {num_groups}, {samples}, {max_len})")
    if min(group_phrase_prob, global_phrase_prob) < 0 or group_phrase_prob + global_phrase_prob > 1:
        raise ValueError("group_phrase_prob and global_phrase_prob must be >= 0 and sum to at most 1")
    if not 0.0 < phrase_reuse < 1.0:
        raise ValueError(f"phrase_reuse must be in (0, 1), got {phrase_reuse}")
    if phrase_len < 1 or prompt_len < 0 or first_token_id < 0:
        raise ValueError("phrase_len must be >= 1, prompt_len and first_token_id >= 0")
    if vocab_size is not None and vocab_size <= first_token_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no token ids at or above {first_token_id}")
    if iteration < 0 or drift < 0:
        raise ValueError(f"iteration and drift must be >= 0, got {iteration} and {drift}")
    if not 0.0 <= across_sigma <= MAX_ACROSS_SIGMA:
        raise ValueError(f"across_sigma must be in [0, {MAX_ACROSS_SIGMA:g}], got {across_sigma}")
    if prompt_len_sigma < 0 or not -1.0 <= prompt_len_corr <= 1.0:
        raise ValueError("prompt_len_sigma must be >= 0 and prompt_len_corr in [-1, 1]")
    if mean_len is not None:
        scale = _scale_for_mean(across_sigma, within_sigma, within_sigma_spread, float(mean_len), max_len)
    else:
        quantile = _population_quantile(across_sigma, within_sigma, within_sigma_spread, scale_quantile)
        scale = max_len / quantile
    population_mean = min(scale * math.exp(across_sigma**2 / 2), max_len)
    global_pool = _pool_size(population_mean, phrase_len, global_phrase_prob, phrase_reuse)
    groups = []
    for g in range(num_groups):
        rng = np.random.default_rng([seed, g, 0])
        mu = across_sigma * rng.standard_normal()
        s = within_sigma * math.exp(within_sigma_spread * rng.standard_normal())
        own_prompt = prompt_len
        if prompt_len_sigma > 0:
            shared = mu / across_sigma if across_sigma > 0 else 0.0
            own = np.random.default_rng([seed, g, 3]).standard_normal()
            x = prompt_len_corr * shared + math.sqrt(1 - prompt_len_corr**2) * own
            own_prompt = max(1, round(prompt_len * math.exp(prompt_len_sigma * x)))
        if iteration:
            walk = np.random.default_rng([seed, g, 2]).standard_normal(iteration)
            mu += drift * float(walk.sum())
            rng = np.random.default_rng([seed, g, 1, iteration])
        z = rng.standard_normal(samples)
        lengths = np.clip(np.rint(np.exp(mu + s * z - s * s / 2) * scale), 1, max_len).astype(np.int64)
        group_mean = min(scale * math.exp(mu), max_len)
        groups.append(
            SyntheticGroup(
                group_id=f"synthetic-{seed}-{g}",
                index=g,
                lengths_full=tuple(int(x) for x in lengths),
                seed=seed,
                vocab_size=vocab_size,
                prompt_len=own_prompt,
                phrase_len=phrase_len,
                group_phrase_prob=group_phrase_prob,
                global_phrase_prob=global_phrase_prob,
                group_pool_size=_pool_size(group_mean, phrase_len, group_phrase_prob, phrase_reuse),
                global_pool_size=global_pool,
                first_token_id=first_token_id,
                iteration=iteration,
            )
        )
    return groups
