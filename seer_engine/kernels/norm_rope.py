"""Triton kernels for the decoder's per-layer element-wise work on the GPU: RMSNorm with
the residual add fused in, and rotary embedding in place on the fused qkv rows.

They take the same arguments as the C++ CPU kernels (``csrc/cpu_ops.cpp``), so the
model calls one interface (``rms_norm``, ``add_rms_norm_``, ``rope_``) whichever device
it runs on. Norm statistics are computed in float32 whatever the tensor dtype, as the
Hugging Face reference does; arithmetic is float32, rounded to the tensor dtype where
torch's ops would round. One program per token row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    weight_ptr,
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = weight * norm(x) or, with ADD_RESIDUAL: residual += x; out = weight * norm(residual)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    if ADD_RESIDUAL:  # rounded to the tensor dtype, as torch's add is
        x32 = x32 + tl.load(residual_ptr + row * stride_r + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(residual_ptr + row * stride_r + cols, x32.to(dtype), mask=live)
        x32 = x32.to(dtype).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(dtype), mask=live)


@triton.jit
def _rope_kernel(
    qk_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    heads,
    max_pos,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """Rotate halves of each of the row's first ``heads`` heads by its position's angles.
    A position outside the table reads no memory: its row comes out zero rather than
    rotated by whatever lies past the table (Triton's debug mode also asserts on it)."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    tl.device_assert((pos >= 0) & (pos < max_pos), "rope_: position outside the cos/sin table")
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    live = (h < heads) & (i < HALF)
    base = qk_ptr + row * stride_t + h * (2 * HALF) + i
    a = tl.load(base, mask=live, other=0.0)
    dtype = a.dtype
    a = a.to(tl.float32)
    b = tl.load(base + HALF, mask=live, other=0.0).to(tl.float32)
    table = pos * 2 * HALF + i
    at = pos + 0 * i  # the position as a block: Triton's interpreter refuses a scalar mask term
    read = (i < HALF) & (at >= 0) & (at < max_pos)
    c1 = tl.load(cos_ptr + table, mask=read, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=read, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF, mask=read, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF, mask=read, other=0.0).to(dtype).to(tl.float32)
    # Each product rounded to the tensor dtype before the sum, as torch's
    # q * cos + rotate_half(q) * sin rounds them (one rounding only would differ by an ulp).
    first = (a * c1).to(dtype).to(tl.float32) - (b * s1).to(dtype).to(tl.float32)
    second = (b * c2).to(dtype).to(tl.float32) + (a * s2).to(dtype).to(tl.float32)
    tl.store(base, first.to(dtype), mask=live)
    tl.store(base + HALF, second.to(dtype), mask=live)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("rows must be contiguous in their last dimension")
    return x.reshape(-1, x.shape[-1])


def _launch_rms_norm(
    rows: torch.Tensor, res: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float, add: bool
) -> None:
    """One program per row: out = norm(rows (+ res, written back into res when ``add``))."""
    if rows.shape[0]:
        hidden = rows.shape[1]
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, out, weight, rows.stride(0), res.stride(0), out.stride(0), hidden, eps,
            ADD_RESIDUAL=add, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty_like(rows)
    _launch_rms_norm(rows, rows, out, weight, eps, add=False)
    return out.view(x.shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x; x = norm(residual), both in place."""
    rows, res = _rows(x), _rows(residual)
    if rows.data_ptr() != x.data_ptr() or res.data_ptr() != residual.data_ptr() or rows.shape != res.shape:
        raise ValueError("x and residual must be row views of the same shape")
    _launch_rms_norm(rows, res, rows, weight, eps, add=True)


def rope_(
    qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int
) -> None:
    """Neox rotary embedding in place on the first ``heads`` heads of each row of ``qk``
    (``[T, >= heads * head_dim]``, rows contiguous); ``cos``/``sin`` ``[max_pos, head_dim]``."""
    if qk.dim() != 2 or qk.stride(1) != 1 or qk.shape[1] < heads * head_dim:
        raise ValueError("rope_: qk must be [T, >= heads * head_dim] with contiguous rows")
    if positions.shape != (qk.shape[0],):
        raise ValueError("rope_: one position per row of qk")
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"rope_: cos and sin must both be [max_pos, {head_dim}] (an even head_dim)")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_: cos and sin must be contiguous")
    positions = positions.contiguous()  # the kernel reads it as a flat array
    if qk.shape[0]:
        half = head_dim // 2
        _rope_kernel[(qk.shape[0],)](
            qk, positions, cos, sin, qk.stride(0), heads, cos.shape[0],
            HALF=half, HALF_PAD=triton.next_power_of_2(half), HEADS_PAD=triton.next_power_of_2(heads),
        )  # fmt: skip
