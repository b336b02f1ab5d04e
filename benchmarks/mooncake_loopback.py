"""Bytes per second through the Mooncake KV pool on one host (TCP loopback), put and get apart.

Why: a response that moves between instances pays a pool save at the end of its chunk and a
pool load at the start of the next one; whether that beats recomputing the context depends
on how fast blocks move through the pool. This measures it on the path the engine uses.

Setup: a ``MooncakeMaster`` on 127.0.0.1 whose segment holder (a ``mooncake_client``
process) mounts the pool's memory, and one ``MooncakeStore`` client in this process that
mounts none: every byte crosses loopback TCP between two processes, as between two
instances on one host. For each call size (64 KiB, 1 MiB, 16 MiB by default) it times:

* ``store``: ``MooncakeStore.put`` / ``get_into`` from / into a CPU tensor (what
  ``PooledConnector`` calls): a probe of the master, the copy through the registered staging
  buffer, and the Mooncake batch call;
* ``raw``: the Mooncake client's ``batch_upsert_from`` / ``batch_get_into`` on the already
  registered buffer (zero-copy; the floor under ``store``);

each with two layouts of the same bytes: one key holding them all, and KV blocks of
``--block-kib`` (64 KiB) each, one key per block. Puts overwrite the same keys (upsert) every
repeat; gets read them back (checked byte for byte once per case). A case repeats for at
least ``--seconds`` and ``--min-repeats`` times after one warm-up call; the figure is the
median call, with the best and the slowest listed.

    python benchmarks/mooncake_loopback.py [--sizes-kib 64 1024 16384] [--block-kib 64]

Writes ``benchmarks/results/mooncake_loopback/{report.json,README.md,throughput.png}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from seer_engine.kv_connector.mooncake import MooncakeMaster, MooncakeStore
from seer_engine.rollout.machine import machine_info

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "mooncake_loopback"
MiB = 1 << 20


def machine() -> dict[str, Any]:
    return machine_info(
        mooncake=importlib.metadata.version("mooncake-transfer-engine-non-cuda"),
        transport="TCP over loopback (127.0.0.1), client and segment holder in two processes",
    )


def timed(call, seconds: float, min_repeats: int) -> list[float]:
    """Seconds per call: one warm-up, then repeats until both limits are reached."""
    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times


def summary(nbytes: int, times: list[float]) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "repeats": len(times),
        "median_s": med,
        "best_s": min(times),
        "worst_s": max(times),
        "mib_per_s": nbytes / med / MiB,
        "best_mib_per_s": nbytes / min(times) / MiB,
    }


def raw_calls(store: MooncakeStore, keys: list[str], value_bytes: int):
    """Zero-copy put/get of ``keys`` straight from/into the store's registered staging buffer."""
    client = store._h.client
    ptrs = [store._h.staging.data_ptr() + i * value_bytes for i in range(len(keys))]
    sizes = [value_bytes] * len(keys)

    def check(codes: list[int], ok) -> None:
        bad = [c for c in codes if not ok(c)]
        if bad:
            raise RuntimeError(f"Mooncake returned {bad[:3]} for {len(bad)} of {len(keys)} keys")

    def put() -> None:
        for s in range(0, len(keys), store.max_batch):
            e = s + store.max_batch
            check(client.batch_upsert_from(keys[s:e], ptrs[s:e], sizes[s:e]), lambda c: c == 0)

    def get() -> None:
        for s in range(0, len(keys), store.max_batch):
            e = s + store.max_batch
            check(client.batch_get_into(keys[s:e], ptrs[s:e], sizes[s:e]), lambda c: c == value_bytes)

    return put, get


