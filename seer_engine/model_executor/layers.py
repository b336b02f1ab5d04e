"""Building blocks of the decoder: linear layers, RMSNorm, rotary embedding, gated MLP
activation.

Numerics follow the Hugging Face reference (norms in float32, rotary tables in
float32) so that greedy outputs match it token for token. ``use_native`` switches a
layer to fused kernels with one interface on both devices: the C++ CPU kernels
(``cpu_kernels``) or the Triton ones (``kernels.norm_rope``): same math, fewer passes.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn

from seer_engine.model_executor import cpu_kernels


class Linear(nn.Linear):
    """``nn.Linear`` that, switched to kernels with a ``linear`` (the C++ CPU kernels),
    multiplies by a block-packed copy of its weight (made by ``use_native`` once the
    weights are final). Other kernel sets leave matmuls to torch (cuBLAS on a GPU)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._ops: ModuleType | None = None
        self._packed: torch.Tensor | None = None
        self._packed_bias: torch.Tensor | None = None

    def use_native(self, ops: ModuleType | None, weight_dtype: torch.dtype = torch.float32) -> None:
        """``weight_dtype`` bfloat16 packs the weight as bfloat16 (opt-in, changes numerics)."""
        self._ops = ops if hasattr(ops, "linear") else None
        self._packed = None if self._ops is None else cpu_kernels.pack_weight(self.weight, weight_dtype)
        self._packed_bias = None if self._ops is None else cpu_kernels.pad_bias(self.bias, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._ops is None:
            return nn.functional.linear(x, self.weight, self.bias)
        return self._ops.linear(x, self._packed, self._packed_bias, self.out_features)


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream as well, adds into it first (returning both)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._ops: ModuleType | None = None

    def use_native(self, ops: ModuleType | None) -> None:
        self._ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._ops is not None and x.is_contiguous():
            if residual is None:
                return self._ops.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous():
                self._ops.add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3 frequency scaling: long wavelengths slowed by `factor`, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    ramp = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - ramp) * scaled / factor + ramp * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":  # as transformers: the frequencies, not the positions
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._ops: ModuleType | None = None

    def use_native(self, ops: ModuleType | None) -> None:
        self._ops = ops

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's rotation, looked up once and shared by every layer."""
        if self._ops is not None:
            return Rope(positions, self.cos, self.sin, self._ops)
        return Rope(
            None, self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]
        )


class Rope:
    """One step's rotary embedding: per-token cos/sin rows (torch), or the whole tables and
    the positions (native kernel, which rotates in place)."""

    def __init__(
        self,
        positions: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ops: ModuleType | None = None,
    ) -> None:
        self.positions, self.cos, self.sin, self.ops = positions, cos, sin, ops

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k ``[T, Hkv, D]`` (views of the fused qkv rows are rotated in place)."""
        if self.ops is not None:
            for x in (q, k):
                self.ops.rope_(x.flatten(1), self.positions, self.cos, self.sin, x.shape[1], x.shape[2])
            return q, k
        return q * self.cos + _rotate_half(q) * self.sin, k * self.cos + _rotate_half(k) * self.sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
