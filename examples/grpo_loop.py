"""Synchronous GRPO driving a running ``seer_engine serve --rollout-mode`` over HTTP.

Plain torch, no trainer framework. Each iteration:

1. sends its prompts (an epoch over a small fixed set, so prompts recur across
   iterations) as token ids with ``n`` samples, ``return_token_ids`` and logprobs,
   through the OpenAI Batch API (default) or ``/v1/completions`` (``--via
   completions``), the way veRL and slime call inference servers;
2. grades every response with the task's grader and normalizes rewards within each
   group (GRPO's advantage: ``(r - mean) / (std + eps)``);
3. takes a clipped policy-gradient step on CPU on the trainer's own copy of the model
   (the last ``--train-layers`` decoder layers and the final norm unfrozen), with the
   log-probabilities of the sampled tokens recomputed under the current policy;
4. writes the weights as a Hugging Face folder, calls ``/update_weights_from_disk``
   and checks that ``/get_weight_version`` went up by one.

Against ``make run``'s server (SmolLM2-135M-Instruct on 127.0.0.1:8000)::

    python examples/grpo_loop.py --model smollm2-135m --iterations 3 \\
        --knob steps=1 --knob max_operand=10 --knob ops=add,sub,mul

``--model`` names the trainer's copy and must be the weights the server serves. The
parts live in ``examples/grpo/``: ``config.py`` (settings), ``client.py`` (the HTTP
calls), ``trainer.py`` (advantages, the step, the checkpoint), ``checkpoints.py``
(resuming); this file is the loop and its command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from grpo.checkpoints import PROGRESS_FILE, check_out_dir, iterations_done
from grpo.client import ServerClient, check_version, parse_choices
from grpo.config import GRPOConfig, GRPOError, Reward
from grpo.trainer import Trainer, group_advantages

from seer_engine.core.seeds import group_seed
from seer_engine.rollout.machine import machine_info
from seer_engine.tasks import TASKS, TaskPrompt, get_task, parse_knobs, task_prompts


def task_reward(task, format_bonus: float) -> Reward:
    def reward(prompt: TaskPrompt, text: str) -> float:
        grade = task.grade(prompt, text)
        return grade.reward + (format_bonus if grade.parsed is not None else 0.0)

    return reward


def run_grpo(
    cfg: GRPOConfig,
    reward: Reward | None = None,
    log: Callable[[str], None] = print,
    records: list[dict] | None = None,
) -> list[dict]:
    """``cfg.iterations`` iterations; one record per iteration (what the table prints),
    appended to ``records`` as each ends, so a caller keeps those done if the loop stops."""
    from transformers import AutoTokenizer

    from seer_engine.engine.llm_engine import resolve_model_path

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    task = get_task(cfg.task, **cfg.knobs)
    reward = reward or task_reward(task, cfg.format_bonus)
    client = ServerClient(cfg.server, cfg.api_key, cfg.timeout_s)
    try:
        served = client.served_model(cfg.served_model)
        version = client.weight_version()
        path = resolve_model_path(cfg.model)
        tokenizer = AutoTokenizer.from_pretrained(str(path))

        def chat(messages: list[dict[str, str]]) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        prompts = task_prompts(task, cfg.prompts, cfg.seed, chat_template=chat)
        prompt_ids = [tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
        try:
            cfg.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GRPOError(f"cannot make --out-dir {str(cfg.out_dir)!r}: {e}") from None
        done = iterations_done(path) if cfg.resume else 0
        if cfg.resume and not done:
            raise GRPOError(f"--resume: {path} has no {PROGRESS_FILE}; it is not a checkpoint of this loop")
        if done >= cfg.iterations:
            raise GRPOError(
                f"--model {cfg.model} ends iteration {done}: --iterations {cfg.iterations} (the total, "
                "counted from the first run) leaves nothing to run"
            )
        check_out_dir(cfg.out_dir, done, path)
        trainer = Trainer(path, cfg)
        log(
            f"GRPO: {served} at {cfg.server} (weight version {version}), trainer copy {path}, "
            f"{cfg.task} {task.knobs()}, {cfg.prompts} prompts, {cfg.batch_prompts} x n={cfg.n} "
            f"per iteration via {cfg.via}" + (f"; resuming after iteration {done}" if done else "")
        )
        log(HEADER)
        records = [] if records is None else records
        # A resumed loop's source checkpoint in --out-dir is superseded like its own.
        previous = path if done and path.parent.resolve() == cfg.out_dir.resolve() else None
        for it in range(done + 1, cfg.iterations + 1):
            chosen = [((it - 1) * cfg.batch_prompts + j) % cfg.prompts for j in range(cfg.batch_prompts)]
            bodies = [{
                "model": served, "prompt": prompt_ids[k], "n": cfg.n, "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "seed": group_seed(cfg.seed, (it - 1) * cfg.prompts + k),
                "logprobs": 0, "return_token_ids": True,
            } for k in chosen]  # fmt: skip
            start = time.perf_counter()
            answers = client.batch(bodies) if cfg.via == "batch" else client.completions(bodies)
            rollout_s = time.perf_counter() - start
            groups = [parse_choices(body, prompt_ids[k], cfg.n) for body, k in zip(answers, chosen)]
            for k, group in zip(chosen, groups):
                for s in group:
                    s.reward = reward(prompts[k], s.text)
                for s, a in zip(group, group_advantages([s.reward for s in group])):
                    s.advantage = a
            samples = [s for g in groups for s in g]
            start = time.perf_counter()
            figures = trainer.step(samples)
            checkpoint = trainer.save(cfg.out_dir / f"iter-{it}", it)
            train_s = time.perf_counter() - start
            start = time.perf_counter()
            try:
                new_version = client.update_weights(checkpoint)
                check_version(version, new_version, client.weight_version())
            except BaseException:  # refused, server gone, Ctrl-C: the resume hint names the last one taken
                if not client.took_since(version):  # left, it would block that resume (_check_out_dir)
                    shutil.rmtree(checkpoint, ignore_errors=True)
                raise
            update_s = time.perf_counter() - start
            if previous is not None and not cfg.keep_checkpoints:
                shutil.rmtree(previous, ignore_errors=True)
            previous, version = checkpoint, new_version
            lengths = [len(s.token_ids) for s in samples]
            record = {
                "iteration": it, "prompts": [prompts[k].id for k in chosen], "responses": len(samples),
                "rollout_s": round(rollout_s, 3), "tokens": sum(lengths),
                "tokens_per_s": round(sum(lengths) / rollout_s, 1),
                "mean_reward": round(statistics.fmean(s.reward for s in samples), 4),
                "mixed_groups": sum(len({s.reward for s in g}) > 1 for g in groups),
                "mean_len": round(statistics.fmean(lengths), 1), "max_len": max(lengths),
                **{k: float(f"{v:.4g}") for k, v in figures.items()},
                "train_s": round(train_s, 2), "update_s": round(update_s, 2),
                "weight_version": new_version, "checkpoint": str(checkpoint),
            }  # fmt: skip
            records.append(record)
            log(format_row(record, len(groups)))
        return records
    finally:
        client.close()


HEADER = (f"{'iter':>4} {'rollout_s':>9} {'tok/s':>7} {'reward':>6} {'mixed':>5} {'len_mean':>8} "
          f"{'len_max':>7} {'loss':>9} {'grad':>7} {'logp_gap':>8} {'train_s':>7} "
          f"{'version':>7}")  # fmt: skip


def format_row(r: dict, groups: int) -> str:
    return (f"{r['iteration']:>4} {r['rollout_s']:>9.1f} {r['tokens_per_s']:>7.1f} {r['mean_reward']:>6.3f} "
            f"{r['mixed_groups']:>2}/{groups:<2} {r['mean_len']:>8.1f} {r['max_len']:>7} {r['loss']:>9.5f} "
            f"{r['grad_norm']:>7.3f} {r['logp_gap']:>8.1e} {r['train_s']:>7.1f} "
            f"{r['weight_version']:>7}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = GRPOConfig()
    p.add_argument("--server", default=d.server, help="the server's root URL (a trailing /v1 is dropped)")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--model", default=d.model, help="the trainer's copy (folder or alias): what the server serves"
    )
    p.add_argument("--served-model-name", dest="served_model", default=None)
    p.add_argument("--task", default=d.task, choices=sorted(TASKS))
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE", help="task knob, repeatable")
    p.add_argument("--via", default=d.via, choices=("batch", "completions"))
    p.add_argument("--log-json", default=None, help="write the per-iteration records here")
    p.add_argument("--out-dir", default=str(d.out_dir), help="checkpoints (the latest is kept)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument(
        "--resume", action="store_true",
        help="--model is a checkpoint of this loop (OUT_DIR/iter-K): run iterations K+1..--iterations, "
        "with its optimizer state and KL reference",
    )  # fmt: skip
    for name in ("prompts", "batch_prompts", "n", "iterations", "max_tokens", "train_layers", "epochs",
                 "micro_batch", "seed", "num_threads"):  # fmt: skip
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("temperature", "lr", "clip", "kl_coef", "max_grad_norm", "format_bonus", "timeout_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    args = p.parse_args(argv)
    meta = {
        "command": " ".join(["python", "examples/grpo_loop.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),  # the load as the run starts
    }
    log_json: Path | None = None
    cfg: GRPOConfig | None = None
    records: list[dict] = []
    error: str | None = None
    # SIGTERM (a scheduler's stop, `timeout`, `kill`) stops the loop as Ctrl-C does: its
    # batch cancelled, --log-json written, where to resume said; by default it killed the
    # process with none of that.
    on_main_thread = threading.current_thread() is threading.main_thread()  # where signals may be set
    previous_term = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
    try:
        log_json = Path(args.log_json) if args.log_json else None
        if log_json is not None and (log_json.is_dir() or not log_json.parent.is_dir()):
            raise ValueError(f"cannot write --log-json {args.log_json!r}: not a file in an existing folder")
        values = {k: v for k, v in vars(args).items() if k not in ("knob", "log_json")}
        cfg = GRPOConfig(**values, knobs=parse_knobs(args.task, args.knob))
        run_grpo(cfg, records=records)
    except (GRPOError, ValueError, KeyboardInterrupt) as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        error = "interrupted" if interrupted else str(e)
        print(f"grpo_loop: {error if interrupted else f'error: {e}'}", file=sys.stderr)
        if records:  # what the server last loaded: where a restarted loop goes on from
            last = records[-1]["checkpoint"]
            print(f"grpo_loop: the server took {last} last; resume with --model {last} --resume",
                  file=sys.stderr)  # fmt: skip
        return 130 if interrupted else 1
    finally:  # a loop stopped part way (an error, Ctrl-C, SIGTERM) keeps the iterations it did
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous_term)
        if log_json is not None and cfg is not None:
            log = {"meta": meta, "config": asdict(cfg), "iterations": records, "error": error}
            log_json.write_text(json.dumps(_jsonable(log), indent=2) + "\n")
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


if __name__ == "__main__":
    sys.exit(main())
