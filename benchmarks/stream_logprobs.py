"""Streaming with logprobs against the same request unstreamed, and a reader that stalls.

RL trainers stream long responses with logprobs. Each streamed event must cost the
server the new tokens only: a server that re-converts every token so far on each step
is quadratic in the response's length. This script starts ``seer_engine serve`` (plain,
then ``--rollout-mode --instances 2``) on a tiny model, sends one completion request of
``--n`` samples x ``--max-tokens`` tokens with ``logprobs``, once whole and once streamed,
and reports the wall time of each and their ratio (the same tokens are generated both
ways: ``ignore_eos`` and a seed). Then it opens the same request streamed, reads one event
and stops reading until the server has generated everything, and reports how much the
server process grew meanwhile (its resident memory, summed with its children's).

    python benchmarks/stream_logprobs.py [--n 8] [--max-tokens 400] [--model tiny]

Results go to ``benchmarks/results/stream_logprobs.{md,json}`` with the command,
machine and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import httpx
from load_test import Server, read_metrics

from seer_engine.rollout.machine import describe_machine, machine_info

RESULTS = Path(__file__).resolve().parent / "results"


def _body(args: argparse.Namespace, stream: bool) -> dict:
    return {
        "prompt": "The rollout phase of reinforcement learning",
        "n": args.n, "max_tokens": args.max_tokens, "logprobs": 5, "temperature": 1.0, "seed": 0,
        "ignore_eos": True, "stream": stream,
    }  # fmt: skip


def _whole(url: str, args: argparse.Namespace) -> tuple[float, int]:
    start = time.perf_counter()
    resp = httpx.post(url + "/v1/completions", json=_body(args, False), timeout=3600)
    resp.raise_for_status()
    return time.perf_counter() - start, resp.json()["usage"]["completion_tokens"]


def _streamed(url: str, args: argparse.Namespace) -> tuple[float, int, int]:
    """Seconds, tokens (from the logprobs entries) and events of the streamed request."""
    tokens = events = 0
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=_body(args, True), timeout=3600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            for choice in json.loads(line[6:])["choices"]:
                tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
    return time.perf_counter() - start, tokens, events


def _rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _stalled_reader(server: Server, args: argparse.Namespace) -> dict:
    """Read one event, then nothing until every token is generated; the growth meanwhile."""
    assert server.proc is not None
    before = _rss_bytes(server.proc.pid)
    with httpx.stream("POST", server.url + "/v1/completions", json=_body(args, True), timeout=3600) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            m = read_metrics(server.url)
            if m.get("num_requests_running", 0) == 0 and m.get("num_requests_waiting", 0) == 0:
                break
            time.sleep(0.5)
        stalled = _rss_bytes(server.proc.pid)
        for _ in lines:  # drain, so the request ends normally
            pass
    return {"rss_before_mb": before / 2**20, "rss_stalled_mb": stalled / 2**20,
            "growth_mb": (stalled - before) / 2**20}  # fmt: skip


def run_mode(label: str, extra: list[str], args: argparse.Namespace) -> dict:
    log = RESULTS / f"stream_logprobs_{label}.log"
    with Server(["--model", args.model, "--max-model-len", str(args.max_tokens + 64), *extra], log) as server:
        _whole(server.url, args)  # warm-up: first-step costs out of the figures
        whole_s, whole_tokens = _whole(server.url, args)
        stream_s, stream_tokens, events = _streamed(server.url, args)
        print(f"{label}: whole {whole_s:.2f} s, streamed {stream_s:.2f} s ({events} events)", flush=True)
        stalled = _stalled_reader(server, args)
        print(f"{label}: a stalled reader grew the server by {stalled['growth_mb']:.1f} MB", flush=True)
    log.unlink(missing_ok=True)
    return {
        "mode": label, "whole_s": whole_s, "streamed_s": stream_s, "streamed_over_whole": stream_s / whole_s,
        "tokens": whole_tokens, "streamed_tokens": stream_tokens, "events": events, **stalled,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    modes = [("plain", []), ("rollout", ["--rollout-mode", "--instances", "2"])]
    rows = [run_mode(label, extra, args) for label, extra in modes]
    command = "python benchmarks/stream_logprobs.py " + " ".join(sys.argv[1:])
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = {"command": command.strip(), "date": date, "machine": machine_info(), "rows": rows}
    (RESULTS / "stream_logprobs.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Streaming with logprobs, and a reader that stalls",
        "",
        f"Command: `{report['command']}`. Date: {date}. Machine: {describe_machine(report['machine'])}.",
        "",
        f"One request of n={args.n} x {args.max_tokens} tokens with logprobs=5 (`ignore_eos`, seed 0), "
        "after one warm-up request.",
        "",
        "| mode | whole s | streamed s | streamed / whole | events | stalled reader: server growth MB |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['mode']} | {r['whole_s']:.2f} | {r['streamed_s']:.2f} | {r['streamed_over_whole']:.2f} | "
            f"{r['events']} | {r['growth_mb']:.1f} |"
            for r in rows
        ),
        "",
    ]
    (RESULTS / "stream_logprobs.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
