"""Output tokens/s of seer_engine vs ``transformers.generate``, side by side in one run.

Same random-weight model, same prompts, greedy decoding, at batch 1, 16 and 64 with
mixed output lengths. ``transformers.generate`` runs a static padded batch until its
longest member finishes, so its useful throughput counts only the tokens each prompt
asked for; its raw rate (every padded position) is reported too. Also measured: the
memory-bandwidth floor of one decode step (weight bytes / measured copy bandwidth)
and the fraction of it the engine reaches at batch 1.

    python benchmarks/engine_throughput.py [--batches 1,16,64] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from seer_engine import LLM, SamplingParams
from seer_engine.model_executor.tiny_model import make_tiny_model
from seer_engine.rollout.machine import machine_info

SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "traces" / "bpe32k-tokenizer.json"


def copy_bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes moved (read + write) per second by a large tensor copy: the memory roofline."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def workload(batch: int, vocab: int, max_new: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 128))] for _ in range(batch)]
    if batch == 1:
        return prompts, [max_new]
    return prompts, [rng.randint(max_new // 8, max_new) for _ in range(batch)]


def run_seer(llm: LLM, prompts, lengths) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n) for n in lengths]
    elapsed = _timed(lambda: llm.generate(prompts, params))
    return elapsed, sum(lengths)


def run_hf(model, prompts, lengths) -> tuple[float, int, int]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    longest = max(lengths)

    def go():
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )

    return _timed(go), sum(lengths), len(prompts) * longest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per side; best kept")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info(threads=args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    from transformers import AutoModelForCausalLM

    tmp = Path(tempfile.mkdtemp(prefix="seer-bench-"))
    tokenizer = str(SHARED_TOKENIZER) if SHARED_TOKENIZER.is_file() else None
    path = make_tiny_model(
        tmp / "model",
        arch="qwen3",
        tokenizer=tokenizer,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=3 * args.hidden,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), max_num_seqs=max(batches), num_threads=args.threads)
    vocab = hf.config.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    bandwidth = copy_bandwidth_gbs()
    floor_s = weight_bytes / (bandwidth * 1e9)

    # Warm both up (first-call allocations, tokenizer, kernels).
    warm_prompts, warm_lengths = workload(2, vocab, 8, seed=99)
    run_seer(llm, warm_prompts, warm_lengths)
    run_hf(hf, warm_prompts, warm_lengths)

    rows = []
    for batch in batches:
        prompts, lengths = workload(batch, vocab, args.max_new_tokens, seed=batch)
        # Alternate the two and keep each one's best run: other load on a shared
        # machine then hits both alike instead of whichever ran second.
        seer_runs, hf_runs = [], []
        for _ in range(args.repeats):
            seer_runs.append(run_seer(llm, prompts, lengths))
            hf_runs.append(run_hf(hf, prompts, lengths))
        seer_s, useful = min(seer_runs)
        hf_s, hf_useful, hf_raw = min(hf_runs)
        row = {
            "batch": batch,
            "useful_output_tokens": useful,
            "seer_s": round(seer_s, 3),
            "seer_tokens_per_s": round(useful / seer_s, 1),
            "hf_s": round(hf_s, 3),
            "hf_tokens_per_s": round(hf_useful / hf_s, 1),
            "hf_raw_tokens_per_s": round(hf_raw / hf_s, 1),
            "speedup": round(hf_s / seer_s, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    batch1 = next((r for r in rows if r["batch"] == 1), None)
    step_s = batch1["seer_s"] / batch1["useful_output_tokens"] if batch1 else None
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.date.today().isoformat(),
        "machine": machine,
        "model": {
            "arch": "qwen3",
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": vocab,
            "weight_bytes": weight_bytes,
        },
        "copy_bandwidth_gb_s": round(bandwidth, 2),
        "decode_floor_ms": round(floor_s * 1e3, 2),
        "batch1_ms_per_token": round(step_s * 1e3, 2) if step_s else None,
        "batch1_fraction_of_floor": round(floor_s / step_s, 3) if step_s else None,
        "repeats": args.repeats,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(rows, out / "engine_throughput.png")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["batch"]) for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([i - 0.2 for i in x], [r["seer_tokens_per_s"] for r in rows], 0.4, label="seer_engine")
    ax.bar([i + 0.2 for i in x], [r["hf_tokens_per_s"] for r in rows], 0.4, label="transformers.generate")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['speedup']}x", (i - 0.2, r["seer_tokens_per_s"]), ha="center", va="bottom")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("batch (mixed output lengths)")
    ax.set_ylabel("useful output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
