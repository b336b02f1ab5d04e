"""``seer_engine rollout``: a real (non-replay) rollout of a JSON-lines file of prompts
(``--input``) or of a verifiable task's problems (``--task``), graded.

Input lines: ``{"prompt": text or token ids, optional n and sampling fields}``; prompt k
without a seed samples with ``group_seed(--seed, k)``. Output lines,
in input order: ``{"prompt", "prompt_token_ids", "outputs": [{"token_ids", "text",
"logprobs", "finish_reason"}, ...n]}``. With ``--task`` each line also carries the
problem (``id``, ``task``, ``messages``, ``answer``, ``data``: what grading reads) and
each output its grade (``reward``, ``parsed``, ``verdict``); a summary of rewards and
lengths goes to stderr. With ``--rollout-mode`` the groups run under divided rollout
and context-aware scheduling, else veRL-style (whole groups, FCFS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from seer_engine.core.seeds import group_seed
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.input_processor import InputProcessor
from seer_engine.rollout.config import RolloutConfig, bind_history, save_history
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.metrics import RolloutResult
from seer_engine.rollout.report import Progress, writable_dir
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import InvalidRequestError, SamplingParams
from seer_engine.tasks import TASKS, Grade, Task, TaskPrompt, get_task, parse_knobs, task_prompts
from seer_engine.tasks.summary import format_summary, rollout_summary

_SAMPLING_FIELDS = {
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
}  # fmt: skip


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("rollout", help="run a rollout of a JSON-lines file of prompts or of a task")
    EngineConfig.add_cli_args(p)
    p.add_argument("--input", default=None, help="a JSON-lines file of prompts (or use --task)")
    add_task_args(p)
    p.add_argument("--output", required=True, help="JSON lines out: each prompt with its responses")
    p.add_argument("--n", type=int, default=16, help="responses per prompt (group size)")
    RolloutConfig.add_cli_args(p)
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens for lines without one")
    p.add_argument("--temperature", type=float, default=1.0, help="default temperature")
    p.set_defaults(func=run_rollout)


def add_task_args(p: argparse.ArgumentParser) -> None:
    """``--task``, ``--prompts`` and ``--knob`` (``--seed``, the engine's, picks the problems)."""
    p.add_argument("--task", default=None, choices=sorted(TASKS), help="a verifiable task's problems, graded")
    p.add_argument("--prompts", type=int, default=None, help="--task: number of problems (default 16)")
    p.add_argument(
        "--knob", action="append", default=[], metavar="KEY=VALUE",
        help="--task difficulty knob, repeatable (e.g. steps=1, ops=add,sub,mul)",
    )  # fmt: skip


def check_source_args(args: argparse.Namespace, other: str) -> None:
    """Exactly one of ``--task`` and ``other`` (``--input`` or ``--trace``); task-only flags only with it."""
    other_value = getattr(args, other.removeprefix("--"))
    if (args.task is None) == (other_value is None):
        raise ValueError(f"give exactly one of {other} and --task")
    if args.task is None and (args.prompts is not None or args.knob):
        raise ValueError("--prompts and --knob go with --task")
    if args.task is not None:
        if args.prompts is None:
            args.prompts = 16
        if args.prompts < 1:
            raise ValueError(f"--prompts must be >= 1, got {args.prompts}")


def task_groups(
    task: Task, count: int, seed: int, n: int, params: SamplingParams, processor: InputProcessor
) -> tuple[list[TaskPrompt], list[Group]]:
    """The first ``count`` problems of ``seed`` through the model's chat template, as groups
    of ``n`` responses; group k samples with seed ``group_seed(seed, k)``."""
    if not getattr(processor.tokenizer.tokenizer, "chat_template", None):
        raise ValueError("--task needs a chat model: the model's tokenizer has no chat template")
    prompts = task_prompts(task, count, seed, chat_template=processor.tokenizer.apply_chat_template)
    groups = []
    for k, p in enumerate(prompts):
        # The chat template writes the special tokens itself.
        group_params = params.clone(seed=group_seed(seed, k), add_special_tokens=False)
        checked = processor.process(p.text or "", group_params)
        groups.append(Group(p.id, checked.prompt_token_ids, checked.params, n, checked.max_tokens,
                            prompt=checked.prompt, order=k))  # fmt: skip
    return prompts, groups


def grade_result(task: Task, prompts: list[TaskPrompt], result: RolloutResult) -> list[list[Grade]]:
    """The grade of every response, group by group in prompt order."""
    return [[task.grade(p, s.text) for s in result.samples[p.id]] for p in prompts]


def summarize(prompts: list[TaskPrompt], result: RolloutResult, grades: list[list[Grade]]) -> dict:
    """Rewards and output lengths of a graded rollout, group by group (tasks.summary)."""
    samples = [result.samples[p.id] for p in prompts]
    return rollout_summary(
        [[s.num_generated for s in group] for group in samples],
        [[g.reward for g in row] for row in grades],
        [p.id for p in prompts],
        [s.finish_reason for group in samples for s in group],
    )


def read_lines(path: Path, n: int, defaults: dict) -> list[tuple[int, object, SamplingParams, int]]:
    """Every prompt line as ``(line number, prompt, params, n)``, checked as far as the
    model is not needed (JSON, fields, sampling values): read before the model loads, a bad
    line is named before minutes of loading, not after."""
    lines = []
    try:
        f = path.open("rb")
    except OSError as e:
        raise ValueError(f"cannot read --input {str(path)!r}: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:  # a BOM (as Windows editors write one) is not part of the first line's JSON
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                why = f"{e.reason} at byte {e.start}"
                raise InvalidRequestError(f"{path}:{lineno}: not UTF-8 text ({why})") from e
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path}:{lineno}: not valid JSON ({e})") from e
            except RecursionError:
                raise InvalidRequestError(f"{path}:{lineno}: not valid JSON (nested too deeply)") from None
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
                params = SamplingParams(**fields)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{path}:{lineno}: {e}") from e
            lines.append((lineno, item["prompt"], params, samples))
    if not lines:
        raise InvalidRequestError(f"{path} holds no prompts")
    return lines


def read_groups(path: Path, lines: list, processor: InputProcessor, seed: int) -> list[Group]:
    """The groups of ``read_lines``' prompts, tokenized and checked against the model; group
    k without a seed of its own samples with ``group_seed(seed, k)``, as ``--task``'s do."""
    groups = []
    for lineno, prompt, params, samples in lines:
        if params.seed is None:
            params = params.clone(seed=group_seed(seed, len(groups)))
        try:
            checked = processor.process(prompt, params)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{path}:{lineno}: {e}") from e
        gid = f"g{len(groups)}"
        groups.append(Group(gid, checked.prompt_token_ids, checked.params, samples, checked.max_tokens,
                            prompt=checked.prompt))  # fmt: skip
    return groups


def run_rollout(args: argparse.Namespace) -> int:
    check_source_args(args, "--input")
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    task = None
    if args.task is not None:
        task = get_task(args.task, **parse_knobs(args.task, args.knob))
    else:
        path = Path(args.input)
        if path.is_dir():
            raise ValueError(f"--input {str(path)!r} is a directory")
        if not path.exists():  # a regular file or a stream (/dev/stdin, a named pipe)
            raise ValueError(f"input file {str(path)!r} not found")
    out_path = Path(args.output)  # checked now: a rollout is not run to be lost at the end
    check_output(out_path, f"--output {args.output!r}")
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:  # the flags' fault, named before the model loads, not blamed on the input's first line
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise ValueError(f"--{(e.param or '').replace('_', '-')}: {e}") from None
    rollout_config = RolloutConfig.from_cli_args(args)
    lines = read_lines(path, args.n, defaults) if task is None else []
    history = rollout_config.open_history()
    policy = rollout_config.make_policy(history)
    with rollout_config.make_pool(EngineConfig.from_cli_args(args), policy, history=history) as pool:
        processor = pool.make_input_processor()
        bind_history(history, rollout_config.history_spec(), processor)
        if task is not None:
            params = SamplingParams(**defaults)
            prompts, groups = task_groups(task, args.prompts, args.seed, args.n, params, processor)
        else:
            groups = read_groups(path, lines, processor, args.seed)
        name = rollout_config.policy
        total = sum(g.n for g in groups)
        pool.reset_clocks()  # the rollout's time starts now, not when the instances were up
        tty = sys.stderr.isatty()  # a bar there; in a log, a line every ~10% of responses
        with tqdm(
            total=total, desc=f"rollout ({name})", unit="resp", disable=not tty, file=sys.stderr
        ) as bar:
            progress = Progress(f"rollout ({name})", total, file=sys.stderr)
            dispatcher = Dispatcher(
                pool,
                policy,
                rollout_config.chunk_tokens,
                on_sample_finished=(lambda s: bar.update()) if tty else progress,
                placement=rollout_config.placement(),
            )
            result = dispatcher.run(groups)
    grades = grade_result(task, prompts, result) if task is not None else None

    def out_lines():
        for k, g in enumerate(groups):
            line = _line(g, result.samples[g.group_id])
            if grades is not None:
                problem = prompts[k].to_json()
                line = {**{key: problem[key] for key in ("id", "task", "messages", "answer", "data")}, **line}
                for output, grade in zip(line["outputs"], grades[k]):
                    output.update(reward=grade.reward, parsed=grade.parsed, verdict=grade.verdict)
            yield json.dumps(line) + "\n"

    write_whole(out_path, out_lines(), f"--output {args.output!r}")
    if history is not None:
        history.next_iteration()  # this rollout is an earlier iteration to the next one
        save_history(history, rollout_config.history_spec())
    if grades is not None:
        print(format_summary(summarize(prompts, result, grades)), file=sys.stderr)
    m = result.metrics
    print(f"rollout: {len(groups)} groups, {m.output_tokens} tokens in {m.makespan_s:.2f}s "
          f"({m.throughput_tokens_per_s:.1f} tokens/s), preemptions {m.preemptions} -> {args.output}",
          file=sys.stderr)  # fmt: skip
    return 0


def check_output(path: Path, flag: str) -> None:
    """``path`` as ``write_whole`` will write it: a stream it can write to, or a file in an
    existing folder (a link's target's) where it can make the file it renames into place."""
    if path.exists() and not path.is_file() and not path.is_dir():
        if not os.access(path, os.W_OK):
            raise ValueError(f"cannot write {flag}: permission denied")
        return
    real = Path(os.path.realpath(path))
    if real.is_dir() or not real.parent.is_dir():
        raise ValueError(f"cannot write {flag}: not a file in an existing directory")
    writable_dir(real.parent, f"{flag}: its folder")


def write_whole(path: Path, lines: Iterable[str], flag: str) -> None:
    """Write ``lines`` beside ``path`` (a link's target) and rename the file into place, in
    the earlier file's mode: a write that fails (a full disk) or is interrupted leaves the
    earlier file, never one cut short. A stream (``/dev/stdout``, a pipe) is written to."""
    if path.exists() and not path.is_file():
        try:
            with path.open("w", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as e:
            raise ValueError(f"cannot write {flag}: {e.strerror or e}") from None
        return
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(lines)
        if target.exists():
            shutil.copymode(target, tmp)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"cannot write {flag}: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _line(g: Group, samples: list) -> dict:
    return {
        "prompt": g.prompt if g.prompt is not None else g.prompt_token_ids,
        "prompt_token_ids": list(g.prompt_token_ids),
        "outputs": [
            {
                "token_ids": s.output_token_ids,
                "text": s.text,
                "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in s.logprobs] or None,
                "finish_reason": s.finish_reason,
            }
            for s in samples
        ],
    }
