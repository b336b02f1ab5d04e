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

``--model`` names the trainer's copy and must be the weights the server serves.
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from seer_engine.rollout.machine import machine_info
from seer_engine.tasks import TASKS, TaskPrompt, get_task, parse_knobs, task_prompts

BATCH_TERMINAL = ("completed", "failed", "cancelled", "expired")
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.gguf")
# Written into each checkpoint: a loop resumed from it goes on with the next iteration
# (its prompts, its seeds, its checkpoint's name), not from iteration 1 again.
PROGRESS_FILE = "grpo_progress.json"
# Beside it, what the weights alone do not carry: the optimizer's moments and the KL
# reference (the first run's initial policy), so a resumed loop trains as one that went on.
TRAINER_STATE_FILE = "grpo_trainer_state.pt"

Reward = Callable[[TaskPrompt, str], float]


class GRPOError(RuntimeError):
    """Something the loop cannot go on from; the message says what went wrong."""


@dataclass
class GRPOConfig:
    server: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    model: str = "smollm2-135m"  # the trainer's copy: the weights the server serves
    served_model: str | None = None  # the name in requests (default: the server's first model)
    task: str = "arith"
    knobs: dict[str, Any] = field(default_factory=dict)
    prompts: int = 8  # the fixed prompt set
    batch_prompts: int = 4  # prompts per iteration, taken in turn from the set
    n: int = 8
    iterations: int = 3
    max_tokens: int = 128
    temperature: float = 0.7
    via: str = "batch"  # or "completions"
    lr: float = 1e-5
    train_layers: int = 2
    clip: float = 0.2  # PPO clip range of the probability ratio
    epochs: int = 1  # gradient steps over each rollout (the ratio leaves 1 from the second on)
    kl_coef: float = 0.0  # k3 KL to the initial policy
    max_grad_norm: float = 1.0
    micro_batch: int = 4  # sequences per forward pass
    format_bonus: float = 0.0  # added to the reward when an answer could be read (R1-style format reward)
    seed: int = 0
    out_dir: Path = Path("grpo-checkpoints")
    keep_checkpoints: bool = False
    resume: bool = False  # --model is a checkpoint of this loop: go on after the iteration it ends
    num_threads: int | None = None
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.via not in ("batch", "completions"):
            raise ValueError(f"--via must be batch or completions, got {self.via!r}")
        for name in ("prompts", "batch_prompts", "n", "iterations", "max_tokens", "train_layers", "epochs",
                     "micro_batch"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_prompts > self.prompts:
            raise ValueError(f"--batch-prompts ({self.batch_prompts}) must be <= --prompts ({self.prompts})")
        if self.n < 2:
            raise ValueError("--n must be >= 2: GRPO's advantages compare the responses of a group")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"--temperature must be a finite number > 0 (GRPO needs sampled, different responses), "
                f"got {self.temperature}"
            )
        for name in ("lr", "clip", "max_grad_norm", "timeout_s"):  # nan passes a plain `<= 0` check
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"--kl-coef must be a finite number >= 0, got {self.kl_coef}")
        if not math.isfinite(self.format_bonus):
            raise ValueError(f"--format-bonus must be a finite number, got {self.format_bonus}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        self.out_dir = Path(self.out_dir)


@dataclass
class Sample:
    """One response as the trainer uses it."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    engine_logprobs: list[float]  # the server's, of the raw (temperature 1) distribution
    reward: float = 0.0
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # of the sampling distribution, before this iteration's steps


# ---------------------------------------------------------------------------------- the server


class ServerClient:
    """The HTTP calls the loop makes; every failure becomes a GRPOError that says what happened."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")  # the root: an OpenAI base URL names its /v1
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, what: str, text: bool = False, **kwargs: Any) -> Any:
        """The JSON answer (``text``: the body as text) of one call."""
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise GRPOError(
                f"{what}: the server at {self.url} did not answer within {self.timeout_s:.0f}s"
            ) from None
        except httpx.TransportError as e:
            raise GRPOError(
                f"{what}: cannot reach the seer_engine server at {self.url} ({e}); start one with "
                "`seer_engine serve --rollout-mode --model MODEL` (or `make run`) or pass --server"
            ) from None
        if resp.status_code >= 400:
            raise GRPOError(f"{what}: HTTP {resp.status_code} from {method} {path}: {_error_message(resp)}")
        if text:
            return resp.text
        try:
            return resp.json()
        except ValueError:
            raise GRPOError(f"{what}: {method} {path} answered with no JSON: {resp.text[:200]!r}") from None

    def served_model(self, name: str | None = None) -> str:
        """``name`` when the server serves it (else the first model it serves): a wrong
        --served-model-name is refused before a batch is built, not in every request."""
        ids = [m["id"] for m in self.request("GET", "/v1/models", "listing the served models")["data"]]
        if not ids:
            raise GRPOError("the server serves no model")
        if name is not None and name not in ids:
            raise GRPOError(f"--served-model-name {name!r} is not served here; the server serves {ids}")
        return name or ids[0]

    def weight_version(self, **kwargs: Any) -> str:
        answer = self.request("GET", "/get_weight_version", "reading the weight version", **kwargs)
        return str(answer["weight_version"])

    def took_since(self, version: str) -> bool:
        """Whether the server says it loaded weights after ``version`` (False if it cannot say)."""
        try:
            return self.weight_version(timeout=10) != version
        except (GRPOError, KeyError):
            return False

    def update_weights(self, path: Path) -> str:
        """Load ``path`` on the server; the new version (refusals raise)."""
        body = {"model_path": str(path.resolve())}
        try:
            out = self.request("POST", "/update_weights_from_disk", "weight update", json=body)
        except GRPOError as e:
            raise GRPOError(f"weight update refused: {e}") from None
        if not out.get("success"):
            raise GRPOError(f"weight update refused: {out}")
        return str(out["weight_version"])

    def completions(self, bodies: list[dict]) -> list[dict]:
        """All requests at once (one thread each), so the server schedules them together."""
        with ThreadPoolExecutor(max(1, min(len(bodies), 64))) as pool:
            futures = [
                pool.submit(self.request, "POST", "/v1/completions", f"completion request {k}", json=b)
                for k, b in enumerate(bodies)
            ]
            return [f.result() for f in futures]

    def batch(self, bodies: list[dict], poll_s: float = 0.2) -> list[dict]:
        """One Batch API batch of the requests; every line must come back answered."""
        lines = [{"custom_id": f"req-{k}", "method": "POST", "url": "/v1/completions", "body": b}
                 for k, b in enumerate(bodies)]  # fmt: skip
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = self.request(
            "POST", "/v1/files", "uploading the batch input",
            files={"file": ("grpo.jsonl", content, "application/jsonl")}, data={"purpose": "batch"},
        )  # fmt: skip
        batch = self.request("POST", "/v1/batches", "creating the batch", json={
            "input_file_id": upload["id"], "endpoint": "/v1/completions", "completion_window": "24h",
        })  # fmt: skip
        deadline = time.monotonic() + self.timeout_s
        try:
            while batch["status"] not in BATCH_TERMINAL:
                if time.monotonic() > deadline:
                    waited = f"{self.timeout_s:.0f}s"
                    raise GRPOError(f"batch {batch['id']} still {batch['status']} after {waited}")
                time.sleep(poll_s)
                batch = self.request("GET", f"/v1/batches/{batch['id']}", "polling the batch")
            if batch["status"] != "completed":
                raise GRPOError(f"batch {batch['id']} {batch['status']}: {json.dumps(batch.get('errors'))}")
            outputs = self._records(batch.get("output_file_id"))
            errors = self._records(batch.get("error_file_id"))
            if errors:
                cid, record = next(iter(errors.items()))
                raise GRPOError(f"{len(errors)} of {len(lines)} batch requests failed, e.g. {cid}: "
                                f"{_record_message(record)}")  # fmt: skip
            missing = [line["custom_id"] for line in lines if line["custom_id"] not in outputs]
            if missing:
                raise GRPOError(
                    f"batch {batch['id']} returned no answer for {len(missing)} requests: {missing[:5]}"
                )
            return [outputs[line["custom_id"]]["response"]["body"] for line in lines]
        finally:
            if batch["status"] not in BATCH_TERMINAL:  # given up on (timeout, Ctrl-C): stop its work
                batch = self._cancel(batch)
            for fid in (upload["id"], batch.get("output_file_id"), batch.get("error_file_id")):
                if fid:  # best effort: keeps the server's data folder small
                    try:
                        self.http.delete(f"/v1/files/{fid}")
                    except httpx.HTTPError:
                        pass

    def _cancel(self, batch: dict, wait_s: float = 10.0) -> dict:
        """Cancel a batch and wait a little for it to end: until it has, the server refuses to
        delete its input file (409), and its error file appears only then."""
        deadline = time.monotonic() + wait_s
        try:
            self.http.post(f"/v1/batches/{batch['id']}/cancel", timeout=wait_s)
            while batch["status"] not in BATCH_TERMINAL and time.monotonic() < deadline:
                batch = self.http.get(f"/v1/batches/{batch['id']}", timeout=wait_s).json()
                if batch["status"] not in BATCH_TERMINAL:
                    time.sleep(0.1)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        return batch

    def _records(self, file_id: str | None) -> dict[str, dict]:
        if not file_id:
            return {}
        text = self.request("GET", f"/v1/files/{file_id}/content", "reading the batch results", text=True)
        return {r["custom_id"]: r for r in map(json.loads, text.splitlines()) if r}


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def _record_message(record: dict) -> str:
    response = record.get("response") or {}
    body = response.get("body") or {}
    message = (body.get("error") or {}).get("message") or (record.get("error") or {}).get("message")
    return f"HTTP {response.get('status_code')}: {message}"


