"""The Triton norm and RoPE kernels (the GPU's fused ops) against the torch path.

Without a GPU they run under Triton's interpreter (TRITON_INTERPRET is set before the
kernels are first imported, as in test_triton_kernels.py), and are compiled for a
Hopper target so that code the interpreter accepts but the compiler rejects fails here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from references import compile_for_hopper  # noqa: E402

from seer_engine.kernels import norm_rope  # noqa: E402
from seer_engine.model_executor.layers import RMSNorm, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter rounds fp32 -> bf16 by truncation, torch to nearest.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 72])
def test_norms_match_torch(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    plain, (added, new_residual) = norm(x), norm(x, residual)
    norm.use_native(norm_rope)
    torch.testing.assert_close(norm(x), plain, **TOL[dtype])
    x2, residual2 = x.clone(), residual.clone()
    out, out_residual = norm(x2, residual2)
    assert out.data_ptr() == x2.data_ptr() and out_residual.data_ptr() == residual2.data_ptr(), "in place"
    torch.testing.assert_close(out_residual, new_residual, **TOL[dtype])
    torch.testing.assert_close(out, added, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_torch(dtype: torch.dtype) -> None:
    """In place on q and k views of the fused qkv rows; values untouched."""
    heads, kv_heads, dim = 6, 2, 32
    rotary = RotaryEmbedding(dim, 256, 10000.0, None).to(DEVICE)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(7, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 2, 100, 7, 255, 3], device=DEVICE)
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    q_ref, k_ref = rotary.for_positions(positions, dtype)(q, k)
    values = qkv[:, (heads + kv_heads) * dim :].clone()
    rotary.use_native(norm_rope)
    q_out, k_out = rotary.for_positions(positions, dtype)(q, k)
    assert q_out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], values)


def test_rope_rounds_as_torch_in_half_precision() -> None:
    """float16 (which the interpreter rounds to nearest, as torch does): bit for bit the
    torch path, which rounds q * cos and rotate_half(q) * sin before adding them."""
    heads, kv_heads, dim = 6, 2, 32
    rotary = RotaryEmbedding(dim, 256, 10000.0, None).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(16, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, torch.float16)
    positions = torch.randint(0, 256, (16,), generator=gen).to(DEVICE)
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    q_ref, k_ref = rotary.for_positions(positions, torch.float16)(q, k)
    rotary.use_native(norm_rope)
    q_out, k_out = rotary.for_positions(positions, torch.float16)(q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_rope_reads_strided_positions() -> None:
    """Positions as a view with a stride are read by stride, and must be one per row."""
    rotary = RotaryEmbedding(16, 64, 10000.0, None).to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    qk = torch.randn(5, 2 * 16, generator=gen).to(DEVICE)
    positions = torch.tensor([[3, 0], [60, 0], [0, 0], [17, 0], [9, 0]], device=DEVICE)[:, 0]
    expected = qk.clone()
    norm_rope.rope_(expected, positions.contiguous(), rotary.cos, rotary.sin, 2, 16)
    norm_rope.rope_(qk, positions, rotary.cos, rotary.sin, 2, 16)
    assert torch.equal(qk, expected)
    with pytest.raises(ValueError, match="one position per row"):
        norm_rope.rope_(qk, positions[:4], rotary.cos, rotary.sin, 2, 16)


def test_rope_checks_its_tables_and_reads_no_position_outside_them() -> None:
    """Tables of the wrong shape are refused before launch; a position past the table
    reads nothing outside it (its row comes out zero, the other rows as usual)."""
    rotary = RotaryEmbedding(16, 64, 10000.0, None).to(DEVICE)
    gen = torch.Generator().manual_seed(5)
    qk = torch.randn(3, 2 * 16, generator=gen).to(DEVICE)
    positions = torch.tensor([5, 64, 9], device=DEVICE)
    with pytest.raises(ValueError, match="cos and sin must both be"):
        norm_rope.rope_(qk.clone(), positions, rotary.cos[:, :8], rotary.sin[:, :8], 2, 16)
    with pytest.raises(ValueError, match="contiguous"):
        norm_rope.rope_(qk.clone(), positions, rotary.cos.t().contiguous().t(), rotary.sin, 2, 16)
    expected = qk.clone()
    norm_rope.rope_(expected, torch.tensor([5, 0, 9], device=DEVICE), rotary.cos, rotary.sin, 2, 16)
    norm_rope.rope_(qk, positions, rotary.cos, rotary.sin, 2, 16)
    assert torch.equal(qk[[0, 2]], expected[[0, 2]])
    assert not qk[1].any()


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from seer_engine.kernels import norm_rope as nr

    target = GPUTarget("cuda", 90, 32)
    for dt in ("bf16", "fp32"):
        for add in (False, True):
            sig = {"x_ptr": "*" + dt, "residual_ptr": "*" + dt, "out_ptr": "*" + dt, "weight_ptr": "*" + dt,
                   "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "hidden": "i32", "eps": "fp32"}
            consts = dict(ADD_RESIDUAL=add, BLOCK=4096)
            triton.compile(ASTSource(nr._rms_norm_kernel, sig, consts), target=target)
        sig = {"qk_ptr": "*" + dt, "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
               "stride_t": "i32", "heads": "i32", "max_pos": "i32"}
        consts = dict(HALF=64, HALF_PAD=64, HEADS_PAD=64)
        triton.compile(ASTSource(nr._rope_kernel, sig, consts), target=target)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels for real")
def test_kernels_compile_for_cuda(tmp_path: Path) -> None:
    compile_for_hopper(_COMPILE_SCRIPT, tmp_path)
