"""What the machine allows, measured in the same process as the numbers set against it,
and the real model to measure with (shared by engine_profile.py and engine_throughput.py).

A decode step streams every weight once (batch 1: memory-bound, the floor is weight bytes
over read bandwidth) and does 2 FLOPs per weight per row (large batches: compute-bound, the
roof is what a large ``torch.mm`` sustains). Both are measured here, with the thread count
the benchmark uses, and best of ``repeats`` (the machine is shared).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read per second by ``sum`` over a tensor far larger than the caches."""
    x = torch.ones(nbytes // 4)
    return nbytes / best_time(x.sum, repeats) / 1e9


def mm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square float32 ``torch.mm``: the compute roof."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), repeats) / 1e9


def resolve_model(name: str) -> Path:
    """A model folder, or an alias the engine knows (e.g. ``smollm2-135m``), else the
    converted copy under ``$SEER_ENGINE_CACHE`` (default ``~/.cache/seer_engine``)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from seer_engine.engine.llm_engine import resolve_model_path

        resolved = Path(resolve_model_path(name))
        if resolved.is_dir():
            return resolved
    except Exception:  # an alias the engine does not know yet: try the cache folder
        pass
    cached = Path(os.environ.get("SEER_ENGINE_CACHE", "~/.cache/seer_engine")).expanduser() / name
    if cached.is_dir():
        return cached
    raise SystemExit(f"model {name!r} is neither a folder nor a converted model in {cached.parent}")


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every matmul a decode step runs, LM head included, in order."""
    return [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
