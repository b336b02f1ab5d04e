"""``seer_engine bench rollout``: trace replay of every policy on the same groups.

The model runs real forward passes; the tokens come from the trace (TraceReplay is
their only holder). Every policy gets a fresh engine pool and the same groups in one
invocation, so the figures compare side by side.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import resolve_model_path
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.rollout.config import RolloutConfig
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.machine import machine_info
from seer_engine.rollout.policies import ROLLOUT_POLICIES, make_rollout_policy
from seer_engine.rollout.report import Progress, format_table, write_report
from seer_engine.sim.profile import InstanceProfile, StepTimeModel
from seer_engine.sim.setups import SETUPS
from seer_engine.workloads.replay import ReplayWorkload


def add_cli(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser("rollout", help="trace-replay rollout benchmark of the scheduling policies")
    p.add_argument("--trace", required=True, help="a traces .jsonl.gz file")
    p.add_argument(
        "--policy",
        default="baseline,divided,context,seer,oracle",
        help="comma-separated; a policy may add speculative decoding with 16 drafted tokens per step: "
        "context+ngram, context+suffix, context+group_path, context+group_tree (seer: adaptive budget)",
    )
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--groups", default="8", help="a count (8) or an index range (60:90) of trace groups")
    p.add_argument("--samples", type=int, default=8, help="responses per group")
    p.add_argument("--kv-blocks", type=int, default=256, help="KV blocks per instance")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--starvation-s", type=float, default=120.0)
    p.add_argument("--model", default=None, help="default: a tiny random model with the trace tokenizer")
    p.add_argument("--tokenizer", default=None, help="default: bpe32k-tokenizer.json beside the trace")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--report", default=None, help="write report.json and report.png here")
    p.add_argument(
        "--clock",
        default="wall",
        help="wall: instances' clocks follow measured step times; or a modeled clock, a setup name "
        f"({', '.join(SETUPS)}) or an instance profile JSON (seer_engine profile): the engines run and "
        "decide everything for real, each instance's clock advances by the profile's price of the work "
        "its step did (instances then step one at a time, in modeled-time order)",
    )
    RolloutConfig.add_cluster_args(p)
    p.set_defaults(func=run_bench_rollout)


def step_timer(clock: str) -> StepTimeModel | None:
    """``--clock``: None for the wall clock, else the step-time model to run on."""
    if clock == "wall":
        return None
    if clock in SETUPS:
        return SETUPS[clock].profile.step
    if Path(clock).suffix == ".json" or Path(clock).is_file():
        return InstanceProfile.load(clock).step
    raise ValueError(
        f"--clock must be 'wall', a setup ({', '.join(SETUPS)}) or a profile JSON, got {clock!r}"
    )


def _trace_model(args: argparse.Namespace, max_len: int) -> str:
    if args.model:
        return args.model
    from seer_engine.model_executor.tiny_model import make_tiny_model

    tokenizer = args.tokenizer or str(Path(args.trace).parent / "bpe32k-tokenizer.json")
    if not Path(tokenizer).is_file():
        raise ValueError(f"tokenizer {tokenizer!r} not found; pass --tokenizer or --model")
    out = Path(tempfile.mkdtemp(prefix="seer-bench-model-"))
    return str(
        make_tiny_model(
            out, tokenizer=tokenizer, num_layers=args.layers, hidden_size=args.hidden,
            max_position_embeddings=max(4096, max_len),
        )
    )  # fmt: skip


def run_bench_rollout(args: argparse.Namespace) -> int:
    from seer_engine.workloads.groups import select_groups
    from seer_engine.workloads.traces import load_trace

    machine = machine_info()
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for name in policies:
        base, _, spec = name.partition("+")
        if base not in ROLLOUT_POLICIES or (spec and spec not in SPEC_VARIANTS):
            raise ValueError(
                f"unknown policy {name!r}; choose from {sorted(ROLLOUT_POLICIES)}, optionally with "
                f"+{'|+'.join(SPEC_VARIANTS)} (speculative decoding on top)"
            )
    timer = step_timer(args.clock)  # a bad --clock fails before anything is loaded
    if not Path(args.trace).is_file():
        raise ValueError(f"trace file {args.trace!r} not found")
    trace = select_groups(load_trace(args.trace), args.groups)
    max_len = max(len(g.prompt_token_ids) for g in trace) + args.max_tokens + 1
    model = _trace_model(args, max_len)
    cfg = EngineConfig(
        model=model, num_kv_blocks=args.kv_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, num_threads=args.num_threads, max_model_len=max_len,
    )  # fmt: skip
    workload = ReplayWorkload(trace, args.samples, args.max_tokens)
    replay = workload.replay(min(ModelConfig.from_pretrained(resolve_model_path(model)).eos_token_ids))
    cluster = RolloutConfig(
        instances=args.instances,
        distributed_backend=args.distributed_backend,
        kv_connector=args.kv_connector,
        mooncake_master=args.mooncake_master,
        kv_pool_gib=args.kv_pool_gib,
        migration_spread=args.migration_spread,
        pool_pull_tokens=args.pool_pull_tokens,
    )
    true_lengths = workload.true_lengths
    total = len(true_lengths)
    print(f"bench rollout: {len(workload.prompts)} groups x {args.samples} samples = {total} responses, "
          f"{sum(true_lengths.values())} output tokens to replay, {args.instances} instances, "
          f"{args.kv_blocks} KV blocks each, chunk {args.chunk_tokens}, backend "
          f"{cluster.distributed_backend}, KV pool {cluster.kv_connector}", flush=True)  # fmt: skip
    results = {}
    for name in policies:
        policy = _bench_policy(name, true_lengths, args.starvation_s)
        progress = Progress(name, total)
        with cluster.make_pool(cfg, policy, replay, step_timer=timer) as pool:
            pool.reset_clocks()
            start = time.perf_counter()
            dispatcher = Dispatcher(
                pool, policy, args.chunk_tokens, on_sample_finished=progress, placement=cluster.placement()
            )
            results[name] = dispatcher.run(workload.groups())
        print(f"[{name}] done in {time.perf_counter() - start:.1f}s wall", flush=True)
    print(format_table(results))
    if args.report:
        meta = {
            "command": "seer_engine " + " ".join(sys.argv[1:]),
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": machine,
            "model": model, "groups": len(workload.prompts), "samples": args.samples,
            "instances": args.instances,
            "kv_blocks": args.kv_blocks, "chunk_tokens": args.chunk_tokens, "max_tokens": args.max_tokens,
            "distributed_backend": cluster.distributed_backend, "kv_connector": cluster.kv_connector,
            "clock": args.clock,
        }  # fmt: skip
        path = write_report(Path(args.report), results, meta)
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


# Speculative decoding variants a bench policy can add, e.g. "context+ngram". They
# draft a fixed 16 tokens per request and step, so their accepted tokens per step
# compare the draft sources alone; seer itself sizes drafts with the adaptive budget.
_FIXED16 = {"budget": "fixed", "num_speculative_tokens": 16}
SPEC_VARIANTS: dict[str, dict] = {
    "ngram": {"method": "ngram", **_FIXED16},
    "suffix": {"method": "suffix", **_FIXED16},  # a tree per response (SuffixDecoding)
    "group_path": {"method": "group_suffix", "multi_path": False, **_FIXED16},
    "group_tree": {"method": "group_suffix", **_FIXED16},
}


def _bench_policy(name: str, true_lengths: dict[str, int], starvation_s: float):
    """A rollout policy by name; ``base+variant`` adds that speculative decoding."""
    base, _, spec = name.partition("+")
    policy = make_rollout_policy(base, true_lengths=true_lengths, starvation_s=starvation_s)
    if spec:
        policy.name = name
        policy.speculative = SPEC_VARIANTS[spec]
    return policy
