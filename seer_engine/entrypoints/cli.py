"""The ``seer_engine`` command: one subcommand per job, each in its own small function."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from seer_engine.sampling_params import InvalidRequestError


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt")
    parser.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=-1, help="-1: every token")
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below this share of the top one"
    )
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="as OpenAI's")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="as OpenAI's")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="as transformers'; 1: none")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    parser.add_argument("--logprobs", type=int, default=None, help="return this many top logprobs per token")


def _sampling_params(args: argparse.Namespace):
    from seer_engine.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """Offline generation: prompts from --prompt flags or a file, one JSON line per prompt."""
    from seer_engine.entrypoints.llm import LLM

    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8-sig") as f:  # a BOM is no part of a prompt
                from_file = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise ValueError(f"cannot read --prompts-file {args.prompts_file!r}: {why}") from None
        if not from_file:
            raise ValueError(f"--prompts-file {args.prompts_file!r} holds no prompts")
        prompts += from_file
    if not prompts:
        prompts = ["The rollout phase of reinforcement learning", "Once upon a time"]
    params = _sampling_params(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    total = 0
    for out in outputs:
        for sample in out.outputs:
            total += len(sample.token_ids)
        print(
            json.dumps(
                {
                    "prompt": out.prompt,
                    "outputs": [_sample_json(s, args.logprobs is not None) for s in out.outputs],
                }
            )
        )
    print(
        f"generated {total} tokens for {len(prompts)} prompts in {elapsed:.2f}s "
        f"({total / max(elapsed, 1e-9):.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _sample_json(sample, with_logprobs: bool) -> dict:
    """One sample of a ``generate`` line; with ``--logprobs``, per token: token id -> logprob
    (the sampled token's and the top-N), as ``rollout`` writes them."""
    line = {"text": sample.text, "token_ids": sample.token_ids, "finish_reason": sample.finish_reason}
    if with_logprobs:
        line["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in sample.logprobs or []]
    return line


def _engine_kwargs(args: argparse.Namespace) -> dict:
    from seer_engine.engine.config import EngineConfig

    cfg = EngineConfig.from_cli_args(args)
    return {k: v for k, v in vars(cfg).items() if k != "model"}


def build_parser() -> argparse.ArgumentParser:
    from seer_engine.engine.config import EngineConfig
    from seer_engine.entrypoints.bench import add_cli as add_bench
    from seer_engine.entrypoints.openai.api_server import add_cli as add_serve
    from seer_engine.entrypoints.rollout_cli import add_cli as add_rollout
    from seer_engine.entrypoints.simulate import add_cli as add_simulate
    from seer_engine.model_executor.tiny_model_cli import add_cli as add_make_tiny_model
    from seer_engine.sim.profiler import add_cli as add_profile
    from seer_engine.workloads.cli import add_cli as add_trace_stats

    parser = argparse.ArgumentParser(
        prog="seer_engine", description="LLM inference engine for RL rollouts (Seer)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation (prints JSON lines)")
    EngineConfig.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", default=None, help="a text file, one prompt per line")
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    add_make_tiny_model(sub)
    add_serve(sub)
    add_rollout(sub)
    add_bench(sub)
    add_trace_stats(sub)
    add_simulate(sub)
    add_profile(sub)
    _name_defaults(parser)
    return parser


def _name_defaults(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's ``--help`` (``bench rollout``'s too) names the defaults."""
    parser.formatter_class = _DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _name_defaults(command)


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` names each option's default, as vLLM's and SGLang's do, unless its help
    already says it or there is none to say (None, an empty list, a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        unsaid = d is None or d is argparse.SUPPRESS or d == [] or action.nargs == 0  # a switch: in words
        if "default" in text or unsaid or not action.option_strings:
            return action.help
        return f"{text} (default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    from seer_engine.kv_connector.base import KVPoolError
    from seer_engine.model_executor.model_config import ModelLoadError
    from seer_engine.rollout.types import RolloutStalled

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a report records as its command
    # SIGTERM's default action ends the process on the spot: a rollout's instance processes
    # then die on a broken pipe with tracebacks and its shared memory is left to the
    # resource tracker (serve: uvicorn re-raises it once drained, before the engine's
    # shutdown and the history store's save). As SystemExit it unwinds as Ctrl-C does.
    on_main_thread = threading.current_thread() is threading.main_thread()  # where signals may be set
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if on_main_thread else None
    try:
        return int(args.func(args) or 0)
    except (InvalidRequestError, ModelLoadError, ValueError, KVPoolError, RolloutStalled) as e:
        parser.exit(2, f"seer_engine {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
