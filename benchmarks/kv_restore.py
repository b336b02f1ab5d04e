"""Restoring a response's KV from the pool versus recomputing it, side by side.

For each model and context length: engine A prefills the context and its chunk-end
KV goes to the pool; engine B (a fresh instance, empty prefix cache) then resumes the
response one token further, either by recomputing the whole context (no pool) or by
loading it from the pool and computing only the last partial block. Times are the
median of ``--repeats`` runs of each, measured in one process; the ratio is what a
migration through the pool saves. Forward tokens are counted too.

    python benchmarks/kv_restore.py [--contexts 1024,4096,16384] [--pools local,mooncake]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.kv_connector.factory import kv_pool_for
from seer_engine.model_executor.tiny_model import make_tiny_model
from seer_engine.rollout.machine import machine_info
from seer_engine.sampling_params import SamplingParams

MODELS = {  # name -> make_tiny_model arguments
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2),
    "larger": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536),
}


def _resume(engine: LLMEngine, context: list[int], rid: str) -> int:
    """Generate one token after ``context``; returns the forward tokens it computed."""
    before = engine.scheduler.stats.scheduled_tokens
    params = SamplingParams(temperature=0, max_tokens=len(context), ignore_eos=True)  # one past the prior
    engine.add_request(rid, context[:1], params, prior_output_token_ids=context[1:])
    while engine.has_unfinished_requests():
        engine.step()
    return engine.scheduler.stats.scheduled_tokens - before


def measure(model: str, context_len: int, pool_kind: str, repeats: int, threads: int | None) -> dict:
    cfg = EngineConfig(
        model=model, num_kv_blocks=-(-(context_len + 64) // 16) + 8, max_model_len=context_len + 64,
        num_threads=threads, max_num_batched_tokens=max(8192, context_len + 64),
    )  # fmt: skip
    context = [(7 * i) % 500 + 3 for i in range(context_len)]
    source, target = LLMEngine(cfg), LLMEngine(cfg)
    capacity = max(0.25, 4 * context_len * _bytes_per_token(source) / 2**30)
    pool = kv_pool_for(pool_kind, cfg, capacity_gib=capacity)
    try:
        _resume(source, context, "warm")
        saved = pool.connector.save("r", source, context)
        recompute, restore, load_only = [], [], []
        tokens = {}
        for i in range(repeats):
            target.reset_prefix_cache()
            start = time.perf_counter()
            tokens["recompute"] = _resume(target, context, f"re{i}")
            recompute.append(time.perf_counter() - start)
            target.reset_prefix_cache()
            start = time.perf_counter()
            result = pool.connector.load("r", target, context)
            loaded = time.perf_counter()
            tokens["restore"] = _resume(target, context, f"rs{i}")
            restore.append(time.perf_counter() - start)
            load_only.append(loaded - start)
            assert result.error is None and result.tokens == saved, result
        pool.connector.free("r")
    finally:
        pool.close()
    row = {
        "context_tokens": context_len,
        "pool": pool_kind,
        "pooled_tokens": saved,
        "kv_mib": saved * _bytes_per_token(source) / 2**20,
        "recompute_s": statistics.median(recompute),
        "restore_s": statistics.median(restore),
        "load_s": statistics.median(load_only),
        "recompute_forward_tokens": tokens["recompute"],
        "restore_forward_tokens": tokens["restore"],
    }
    row["speedup"] = row["recompute_s"] / row["restore_s"]
    row["load_gib_per_s"] = row["kv_mib"] / 1024 / row["load_s"]
    return row


def _bytes_per_token(engine: LLMEngine) -> float:
    return math.prod(engine.kv_block_shape) * engine.kv_block_dtype.itemsize / engine.kv_block_size


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        contexts = sorted({r["context_tokens"] for r in mine})
        pools = sorted({r["pool"] for r in mine})
        recompute = [next(r["recompute_s"] for r in mine if r["context_tokens"] == c) for c in contexts]
        ax.plot(contexts, recompute, "o-", label="recompute")
        for pool in pools:
            restore = {r["context_tokens"]: r["restore_s"] for r in mine if r["pool"] == pool}
            ax.plot(contexts, [restore[c] for c in contexts], "s-", label=f"restore ({pool})")
        ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="seconds", title=f"{model} model")
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.legend()
    fig.suptitle("Resuming a response on another instance: restore from the KV pool vs recompute")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--models", default="tiny,larger")
    p.add_argument("--pools", default="local,mooncake")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/kv_restore")
    args = p.parse_args()
    machine = machine_info()
    contexts = [int(c) for c in args.contexts.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        path = make_tiny_model(
            Path(tempfile.mkdtemp(prefix=f"kv-restore-{name}-")) / "model",
            max_position_embeddings=max(contexts) + 128,
            **MODELS[name],
        )
        for context in contexts:
            for pool in args.pools.split(","):
                row = {"model": name, **measure(str(path), context, pool, args.repeats, args.threads)}
                rows.append(row)
                print(
                    f"[{name} {context:>6} tokens, {pool:>8}] recompute {row['recompute_s']:.3f}s "
                    f"({row['recompute_forward_tokens']} tokens), restore {row['restore_s']:.3f}s "
                    f"({row['restore_forward_tokens']} tokens, load {row['load_s']:.3f}s for "
                    f"{row['kv_mib']:.1f} MiB): {row['speedup']:.1f}x",
                    flush=True,
                )
    meta = {
        "command": "python " + " ".join(sys.argv),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine,
        "models": {k: MODELS[k] for k in args.models.split(",")},
    }
    (out / "report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out / "report.png")
    print(f"wrote {out / 'report.json'} and {out / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