def parse_choices(body: dict, prompt_ids: list[int], n: int) -> list[Sample]:
    """The n samples of one completion response, checked: none lost, tokens and logprobs aligned."""
    choices = sorted(body.get("choices", []), key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n)):
        raise GRPOError(f"expected {n} choices, got indices {[c['index'] for c in choices]}")
    samples = []
    for c in choices:
        if c.get("prompt_token_ids") != prompt_ids:
            raise GRPOError("the server's prompt_token_ids differ from the prompt sent")
        ids = c.get("token_ids")
        logprobs = (c.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logprobs is None or len(logprobs) != len(ids):
            raise GRPOError("a choice lacks token_ids or per-token logprobs (return_token_ids, logprobs=0)")
        samples.append(Sample(prompt_ids, list(ids), c["text"], c["finish_reason"], list(logprobs)))
    return samples


# ---------------------------------------------------------------------------------- the trainer


class Trainer:
    """The policy on CPU: a transformers model with its last layers trainable."""

    def __init__(self, path: Path, cfg: GRPOConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.path = path
        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        self.model.eval()  # no dropout: the recomputed logprobs must be the policy's own
        decoder = self.model.model
        layers = decoder.layers
        if cfg.train_layers > len(layers):
            raise ValueError(f"--train-layers {cfg.train_layers} but the model has {len(layers)} layers")
        for p in self.model.parameters():
            p.requires_grad_(False)
        for module in [*layers[-cfg.train_layers :], decoder.norm]:
            for p in module.parameters():
                p.requires_grad_(True)
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(list(self.trainable.values()), lr=cfg.lr, weight_decay=0.0)
        # The first run's initial policy, kept (and saved) with or without a KL term: a run
        # resumed with --kl-coef > 0 then measures from it, whatever earlier runs used.
        self.reference: dict | None = {n: p.detach().clone() for n, p in self.trainable.items()}
        if cfg.resume:
            self._load_state(path / TRAINER_STATE_FILE)
        # Read now: the source may be a checkpoint of an earlier run that this run's own
        # checkpoints overwrite and remove (a loop resumed from its --out-dir).
        self.files = {
            f.name: f.read_bytes()
            for f in path.iterdir()
            if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES)
        }

    def _load_state(self, file: Path) -> None:
        """The optimizer state and KL reference a checkpoint of this loop was saved with."""
        if not file.is_file():
            raise GRPOError(f"--resume: {file} is missing; the checkpoint has no trainer state to go on from")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
        except Exception as e:  # noqa: BLE001 - a damaged file or another --train-layers
            raise GRPOError(
                f"--resume: cannot restore the trainer state in {file} ({e}); it must come from a run with "
                "the same --train-layers"
            ) from None
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr  # this run's --lr, as a fresh run would take it
        reference = state.get("reference")
        if reference is None:  # saved without one: the first run's initial policy is gone
            if self.cfg.kl_coef:
                raise GRPOError(
                    f"--resume: {file} holds no KL reference (the first run's initial policy); "
                    "resume with --kl-coef 0, or start a new run from these weights"
                )
            self.reference = None
        elif set(reference) != set(self.trainable):
            raise GRPOError(f"--resume: the KL reference in {file} covers other parameters")
        else:
            self.reference = reference

    def logprobs(
        self, batch: list[Sample], params: dict | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sample: log-probabilities of its tokens under the sampling distribution
        (logits / temperature) and, detached, under the raw one (what the server reports)."""
        lengths = [len(s.prompt_ids) + len(s.token_ids) for s in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(batch):
            ids[b, : lengths[b]] = torch.tensor(s.prompt_ids + s.token_ids)
            mask[b, : lengths[b]] = 1
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if params is None:
            hidden = self.model.model(**kwargs).last_hidden_state
        else:
            hidden = torch.func.functional_call(self.model.model, _strip(params), args=(), kwargs=kwargs)[0]
        head = self.model.get_output_embeddings()
        scaled, raw = [], []
        for b, s in enumerate(batch):
            start = len(s.prompt_ids) - 1  # the position whose logits predict the first response token
            logits = head(hidden[b, start : start + len(s.token_ids)])
            target = torch.tensor(s.token_ids).unsqueeze(1)
            scaled.append(torch.log_softmax(logits / self.cfg.temperature, -1).gather(1, target).squeeze(1))
            with torch.no_grad():
                raw.append(torch.log_softmax(logits, -1).gather(1, target).squeeze(1))
        return scaled, raw

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """``epochs`` steps of the token-mean clipped policy gradient over the samples with a
        nonzero advantage (a group whose rewards are all equal has none), plus ``kl_coef``
        times the token-mean KL over every sample: each drifts from the reference."""
        kl_on = self.reference is not None and self.cfg.kl_coef > 0
        stepped = samples if kl_on else [s for s in samples if s.advantage != 0.0]
        out = {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "kl": 0.0, "logp_gap": float("nan")}
        if not stepped:
            return out
        tokens = sum(len(s.token_ids) for s in stepped)
        pg_tokens = sum(len(s.token_ids) for s in stepped if s.advantage != 0.0)
        gaps: list[float] = []
        for epoch in range(self.cfg.epochs):
            loss_sum = clipped = kl_sum = 0.0
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, len(stepped), self.cfg.micro_batch):
                micro = stepped[start : start + self.cfg.micro_batch]
                scaled, raw = self.logprobs(micro)
                ref = None
                if kl_on:
                    with torch.no_grad():
                        ref, _ = self.logprobs(micro, self.reference)
                loss = torch.zeros(())
                for k, s in enumerate(micro):
                    if epoch == 0:
                        s.old_logprobs = scaled[k].detach()
                        gaps += (raw[k] - torch.tensor(s.engine_logprobs)).abs().tolist()
                    if s.advantage != 0.0:
                        ratio = torch.exp(scaled[k] - s.old_logprobs)
                        bounded = torch.clamp(ratio, 1 - self.cfg.clip, 1 + self.cfg.clip)
                        surrogate = -torch.minimum(ratio * s.advantage, bounded * s.advantage)
                        clipped += float(((ratio - bounded).abs() > 1e-9).sum())
                        loss = loss + surrogate.sum() / pg_tokens
                    if ref is not None:
                        delta = ref[k] - scaled[k]
                        kl = torch.exp(delta) - delta - 1
                        loss = loss + self.cfg.kl_coef * kl.sum() / tokens
                        kl_sum += float(kl.detach().sum())
                loss.backward()
                loss_sum += float(loss.detach())
            norm = torch.nn.utils.clip_grad_norm_(list(self.trainable.values()), self.cfg.max_grad_norm)
            if not math.isfinite(float(norm)):  # a step would make the weights, then the server's, nan
                raise GRPOError(
                    f"the gradient is not finite (norm {float(norm)}); the weights are left as they were"
                )
            self.optimizer.step()
            clip_frac = clipped / pg_tokens if pg_tokens else 0.0
            out.update(loss=loss_sum, grad_norm=float(norm), clip_frac=clip_frac, kl=kl_sum / tokens)
        out["logp_gap"] = statistics.fmean(gaps) if gaps else float("nan")
        return out

    def save(self, out: Path, iteration: int) -> Path:
        """A full Hugging Face folder: these weights in safetensors, every other file
        (config, tokenizer, notices) as in the source folder, so the server's
        architecture check sees the same config, and the iteration it ends."""
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(str(tmp), safe_serialization=True)
        for name, data in self.files.items():
            (tmp / name).write_bytes(data)
        (tmp / PROGRESS_FILE).write_text(json.dumps({"iteration": iteration}) + "\n")
        state = {"optimizer": self.optimizer.state_dict(), "reference": self.reference}
        torch.save(state, tmp / TRAINER_STATE_FILE)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out


def _strip(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter names of the full model as names inside its decoder (``model.`` dropped)."""
    return {n.removeprefix("model."): p for n, p in params.items()}


def _check_out_dir(out_dir: Path, done: int, source: Path) -> None:
    """Refuse to run where another run's later checkpoints lie: this run's ``iter-K``
    would overwrite them, and its cleanup remove them."""
    later = sorted(
        (
            p
            for p in out_dir.glob("iter-*")
            if p.is_dir() and p.resolve() != source.resolve() and p.suffix != ".partial"
        ),
        key=lambda p: p.name,
    )
    later = [p.name for p in later if iterations_done(p) > done]
    if later:
        raise GRPOError(
            f"--out-dir {str(out_dir)!r} holds checkpoints of another run ({', '.join(later)}) that this "
            "run would overwrite: pass another --out-dir, or --resume from the latest of them"
        )


def iterations_done(path: Path) -> int:
    """The iteration a checkpoint of this loop ends (its PROGRESS_FILE); 0 for other weights."""
    file = path / PROGRESS_FILE
    if not file.is_file():
        return 0
    try:
        done = json.loads(file.read_text())["iteration"]
    except (ValueError, KeyError, TypeError):
        done = None
    if not isinstance(done, int) or isinstance(done, bool) or done < 1:
        raise GRPOError(f'{file} is damaged: expected {{"iteration": K}} with K >= 1')
    return done


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: each reward against its group's mean, in units of the group's std (0 if all equal).
    A reward that is not a finite number is an error: it would make every advantage nan."""
    if not all(math.isfinite(r) for r in rewards):
        raise GRPOError(f"rewards must be finite numbers, got {list(rewards)}")
    mean = statistics.mean(rewards)  # exact: no overflow however large the rewards
    std = statistics.pstdev(rewards)
    return [0.0 if std < eps else (r - mean) / (std + eps) for r in rewards]


# ---------------------------------------------------------------------------------- the loop


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
        _check_out_dir(cfg.out_dir, done, path)
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
                "temperature": cfg.temperature, "seed": (cfg.seed * 1_000_003 + it * 1009 + k) % 2**31,
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


def check_version(before: str, returned: str, read_back: str) -> None:
    """The update took: the server reports the version it returned, one past the last."""
    if read_back != returned:
        raise GRPOError(f"/get_weight_version says {read_back!r} but the update returned {returned!r}")
    expected = str(int(before) + 1) if before.isdigit() else "1"
    if returned != expected:
        raise GRPOError(f"weight version went from {before!r} to {returned!r}, expected {expected!r}")


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