def run_case(store: MooncakeStore, total: int, value_bytes: int, args) -> dict[str, Any]:
    n = total // value_bytes
    keys = [f"bench/{total}/{value_bytes}/{i}" for i in range(n)]
    src = torch.randint(0, 256, (n, value_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    result: dict[str, Any] = {"total_bytes": total, "value_bytes": value_bytes, "keys": n}
    store.put(keys, src)
    store.get_into(keys, dst)
    if not torch.equal(src, dst):
        raise RuntimeError(f"{n} values of {value_bytes} bytes came back different")
    result["store_put"] = summary(total, timed(lambda: store.put(keys, src), args.seconds, args.min_repeats))
    result["store_get"] = summary(
        total, timed(lambda: store.get_into(keys, dst), args.seconds, args.min_repeats)
    )
    put, get = raw_calls(store, keys, value_bytes)
    result["raw_put"] = summary(total, timed(put, args.seconds, args.min_repeats))
    result["raw_get"] = summary(total, timed(get, args.seconds, args.min_repeats))
    store.remove_prefix(f"bench/{total}/{value_bytes}/")
    return result


def fmt_size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes >> 10} KiB"


def plot(cases: list[dict[str, Any]], block: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = {
        "one key per call": [c for c in cases if c["keys"] == 1],
        f"{fmt_size(block)} blocks": [c for c in cases if c["value_bytes"] == block],
    }
    ticks = sorted({c["total_bytes"] for c in cases})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op in zip(axes, ("put", "get")):
        for (layout, rows), marker in zip(layouts.items(), ("o", "s")):
            xs = [c["total_bytes"] for c in rows]
            for kind, style in (("store", "-"), ("raw", "--")):
                ys = [c[f"{kind}_{op}"]["mib_per_s"] for c in rows]
                ax.plot(xs, ys, style, marker=marker, label=f"{kind}, {layout}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt_size(t) for t in ticks])
        ax.set_title(f"{op} (median call)")
        ax.set_xlabel("bytes per call")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("MiB/s")
    axes[1].legend(fontsize=8)
    fig.suptitle("Mooncake store over TCP loopback (2 processes, one host)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def readme(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# Mooncake KV pool throughput on TCP loopback",
        "",
        f"Command (repo root): `{report['command']}`",
        f"(results: `report.json`, `throughput.png`; {report['wall_s']:.0f} s).",
        "",
        f"Date: {report['date']}. Machine: {m['cpu']}, {m['cpu_count']}-core CPU, no GPU, "
        f"{m['platform']}, Python {m['python']}, torch {m['torch']}, "
        f"mooncake-transfer-engine-non-cuda {m['mooncake']}. Transport: TCP over loopback "
        "(127.0.0.1) between this process (a client that mounts no memory) and the master's "
        "segment holder (a `mooncake_client` process that mounts the pool's memory), so every "
        f"byte crosses a socket. 1-minute load average {m['loadavg_1m_at_start']:.2f} at the "
        f"start and {report['loadavg_1m_at_end']:.2f} at the end.",
        "",
        "Each call moves the bytes in the first column, either as one key or as KV blocks of "
        f"{fmt_size(report['block_bytes'])} (one key each). `store` is `MooncakeStore.put` / "
        "`get_into` from/into a CPU tensor (master probe, copy through the registered staging "
        "buffer, Mooncake batch call); `raw` is the client's zero-copy `batch_upsert_from` / "
        "`batch_get_into` on the registered buffer. Figures are the median call over at least "
        f"{report['min_repeats']} repeats and {report['seconds']} s after one warm-up (best call "
        "in brackets).",
        "",
        "| bytes per call | keys | store put MiB/s | store get MiB/s | raw put MiB/s | raw get MiB/s |"
        " store put ms | store get ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        cell = [
            f"{c[k]['mib_per_s']:,.0f} ({c[k]['best_mib_per_s']:,.0f})" for k in ("store_put", "store_get")
        ]
        cell += [f"{c[k]['mib_per_s']:,.0f}" for k in ("raw_put", "raw_get")]
        cell += [f"{c[k]['median_s'] * 1e3:.2f}" for k in ("store_put", "store_get")]
        lines.append(f"| {fmt_size(c['total_bytes'])} | {c['keys']} | " + " | ".join(cell) + " |")
    big = max(report["cases"], key=lambda c: (c["total_bytes"], c["keys"] == 1))
    small = min(report["cases"], key=lambda c: c["total_bytes"])
    lines += [
        "",
        "## Reading",
        "",
        f"- At {fmt_size(big['total_bytes'])} per call the pool moves "
        f"{big['store_put']['mib_per_s']:,.0f} MiB/s in and {big['store_get']['mib_per_s']:,.0f} MiB/s "
        f"out through `MooncakeStore` ({big['raw_put']['mib_per_s']:,.0f} / "
        f"{big['raw_get']['mib_per_s']:,.0f} MiB/s zero-copy).",
        f"- At {fmt_size(small['total_bytes'])} a call is latency-bound: "
        f"{small['store_put']['median_s'] * 1e3:.2f} ms per put, {small['store_get']['median_s'] * 1e3:.2f} "
        "ms per get (a put asks the master for space and then to publish, two RPCs around the "
        "transfer; a get asks where the value is, then reads it; `MooncakeStore` adds a TCP probe "
        "of the master, ~0.05 ms).",
        "- On two cores the client, the segment holder and the master share the CPUs, so these are "
        "a floor for a host with idle cores; RDMA (`protocol='rdma'`) skips the socket copies.",
    ]
    load = max(m["loadavg_1m_at_start"], report["loadavg_1m_at_end"])
    if load > 0.5 * (m["cpu_count"] or 1):
        lines.append(
            f"- Other processes shared the machine during the run (load average up to {load:.2f} on "
            f"{m['cpu_count']} cores): medians vary between runs; the best calls (in brackets) are "
            "closer to what an idle machine gives."
        )
    lines += [
        "",
        "![throughput](throughput.png)",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=1.0, help="least time per case")
    parser.add_argument("--min-repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    wall = time.perf_counter()
    info = machine()
    sizes = [k << 10 for k in args.sizes_kib]
    block = args.block_kib << 10
    pool = max(64 * MiB, 4 * max(sizes))
    cases: list[dict[str, Any]] = []
    with MooncakeMaster(segment_bytes=pool) as master:
        store = MooncakeStore(master.address, master.metadata_server, local_buffer_size=max(sizes))
        try:
            for total in sizes:
                layouts = [total] + ([block] if block < total and total % block == 0 else [])
                for value in layouts:
                    case = run_case(store, total, value, args)
                    cases.append(case)
                    print(
                        f"{fmt_size(total):>7} as {case['keys']:>4} x {fmt_size(value):>7}: "
                        f"put {case['store_put']['mib_per_s']:8,.0f} MiB/s "
                        f"(raw {case['raw_put']['mib_per_s']:8,.0f})  "
                        f"get {case['store_get']['mib_per_s']:8,.0f} MiB/s "
                        f"(raw {case['raw_get']['mib_per_s']:8,.0f})",
                        flush=True,
                    )
        finally:
            store.close()

    argv = " ".join(sys.argv[1:])
    report = {
        "command": f"python benchmarks/mooncake_loopback.py{' ' + argv if argv else ''}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "pool_bytes": pool,
        "block_bytes": block,
        "seconds": args.seconds,
        "min_repeats": args.min_repeats,
        "cases": cases,
        "wall_s": time.perf_counter() - wall,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(cases, block, args.out / "throughput.png")
    (args.out / "README.md").write_text(readme(report))
    print(f"wrote {args.out}/report.json, README.md, throughput.png", flush=True)


if __name__ == "__main__":
    main()
