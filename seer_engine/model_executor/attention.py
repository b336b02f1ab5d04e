"""Paged attention over one flattened variable-length batch.

Every step the model runner lays the scheduled tokens of all requests end to end
(``num_tokens`` rows). Each request contributes ``q_len = query_start_loc[i+1] -
query_start_loc[i]`` new tokens that sit at the end of its context of ``seq_lens[i]``
tokens, so prefill chunks, prefix-cache hits and decode steps are one operation: new
keys/values are written into the paged cache at ``slot_mapping``, then every query
attends causally to its request's cached context through the block table.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). A slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What the attention backends need to know about a flattened batch."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V goes
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sums of q_len
    seq_lens: torch.Tensor  # [num_reqs] int32, context length incl. the new tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies so the torch backend can group requests without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """One interface for every attention implementation (torch reference, Triton)."""

    name: str = "abstract"

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        raise NotImplementedError

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """query ``[num_tokens, num_heads, head_dim]`` -> output of the same shape."""
        raise NotImplementedError

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.store_kv(key, value, kv_cache, meta)
        return self.attend(query, kv_cache, meta, scale)


def torch_store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference KV store: scatter each token's key/value into its slot."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _gather_context(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, ctx_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[B, ctx_len, kv_heads, head_dim]`` for rows of a block table."""
    block_size = kv_cache.shape[2]
    num_blocks = (ctx_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].reshape(-1)
    # index_select is far cheaper than advanced indexing on a large cache tensor.
    k = kv_cache[0].index_select(0, blocks).view(-1, num_blocks * block_size, *kv_cache.shape[3:])
    v = kv_cache[1].index_select(0, blocks).view(-1, num_blocks * block_size, *kv_cache.shape[3:])
    return k[:, :ctx_len], v[:, :ctx_len]


def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q ``[B, Q, H, D]``, k/v ``[B, K, Hkv, D]``; query at position p sees keys 0..p.

    ``q_pos`` ``[B, Q]`` holds each query's absolute position, ``kv_len`` ``[B]`` the
    number of valid keys (padding beyond it is masked out).
    """
    key_idx = torch.arange(k.shape[1], device=k.device)
    mask = (key_idx[None, None, :] <= q_pos[:, :, None]) & (key_idx[None, None, :] < kv_len[:, None, None])
    b, nq, h, d = q.shape
    hkv = k.shape[2]
    # Plain matmuls: on CPU they beat the fused SDPA kernel for short decode queries.
    qg = q.reshape(b, nq, hkv, h // hkv, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k).float() * scale
    scores.masked_fill_(~mask[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(b, nq, h, d)


def torch_paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Reference paged attention in plain PyTorch.

    Decode rows (q_len == 1) are attended together in one padded batch; longer query
    chunks (prefill) one request at a time so that padding never multiplies work.
    """
    out = torch.empty_like(query)
    starts = [0]
    for q_len in meta.query_lens_cpu:
        starts.append(starts[-1] + q_len)
    decode_rows = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, device=query.device)
        tok = torch.tensor([starts[i] for i in decode_rows], device=query.device)
        lens = meta.seq_lens[rows].long()
        max_len = max(meta.seq_lens_cpu[i] for i in decode_rows)
        k, v = _gather_context(kv_cache, meta.block_tables[rows], max_len)
        q = query[tok][:, None]
        out[tok] = _masked_attention(q, k, v, (lens - 1)[:, None], lens, scale)[:, 0].to(out.dtype)
    for i, q_len in enumerate(meta.query_lens_cpu):
        if q_len == 1:
            continue
        seq_len = meta.seq_lens_cpu[i]
        start = starts[i]
        k, v = _gather_context(kv_cache, meta.block_tables[i : i + 1], seq_len)
        q = query[start : start + q_len][None]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[None]
        kv_len = torch.tensor([seq_len], device=query.device)
        out[start : start + q_len] = _masked_attention(q, k, v, q_pos, kv_len, scale)[0].to(out.dtype)
    return out


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch: the reference, and the fast path on CPU."""

    name = "torch"

    def store_kv(self, key, value, kv_cache, meta):
        torch_store_kv(key, value, kv_cache, meta.slot_mapping)

    def attend(self, query, kv_cache, meta, scale):
        return torch_paged_attention(query, kv_cache, meta, scale)


def get_attention_backend(name: str) -> AttentionBackend:
    """Backends by name; the Triton one is imported lazily (it needs triton)."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from seer_engine.kernels.paged_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
