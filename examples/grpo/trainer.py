"""The policy the loop trains: GRPO's advantages, the clipped policy-gradient step, the checkpoint."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from grpo.checkpoints import PROGRESS_FILE, TRAINER_STATE_FILE
from grpo.config import GRPOConfig, GRPOError, Sample

WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.gguf")


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


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: each reward against its group's mean, in units of the group's std (0 if all equal).
    A reward that is not a finite number is an error: it would make every advantage nan."""
    if not all(math.isfinite(r) for r in rewards):
        raise GRPOError(f"rewards must be finite numbers, got {list(rewards)}")
    mean = statistics.mean(rewards)  # exact: no overflow however large the rewards
    std = statistics.pstdev(rewards)
    return [0.0 if std < eps else (r - mean) / (std + eps) for r in rewards]
