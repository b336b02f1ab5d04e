"""What a modeled instance holds while it runs, per policy: running rows, the groups they
belong to, KV in use against capacity, and the prompt tokens siblings share. Averages
are over each instance's busy time (every modeled step weighted by its length).

It answers why the preempting baseline decodes faster per busy second than policies
that never preempt: more rows per instance, and from which savings. ``--sibling-lookahead
W`` tries one lever, a dispatch that places a sibling of a group already on the chosen
instance ahead of the top-ranked sample whose group is not there (looking at most W
samples down the ranking): groups packed onto fewer instances share their prompts more.

    python benchmarks/sim_kv_mix.py --setup qwen2vl-72b --policy baseline,divided,context \\
        --out benchmarks/results/simulator/kv-mix/qwen2vl-72b.json
    python benchmarks/sim_kv_mix.py --setup qwen2vl-72b --policy divided,context --sibling-lookahead 32
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shlex
import sys
import tempfile
from pathlib import Path

from seer_engine.entrypoints.cli import main as seer_engine
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.sim.instance import SimInstance
from seer_engine.sim.setups import SETUPS

FIELDS = ("rows", "groups", "kv", "capacity", "shared_prompt")


def measure_steps(sums: dict[int, collections.Counter]) -> None:
    """Wrap ``SimInstance.step`` to add each step's state, times its length, to
    ``sums[id(world)]`` (one world per simulated rollout)."""
    step = SimInstance.step

    def measured(self: SimInstance, horizon: float = float("inf")):
        t0 = self.clock
        now = {
            "rows": len(self.decoding) + len(self.prefilling),
            "groups": len(self.groups.rows),
            "kv": self._running_kv(),
            "capacity": self.capacity,
            "shared_prompt": self.groups.shared_prompt,
        }
        reply = step(self, horizon)
        dt = self.clock - t0
        if dt > 0:
            acc = sums.setdefault(id(self.world), collections.Counter())
            acc["busy_s"] += dt
            for k, v in now.items():
                acc[k] += v * dt
        return reply

    SimInstance.step = measured


def dispatch_siblings_ahead(lookahead: int, counts: collections.Counter) -> None:
    """Replace ``Dispatcher._dispatch`` with the sibling-first variant (an experiment)."""

    def dispatch(self: Dispatcher, now: float) -> None:
        if not self.buffer or not self._open_instances():
            return
        ranked = self.buffer.ranked(now)
        pending: collections.deque = collections.deque()
        try:
            failed: dict[int, int] = {}
            claimed: set[int] = set()
            while True:
                sample = pending.popleft() if pending else next(ranked, None)
                if sample is None:
                    return
                if sample not in self.buffer:
                    continue
                inst = self._place(sample, failed, claimed)
                if inst is None:
                    if self.backfill == "none" or self._nothing_fits(failed) or not self._claim(claimed):
                        return
                    continue
                chosen = sample
                if self._prefix_tokens(inst, sample) == 0:
                    while len(pending) < lookahead and (s := next(ranked, None)) is not None:
                        pending.append(s)
                    for s in pending:
                        if (
                            s in self.buffer
                            and self._prefix_tokens(inst, s) > 0
                            and self.admission.fits(inst.books, s, s.num_generated, self._chunk_limit(s))
                        ):
                            chosen = s
                            pending.remove(s)
                            pending.appendleft(sample)
                            break
                counts["ahead" if chosen is not sample else "in order"] += 1
                self.buffer.remove(chosen)
                self._submit_or_recover(inst, chosen, self._chunk_limit(chosen), reserve=True)
                if not self._open_instances():
                    return
        finally:
            ranked.close()

    Dispatcher._dispatch = dispatch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", choices=sorted(SETUPS), required=True)
    p.add_argument("--policy", default="baseline,divided,context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sibling-lookahead", type=int, default=0, help="0: the engine's own dispatch")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sums: dict[int, collections.Counter] = {}
    counts: collections.Counter = collections.Counter()
    measure_steps(sums)
    if args.sibling_lookahead:
        dispatch_siblings_ahead(args.sibling_lookahead, counts)
    rows = []
    for name in args.policy.split(","):
        before = set(sums)
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
            cmd = [
                "simulate",
                "--setup",
                args.setup,
                "--seed",
                str(args.seed),
                "--policy",
                name,
                "--report",
                tmp,
            ]
            seer_engine(cmd)
            report = json.loads((Path(tmp) / args.setup / "report.json").read_text())
        (world,) = set(sums) - before
        acc = sums[world]
        busy = acc["busy_s"]
        row = {"policy": name, "makespan_s": report["policies"][name]["makespan_s"]}
        row.update({k: round(acc[k] / busy, 1) for k in FIELDS})
        row["kv_share"] = round(acc["kv"] / acc["capacity"], 4)
        rows.append(row)
        print(
            f"{name:>10}  makespan {row['makespan_s']:>8,.1f} s  rows {row['rows']:>6.1f}  groups "
            f"{row['groups']:>5.1f}  KV in use {row['kv_share']:.1%}  "
            f"shared prompt {row['shared_prompt']:>9,.0f} tokens",
            flush=True,
        )
    report = {
        "command": shlex.join(["python", *sys.argv]),
        "setup": args.setup,
        "seed": args.seed,
        "sibling_lookahead": args.sibling_lookahead,
        "dispatches": dict(counts),
        "per_instance_busy_time_means": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
