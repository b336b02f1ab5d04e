"""Grouped-draft acceptance with cross-iteration history, in lock-step replay of a trace.

Why: RL revisits every prompt each epoch. Seeding a group's suffix tree with earlier
iterations' responses to the same prompt (at a lower weight than live siblings) should
let drafts work from a response's first token, where a plain grouped tree has nothing
to draft from yet.

What is replayed, per trace group and iteration k (siblings k*samples ..
(k+1)*samples-1 of the group: disjoint sets, as ``bench rollout --iterations`` takes
them): every step each live sibling asks the engine's own ``SuffixProposer`` for a
draft (budget ``--budget``, multi-path), accepts the longest draft path matching its
real continuation (exact-match acceptance, as greedy verification), and advances by
that plus the bonus token; then the proposer observes the new tokens. Before the
group's first step the proposer is seeded from a ``HistoryStore`` holding earlier
iterations' responses (``--no-history``: never). After the group the store records its
responses (capped as in the engine).

Reported per iteration: accepted draft tokens per request-step overall and in the last
third of each group's steps (the stragglers, whose siblings have finished).

    python benchmarks/history_acceptance.py [--groups all] [--samples 8] [--iterations 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from seer_engine.core.request import Request
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.machine import machine_info
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.acceptance_replay import accepted_len
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.proposers import SuffixProposer
from seer_engine.workloads.groups import select_groups
from seer_engine.workloads.paths import traces_dir
from seer_engine.workloads.traces import load_trace

DEFAULT_TRACE = traces_dir() / "qwen3-8b-mcq-cot.jsonl.gz"
TARGET_OVERALL = 1.5
TARGET_LAST_THIRD = 1.9


def replay(
    proposer: SuffixProposer,
    gid: str,
    prompt: list[int],
    responses: Sequence[list[int]],
    budget: int,
    seeds: list[list[int]],
) -> tuple[list[int], list[int], list[int]]:
    """One group in lock-step; (accepted, drafted nodes, the step's round) per request-step."""
    if seeds:
        proposer.seed_group(gid, prompt, seeds)
    params = SamplingParams(max_tokens=10**9)
    reqs = [
        Request(
            f"{gid}/{k}",
            list(prompt),
            params,
            max_tokens=10**9,
            seed=0,
            group_id=gid,
            sequence_id=f"{gid}/{k}",
        )
        for k in range(len(responses))
    ]
    pos = [0] * len(responses)
    live = [k for k, r in enumerate(responses) if r]
    accepted_out: list[int] = []
    drafted_out: list[int] = []
    rounds: list[int] = []
    step = 0
    while live:
        drafts = [proposer.propose(reqs[k], budget, True) for k in live]
        for k, draft in zip(live, drafts):
            r, p = responses[k], pos[k]
            accepted = accepted_len(draft, r[p : p + len(draft)])
            new = min(len(r), p + accepted + 1)
            for tok in r[p:new]:
                reqs[k].append_output_token(tok)
            proposer.observe(reqs[k])
            pos[k] = new
            accepted_out.append(accepted)
            drafted_out.append(len(draft))
            rounds.append(step)
        live = [k for k in live if pos[k] < len(responses[k])]
        step += 1
    proposer.finish_group(gid)
    return accepted_out, drafted_out, rounds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--groups", default="all", help="'30' (first 30), '0:90', or 'all'")
    parser.add_argument("--samples", type=int, default=8, help="responses (siblings) per group")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument(
        "--min-prob", type=float, default=SpeculativeConfig.min_prob, help="drop draft nodes below this"
    )
    parser.add_argument(
        "--backoff",
        type=float,
        default=SpeculativeConfig.backoff,
        help="pseudo-counts each context length takes from the next shorter one (0: longest match alone)",
    )
    parser.add_argument("--history-weight", type=float, default=SpeculativeConfig.history_weight)
    parser.add_argument(
        "--history-sequences", type=int, default=SpeculativeConfig.history_sequences, help="seeds per group"
    )
    parser.add_argument(
        "--max-sequence-tokens", type=int, default=HistoryStore().max_sequence_tokens, help="a seed's cap"
    )
    parser.add_argument("--no-history", action="store_true", help="never seed (the plain grouped tree)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    groups = select_groups(load_trace(args.trace), args.groups)
    config = SpeculativeConfig(
        method="group_suffix", history_weight=args.history_weight, history_sequences=args.history_sequences,
        min_prob=args.min_prob, backoff=args.backoff,
    )  # fmt: skip
    store = HistoryStore(max_sequences=args.history_sequences, max_sequence_tokens=args.max_sequence_tokens)
    proposer = SuffixProposer(config, grouped=True)
    start = time.perf_counter()
    per_iteration = []
    for it in range(args.iterations):
        total = steps = last = last_steps = seeded = drafted = last_drafted = 0
        for g in groups:
            responses = [list(r) for r in g.response_token_ids[it * args.samples : (it + 1) * args.samples]]
            if len(responses) < args.samples:
                raise ValueError(f"trace group {g.group_id} has too few responses for iteration {it + 1}")
            prompt = list(g.prompt_token_ids)
            seeds = [] if args.no_history else store.sequences(prompt)[-config.history_sequences :]
            seeded += bool(seeds)
            gid = f"g{g.group_id}"
            accepted, nodes, rounds = replay(proposer, gid, prompt, responses, args.budget, seeds)
            cut = (max(rounds) + 1) * 2 / 3
            total += sum(accepted)
            drafted += sum(nodes)
            steps += len(accepted)
            tail = [k for k, r in enumerate(rounds) if r >= cut]
            last += sum(accepted[k] for k in tail)
            last_drafted += sum(nodes[k] for k in tail)
            last_steps += len(tail)
            for r in responses:
                store.record(prompt, len(r), r)
        store.next_iteration()
        row = {
            "iteration": it + 1,
            "seeded_groups": seeded,
            "accepted_per_step": round(total / steps, 3),
            "accepted_per_step_last_third": round(last / max(1, last_steps), 3),
            "drafted_per_step": round(drafted / steps, 2),
            "drafted_per_step_last_third": round(last_drafted / max(1, last_steps), 2),
            "steps": steps,
            "seconds": round(time.perf_counter() - start, 1),  # since the first iteration began
        }
        per_iteration.append(row)
        print(json.dumps(row), f"({time.perf_counter() - start:.0f}s)", flush=True)
    later = per_iteration[1:] or per_iteration
    verdict = all(
        r["accepted_per_step"] >= TARGET_OVERALL and r["accepted_per_step_last_third"] >= TARGET_LAST_THIRD
        for r in later
    )
    print(f"iterations {'2..' if len(per_iteration) > 1 else ''}{len(per_iteration)}: targets "
          f">= {TARGET_OVERALL} overall and >= {TARGET_LAST_THIRD} in the last third: "
          f"{'met' if verdict else 'NOT met'}")  # fmt: skip
    if args.out:
        meta = {
            "command": "python " + " ".join(sys.argv),
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine_info(),
            "trace": Path(args.trace).name, "groups": len(groups), "samples": args.samples,
            "budget": args.budget, "min_prob": args.min_prob, "backoff": args.backoff,
            "history_weight": args.history_weight,
            "history": not args.no_history,
            "history_sequences": args.history_sequences, "max_sequence_tokens": args.max_sequence_tokens,
        }  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "iterations": per_iteration}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
