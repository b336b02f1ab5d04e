"""The Triton attention backend against the torch reference.

Without a GPU the kernels run under Triton's CPU interpreter. Triton reads
TRITON_INTERPRET when a kernel is decorated, so it must be set before
``seer_engine.kernels.paged_attention`` is first imported; torch does not import
triton, so checking for CUDA first is safe. Shapes are tiny: the interpreter executes
every program in Python.
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from references import compile_for_hopper  # noqa: E402

from seer_engine.kernels import paged_attention as pa  # noqa: E402
from seer_engine.model_executor.attention import (  # noqa: E402
    AttentionMetadata,
    get_attention_backend,
    torch_paged_attention,
    torch_store_kv,
)
from seer_engine.model_executor.attention.torch import _plan_torch_attention  # noqa: E402
from seer_engine.model_executor.attention.triton import (  # noqa: E402
    TritonAttentionBackend,
    paged_attention,
)
from seer_engine.model_executor.model_runner import as_int64  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    # The interpreter rounds fp32 -> bf16 by truncation, the reference to nearest.
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# (cached tokens, new tokens) per request: decode rows, a prefill span over a cached
# prefix, a prefill from 0, a first decode; no seq_len is a multiple of 16 or 8.
MIXED = [(20, 1), (13, 7), (0, 11), (36, 1)]
SCALE = 0.3


def make_batch(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query/key/value and a cache whose every slot holds random data.

    Each request gets shuffled, non-contiguous block ids (a few blocks stay unused), so
    a kernel that reads a wrong block, or a slot past seq_len, sees noise.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-(cached + new) // block_size) for cached, new in reqs]
    num_blocks = sum(blocks_per_req) + 3
    block_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(reqs), max(blocks_per_req), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = block_ids[used : used + n]
        used += n

    query_start_loc, slots = [0], []
    for i, (cached, new) in enumerate(reqs):
        query_start_loc.append(query_start_loc[-1] + new)
        for pos in range(cached, cached + new):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    num_tokens = query_start_loc[-1]
    seq_lens = [cached + new for cached, new in reqs]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(new for _, new in reqs),
        max_seq_len=max(seq_lens),
        query_lens_cpu=[new for _, new in reqs],
        seq_lens_cpu=seq_lens,
    )
    query = rand(num_tokens, num_heads, head_dim)
    key = rand(num_tokens, num_kv_heads, head_dim)
    value = rand(num_tokens, num_kv_heads, head_dim)
    kv_cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    return query, key, value, kv_cache, meta


def check_attention(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    **tiles: int,
) -> None:
    query, _, _, kv_cache, meta = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    expected = torch_paged_attention(query, kv_cache, meta, SCALE)
    actual = paged_attention(query, kv_cache, meta, SCALE, **tiles)
    assert actual.dtype == query.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def test_kernels_run_where_expected() -> None:
    """On CPU the kernels must have been built for the interpreter (the env var worked)."""
    assert pa._is_interpreted() == (not torch.cuda.is_available())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_reference(dtype: torch.dtype) -> None:
    _, key, value, kv_cache, meta = make_batch(MIXED, 4, 2, 32, dtype=dtype)
    # Keys as a strided view (as when split from a fused projection).
    fused = torch.cat([key, value], dim=1)
    key = fused[:, :2]
    expected = kv_cache.clone()
    torch_store_kv(key, value, expected, meta.slot_mapping)
    pa.triton_store_kv(key, value, kv_cache, meta.slot_mapping)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_mixed_batch_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    check_attention(MIXED, num_heads, num_kv_heads, head_dim, dtype=dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("block_q,tile_n", [(1, 16), (2, 16), (4, 32)])
def test_tiles_cross_blocks_and_queries(block_size: int, block_q: int, tile_n: int) -> None:
    """Several key tiles per query (online softmax rescaling), several query tiles per
    request, and key tiles smaller than, equal to and larger than a block."""
    reqs = [(45, 1), (30, 9), (0, 19)]
    check_attention(reqs, 4, 2, 32, block_size, block_q=block_q, tile_n=tile_n)


def test_block_size_not_power_of_two() -> None:
    """Nothing in the kernels needs a power-of-two block size (16 is the default)."""
    check_attention([(30, 1), (10, 9)], 4, 2, 32, block_size=12, block_q=2, tile_n=16)


def test_decode_only_batch() -> None:
    """The single-query tile shape, including a request whose context is one token."""
    check_attention([(0, 1), (17, 1), (40, 1)], 8, 2, 32, tile_n=16)


@pytest.mark.parametrize("head_dim", [16, 80, 128, 256])
def test_head_dims(head_dim: int) -> None:
    """Power-of-two head sizes at both ends, and a padded one (80)."""
    check_attention([(9, 1), (5, 4)], 2, 1, head_dim, dtype=torch.float16)


def test_forward_matches_torch_backend() -> None:
    """Store then attend, with q/k/v as views of one fused projection."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    _, _, _, kv_cache, meta = make_batch(MIXED, num_heads, num_kv_heads, head_dim)
    num_tokens = meta.slot_mapping.shape[0]
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    torch_cache = kv_cache.clone()

    expected = get_attention_backend("torch").forward(query, key, value, torch_cache, meta, SCALE)
    backend = get_attention_backend("triton")
    assert backend.name == "triton"
    actual = backend.forward(query, key, value, kv_cache, meta, SCALE)
    assert torch.equal(kv_cache, torch_cache)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a wider tensor)."""
    return torch.stack([t, torch.full_like(t, 7)], dim=-1)[..., 0]


def test_strided_metadata_is_read_by_stride() -> None:
    """Slot mappings, sequence lengths and query starts that are views with a stride
    (the kernels used to read them as flat arrays: wrong slots, wrong lengths)."""
    query, key, value, kv_cache, meta = make_batch(MIXED, 4, 2, 32)
    expected_cache = kv_cache.clone()
    torch_store_kv(key, value, expected_cache, meta.slot_mapping)
    pa.triton_store_kv(key, value, kv_cache, strided(meta.slot_mapping))
    assert torch.equal(kv_cache, expected_cache)
    expected = torch_paged_attention(query, kv_cache, meta, SCALE)
    views = dataclasses.replace(
        meta, seq_lens=strided(meta.seq_lens), query_start_loc=strided(meta.query_start_loc)
    )
    torch.testing.assert_close(paged_attention(query, kv_cache, views, SCALE), expected, **TOL[torch.float32])


def check_any_layout(backend: str) -> None:
    """q/k/v whose last dimension is strided (heads innermost) are stored and attended as
    the torch backend does them, not refused."""
    query, key, value, kv_cache, meta = make_batch(MIXED, 4, 2, 32)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (query, key, value))
    expected_cache = kv_cache.clone()
    expected = get_attention_backend("torch").forward(q, k, v, expected_cache, meta, SCALE)
    actual = get_attention_backend(backend).forward(q, k, v, kv_cache, meta, SCALE)
    assert torch.equal(kv_cache, expected_cache)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])


def test_any_layout_of_query_key_value() -> None:
    check_any_layout("triton")


def test_empty_batch() -> None:
    query, key, value, kv_cache, meta = make_batch([(5, 1)], 2, 1, 32)
    empty = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:0],
        query_start_loc=meta.query_start_loc[:1],
        seq_lens=meta.seq_lens[:0],
        block_tables=meta.block_tables[:0],
        max_query_len=0,
        max_seq_len=0,
        query_lens_cpu=[],
        seq_lens_cpu=[],
    )
    before = kv_cache.clone()
    out = TritonAttentionBackend().forward(query[:0], key[:0], value[:0], kv_cache, empty, SCALE)
    assert out.shape == (0, 2, 32)
    assert torch.equal(kv_cache, before)


# Draft trees: each request's parent list (None: no tree, plain causal) -> tree_mask.


def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    """A random draft tree, parents before children: node 0 is the root (the request's
    first new token), node j's parent is one of nodes 0 .. j-1."""
    return [-1] + [int(torch.randint(0, j, (), generator=gen)) for j in range(1, num_nodes)]


