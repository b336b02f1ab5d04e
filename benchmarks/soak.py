"""Soak test of ``seer_engine serve``: a long, steady mixed load with the server's memory
sampled, to show that nothing grows without bound.

This script is the client. It starts the server (``load_test.Server``), sends
``--requests`` requests paced evenly over ``--duration`` seconds with at most
``--concurrency`` in flight, and samples the resident memory (RSS) of the server
process and of every process under it (rollout instances) every ``--interval``
seconds. The mix: plain and streamed completions, chat completions, n=4 groups,
token-id prompts with echo and logprobs, and a few requests the server must refuse
(400), so error paths run as often as the others. Afterwards it waits for the server
to go idle and reads /metrics: every KV block must be free again.

Pass: every request got what it should (0 errors), RSS after the warm-up stays
within ``--tolerance`` of its level at the end of the warm-up, and 0 KV blocks leak.
Results: ``benchmarks/results/soak/<mode>.json``, and README.md + soak.png there,
redrawn from every mode's json.

    python benchmarks/soak.py --mode plain
    python benchmarks/soak.py --mode rollout   # --rollout-mode --instances 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from load_test import Server, read_metrics

from seer_engine.rollout.machine import describe_machine, machine_info

OUT = Path(__file__).resolve().parent / "results" / "soak"
MODES = {
    "plain": [],
    "rollout": ["--rollout-mode", "--instances", "2", "--chunk-tokens", "16"],
}
WORDS = "the rollout phase of reinforcement learning takes most of each iteration step".split()


# ------------------------------------------------------------------------- the load


def make_request(i: int, rng: random.Random, model: str) -> tuple[str, dict, int, bool]:
    """(path, body, expected status, stream) of request ``i``: a fixed, seeded mix."""
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))
    base = {"model": model, "max_tokens": rng.randint(4, 24), "temperature": 1.0, "seed": i}
    kind = rng.random()
    if kind < 0.45:
        return "/v1/completions", {**base, "prompt": prompt}, 200, False
    if kind < 0.60:
        return "/v1/completions", {**base, "prompt": prompt, "stream": True}, 200, True
    if kind < 0.75:
        return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": prompt}]}, 200, False
    if kind < 0.85:
        return "/v1/completions", {**base, "prompt": prompt, "n": 4}, 200, False
    if kind < 0.95:
        ids = [rng.randrange(10, 200) for _ in range(rng.randint(2, 30))]
        return "/v1/completions", {**base, "prompt": ids, "echo": True, "logprobs": 2}, 200, False
    bad = rng.choice([{"temperature": -1.0}, {"prompt": "\ud800 lone surrogate"}, {"n": 0}])
    return "/v1/completions", {**base, "prompt": prompt, **bad}, 400, False


async def send(client: httpx.AsyncClient, path: str, body: dict, expected: int, stream: bool) -> str | None:
    """None when the server answered as it should, else what went wrong."""
    content = json.dumps(body)  # ASCII escapes: httpx's own encoder cannot send a lone surrogate
    headers = {"content-type": "application/json"}
    try:
        if stream:
            async with client.stream("POST", path, content=content, headers=headers) as resp:
                if resp.status_code != expected:
                    return f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
            if events[-1] != "data: [DONE]" or any('"error"' in e for e in events):
                return f"bad stream ending: {events[-2:]}"
            return None
        resp = await client.post(path, content=content, headers=headers)
    except httpx.HTTPError as e:
        return repr(e)
    if resp.status_code != expected:
        return f"{resp.status_code}: {resp.text[:200]}"
    if expected == 200:
        reasons = {c["finish_reason"] for c in resp.json()["choices"]}
        if not reasons <= {"length", "stop"}:
            return f"finish reasons {reasons}"
    return None


async def run_load(url: str, model: str, n: int, duration: float, concurrency: int, seed: int) -> dict:
    """Request i is sent at ``i * duration / n`` seconds (or later, when ``concurrency``
    requests are already in flight)."""
    rng = random.Random(seed)
    requests = [make_request(i, rng, model) for i in range(n)]
    errors: list[str] = []
    latencies: list[float] = []
    next_index = 0
    start = time.monotonic()

    async def worker() -> None:
        nonlocal next_index
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
            while next_index < n:
                i = next_index
                next_index += 1
                delay = start + i * duration / n - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent = time.monotonic()
                problem = await send(client, *requests[i])
                latencies.append(time.monotonic() - sent)
                if problem is not None:
                    errors.append(problem)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies.sort()
    return {
        "requests": n,
        "expected_refusals": sum(1 for r in requests if r[2] == 400),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "wall_s": round(time.monotonic() - start, 1),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3),
        "latency_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 3),
    }


# ------------------------------------------------------------------------- memory


class RSSSampler(threading.Thread):
    """RSS of a process and everything under it, every ``interval`` seconds, plus the
    engine step counter (memory that grows per step shows against it)."""

    def __init__(self, pid: int, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.url = url
        self.interval = interval
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(self.interval if self.samples else 0):
            self.samples.append(self.sample())

    def sample(self) -> dict:
        procs = {"server": self.root.memory_info().rss}
        for child in self.root.children(recursive=True):
            try:
                role = "resource_tracker" if "resource_tracker" in " ".join(child.cmdline()) else "child"
                procs[f"{role} {child.pid}"] = child.memory_info().rss
            except psutil.Error:
                pass
        try:
            steps = read_metrics(self.url)["engine_steps_total"]
        except (httpx.HTTPError, KeyError):
            steps = None
        t = round(time.monotonic() - self.start_time, 1)
        return {"t": t, "total": sum(procs.values()), "procs": procs, "steps": steps}


def flatness(samples: list[dict], warmup_s: float) -> dict:
    """How far RSS after the warm-up strays from its level at the end of the warm-up."""
    after = [s for s in samples if s["t"] >= warmup_s]
    base = statistics.median(s["total"] for s in after[:6])  # the first ~30 s after warm-up
    worst = max(after, key=lambda s: abs(s["total"] - base))
    ts = [s["t"] for s in after]
    slope = statistics.linear_regression(ts, [s["total"] for s in after]).slope
    return {
        "warmup_s": warmup_s,
        "samples_after_warmup": len(after),
        "base_rss_mb": round(base / 2**20, 1),
        "max_deviation_pct": round(100 * abs(worst["total"] - base) / base, 2),
        "trend_pct_over_window": round(100 * slope * (ts[-1] - ts[0]) / base, 2),
        "end_rss_mb": round(after[-1]["total"] / 2**20, 1),
    }


# ------------------------------------------------------------------------- report


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(url)
        idle = metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0
        if idle and metrics["kv_cache_free_blocks"] == metrics["kv_cache_total_blocks"]:
            return metrics
        if time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def write_report(out: Path) -> None:
    """README.md and soak.png from every ``<mode>.json`` in ``out``."""
    runs = {m: json.loads((out / f"{m}.json").read_text()) for m in MODES if (out / f"{m}.json").exists()}
    lines = ["# Soak test", ""]
    for mode, r in runs.items():
        meta, load, flat, kv = r["meta"], r["load"], r["flatness"], r["kv"]
        verdict = "PASS" if meta["passed"] else "FAIL"
        lines += [
            f"## {mode}: {verdict}",
            "",
            f"- command: `{meta['command']}`",
            f"- server: `{meta['server_command']}`",
            f"- machine: {describe_machine(meta['machine'])}",
            f"- date: {meta['date']}; load average before: "
            f"{', '.join(f'{x:.2f}' for x in meta['load_average_before'])}",
            "",
            "| figure | value |",
            "|---|---|",
            f"| requests (refused on purpose: 400) | {load['requests']} ({load['expected_refusals']}) |",
            f"| errors | {load['errors']} |",
            f"| wall time | {load['wall_s']} s |",
            f"| latency p50 / p99 | {load['latency_p50_s']} / {load['latency_p99_s']} s |",
            f"| engine steps | {kv['engine_steps']:.0f} |",
            f"| RSS at the end of the warm-up ({flat['warmup_s']:.0f} s), server + instances | "
            f"{flat['base_rss_mb']} MB |",
            f"| largest deviation after the warm-up | {flat['max_deviation_pct']}% |",
            f"| linear trend over the rest of the run | {flat['trend_pct_over_window']}% |",
            f"| RSS at the end | {flat['end_rss_mb']} MB |",
            f"| KV blocks free after the run | {kv['free']:.0f} / {kv['total']:.0f} |",
            f"| KV blocks leaked | {kv['leaked']:.0f} |",
            "",
        ]
        procs = r["samples"][-1]["procs"]
        lines[-1:-1] = [f"| RSS per process at the end | {', '.join(_mb(k, v) for k, v in procs.items())} |"]
    lines += [
        "![RSS over time](soak.png)",
        "",
        "The load: requests spread evenly over the run (at most 64 in flight), a seeded mix of",
        "completions (45%), streamed completions (15%), chat completions (15%), n=4 groups (10%),",
        "token-id prompts with echo and logprobs (10%), and requests the server must refuse with",
        "400 (5%: a negative temperature, a lone surrogate, n=0). RSS of the server process and",
        "every process under it (the rollout instances and multiprocessing's resource tracker)",
        "is sampled every few seconds. The model is the built-in tiny random-weight model: the",
        "run measures the server, not the model. Pass: 0 errors, RSS after the warm-up within",
        "the tolerance of its level at the end of the warm-up, 0 leaked KV blocks (/metrics).",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    plot(runs, out / "soak.png")


def _mb(name: str, rss: int) -> str:
    return f"{name.split()[0]} {rss / 2**20:.0f} MB"


def plot(runs: dict, path: Path) -> None:
    """RSS over time per mode (top), and its change from the end of the warm-up (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(1, len(runs))
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 7), squeeze=False, height_ratios=[3, 2])
    for col, (mode, r) in enumerate(runs.items()):
        samples, flat = r["samples"], r["flatness"]
        ts = [s["t"] / 60 for s in samples]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(ts, [s["total"] / 2**20 for s in samples], label="server + instances", color="black")
        server = [s["procs"]["server"] / 2**20 for s in samples]
        top.plot(ts, server, label="server process", color="tab:blue")
        top.set_title(f"{mode}: {r['load']['requests']} requests, {r['load']['errors']} errors")
        top.set_ylabel("RSS (MB)")
        top.set_ylim(bottom=0)
        top.legend(loc="lower right")
        base = flat["base_rss_mb"] * 2**20
        tol = r["meta"]["tolerance_pct"]
        bottom.plot(ts, [100 * (s["total"] - base) / base for s in samples], color="black")
        bottom.axhspan(-tol, tol, color="tab:green", alpha=0.15, label=f"within {tol:g}%")
        bottom.set_ylim(-2 * tol, 2 * tol)
        bottom.set_ylabel("change from end of warm-up (%)")
        bottom.set_xlabel("minutes")
        bottom.legend(loc="lower right")
        for ax in (top, bottom):
            ax.axvline(flat["warmup_s"] / 60, color="gray", linestyle="--")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=list(MODES), default="plain")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=24_000)
    parser.add_argument("--duration", type=float, default=660.0, help="seconds the requests are spread over")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before RSS must be flat")
    parser.add_argument(
        "--tolerance", type=float, default=5.0, help="allowed RSS deviation after warm-up, %%"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--server-args", default="--max-num-seqs 256 --max-model-len 256 --num-threads 1")
    args = parser.parse_args()

    load_before = os.getloadavg()
    server_args = [
        "--model",
        args.model,
        *args.server_args.split(),
        *MODES[args.mode],
        "--log-level",
        "warning",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        with Server([*server_args, "--data-dir", str(Path(tmp) / "data")], Path(tmp) / "server.log") as srv:
            model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            sampler = RSSSampler(srv.proc.pid, srv.url, args.interval)
            sampler.start()
            load = asyncio.run(
                run_load(srv.url, model, args.requests, args.duration, args.concurrency, args.seed)
            )
            metrics = wait_idle(srv.url)
            time.sleep(args.interval)  # one sample of the idle server
            sampler.stop.set()
            sampler.join()
    flat = flatness(sampler.samples, args.warmup)
    kv = {
        "free": metrics["kv_cache_free_blocks"],
        "total": metrics["kv_cache_total_blocks"],
        "leaked": metrics["kv_cache_total_blocks"] - metrics["kv_cache_free_blocks"],
        "running_after": metrics["num_requests_running"],
        "waiting_after": metrics["num_requests_waiting"],
        "engine_steps": metrics["engine_steps_total"],
    }
    passed = load["errors"] == 0 and kv["leaked"] == 0 and flat["max_deviation_pct"] <= args.tolerance
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "server_command": "seer_engine serve " + " ".join(server_args) + " --data-dir <tmpdir>/data",
        "machine": machine_info(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_before": load_before,
        "tolerance_pct": args.tolerance,
        "passed": passed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "load": load, "flatness": flat, "kv": kv, "samples": sampler.samples}
    (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=1) + "\n")
    write_report(args.out)
    print(json.dumps({"load": load, "flatness": flat, "kv": kv}, indent=2))
    print(f"{'PASS' if passed else 'FAIL'}: report in {args.out / 'README.md'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
