"""``seer_engine rollout``: a real (non-replay) rollout from a JSON-lines file of prompts.

Input lines: ``{"prompt": text or token ids, optional sampling fields}``. Output lines,
in input order: ``{"prompt", "prompt_token_ids", "outputs": [{"token_ids", "text",
"logprobs", "finish_reason"}, ...n]}``. With ``--rollout-mode`` the groups run under
divided rollout and context-aware scheduling, else veRL-style (whole groups, FCFS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.input_processor import InputProcessor
from seer_engine.rollout.config import RolloutConfig
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

_SAMPLING_FIELDS = {
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs",
}  # fmt: skip


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("rollout", help="run a rollout over a JSON-lines file of prompts")
    EngineConfig.add_cli_args(p)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--n", type=int, default=16, help="responses per prompt (group size)")
    RolloutConfig.add_cli_args(p)
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens for lines without one")
    p.add_argument("--temperature", type=float, default=1.0, help="default temperature")
    p.set_defaults(func=run_rollout)


def read_groups(path: Path, n: int, defaults: dict, processor: InputProcessor) -> list[Group]:
    groups = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(item, dict) or "prompt" not in item:
                raise InvalidRequestError(f'{path}:{lineno}: expected an object with a "prompt"')
            unknown = set(item) - _SAMPLING_FIELDS - {"prompt", "n"}
            if unknown:
                raise InvalidRequestError(f"{path}:{lineno}: unknown fields {sorted(unknown)}")
            fields = {**defaults, **{k: v for k, v in item.items() if k in _SAMPLING_FIELDS}}
            samples = item.get("n", n)
            if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
                raise InvalidRequestError(f"{path}:{lineno}: n must be an integer >= 1, got {samples!r}")
            try:
                checked = processor.process(item["prompt"], SamplingParams(**fields))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{path}:{lineno}: {e}") from e
            gid = f"g{len(groups)}"
            groups.append(Group(gid, checked.prompt_token_ids, checked.params, samples, checked.max_tokens,
                                prompt=checked.prompt))  # fmt: skip
    if not groups:
        raise InvalidRequestError(f"{path} holds no prompts")
    return groups


def run_rollout(args: argparse.Namespace) -> int:
    path = Path(args.input)
    if not path.is_file():
        raise ValueError(f"input file {str(path)!r} not found")
    rollout_config = RolloutConfig.from_cli_args(args)
    policy = make_rollout_policy(rollout_config.policy, starvation_s=rollout_config.starvation_s)
    with rollout_config.make_pool(EngineConfig.from_cli_args(args), policy) as pool:
        defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}
        groups = read_groups(path, args.n, defaults, pool.make_input_processor())
        name = rollout_config.policy
        total = sum(g.n for g in groups)
        with tqdm(total=total, desc=f"rollout ({name})", unit="resp", disable=None, file=sys.stderr) as bar:
            dispatcher = Dispatcher(
                pool,
                policy,
                rollout_config.chunk_tokens,
                on_sample_finished=lambda s: bar.update(),
                placement=rollout_config.placement(),
            )
            result = dispatcher.run(groups)
    with open(args.output, "w") as out:
        for g in groups:
            samples = result.samples[g.group_id]
            out.write(json.dumps({
                "prompt": g.prompt if g.prompt is not None else g.prompt_token_ids,
                "prompt_token_ids": g.prompt_token_ids,
                "outputs": [
                    {
                        "token_ids": s.output_token_ids,
                        "text": s.text,
                        "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in s.logprobs]
                        or None,
                        "finish_reason": s.finish_reason,
                    }
                    for s in samples
                ],
            }) + "\n")  # fmt: skip
    m = result.metrics
    print(f"rollout: {len(groups)} groups, {m.output_tokens} tokens in {m.makespan_s:.2f}s "
          f"({m.throughput_tokens_per_s:.1f} tokens/s), preemptions {m.preemptions} -> {args.output}",
          file=sys.stderr)  # fmt: skip
    return 0
