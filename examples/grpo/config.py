"""What a GRPO run is given (its settings, checked), what it works on (samples), and how it fails."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from seer_engine.tasks import TaskPrompt

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
