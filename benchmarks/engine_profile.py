"""Where a decode step's time goes on the real model, against the machine's roofs.

For each engine configuration (plain torch ops, and the C++ CPU kernels where the engine
has them) and each batch size: the wall time of ``LLMEngine.step`` in steady decode
(every request one row, context ``--context`` tokens), and a cProfile of the same steps
split into matmuls, attention (with the KV store and context gather), other tensor ops
and Python. Then every matmul of one step timed alone per library (MKL through
``F.linear``, oneDNN with prepacked weights, the engine's packed kernel) at the step's
row count, with the model's real weights streamed from memory as in a step.

    PYTHONPATH=. python benchmarks/engine_profile.py --model smollm2-135m --threads 2 \\
        [--batches 1,16,64] [--out benchmarks/results/engine_speed/profile.json]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime as dt
import json
import os
import pstats
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from roofs import best_time, mm_gflops, read_bandwidth_gbs, resolve_model

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.rollout.machine import machine_info
from seer_engine.sampling_params import SamplingParams

HAS_CPU_KERNELS = "cpu_kernels" in {f.name for f in dataclasses.fields(EngineConfig)}
MATMUL = ("linear", "addmm", "aten.mm", "matmul")
ATTENTION = ("scaled_dot_product", "paged_attention", "store_kv", "index_select", "index_copy")


def decode_engine(model: Path, batch: int, context: int, threads: int, native: bool) -> LLMEngine:
    """An engine with ``batch`` requests past their prefill, each decoding one row a step."""
    kwargs = {"cpu_kernels": native} if HAS_CPU_KERNELS else {}
    blocks = batch * -(-(context + 512) // 16) + 8
    engine = LLMEngine(
        EngineConfig(
            model=str(model), max_num_seqs=batch, num_threads=threads, num_kv_blocks=blocks, **kwargs
        )
    )
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", [rng.randrange(3, engine.vocab_size) for _ in range(context)], params)
    while engine.scheduler.num_waiting or engine.scheduler.stats.steps < 2:
        engine.step()
    engine.step()
    return engine


def categorize(profile: cProfile.Profile, steps: int) -> dict[str, float]:
    """ms per step by kind: matmul / attention / other tensor ops (C calls) and Python; the
    C++ decoder stack (all layers in one call) as one item."""
    kinds = ("matmul_ms", "attention_ms", "other_ops_ms", "python_ms", "decoder_stack_ms")
    out = dict.fromkeys(kinds, 0.0)
    for (file, _, name), (_, _, tottime, _, _) in pstats.Stats(profile).stats.items():
        if file != "~":
            out["python_ms"] += tottime
        elif name.endswith("_cpu_ops.run>"):  # NativeDecoder.run: every layer in one C++ call
            out["decoder_stack_ms"] += tottime
        elif any(k in name for k in MATMUL):
            out["matmul_ms"] += tottime
        elif any(k in name for k in ATTENTION):
            out["attention_ms"] += tottime
        elif "perf_counter" not in name and "disable" not in name:
            out["other_ops_ms"] += tottime
    return {k: round(v * 1e3 / steps, 2) for k, v in out.items()}


def profile_steps(engine: LLMEngine, steps: int) -> dict:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    times.sort()
    return {
        "step_ms_best": round(times[0] * 1e3, 2),
        "step_ms_median": round(times[len(times) // 2] * 1e3, 2),
        "cprofile_ms_per_step": categorize(prof, steps),
    }


def gemm_table(weights: list[torch.Tensor], rows: int, repeats: int, native) -> dict[str, dict]:
    """One step's matmuls at ``rows`` rows per library: GFLOP/s and weight GB/s."""
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    flops = 2 * rows * sum(w.numel() for w in weights)
    nbytes = sum(w.numel() * 4 for w in weights)
    runs = {"mkl (F.linear)": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=rows) for w in weights]
    runs["onednn (prepacked)"] = lambda: [
        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
        for w, p in zip(weights, packed)
    ]
    if native is not None:
        from seer_engine.model_executor.cpu_kernels import pack_weight

        ours = [pack_weight(w) for w in weights]
        runs["seer packed kernel"] = lambda: [
            native.linear(xs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(weights, ours)
        ]
    table = {}
    for name, fn in runs.items():
        s = best_time(fn, repeats)
        table[name] = {
            "ms": round(s * 1e3, 2),
            "gflops": round(flops / s / 1e9, 1),
            "gbs": round(nbytes / s / 1e9, 1),
        }
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=128, help="context tokens per request")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--configs", default="torch,cpu",
        help="torch (plain torch ops), cpu (C++ kernels), layers (C++ kernels one layer at a time, "
        "without the C++ decoder stack; measured on the cpu engine right after it)",
    )  # fmt: skip
    parser.add_argument("--no-gemm", action="store_true", help="skip the per-library matmul table")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "engine_speed" / "profile.json")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {
        "command": " ".join(["python", *sys.argv]),
        "date": dt.datetime.now().isoformat(timespec="minutes"),
        "machine": machine_info(threads=args.threads),
        "model": str(model),
        "context": args.context,
        "read_gbs": round(read_bandwidth_gbs(repeats=args.repeats), 1),
        "mm_gflops": round(mm_gflops(repeats=args.repeats), 1),
        "steps": {},
        "gemm": {},
    }
    print(json.dumps({k: result[k] for k in ("read_gbs", "mm_gflops")}), flush=True)
    wanted = args.configs.split(",")
    configs = {"torch ops": False, "cpu kernels": True} if HAS_CPU_KERNELS else {"torch ops": False}
    configs = {k: v for k, v in configs.items() if k.split()[0] in wanted}
    native = None
    for name, flag in configs.items():
        for batch in batches:
            engine = decode_engine(model, batch, args.context, args.threads, flag)
            row = {"loadavg_1m": os.getloadavg()[0], **profile_steps(engine, args.steps)}
            row["tokens_per_s"] = round(batch * 1e3 / row["step_ms_best"], 1)
            result["steps"][f"{name} b{batch}"] = row
            print(name, batch, json.dumps(row), flush=True)
            if flag and "layers" in wanted and getattr(engine.runner.model, "_native", None) is not None:
                engine.runner.model._native = None  # the same engine, its layers driven from Python
                row = {"loadavg_1m": os.getloadavg()[0], **profile_steps(engine, args.steps)}
                row["tokens_per_s"] = round(batch * 1e3 / row["step_ms_best"], 1)
                result["steps"][f"cpu kernels per layer b{batch}"] = row
                print("cpu kernels per layer", batch, json.dumps(row), flush=True)
            native = getattr(engine.runner, "native", None) or native
            weights = [
                m.weight.detach() for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)
            ]
            del engine
    result["matmul_weight_bytes"] = sum(w.numel() * 4 for w in weights)
    for batch in [] if args.no_gemm else batches:
        table = gemm_table(weights, batch, args.repeats, native)
        result["gemm"][batch] = {"loadavg_1m": os.getloadavg()[0], **table}
        print("gemm", batch, json.dumps(result["gemm"][batch]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
