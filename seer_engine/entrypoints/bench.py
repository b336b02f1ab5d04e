"""``seer_engine bench rollout``: every policy on the same groups, in one invocation.

With ``--trace`` the model runs real forward passes and the tokens come from the trace
(TraceReplay is their only holder). With ``--task`` the model samples its own
responses to a verifiable task's problems; seeded sampling (``core.seeds``) makes them
the same under every policy, which the report checks response by response. Every
policy gets a fresh engine pool, so the figures compare side by side.

``--iterations N`` revisits the same prompts N times, as RL epochs do: with ``--trace``
iteration k replays trace responses k*samples .. (k+1)*samples-1 of each group
(disjoint sibling sets), with ``--task`` the same problems with fresh sampling seeds.
A ``+history`` policy carries its own history store across its iterations (it ranks
by it and its grouped drafts are seeded from it); other policies start fresh each time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from seer_engine.core.seeds import group_seed
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.input_processor import InputProcessor
from seer_engine.engine.llm_engine import resolve_model_path
from seer_engine.entrypoints.bench_policies import bench_policy, parse_policies, split_policy
from seer_engine.entrypoints.rollout_cli import (
    add_task_args,
    check_source_args,
    grade_result,
    summarize,
    task_groups,
)
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.rollout.config import RolloutConfig, bind_history, history_help, open_history, save_history
from seer_engine.rollout.context_manager import DEFAULT_STARVATION_S, add_context_order_arg
from seer_engine.rollout.dispatcher import Dispatcher, add_dispatch_args, check_dispatch_rules
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.machine import machine_info
from seer_engine.rollout.metrics import RolloutResult
from seer_engine.rollout.policies import HISTORY_POLICIES, check_context_flags
from seer_engine.rollout.report import (
    Progress,
    format_table,
    plot_group_lengths,
    writable_dir,
    write_report,
    written,
)
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.profile import InstanceProfile
from seer_engine.sim.setups import SETUPS
from seer_engine.tasks import get_task, parse_knobs
from seer_engine.tasks.summary import format_summary
from seer_engine.workloads.replay import ReplayWorkload


def add_cli(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser("rollout", help="rollout benchmark of the scheduling policies (trace or task)")
    p.add_argument("--trace", default=None, help="a traces .jsonl.gz file to replay (or use --task)")
    add_task_args(p)
    p.add_argument("--seed", type=int, default=None, help="--task: picks the problems and sampling seeds (0)")
    p.add_argument("--temperature", type=float, default=None, help="--task: sampling temperature (0.7)")
    p.add_argument(
        "--policy",
        default="baseline,divided,context,seer,oracle",
        help="comma-separated; a policy may add speculative decoding with 16 drafted tokens per step: "
        "context+ngram, context+suffix, context+group_path, context+group_tree (seer: adaptive budget)",
    )
    p.add_argument("--instances", type=int, default=2, help="engine instances")
    p.add_argument(
        "--groups", default=None, help="--trace: a count (8, the default) or an index range (60:90) of groups"
    )
    p.add_argument("--samples", "--n", type=int, default=8, help="responses per group")
    p.add_argument("--kv-blocks", type=int, default=256, help="KV blocks per instance")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--chunk-tokens", type=int, default=512, help="divided rollout: most tokens per dispatch")
    p.add_argument("--max-tokens", type=int, default=2048, help="most tokens per response")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per instance step")
    p.add_argument("--starvation-s", type=float, default=None, help=f"default {DEFAULT_STARVATION_S:g}")
    add_context_order_arg(p)
    add_dispatch_args(p)
    p.add_argument(
        "--model", default=None, help="--task: the model that samples; --trace default: a tiny random "
        "model with the trace tokenizer"
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", default=None,
        help="--trace: the trace's tokenizer (default: bpe32k-tokenizer.json beside the trace, else in "
        "the shared traces folder)",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="--trace without --model: replay model's (2)")
    p.add_argument("--hidden", type=int, default=None, help="--trace without --model: replay model's (64)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per instance")
    p.add_argument("--report", default=None, help="write report.json and report.png here")
    p.add_argument(
        "--clock",
        default="wall",
        help="wall: instances' clocks follow measured step times; or a modeled clock, a setup name "
        f"({', '.join(SETUPS)}) or an instance profile JSON (seer_engine profile): the engines run and "
        "decide everything for real, each instance's clock advances by the profile's price of the work "
        "its step did and of the KV it pulled from the pool (instances step one at a time, in modeled time)",
    )
    p.add_argument(
        "--iterations", type=int, default=1,
        help="rollouts of the same prompts (--trace: disjoint sibling sets; --task: fresh seeds)",
    )  # fmt: skip
    p.add_argument(
        "--history", default="memory", metavar="off|memory|DIR",
        help=history_help("default: memory; with DIR each +history policy keeps DIR/POLICY/") + "; "
        "only +history policies use one",
    )  # fmt: skip
    RolloutConfig.add_cluster_args(p)
    p.set_defaults(func=run_bench_rollout)


def clock_profile(clock: str) -> InstanceProfile | None:
    """``--clock``: None for the wall clock, else the profile whose steps and pool run it."""
    if clock == "wall":
        return None
    if clock in SETUPS:
        return SETUPS[clock].profile
    if Path(clock).suffix == ".json" or Path(clock).is_file():
        return InstanceProfile.load(clock)
    raise ValueError(
        f"--clock must be 'wall', a setup ({', '.join(SETUPS)}) or a profile JSON, got {clock!r}"
    )


def _trace_model(args: argparse.Namespace, max_len: int, scratch: ExitStack) -> tuple[str, str]:
    """The model the trace is replayed on, and its name in the report: ``--model``, else a
    tiny random model with the trace's tokenizer, in a temporary folder ``scratch`` removes."""
    if args.model:
        return args.model, args.model
    from seer_engine.model_executor.tiny_model import make_tiny_model

    out = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="seer-bench-model-")))
    model = make_tiny_model(out, tokenizer=args.tokenizer, num_layers=args.layers, hidden_size=args.hidden,
                            max_position_embeddings=max(4096, max_len))  # fmt: skip
    return str(model), f"tiny random qwen3 ({args.layers} layers, hidden {args.hidden}, the trace tokenizer)"


