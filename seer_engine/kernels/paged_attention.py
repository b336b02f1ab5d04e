"""Triton kernels for the paged KV cache: storing new keys/values and attending.

One attention kernel serves every kind of row in a flattened batch (prefill from 0,
prefill spans over a cached prefix, decode), so the model runner never splits a step
by phase. The launch wrappers take tensors and plain numbers only, so this module
imports nothing from seer_engine; ``model_executor.attention.triton`` adapts them to
the attention backend interface, and the tests compare them with the torch reference
backend.

Attention grid: ``(query tiles, kv heads)``. A query tile is up to ``BLOCK_Q``
consecutive query tokens of one request times all query heads that share one kv
head (the GQA group), so each key/value tile is loaded once for the whole group.
Request ``i`` owns the programs ``query_start_loc[i] // BLOCK_Q + i`` onwards; that
numbering gives every request at least ``cdiv(q_len, BLOCK_Q)`` programs while the
total, ``num_tokens // BLOCK_Q + num_reqs``, is known on the host without reading
device memory. A program finds its request by binary search over
``query_start_loc`` and returns at once if its tile is past the request's end (at
most one such program per request). Decode-heavy and prefill-heavy batches thus
launch no more programs than they have work for.

Each program runs an online softmax over the context in tiles of ``TILE_N`` keys,
looking each key's block up in the block table, so tiles need not align with blocks.
Visibility is decided in one helper, ``_visible``: causal by absolute position, and,
for speculative-decoding verification (``HAS_TREE``), ANDed with each query token's
draft-tree bit-mask (``tree_mask``: one signed int64 word per query token, bit j set
when it may see the request's new token j) for keys at or past the request's first
query. Tree nodes are laid out parents before children, so the causal
loop bound stays valid. Without a tree the mask is neither loaded nor applied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cblk,
    stride_coff,
    stride_chead,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its key and value (all kv heads) into its slot."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding token owns no slot
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * stride_cblk
        + (slot % BLOCK_SIZE) * stride_coff
        + heads[:, None] * stride_chead
        + dims[None, :]
    )
    key = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(dst + stride_ckv, value.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _visible(q_pos, k_pos, num_cached, tree, HAS_TREE: tl.constexpr):
    """``[M, N]`` mask of which keys each query row may see: causal by absolute position
    and, with ``HAS_TREE``, limited among the new keys to the bits of the row's ``tree``
    mask (bit j: new token j; the shift is clamped because only q_len <= 64 has a tree).
    The words are signed: an arithmetic shift by 63 of a negative word still yields 1."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if HAS_TREE:
        bit = tl.minimum(tl.maximum(k_pos - num_cached, 0), 63).to(tl.int64)
        in_tree = ((tree[:, None] >> bit[None, :]) & 1) != 0
        visible = visible & ((k_pos < num_cached)[None, :] | in_tree)
    return visible


