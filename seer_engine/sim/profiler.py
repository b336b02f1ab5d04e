"""``seer_engine profile``: fit the simulator's step-time model on the real engine.

The in-process rollout charges every step the wall time of ``engine.step()``, so
that is what is timed here, on a real ``LLMEngine`` with the configuration the
rollout would use. The tokens a step schedules and the KV it reads are the engine's own
account of the step (``LLMEngine.last_step_shape``), never guessed from the request
shapes: prefix hits, chunking and admission order are then
exactly as the rollout sees them. Each point is the fastest of ``repeats`` identical
steps taken in separate passes over the grid, so a busy machine slows the figures as
little as possible.

The model is linear in the KV a step reads, while a prompt chunk's attention on the
CPU backend costs chunk x context (every query against every key): long chunks
(1-2K tokens) take longer than the fit says. Rollouts with chunks of a few hundred
tokens, and decode steps, are what it predicts well.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from seer_engine.core.request import Request
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.engine.stats import StepShape
from seer_engine.rollout.machine import machine_info
from seer_engine.rollout.report import writable_dir
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.profile import InstanceProfile, StepTimeModel

Progress = Callable[[str], object]

# Shapes timed by `seer_engine profile` (each passed to measure_steps); quick: seconds on a CPU.
FULL_GRID = {
    "batch_sizes": (1, 2, 4, 8, 16, 32),
    "contexts": (32, 128, 512, 1024),
    "prefill_tokens": (64, 256, 1024, 2048),
    "repeats": 3,
}
QUICK_GRID = {
    "batch_sizes": (1, 4, 16),
    "contexts": (32, 512),
    "prefill_tokens": (64, 256, 1024),
    "repeats": 3,
}


@dataclass
class StepPoint:
    """One kind of step, timed: what it scheduled, the KV it read, its fastest wall time."""

    scheduled_tokens: int
    kv_tokens_read: int
    seconds: float
    kind: str  # "decode" | "prefill" | "mixed"
    spread: float = 0.0  # second-fastest over fastest time, minus 1: how noisy the timing was
    logit_tokens: int = 0  # tokens whose logits were computed (decode rows, prompts that ended)


@dataclass
class _Shape:
    scheduled_tokens: int
    kv_tokens_read: int
    kind: str
    logit_tokens: int

    @classmethod
    def of(cls, step: StepShape, kv_per_query: bool) -> _Shape:
        """The engine's own account of a step; KV read counts query-key pairs on a CPU
        (every new token attends its context), KV tokens once per row on a GPU."""
        kv = step.kv_pairs if kv_per_query else step.kv_tokens
        return cls(step.scheduled_tokens, kv, step.kind, step.logit_tokens)


Sample = tuple[_Shape, float]  # a step's shape and its wall seconds
SETTLED = 0.15  # a shape's time is settled when its two fastest samples are this close


@dataclass(frozen=True)
class _Decode:
    """R requests of L-token prompts decoding; ``mixed``: a prompt that joins them."""

    context: int
    batch: int
    max_tokens: int
    mixed: int


class _Runner:
    """Adds requests with random prompts (distinct, so no prefix hits) and times steps."""

    def __init__(self, engine: LLMEngine, kv_per_query: bool) -> None:
        self.engine = engine
        self.kv_per_query = kv_per_query
        self._rng = random.Random()
        self._ids = itertools.count()
        self._tokens = range(3, max(4, engine.vocab_size))  # past the specials (0-2)

    def add(self, prompt_len: int, max_tokens: int) -> Request:
        prompt = self._rng.choices(self._tokens, k=prompt_len)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        (req,) = self.engine.add_request(f"profile-{next(self._ids)}", prompt, params)
        return req

    def step(self) -> Sample:
        start = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - start
        if self.engine.last_step_shape is None:
            raise RuntimeError("the engine scheduled nothing while the profiler had requests queued")
        return _Shape.of(self.engine.last_step_shape, self.kv_per_query), seconds

    def decode(self, case: _Decode) -> dict[tuple, Sample]:
        """Prefill the batch untimed, then time one decode step and one with a new prompt."""
        reqs = [self.add(case.context, case.max_tokens) for _ in range(case.batch)]
        while any(r.num_output_tokens == 0 for r in reqs):
            self.step()
        timed = {("decode", case.context, case.batch): self.step()}
        if case.mixed > 0:
            self.add(case.mixed, 1)
            timed["mixed", case.context, case.batch] = self.step()
        self.engine.abort_request([r.request_id for r in reqs])
        return timed

    def prefill(self, size: int) -> dict[tuple, Sample]:
        """One prompt of ``size`` tokens; every chunk the token budget cuts it into is a step."""
        self.add(size, 1)
        timed: dict[tuple, Sample] = {}
        while self.engine.has_unfinished_requests():
            timed["prefill", size, len(timed)] = self.step()
        return timed


_LABELS = {
    "decode": "decode R={2} L={1}",
    "mixed": "decode R={2} L={1} + a prompt",
    "prefill": "prefill P={1}",
}


def _fastest(steps: list[Sample]) -> StepPoint:
    """The fastest of identical steps; KV is their mean (a decode row's grows by the odd token)."""
    shape = steps[0][0]
    kv = round(statistics.fmean(s.kv_tokens_read for s, _ in steps))
    times = sorted(t for _, t in steps)
    spread = times[1] / times[0] - 1 if len(times) > 1 else float("inf")
    return StepPoint(shape.scheduled_tokens, kv, times[0], shape.kind, round(spread, 4), shape.logit_tokens)


@contextmanager
def recording_steps(engine: LLMEngine, kv_per_query: bool) -> Iterator[list[StepPoint]]:
    """Every step ``engine`` takes inside the block, timed and shaped: a rollout's own
    steps, so ``fit_step_time`` on them prices exactly the work that rollout did."""
    step = engine.step
    points: list[StepPoint] = []

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - start
        if engine.last_step_shape is not None:
            shape = _Shape.of(engine.last_step_shape, kv_per_query)
            points.append(
                StepPoint(shape.scheduled_tokens, shape.kv_tokens_read, seconds, shape.kind, 0.0,
                          shape.logit_tokens)
            )  # fmt: skip
        return outputs

    engine.step = timed_step
    try:
        yield points
    finally:
        del engine.step  # the class's method shows again


def _settled(steps: list[Sample]) -> bool:
    return _fastest(steps).spread <= SETTLED


def _grid(
    engine: LLMEngine,
    batch_sizes: Sequence[int],
    contexts: Sequence[int],
    prefill_tokens: Sequence[int],
    progress: Progress,
) -> list[_Decode | int]:
    """The cases that fit the engine (decode batches, then prompt sizes); others are reported."""
    cfg, kv, max_len = engine.config, engine.kv_manager, engine.max_model_len
    budget = cfg.max_num_batched_tokens
    sizes = sorted(prefill_tokens) or [0]
    cases: list[_Decode | int] = []
    for i, (context, batch) in enumerate((c, b) for c in contexts for b in batch_sizes):
        # Prefilling R*L tokens lets early requests decode meanwhile: room for that.
        max_tokens = -(-batch * context // budget) + 4
        mixed = max(0, min(sizes[i % len(sizes)], budget - batch, max_len - 1))
        blocks = batch * kv.blocks_needed(context + max_tokens) + kv.blocks_needed(mixed + 1)
        fits = batch < cfg.max_num_seqs and batch <= budget and context + max_tokens <= max_len
        if fits and blocks <= kv.pool.num_blocks:
            cases.append(_Decode(context, batch, max_tokens, mixed))
        else:
            progress(f"  skip decode R={batch} L={context}: exceeds the engine's limits")
    for size in prefill_tokens:
        if size < max_len and kv.blocks_needed(size + 1) <= kv.pool.num_blocks:
            cases.append(size)
        else:
            progress(f"  skip prefill P={size}: exceeds the engine's limits")
    if not cases:
        raise ValueError(
            f"no step shape fits this engine ({kv.pool.num_blocks} KV blocks of {kv.block_size}, "
            f"max_model_len {max_len}, max_num_seqs {cfg.max_num_seqs}, token budget {budget})"
        )
    return cases


def measure_steps(
    engine: LLMEngine,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    contexts: Sequence[int] = (32, 128, 512, 1024),
    prefill_tokens: Sequence[int] = (64, 256, 1024, 2048),
    repeats: int = 3,
    progress: Progress = print,
    kv_per_query: bool = False,
) -> list[StepPoint]:
    """Time ``engine.step()`` over a grid of decode, mixed and prefill steps.

    Decode: R requests with L-token prompts are prefilled (untimed), one decode step
    is timed, then one step where a new prompt joins them (mixed; its size cycles
    through ``prefill_tokens``). Prefill: one request of P tokens, each chunk (the
    token budget splits it) a step. Shapes that exceed the KV blocks,
    ``max_num_seqs``, the token budget or ``max_model_len`` are skipped.

    The grid runs ``repeats`` times and each shape keeps its fastest time: samples
    seconds apart, rather than back to back, are not all caught by the same burst of
    other work on a busy machine. Shapes whose two fastest samples still disagree by
    more than ``SETTLED`` are timed again, in up to ``repeats`` more passes. The
    engine must be idle.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if engine.has_unfinished_requests():
        raise ValueError("measure_steps needs an idle engine (it would time other requests' work)")
    cases = _grid(engine, batch_sizes, contexts, prefill_tokens, progress)
    kv = engine.kv_manager
    engine.reset_prefix_cache()  # an earlier run's prompts must not be hits
    samples: dict[tuple, list[Sample]] = {}
    keys: dict[_Decode | int, list[tuple]] = {}
    run = _Runner(engine, kv_per_query)
    run.add(max(1, min(64, engine.max_model_len, kv.pool.num_blocks * kv.block_size) - 5), 4)  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    for rep in range(2 * repeats):
        todo = cases
        if rep >= repeats:
            todo = [c for c in cases if not all(_settled(samples[k]) for k in keys[c])]
            if not todo:
                break
        start = time.perf_counter()
        for case in todo:
            timed = run.decode(case) if isinstance(case, _Decode) else run.prefill(case)
            keys[case] = list(timed)
            for key, sample in timed.items():
                samples.setdefault(key, []).append(sample)
        elapsed = time.perf_counter() - start
        what = f"{len(todo)} cases" if rep < repeats else f"{len(todo)} unsettled cases again"
        progress(f"  pass {rep + 1}: {what} in {elapsed:.1f}s")
    points = [_fastest(steps) for steps in samples.values()]
    for key, p in zip(samples, points):
        label = _LABELS[key[0]].format(*key)
        progress(
            f"  {label:28s} {p.scheduled_tokens:5d} tokens {p.kv_tokens_read:6d} KV {p.seconds * 1e3:8.3f} ms"
            + ("" if p.spread <= SETTLED else f"  (noisy: next fastest +{p.spread:.0%})")
        )
    noisy = sum(p.spread > SETTLED for p in points)
    if noisy:
        progress(
            f"  warning: {noisy} of {len(points)} shapes never timed twice within {SETTLED:.0%}: the machine "
            "is busy (other work, or more torch threads than free cores); profile again when it is idle"
        )
    return points


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of columns.

    The constrained optimum is the plain least-squares fit on its own support, and
    every non-negative subset fit is feasible, so the best non-negative subset fit is
    the exact optimum. With four columns that is fifteen small solves.
    """
    k = a.shape[1]
    best, best_cost = np.zeros(k), float(y @ y)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            cost = float(np.sum((a[:, cols] @ coef - y) ** 2))
            if cost < best_cost - 1e-15:
                best, best_cost = np.zeros(k), cost
                best[list(cols)] = coef
    return best


def fit_step_time(points: Sequence[StepPoint], kv_per_query: bool = False) -> StepTimeModel:
    """Fit ``t = a + b * tokens + c * kv + d * logit tokens``, all >= 0, on relative error.

    Each row is divided by its measured seconds, so the fit minimises relative, not
    absolute, error. Step times span two orders of magnitude (a one-token decode vs a
    2048-token prefill): an absolute fit follows the long steps and leaves the fixed
    cost ``a``, which is most of the many short decode steps of a rollout, to absorb
    whatever remains (often zero). Relative error weighs every step alike, and a step
    slowed by other work on the machine counts for less, not more: its row, divided by
    its own inflated time, pulls on the coefficients with less leverage than the rest.
    """
    if len(points) < 1:
        raise ValueError("fit_step_time needs at least one measured step")
    bad = [p for p in points if not p.seconds > 0]
    if bad:
        raise ValueError(f"step times must be positive, got {bad[0]}")
    y = np.array([p.seconds for p in points])
    a = np.array([[1.0, p.scheduled_tokens, p.kv_tokens_read, p.logit_tokens] for p in points])
    # Scale the columns to comparable sizes before solving (tokens are ~1e3x seconds).
    scale = np.maximum(np.abs(a / y[:, None]).max(axis=0), 1e-30)
    coef = _nnls(a / y[:, None] / scale, np.ones(len(points))) / scale
    a_s, b, c, d = (max(float(x), 0.0) for x in coef)
    return StepTimeModel(a_s, b, c, kv_per_query, d)


def fit_quality(model: StepTimeModel, points: Sequence[StepPoint]) -> dict[str, float]:
    """R^2 on seconds, and median / max relative error of the predictions."""
    y = np.array([p.seconds for p in points])
    pred = np.array([model.step_s(p.scheduled_tokens, p.kv_tokens_read, p.logit_tokens) for p in points])
    rel = np.abs(pred - y) / y
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / total if total > 0 else 1.0
    return {"r2": r2, "median_rel_error": float(np.median(rel)), "max_rel_error": float(rel.max())}


def profile_engine(
    config: EngineConfig, name: str | None = None, quick: bool = False, progress: Progress = print
) -> InstanceProfile:
    """Build the engine of ``config``, time its steps, fit, and describe it as a profile."""
    import torch

    from seer_engine.model_executor.model_runner import kv_cache_bytes_per_block

    if config.speculative_config is not None:
        raise ValueError(
            "profile the engine without --speculative-config: drafts make steps of unequal shape"
        )
    start = time.perf_counter()
    machine = machine_info()
    engine = LLMEngine(config)
    grid = QUICK_GRID if quick else FULL_GRID
    progress(
        f"profiling {config.model} on {engine.device} ({engine.dtype}), {engine.kv_manager.pool.num_blocks} "
        f"KV blocks of {config.block_size}, {torch.get_num_threads()} torch threads"
        + (" (quick grid)" if quick else "")
    )
    # A CPU's attention is compute-bound: count the query-key pairs (see StepTimeModel).
    per_query = engine.device.type == "cpu"
    points = measure_steps(engine, progress=progress, kv_per_query=per_query, **grid)
    if len(points) < 3:
        raise ValueError(
            f"only {len(points)} step shapes fit this engine (too few KV blocks, or too small a "
            "max_model_len or max_num_batched_tokens); a fit of three coefficients needs at least 3"
        )
    model = fit_step_time(points, per_query)
    quality = fit_quality(model, points)
    elapsed = time.perf_counter() - start
    kinds = {k: sum(p.kind == k for p in points) for k in ("decode", "prefill", "mixed")}
    derivation = (
        f"seer_engine profile{' --quick' if quick else ''}: wall time of engine.step() on {config.model} "
        f"({engine.device}, {engine.dtype}), fastest of {grid['repeats']} passes over the grid; "
        f"{kinds['decode']} decode shapes (batches {list(grid['batch_sizes'])} x contexts "
        f"{list(grid['contexts'])}), {kinds['mixed']} decode+prompt, {kinds['prefill']} prefill "
        f"(prompts {list(grid['prefill_tokens'])}); scheduled and KV tokens from the scheduler's output; "
        "t = a + b*tokens + c*kv by non-negative least squares on relative error."
    )
    return InstanceProfile(
        name=name or f"{Path(config.model).name or config.model}-{engine.device.type}",
        step=model,
        kv_capacity_tokens=engine.kv_manager.pool.num_blocks * config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        kv_bytes_per_token=kv_cache_bytes_per_block(engine.model_config, 1, engine.dtype),
        derivation=derivation,
        measured={
            "points": [asdict(p) for p in points],
            **quality,
            "noisy_points": sum(p.spread > SETTLED for p in points),
            "machine": machine,
            "torch_threads": torch.get_num_threads(),
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "model": config.model,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "elapsed_s": round(elapsed, 2),
        },
    )


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("profile", help="fit the simulator's step-time model on this machine")
    EngineConfig.add_cli_args(p)
    p.add_argument("--output", required=True, help="where to write the instance profile (JSON)")
    p.add_argument("--name", default=None, help="the profile's name (default: model and device)")
    p.add_argument("--quick", action="store_true", help="a small grid (seconds, not minutes)")
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if out.is_dir():
        raise ValueError(f"--output {str(out)!r} is a directory; give a file path")
    if any(parent.exists() and not parent.is_dir() for parent in out.parents):
        raise ValueError(f"--output {str(out)!r}: a parent of it is a file, not a folder")
    writable_dir(out.parent, f"--output {str(out)!r}: its folder")  # not lost after the profiling
    profile = profile_engine(EngineConfig.from_cli_args(args), args.name, args.quick)
    step, m = profile.step, profile.measured
    print(
        f"t = {step.describe()}  (R^2 {m['r2']:.3f}, relative error median "
        f"{m['median_rel_error']:.1%}, max {m['max_rel_error']:.1%}, {len(m['points'])} points, "
        f"{m['elapsed_s']:.1f}s)"
    )
    print(f"wrote {profile.save(out)}")
    return 0