def tree_mask_for(trees: list[list[int] | None], query_lens: list[int]) -> torch.Tensor:
    """The metadata encoding: per new token, bit j set for each ancestor j and itself,
    stored as the model runner stores it (signed int64); -1 for requests without a tree."""
    words = []
    for parents, q_len in zip(trees, query_lens):
        if parents is None:
            words += [-1] * q_len
            continue
        assert len(parents) == q_len
        for node in range(q_len):
            word = 0
            while node >= 0:
                word |= 1 << node
                node = parents[node]
            words.append(as_int64(word))
    return torch.tensor(words, dtype=torch.int64, device=DEVICE)


def dense_tree_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    trees: list[list[int] | None],
    scale: float,
) -> torch.Tensor:
    """Plain dense reference in fp32: gather each request's context from the cache, let
    each new token see the cached context, its ancestors in the tree and itself (all
    earlier new tokens without a tree), then softmax over that explicit mask."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        num_cached = seq_len - q_len
        pos = torch.arange(seq_len, device=kv_cache.device)
        slots = meta.block_tables[i, pos // block_size].long() * block_size + pos % block_size
        flat = kv_cache.flatten(1, 2).float()  # [2, num_slots, num_kv_heads, head_dim]
        k = flat[0, slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = flat[1, slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        parents = trees[i] if trees[i] is not None else list(range(-1, q_len - 1))
        mask = torch.zeros(q_len, seq_len, dtype=torch.bool, device=kv_cache.device)
        mask[:, :num_cached] = True
        for node in range(q_len):
            seen = node
            while seen >= 0:
                mask[node, num_cached + seen] = True
                seen = parents[seen]
        q = query[start : start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        start += q_len
    return out


def with_trees(meta: AttentionMetadata, tree_mask: torch.Tensor | None) -> AttentionMetadata:
    """The same batch with another tree_mask, and a fresh plan cache (plans depend on it)."""
    return dataclasses.replace(meta, tree_mask=tree_mask, plan_cache={})


# (cached tokens, new tokens, tree nodes or 0): prefill spans without a tree (one longer
# than 64, one of the same q_len as two trees), decode rows, and draft trees of 2 to 64
# nodes, over empty, short and block-crossing contexts.
TREE_BATCH = [(13, 7, 0), (20, 1, 0), (5, 9, 9), (0, 64, 64), (30, 2, 2), (0, 70, 0), (17, 9, 9)]
TREE_BATCH += [(36, 1, 0), (3, 9, 0), (41, 23, 23), (2, 64, 64)]


def make_tree_batch(
    num_heads: int, num_kv_heads: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[list[int] | None]]:
    gen = torch.Generator().manual_seed(seed + 1)
    reqs = [(cached, new) for cached, new, _ in TREE_BATCH]
    query, _, _, kv_cache, meta = make_batch(reqs, num_heads, num_kv_heads, 32, block_size, dtype, seed)
    trees = [random_parents(nodes, gen) if nodes else None for _, _, nodes in TREE_BATCH]
    return query, kv_cache, with_trees(meta, tree_mask_for(trees, meta.query_lens_cpu)), trees


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,dtype,tiles",
    [
        (4, 2, 16, torch.float32, {}),
        (8, 1, 12, torch.float32, dict(block_q=2, tile_n=16)),
        (4, 4, 8, torch.float32, dict(block_q=16, tile_n=32)),
        (4, 2, 16, torch.bfloat16, {}),
    ],
    ids=["gqa2-bs16", "gqa8-bs12-small-tiles", "mha-bs8", "bf16"],
)
def test_tree_attention_matches_dense_reference(
    num_heads: int, num_kv_heads: int, block_size: int, dtype: torch.dtype, tiles: dict
) -> None:
    """Both backends against the dense reference on a batch mixing prefill spans, decode
    rows and random draft trees (tiles that split a tree across programs included)."""
    query, kv_cache, meta, trees = make_tree_batch(num_heads, num_kv_heads, block_size, dtype, seed=7)
    expected = dense_tree_attention(query, kv_cache, meta, trees, SCALE)
    torch.testing.assert_close(torch_paged_attention(query, kv_cache, meta, SCALE), expected, **TOL[dtype])
    actual = paged_attention(query, kv_cache, meta, SCALE, **tiles)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def test_chain_tree_is_causal() -> None:
    """A tree whose parents form one chain is plain causal attention: same output as
    tree_mask=None from both backends."""
    query, kv_cache, meta, _ = make_tree_batch(4, 2, 16, torch.float32, seed=3)
    chains = [list(range(-1, new - 1)) if nodes else None for _, new, nodes in TREE_BATCH]
    chained = with_trees(meta, tree_mask_for(chains, meta.query_lens_cpu))
    plain = with_trees(meta, None)
    assert torch.equal(
        torch_paged_attention(query, kv_cache, chained, SCALE),
        torch_paged_attention(query, kv_cache, plain, SCALE),
    )
    torch.testing.assert_close(
        paged_attention(query, kv_cache, chained, SCALE),
        paged_attention(query, kv_cache, plain, SCALE),
        **TOL[torch.float32],
    )


def test_torch_plan_groups_short_rows() -> None:
    """Requests with the same q_len <= 64 share one padded group (cheap verification
    steps); longer prefill spans attend alone."""
    _, _, meta, _ = make_tree_batch(2, 1, 16, torch.float32, seed=0)
    plan = _plan_torch_attention(meta, 16, torch.device(DEVICE))
    assert sorted((g.q_len, g.batch) for g in plan) == [
        (1, 2),
        (2, 1),
        (7, 1),
        (9, 3),
        (23, 1),
        (64, 2),
        (70, 1),
    ]
    rows = torch.cat([g.rows for g in plan]).sort().values
    assert torch.equal(rows.cpu(), torch.arange(meta.slot_mapping.shape[0]))


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from seer_engine.kernels import paged_attention as pa

    target = GPUTarget("cuda", 90, 32)
    ints = lambda *names: {n: "i32" for n in names}
    strides = ints("stride_ckv", "stride_cblk", "stride_coff", "stride_chead")
    configs = [("bf16", 128, 4, 16, 64, False), ("bf16", 128, 4, 16, 64, True), ("fp32", 80, 1, 1, 16, False)]
    for dt, head_dim, group, block_q, tile_n, has_tree in configs:
        sig = {"out_ptr": "*" + dt, "q_ptr": "*" + dt, "cache_ptr": "*" + dt,
               "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
               "query_start_loc_ptr": "*i32", "tree_mask_ptr": "*i64",
               "scale_log2e": "fp32", "num_reqs": "i32",
               **ints("stride_qt", "stride_qh", "stride_ot", "stride_oh"), **strides,
               "stride_bt": "i32"}
        consts = dict(QUERIES_PER_KV=group, GROUP_PAD=group, HEAD_DIM=head_dim,
                      HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=16,
                      BLOCK_Q=block_q, BLOCK_M=max(16, block_q * group), TILE_N=tile_n,
                      UPCAST=False, HAS_TREE=has_tree)
        triton.compile(ASTSource(pa._paged_attention_kernel, sig, consts), target=target)
    sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*bf16",
           "slot_mapping_ptr": "*i64",
           **ints("stride_kt", "stride_kh", "stride_vt", "stride_vh"), **strides}
    consts = dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16)
    triton.compile(ASTSource(pa._store_kv_kernel, sig, consts), target=target)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels for real")
def test_kernels_compile_for_cuda(tmp_path: Path) -> None:
    """Without a GPU, at least compile the GPU path (to a Hopper cubin) so that code the
    interpreter tolerates but the compiler rejects is caught here."""
    compile_for_hopper(_COMPILE_SCRIPT, tmp_path)
