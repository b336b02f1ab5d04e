"""An experiment, not part of the engine or the simulator: where `seer`'s decode rows
fall in the acceptance model's (stage, coverage) cells, and what they accept there, in
the real engine and in the simulator on the same workload.

    python benchmarks/results/history/g48/cells/run.py engine FIT.json OUT.json bench rollout ... \
        --policy seer
    python benchmarks/results/history/g48/cells/run.py simulate OUT.json simulate ... --policy seer
    python benchmarks/results/history/g48/cells/run.py compare FIT.json ENGINE.json SIM.json

``engine`` wraps the drafter's ``after_step``: for every verified step of a response it
records the cell of the acceptance model ``FIT.json`` (stage: the share of the group's
responses finished, i.e. stopped; coverage: the model's statistic of the siblings' lead
share, ``sim.acceptance.lead_share``), from every response's output length after the
previous step, with the tokens accepted. ``simulate`` wraps the modeled
instances: each decode stretch adds its rows' cells (from the simulator's own world, as
the acceptance model is asked) times its steps. Both run the command that follows.
"""

from __future__ import annotations

import collections
import json
import sys

from seer_engine.entrypoints import cli
from seer_engine.sim.acceptance import COVERAGE_WINDOW, AcceptanceModel, lead_share


def engine(fit: str, out: str, argv: list[str]) -> None:
    from seer_engine.spec_decode import drafter

    model = AcceptanceModel.load(fit)

    samples = int(argv[argv.index("--samples") + 1]) if "--samples" in argv else 8

    written: dict[str, int] = {}
    members: dict[str, set[str]] = collections.defaultdict(set)
    stopped: set[str] = set()
    cells: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    after_step = drafter.Drafter.after_step

    def recording(self, updated, verdicts, running):
        before = dict(written)
        for req in updated:
            sid, siblings = req.sequence_id, members[req.group_id]
            siblings.add(sid)
            verdict = verdicts.get(req.request_id)
            if verdict is None:
                continue
            size = samples
            p = req.num_output_tokens - len(verdict.tokens)
            # Siblings not seen yet have written nothing.
            leads = [before.get(j, 0) for j in siblings if j != sid] + [0] * (size - len(siblings))
            stage = model.stage_bin(sum(1 for j in siblings if j in stopped) / size)
            cell = cells[f"{stage}/{model.lead_bin(lead_share(p, leads))}"]
            cell[0] += 1
            cell[1] += len(verdict.nodes)
        for req in updated:
            written[req.sequence_id] = req.num_output_tokens
            if req.status.name == "FINISHED_STOPPED":
                stopped.add(req.sequence_id)
        return after_step(self, updated, verdicts, running)

    drafter.Drafter.after_step = recording
    cli.main(argv)
    _write(out, cells)


def simulate(out: str, argv: list[str]) -> None:
    from seer_engine.sim import instance

    cells: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    rates, run_decode = instance.SimInstance._rates, instance.SimInstance._run_decode

    def recording_rates(self, rows):
        gain, drafted, steady = rates(self, rows)
        here = collections.Counter()
        if self.speculation is not None:
            spec = self.speculation
            for g, keys in self.groups.keys.items():
                stage = spec.acceptance.stage_bin(self.world.stage(g))
                for k in keys:
                    here[f"{stage}/{spec.lead_bin(self.world.lead_share(g, k, COVERAGE_WINDOW))}"] += 1
        self._recorded = here
        return gain, drafted, steady

    def recording_run_decode(self, seg, steps):
        for key, n in getattr(self, "_recorded", {}).items():
            cells[key][0] += n * steps  # row-steps; the model prices a batch, not a row's verdicts
        return run_decode(self, seg, steps)

    instance.SimInstance._rates = recording_rates
    instance.SimInstance._run_decode = recording_run_decode
    cli.main(argv)
    _write(out, cells)


def _write(out: str, cells: dict[str, list[float]]) -> None:
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "cells": {k: cells[k] for k in sorted(cells)}}, f, indent=1)


def compare(fit_path: str, engine_path: str, sim_path: str) -> None:
    fit = json.load(open(fit_path))
    eng, sim = (json.load(open(p))["cells"] for p in (engine_path, sim_path))
    steps = fit["measured"]["steps"]
    fit_total = sum(cell[-1] for row in steps for cell in row)
    eng_total, sim_total = sum(v[0] for v in eng.values()), sum(v[0] for v in sim.values())
    print(
        "| stage/coverage bin | replay fit share | engine share | sim share | engine accepted/step "
        "| fit at budgets 2 / 4 / 16 |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for key in sorted(set(eng) | set(sim), key=lambda k: tuple(map(int, k.split("/")))):
        s, c = map(int, key.split("/"))
        e, m = eng.get(key, [0, 0.0]), sim.get(key, [0, 0.0])
        row = fit["accepted"][s][c]
        print(
            f"| {key} | {steps[s][c][-1] / fit_total:.3f} | {e[0] / eng_total:.3f} "
            f"| {m[0] / sim_total:.3f} | {e[1] / e[0] if e[0] else 0:.2f} "
            f"| {row[1]:.2f} / {row[2]:.2f} / {row[-1]:.2f} |"
        )


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "compare":
        compare(*rest)
    elif mode == "engine":
        engine(rest[0], rest[1], rest[2:])
    else:
        simulate(rest[0], rest[1:])
