"""Startup of a fresh engine process: imports, then engine construction (tokenizer, weights
loaded and packed, KV cache) to the first generated token.

Each configuration runs in its own process, alternating, best of ``--repeats``; pass
``--baseline DIR`` (another checkout of seer_engine, e.g. the commit before a change) to
time its engine the same way in the same run.

    PYTHONPATH=. python benchmarks/engine_startup.py --model smollm2-135m --threads 2 \\
        [--baseline /tmp/base-checkout] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from roofs import resolve_model

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from seer_engine import LLM, SamplingParams
t1 = time.perf_counter()
kwargs = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], max_num_seqs=1, **kwargs)
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_to_first_token_s": t2 - t1}))
"""


def run(root: Path, model: Path, kwargs: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), json.dumps(kwargs)],
        cwd=root, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", help="another seer_engine checkout to time the same way")
    args = parser.parse_args()
    model = resolve_model(args.model)
    here = Path(__file__).resolve().parents[1]
    configs = {
        "cpu kernels": (here, {"num_threads": args.threads, "cpu_kernels": True}),
        "torch ops": (here, {"num_threads": args.threads, "cpu_kernels": False}),
    }
    if args.baseline:
        configs["baseline"] = (Path(args.baseline).resolve(), {"num_threads": args.threads})
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, (root, kwargs) in configs.items():
            got = run(root, model, kwargs)
            got["loadavg_1m"] = os.getloadavg()[0]
            print(name, json.dumps(got), flush=True)
            if name not in best or got["load_to_first_token_s"] < best[name]["load_to_first_token_s"]:
                best[name] = got
    print(json.dumps({k: round(v["load_to_first_token_s"], 2) for k, v in best.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