@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tree_mask_ptr,
    scale_log2e,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cblk,
    stride_coff,
    stride_chead,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    """One program: a tile of query tokens x the query heads of one kv head."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Find the request whose program range [qsl[i] // BLOCK_Q + i, ...) holds pid.
    lo = tl.zeros((), dtype=tl.int32)
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        next_start = tl.load(query_start_loc_ptr + mid + 1) // BLOCK_Q + mid + 1
        go_right = next_start <= pid
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    req = lo
    if req >= num_reqs:
        return
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + req)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - q_len  # context tokens before this step's first query

    # Row m of the tile is query token m // GROUP_PAD, head m % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (rows < BLOCK_Q * GROUP_PAD) & (q_idx < q_len) & (head_in_group < QUERIES_PER_KV)
    heads = kv_head * QUERIES_PER_KV + head_in_group
    tokens = (q_start + q_idx).to(tl.int64)
    q_pos = num_cached + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    tree = 0  # unused without a tree
    if HAS_TREE:
        tree = tl.load(tree_mask_ptr + tokens, mask=row_valid, other=-1)

    # Online softmax state. A finite floor for the running max keeps rows that see no
    # key (padding rows) free of inf - inf = nan.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # The last query of this tile sees keys 0 .. kv_end - 1; no row sees further.
    kv_end = num_cached + tl.minimum((tile + 1) * BLOCK_Q, q_len)
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    k_base = cache_ptr + kv_head * stride_chead
    for start in range(0, kv_end, TILE_N):
        k_pos = start + tl.arange(0, TILE_N)
        k_valid = k_pos < kv_end
        block_ids = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        slots = block_ids.to(tl.int64) * stride_cblk + (k_pos % BLOCK_SIZE) * stride_coff
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_base + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_ckv + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e
        s = tl.where(_visible(q_pos, k_pos, num_cached, tree, HAS_TREE), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def _is_interpreted() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def triton_store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape and kv_cache.shape[3:] == (num_kv_heads, head_dim)
    assert kv_cache.stride(-1) == 1
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    assert slot_mapping.shape == (num_tokens,), "one slot per token"
    slot_mapping = slot_mapping.contiguous()  # the kernel reads it as a flat array
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=kv_cache.shape[2],
    )


_NO_TREE: dict[torch.device, torch.Tensor] = {}


def _no_tree(device: torch.device) -> torch.Tensor:
    """An int64 stand-in for ``tree_mask`` when there is none (never read then), so the
    kernel's signature stays the same with and without trees."""
    dummy = _NO_TREE.get(device)
    if dummy is None:
        dummy = _NO_TREE[device] = torch.full((1,), -1, dtype=torch.int64, device=device)
    return dummy


def _tile_sizes(max_query_len: int, group_pad: int, head_dim_pad: int) -> tuple[int, int]:
    """Default (BLOCK_Q, TILE_N): one query token per tile for decode-only batches,
    about 64 rows otherwise; 64 keys per tile, 32 for the widest heads."""
    block_q = 1 if max_query_len <= 1 else max(1, 64 // group_pad)
    tile_n = 64 if head_dim_pad <= 128 else 32
    return block_q, tile_n


def triton_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    *,
    block_q: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Paged attention for a flattened batch of ``seq_lens.shape[0]`` requests.

    ``query`` ``[num_tokens, num_heads, head_dim]``; ``kv_cache`` ``[2, num_blocks,
    block_size, num_kv_heads, head_dim]``; ``block_tables`` ``[num_reqs, max_blocks]``
    int32; ``seq_lens`` ``[num_reqs]`` int32 (context including the new tokens);
    ``query_start_loc`` ``[num_reqs + 1]`` int32; ``tree_mask`` None or ``[num_tokens]``
    int64 (see the module docstring). ``block_q``/``tile_n`` override the tiling (powers
    of two, ``tile_n >= 16``), which tests use to cross tile edges cheaply."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert kv_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    assert query_start_loc.shape == (num_reqs + 1,)
    # The kernel reads these as flat arrays.
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()

    queries_per_kv = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(queries_per_kv)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    default_q, default_n = _tile_sizes(max_query_len, group_pad, head_dim_pad)
    block_q = block_q or default_q
    tile_n = tile_n or default_n
    block_m = max(16, block_q * group_pad)  # tl.dot needs at least 16 rows
    if tree_mask is not None:
        assert tree_mask.dtype == torch.int64 and tree_mask.shape == (num_tokens,)
        tree_mask = tree_mask.contiguous()
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        _no_tree(query.device) if tree_mask is None else tree_mask,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        # The interpreter multiplies bfloat16 tiles as raw uint16 bits; do its dots in
        # fp32 (exact for bf16 products, so results stay comparable with the GPU's).
        UPCAST=_is_interpreted() and query.dtype == torch.bfloat16,
        HAS_TREE=tree_mask is not None,
    )
    return out
