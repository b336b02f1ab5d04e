"""What the simulator knows of an instance: its step-time model and its capacity.

A step costs ``t = a + b * scheduled_tokens + c * kv_tokens_read``: ``a`` is the
fixed cost (on a GPU, reading the weights once), ``b`` the per-token compute and
``c`` reading the KV cache of the batch. Profiles are small JSON files written by
``seer_engine profile`` (fitted on the machine at hand) or derived on paper for the
built-in cluster setups (``sim/setups.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from seer_engine.core.numbers import is_real


class SavedAsJson:
    """A dataclass written as a small JSON file (profiles, acceptance models)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.to_json())
        return out


@dataclass(frozen=True)
class StepTimeModel:
    """``t = a + b * scheduled_tokens + c * kv_tokens_read + d * logit_tokens``.

    ``d`` prices the tokens whose logits are computed (the LM head over the
    vocabulary, and sampling): a decode row's token and each draft node it verifies,
    and a prompt's last token. Negligible next to ``a`` on a GPU (0 in the paper
    setups); most of a decode token's cost for a small model with a large vocabulary
    on a CPU, where other prompt tokens (no LM head) are far cheaper.

    ``kv_per_query``: what "KV tokens read" counts. On a GPU, decode attention is
    memory-bound and a row's KV is read once per step, however many tokens the row
    schedules (False). On a CPU it is compute-bound: every scheduled token attends its
    whole context (query-key pairs, True), so draft tokens and prompt chunks cost more."""

    a_s: float  # fixed seconds per step
    b_s_per_token: float  # seconds per scheduled token
    c_s_per_kv_token: float  # seconds per KV token read by the step's attention
    kv_per_query: bool = False
    d_s_per_logit: float = 0.0  # seconds per token whose logits are computed

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "kv_per_query":
                if not isinstance(value, bool):
                    raise ValueError(f"step-time model: kv_per_query must be true or false, got {value!r}")
            elif not (is_real(value) and value >= 0):  # NaN would turn every time into NaN
                raise ValueError(f"step-time model: {f.name} must be a finite number >= 0, got {value!r}")
        if not (self.a_s or self.b_s_per_token or self.c_s_per_kv_token):  # a step always runs a token
            raise ValueError(
                "step-time model: every step would take 0 s (no time, no throughput to compare): "
                "give a_s, b_s_per_token or c_s_per_kv_token a value > 0"
            )

    def step_s(self, scheduled_tokens: float, kv_tokens_read: float, logit_tokens: float = 0.0) -> float:
        return (
            self.a_s
            + self.b_s_per_token * scheduled_tokens
            + self.c_s_per_kv_token * kv_tokens_read
            + self.d_s_per_logit * logit_tokens
        )

    def describe(self) -> str:
        kv = "query-key pair" if self.kv_per_query else "KV token"
        return (
            f"{self.a_s * 1e3:.3g} ms + {self.b_s_per_token * 1e6:.3g} us/token + "
            f"{self.c_s_per_kv_token * 1e9:.3g} ns/{kv} + {self.d_s_per_logit * 1e6:.3g} us/logit token"
        )

    def kv_read(self, context: float, new_tokens: float) -> float:
        """KV tokens a row reads when it computes ``new_tokens`` after ``context`` tokens."""
        if self.kv_per_query:
            return new_tokens * context + new_tokens * (new_tokens + 1) / 2
        return context + new_tokens


@dataclass(frozen=True)
class InstanceProfile(SavedAsJson):
    """One inference instance (a TP/EP group of GPUs, or one CPU engine)."""

    name: str
    step: StepTimeModel
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16
    kv_bytes_per_token: int = 0  # KV of one token over all layers (pool transfers)
    pool_bytes_per_s: float = 0.0  # KV pool bandwidth into one instance; 0: no pool
    derivation: str = ""  # how the figures were measured or derived
    measured: dict = field(default_factory=dict)  # fit quality, machine, date (profiles only)

    def __post_init__(self) -> None:
        for name in ("kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"instance profile {self.name!r}: {name} must be a positive integer, got {value!r}"
                )
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"instance profile {self.name!r}: kv_capacity_tokens ({self.kv_capacity_tokens}) holds "
                f"no KV block of block_size {self.block_size} tokens"
            )
        for name in ("kv_bytes_per_token", "pool_bytes_per_s"):  # a negative one gives negative pull times
            value = getattr(self, name)
            if not (is_real(value) and value >= 0):
                raise ValueError(
                    f"instance profile {self.name!r}: {name} must be a finite number >= 0, got {value!r}"
                )

    @property
    def num_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    @property
    def partial_block_tokens(self) -> float:
        """KV tokens a running row holds past its context: the engine allocates whole
        blocks, so a row's last block is on average half empty."""
        return (self.block_size - 1) / 2

    def pool_load_s(self, tokens: int) -> float:
        """Seconds to pull ``tokens`` of KV from the pool (0 without a pool model)."""
        if not self.pool_bytes_per_s or not self.kv_bytes_per_token:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.pool_bytes_per_s

    @classmethod
    def from_dict(cls, data: dict) -> InstanceProfile:
        if not isinstance(data, dict):
            raise ValueError(f"instance profile: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"instance profile: unknown keys {unknown}")
        data = dict(data)
        step = data.pop("step", None)
        if not isinstance(step, dict):
            raise ValueError(
                "instance profile: 'step' must be an object with a_s, b_s_per_token, c_s_per_kv_token"
            )
        return cls(step=StepTimeModel(**step), **data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> InstanceProfile:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"instance profile {str(p)!r} not found (write one with `seer_engine profile`)")
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (TypeError, ValueError) as e:  # ValueError: bad JSON, or a field out of range
            raise ValueError(f"instance profile {str(p)!r} is not valid: {e}") from None
