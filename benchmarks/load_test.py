"""Load test of ``seer_engine serve``: a bounded burst of concurrent HTTP requests.

This script is the client process; it starts the server as a child process on
127.0.0.1 (or uses ``--url``), sends ``--requests`` completions with at most
``--concurrency`` in flight, then checks that every request completed and that
the KV pool is entirely free again (read from /metrics). Results go to
``benchmarks/results/load_test.{md,json}`` with the command, machine and date.

    python benchmarks/load_test.py [--requests 2000] [--concurrency 256] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from seer_engine.rollout.machine import describe_machine, machine_info

RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------- the server


class Server:
    """``seer_engine serve`` as a child process on a free port."""

    def __init__(self, extra_args: list[str], log_path: Path) -> None:
        self.cmd = [sys.executable, "-m", "seer_engine.entrypoints.cli", "serve", "--port", "0", *extra_args]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> Server:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log_path.read_text()[-3000:]}")
            match = re.search(r"serving \S+ on (http://[\d.]+:\d+)", self.log_path.read_text())
            if match:
                try:
                    if httpx.get(match.group(1) + "/health", timeout=2).status_code == 200:
                        self.url = match.group(1)
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError("server did not start in time")

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def read_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0].removeprefix("seer_engine_")] = float(value)
    return out


# ------------------------------------------------------------------------- the load


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    start = time.perf_counter()
    try:
        resp = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e), "latency": time.perf_counter() - start}
    latency = time.perf_counter() - start
    if resp.status_code != 200:
        return {"ok": False, "error": f"{resp.status_code}: {resp.text[:200]}", "latency": latency}
    data = resp.json()
    reasons = [c["finish_reason"] for c in data["choices"]]
    return {
        "ok": all(r in ("length", "stop") for r in reasons),
        "finish_reasons": reasons,
        "tokens": data["usage"]["completion_tokens"],
        "latency": latency,
    }


async def run_load(
    url: str, n: int, concurrency: int, max_tokens: int, seed: int
) -> tuple[list[dict], float]:
    """``concurrency`` workers, each with its own keep-alive connection, share the requests.

    One client per worker: httpx's connection pool costs O(connections) per request,
    which at 256 connections makes a shared client the bottleneck, not the server.
    """
    rng = random.Random(seed)
    words = "the rollout phase of reinforcement learning takes most of each iteration".split()
    todo: asyncio.Queue[dict] = asyncio.Queue()
    for i in range(n):
        prompt = " ".join(rng.choices(words, k=rng.randint(4, 40)))
        todo.put_nowait({"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": i})
    results: list[dict] = []
    tls = ssl.create_default_context()  # unused for http://, but httpx builds one per client otherwise

    async def worker() -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600, verify=tls) as client:
            while not todo.empty():
                results.append(await one_request(client, todo.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


# ------------------------------------------------------------------------- report


def summarize(results: list[dict], wall: float, metrics: dict[str, float]) -> dict:
    latencies = sorted(r["latency"] for r in results)
    ok = [r for r in results if r["ok"]]
    tokens = sum(r.get("tokens", 0) for r in ok)

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))]

    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"] and "error" in r})[:5],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 1),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1),
        "latency_s": {
            "mean": round(statistics.fmean(latencies), 3),
            "p50": round(pct(0.50), 3),
            "p90": round(pct(0.90), 3),
            "p99": round(pct(0.99), 3),
            "max": round(latencies[-1], 3),
        },
        "after": {
            "running": metrics["num_requests_running"],
            "waiting": metrics["num_requests_waiting"],
            "kv_free_blocks": metrics["kv_cache_free_blocks"],
            "kv_total_blocks": metrics["kv_cache_total_blocks"],
            "kv_usage": metrics["kv_cache_usage_perc"],
            "preemptions": metrics["num_preemptions_total"],
            "engine_steps": metrics["engine_steps_total"],
        },
    }


def write_report(summary: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_test.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")
    s, a, lat = summary, summary["after"], summary["latency_s"]
    verdict = "PASS" if meta["passed"] else "FAIL"
    lines = [
        "# Server load test",
        "",
        f"- command: `{meta['command']}`",
        f"- server: `{meta['server_command']}`",
        f"- machine: {describe_machine(meta['machine'])}",
        f"- date: {meta['date']}",
        f"- load average before the run (other jobs on the machine): "
        f"{', '.join(f'{x:.2f}' for x in meta['load_average_before'])}",
        "",
        f"**{verdict}**: {s['completed']}/{s['requests']} requests completed "
        f"({meta['concurrency']} concurrent, max_tokens {meta['max_tokens']}); afterwards "
        f"{a['running']:.0f} running, {a['waiting']:.0f} waiting, "
        f"{a['kv_free_blocks']:.0f}/{a['kv_total_blocks']:.0f} KV blocks free.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| wall time | {s['wall_s']} s |",
        f"| requests/s | {s['requests_per_s']} |",
        f"| output tokens | {s['output_tokens']} |",
        f"| output tokens/s | {s['output_tokens_per_s']} |",
        f"| latency mean / p50 / p90 / p99 / max | {lat['mean']} / {lat['p50']} / {lat['p90']} / "
        f"{lat['p99']} / {lat['max']} s |",
        f"| engine steps | {a['engine_steps']:.0f} |",
        f"| preemptions | {a['preemptions']:.0f} |",
        f"| failed requests | {s['failed']} |",
        "",
        "The model is the built-in tiny random-weight model, so the figures measure the "
        "server and scheduler overhead on this machine, not model speed.",
    ]
    if s["errors"]:
        lines += ["", "Errors:", *[f"- `{e}`" for e in s["errors"]]]
    (out / "load_test.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="an already running server (default: start one)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--server-args",
        default="--max-num-seqs 256 --max-model-len 256 --num-threads 1",
        help="extra flags for the server this script starts",
    )
    args = parser.parse_args()

    load_before = os.getloadavg()
    machine = machine_info()
    server_args = ["--model", args.model, *args.server_args.split(), "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as tmp:
        server_args += ["--data-dir", str(Path(tmp) / "data")]
        server = Server(server_args, Path(tmp) / "server.log") if args.url is None else None
        with server or _Existing(args.url) as srv:
            results, wall = asyncio.run(
                run_load(srv.url, args.requests, args.concurrency, args.max_tokens, args.seed)
            )
            metrics = read_metrics(srv.url)
    summary = summarize(results, wall, metrics)
    after = summary["after"]
    passed = (
        summary["completed"] == args.requests
        and after["running"] == 0
        and after["waiting"] == 0
        and after["kv_free_blocks"] == after["kv_total_blocks"]
    )
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "server_command": (
            "seer_engine serve " + " ".join([*server_args[:-1], "<tmpdir>/data"])
            if args.url is None
            else args.url
        ),
        "load_average_before": load_before,
        "machine": machine,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "passed": passed,
    }
    write_report(summary, meta, args.out)
    print(json.dumps(summary, indent=2))
    print(f"{'PASS' if passed else 'FAIL'}: report in {args.out / 'load_test.md'}")
    return 0 if passed else 1


class _Existing:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __enter__(self) -> _Existing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