def _check_replay_model_args(args: argparse.Namespace) -> None:
    """``--layers``, ``--hidden`` (and ``--tokenizer``) only shape the model made for a trace
    replay: given where none is made, they would change nothing."""
    shape = (args.layers, args.hidden) != (None, None)
    if args.task is not None and (shape or args.tokenizer is not None):
        raise ValueError("--layers, --hidden and --tokenizer shape the --trace replay model; --task samples "
                         "with --model as it is")  # fmt: skip
    if args.model is not None and shape:
        raise ValueError("--layers and --hidden shape the replay model made without --model")
    args.layers = 2 if args.layers is None else args.layers
    args.hidden = 64 if args.hidden is None else args.hidden


def run_bench_rollout(args: argparse.Namespace) -> int:
    with ExitStack() as scratch:  # what the run makes for itself (a replay model) goes with it
        return _bench_rollout(args, scratch)


def _bench_rollout(args: argparse.Namespace, scratch: ExitStack) -> int:
    check_source_args(args, "--trace")
    if args.iterations < 1:
        raise ValueError(f"--iterations must be >= 1, got {args.iterations}")
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.starvation_s is not None and not args.starvation_s >= 0:
        raise ValueError(f"--starvation-s must be >= 0, got {args.starvation_s}")
    machine = machine_info()
    policies = parse_policies(args.policy)
    check_context_flags([split_policy(p)[0] for p in policies], args.starvation_s, args.context_order)
    args.starvation_s = DEFAULT_STARVATION_S if args.starvation_s is None else args.starvation_s
    clock = clock_profile(args.clock)  # a bad --clock fails before anything is loaded
    args.admission = check_dispatch_rules(args.admission, args.backfill)
    for flag in ("chunk_tokens", "max_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    _cluster(args)  # --instances and the KV pool's flags, named before anything loads
    _engine_config(args, args.model or "tiny", 1)  # and the engine's
    if args.history == "off" and any(split_policy(p)[0] in HISTORY_POLICIES for p in policies):
        raise ValueError("+history policies rank by the history store: they need --history memory or DIR")
    if args.report:
        writable_dir(args.report, "--report")
    if args.history not in ("off", "memory"):
        writable_dir(args.history, "--history")
    if args.task is None and (args.seed, args.temperature) != (None, None):
        raise ValueError("--seed and --temperature go with --task: a trace replay emits the trace's tokens")
    _check_replay_model_args(args)
    args.seed, args.temperature = (args.seed or 0), (0.7 if args.temperature is None else args.temperature)
    if args.task is not None:
        return _run_task_bench(args, policies, machine, clock)
    from seer_engine.workloads.groups import select_groups
    from seer_engine.workloads.paths import default_tokenizer_path, resolve_trace_path
    from seer_engine.workloads.traces import load_trace

    try:  # a path, or a trace's name in the shared traces folder (as simulate takes it)
        args.trace = str(resolve_trace_path(args.trace))
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    # The trace is tokenized with the tokenizer the replay model is made with.
    args.tokenizer = str(args.tokenizer or default_tokenizer_path(args.trace))
    if not Path(args.tokenizer).is_file():
        raise ValueError(f"tokenizer {args.tokenizer!r} not found; pass --tokenizer")
    trace = select_groups(load_trace(args.trace, args.tokenizer), args.groups or "8")
    max_len = max(len(g.prompt_token_ids) for g in trace) + args.max_tokens + 1
    workloads = [
        ReplayWorkload(trace, args.samples, args.max_tokens, first=it * args.samples)
        for it in range(args.iterations)
    ]
    for w in workloads:
        _check_kv_holds(args, w)
    model, model_name = _trace_model(args, max_len, scratch)
    cfg = _engine_config(args, model, max_len)
    path = resolve_model_path(model)
    model_cfg = ModelConfig.from_pretrained(path)
    eos = model_cfg.replay_eos()
    _check_vocab(args, workloads, model_cfg.vocab_size)
    tokenizer = Detokenizer.from_pretrained(path)  # the stores' binding, as rollout and serve bind them
    processor = InputProcessor(tokenizer, model_cfg.vocab_size, max_len, args.kv_blocks, args.block_size)
    cluster = _cluster(args)
    total = sum(len(w.true_lengths) for w in workloads)
    print(f"bench rollout: {len(workloads[0].prompts)} groups x {args.samples} samples x "
          f"{args.iterations} iterations = {total} responses, "
          f"{sum(sum(w.true_lengths.values()) for w in workloads)} output tokens to replay, "
          f"{args.instances} instances, {args.kv_blocks} KV blocks each, chunk {args.chunk_tokens}, backend "
          f"{cluster.distributed_backend}, KV pool {cluster.kv_connector}", flush=True)  # fmt: skip
    iterations: list[dict[str, RolloutResult]] = [{} for _ in workloads]
    for name in policies:
        history = _open_history(args, name, processor)
        for it, w in enumerate(workloads):
            iterations[it][name] = _run_policy(
                args, name, cfg, cluster, w.groups(), w.true_lengths, w.replay(eos), clock, history, it
            )
            if history is not None:
                history.next_iteration()
        _save_history(args, name, history)
    _print_iterations(iterations)
    if args.report:
        meta = _meta(args, machine, model_name, cluster, trace=args.trace, groups=len(workloads[0].prompts))
        meta["policies_iteration"] = len(iterations)  # the top-level keys and the figures: the last
        path = write_report(Path(args.report), iterations[-1], meta, iterations=_if_many(iterations))
        (path.parent / "lengths.png").unlink(missing_ok=True)  # a --task run's, of other responses
        print(f"wrote {written(path)}")
    return 0


def _check_kv_holds(args: argparse.Namespace, workload: ReplayWorkload) -> None:
    """Every response's prompt and tokens fit one instance's KV cache: one that does not can
    never finish (alone on an instance, its engine would preempt it and rerun it for ever)."""
    if args.kv_blocks < 1 or args.block_size < 1:
        return  # EngineConfig names these
    capacity = args.kv_blocks * args.block_size
    prompts = dict(workload.prompts)
    for key, length in workload.true_lengths.items():
        prompt = len(prompts[key.rpartition("/")[0]])
        if prompt + length - 1 > capacity:  # the last token is sampled, never fed back
            raise ValueError(
                f"--kv-blocks {args.kv_blocks} ({capacity} tokens per instance) cannot hold response {key}: "
                f"its {prompt}-token prompt and {length} tokens need KV for {prompt + length - 1}; raise "
                "--kv-blocks or lower --max-tokens"
            )


def _check_vocab(args: argparse.Namespace, workloads: list[ReplayWorkload], vocab_size: int) -> None:
    """The trace's token ids (of the trace tokenizer) are ids of the model's vocabulary."""
    top = max(
        max(max((max(ids, default=-1) for _, ids in w.prompts), default=-1) for w in workloads),
        max(max((max(v[: args.max_tokens], default=-1) for v in w.responses.values()), default=-1)
            for w in workloads),
    )  # fmt: skip
    if top >= vocab_size:
        raise ValueError(
            f"the trace tokenized with {args.tokenizer} has token id {top}, beyond the vocabulary of --model "
            f"{args.model} ({vocab_size} ids): pass the model's own tokenizer with --tokenizer"
        )


def _fresh_seeds(group: Group, iteration: int) -> Group:
    """The group as iteration ``iteration`` samples it: the same prompt, fresh seeds
    (iteration 0: the group's own). Mixed by ``group_seed``: ``child_seed`` would give
    iteration k the seeds of iteration k-1's next samples, so the same responses."""
    if iteration == 0:
        return replace(group)
    seed = group_seed(group.sampling_params.seed or 0, iteration)
    return replace(group, sampling_params=group.sampling_params.clone(seed=seed))


def _open_history(args: argparse.Namespace, policy: str, processor: InputProcessor) -> HistoryStore | None:
    """The policy's history store (+history policies only): fresh, or from ``--history DIR``,
    bound to the model's tokenizer (one kept under another is refused)."""
    if split_policy(policy)[0] not in HISTORY_POLICIES:
        return None
    spec = _history_dir(args, policy)
    bind_history(store := open_history(spec), spec, processor)
    return store


def _save_history(args: argparse.Namespace, policy: str, store: HistoryStore | None) -> None:
    if store is not None:
        save_history(store, _history_dir(args, policy))


def _history_dir(args: argparse.Namespace, policy: str) -> str:
    if args.history in ("off", "memory"):
        return args.history
    return str(Path(args.history) / policy)


def _print_iterations(iterations: list[dict[str, RolloutResult]]) -> None:
    for it, results in enumerate(iterations):
        if len(iterations) > 1:
            print(f"iteration {it + 1}/{len(iterations)}")
        print(format_table(results))


def _if_many(iterations: list[dict[str, RolloutResult]]) -> list[dict[str, RolloutResult]] | None:
    return iterations if len(iterations) > 1 else None


def _engine_config(args: argparse.Namespace, model: str, max_len: int) -> EngineConfig:
    return EngineConfig(
        model=model, num_kv_blocks=args.kv_blocks, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, num_threads=args.num_threads, max_model_len=max_len,
    )  # fmt: skip


def _cluster(args: argparse.Namespace) -> RolloutConfig:
    return RolloutConfig(
        instances=args.instances,
        distributed_backend=args.distributed_backend,
        kv_connector=args.kv_connector,
        mooncake_master=args.mooncake_master,
        kv_pool_gib=args.kv_pool_gib,
        migration_spread=args.migration_spread,
        pool_pull_tokens=args.pool_pull_tokens,
    )


def _run_policy(
    args: argparse.Namespace,
    name: str,
    cfg: EngineConfig,
    cluster: RolloutConfig,
    groups: list[Group],
    true_lengths: dict[str, int],
    token_source=None,
    clock: InstanceProfile | None = None,
    history: HistoryStore | None = None,
    iteration: int = 0,
) -> RolloutResult:
    """One policy on a fresh engine pool (clocks from zero; ``clock``: a modeled clock's profile;
    ``history``: a +history policy's store, filled and seeding drafts)."""
    policy = bench_policy(name, true_lengths, args.starvation_s, history, args.context_order)
    spec = policy.speculative
    if clock is not None and spec is not None and "step_cost" not in spec:
        # On a modeled clock the adaptive budget prices drafts with that clock's step,
        # not with a profile of this machine's.
        cost = [max(clock.step.a_s, 1e-9), clock.step.b_s_per_token + clock.step.d_s_per_logit]
        policy.speculative = {**spec, "step_cost": cost}
    label = name if args.iterations == 1 else f"{name} iter {iteration + 1}"
    progress = Progress(label, sum(g.n for g in groups))
    with cluster.make_pool(cfg, policy, token_source, clock, history) as pool:
        pool.reset_clocks()
        start = time.perf_counter()
        dispatcher = Dispatcher(
            pool, policy, args.chunk_tokens, on_sample_finished=progress, placement=cluster.placement(),
            admission=args.admission, backfill=args.backfill,
        )  # fmt: skip
        result = dispatcher.run(groups)
        seeded = pool.seed_stats
    seeds = (
        f", drafts seeded from history: {seeded.groups} groups, {seeded.tokens} tokens"
        if seeded.groups
        else ""
    )
    print(f"[{label}] done in {time.perf_counter() - start:.1f}s wall{seeds}", flush=True)
    return result


def _meta(args: argparse.Namespace, machine: dict, model: str, cluster: RolloutConfig, **extra) -> dict:
    return {
        "command": shlex.join(["seer_engine", *args.argv]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine,
        "model": model, **extra, "samples": args.samples,
        "instances": args.instances, "num_threads": args.num_threads,
        "kv_blocks": args.kv_blocks, "chunk_tokens": args.chunk_tokens, "max_tokens": args.max_tokens,
        "distributed_backend": cluster.distributed_backend, "kv_connector": cluster.kv_connector,
        "clock": args.clock, "admission": args.admission, "backfill": args.backfill,
        "context_order": args.context_order,
    }  # fmt: skip


def _run_task_bench(
    args: argparse.Namespace, policies: list[str], machine: dict, clock: InstanceProfile | None
) -> int:
    """Every policy samples the same problems with the same seeds; ``oracle`` runs last,
    handed the lengths the first policy's responses came out at."""
    if args.model is None:
        raise ValueError("--task needs --model (a chat model, e.g. smollm2-135m)")
    if args.groups is not None:
        raise ValueError("--groups goes with --trace; use --prompts with --task")
    first = next((p for p in policies if p.partition("+")[0] != "oracle"), None)
    if first is None:
        raise ValueError(
            "with --task, oracle takes its lengths from another policy's run: name one more policy"
        )
    policies = [p for p in policies if p.partition("+")[0] != "oracle"] + [
        p for p in policies if p.partition("+")[0] == "oracle"
    ]
    task = get_task(args.task, **parse_knobs(args.task, args.knob))
    path = resolve_model_path(args.model)
    model_cfg = ModelConfig.from_pretrained(path)
    processor = InputProcessor(
        Detokenizer.from_pretrained(path), model_cfg.vocab_size, model_cfg.max_position_embeddings,
        args.kv_blocks, args.block_size,
    )  # fmt: skip
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    prompts, groups = task_groups(task, args.prompts, args.seed, args.samples, params, processor)
    max_len = max(len(g.prompt_token_ids) for g in groups) + args.max_tokens + 1
    cfg = _engine_config(args, args.model, max_len)
    cluster = _cluster(args)
    print(f"bench rollout: {args.task} x {len(groups)} prompts x {args.samples} samples = "
          f"{len(groups) * args.samples} responses sampled by {args.model} (temperature {args.temperature}, "
          f"max_tokens {args.max_tokens}), {args.instances} instances, {args.kv_blocks} KV blocks each, "
          f"chunk {args.chunk_tokens}, backend {cluster.distributed_backend}", flush=True)  # fmt: skip
    stores = {name: _open_history(args, name, processor) for name in policies}
    iterations: list[dict[str, RolloutResult]] = []
    for it in range(args.iterations):
        results: dict[str, RolloutResult] = {}
        true_lengths: dict[str, int] = {}
        for name in policies:
            fresh = [_fresh_seeds(g, it) for g in groups]
            results[name] = _run_policy(
                args, name, cfg, cluster, fresh, true_lengths, None, clock, stores[name], it
            )
            if stores[name] is not None:
                stores[name].next_iteration()
            if name == first:
                true_lengths = {s.key: s.num_generated for v in results[name].samples.values() for s in v}
        iterations.append(results)
    for name, store in stores.items():
        _save_history(args, name, store)
    if len(iterations) > 1:
        _print_iterations(iterations[:-1])  # the last one is printed with its grades below
    reference = results[first].samples
    extras, summary = {}, None
    for name, result in results.items():
        grades = grade_result(task, prompts, result)
        same = sum(
            s.output_token_ids == r.output_token_ids
            for p in prompts
            for s, r in zip(result.samples[p.id], reference[p.id])
        )
        extras[name] = {
            "mean_reward": round(
                sum(g.reward for row in grades for g in row) / (len(groups) * args.samples), 4
            ),
            "identical_responses": same,  # token for token, against the reference policy's
        }
        if name == first:
            summary = summarize(prompts, result, grades)
    print(format_table(results))
    for name, extra in extras.items():
        print(f"{name}: mean reward {extra['mean_reward']:.3f}, responses identical to {first}'s: "
              f"{extra['identical_responses']}/{len(groups) * args.samples}")  # fmt: skip
    print(format_summary(summary, per_group=False))
    if args.report:
        meta = _meta(args, machine, args.model, cluster, task=task.name, knobs=task.knobs(),
                     prompts=len(groups), seed=args.seed, temperature=args.temperature)  # fmt: skip
        meta["reference_policy"] = first
        meta["policies_iteration"] = len(iterations)  # the top-level keys and the figures: the last
        meta["workload"] = summary  # of the reference policy's responses
        out = Path(args.report)
        path = write_report(out, results, meta, extras, iterations=_if_many(iterations))
        lengths = [[s.num_generated for s in reference[p.id]] for p in prompts]
        plot_group_lengths(lengths, out / "lengths.png", f"{args.model}: {task.name}, {first}'s responses")
        print(f"wrote {written(path, out / 'lengths.png')}")
    return 0
