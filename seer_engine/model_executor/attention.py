"""Paged attention over one flattened variable-length batch.

Every step the model runner lays the scheduled tokens of all requests end to end
(``num_tokens`` rows). Each request contributes ``q_len = query_start_loc[i+1] -
query_start_loc[i]`` new tokens that sit at the end of its context of ``seq_lens[i]``
tokens, so prefill chunks, prefix-cache hits and decode steps are one operation: new
keys/values are written into the paged cache at ``slot_mapping``, then every query
attends causally to its request's cached context through the block table. For
speculative-decoding verification, ``tree_mask`` narrows causality further: a draft
node sees the cached context, its ancestors and itself.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). A slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # Draft-tree verification (speculative decoding): None, or [num_tokens] int64. For
    # query token t of request i, m = t - query_start_loc[i] its index among the
    # request's new tokens: bit j set <=> t may see the request's new token j (key slot
    # num_cached + j, num_cached = seq_len - q_len). -1 (all bits) means plain causal.
    # Keys before num_cached are always visible; causality (k <= q) always applies, as
    # draft nodes are laid out parents before children. Requests with a tree have
    # q_len <= 64.
    tree_mask: torch.Tensor | None = None
    # Per-step precomputation a backend shares across layers (e.g. gather plans, masks).
    plan_cache: dict = field(default_factory=dict)

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


# Longest q_len whose requests share a padded group in the torch backend. Verification
# rows (draft trees have at most 64 nodes) fall under it; longer prefill chunks attend
# alone, so padding never multiplies prefill work.
_MAX_GROUPED_Q_LEN = 64


@dataclass
class _TorchAttentionGroup:
    """Requests attended together: their query rows, context blocks and visibility mask."""

    rows: torch.Tensor  # [B * Q] indices into the flattened query
    batch: int
    q_len: int
    block_ids: torch.Tensor  # [B * num_blocks] block ids to gather
    num_blocks: int
    ctx_len: int
    visible: torch.Tensor  # [B, 1, Q, ctx_len] bool, True where a query may attend


def _group_requests(query_lens: list[int]) -> list[list[int]]:
    """Requests with the same q_len <= 64 (decode rows, verification rows) form one group;
    each longer chunk is a group of its own. Requests without new tokens are skipped."""
    short: dict[int, list[int]] = {}
    long: list[list[int]] = []
    for i, q_len in enumerate(query_lens):
        if q_len > _MAX_GROUPED_Q_LEN:
            long.append([i])
        elif q_len > 0:
            short.setdefault(q_len, []).append(i)
    return list(short.values()) + long


def _tree_visible(
    tree_mask: torch.Tensor, rows: torch.Tensor, num_cached: torch.Tensor, q_len: int, ctx_len: int
) -> torch.Tensor:
    """``[B, Q, ctx_len]`` bool: False where a draft-tree mask hides a new key from a query.

    The bits are expanded to ``[B, Q, Q]`` with shifts and then gathered at each key's
    index among the new tokens, so the int64 work stays independent of the context length.
    """
    batch = num_cached.shape[0]
    device = tree_mask.device
    tree = tree_mask.index_select(0, rows).view(batch, q_len, 1)
    bits = ((tree >> torch.arange(q_len, device=device)) & 1).bool()  # [B, Q, Q]
    new_idx = torch.arange(ctx_len, device=device)[None, :] - num_cached[:, None]  # [B, ctx_len]
    in_tree = bits.gather(2, new_idx.clamp(0, q_len - 1)[:, None, :].expand(batch, q_len, ctx_len))
    return (new_idx < 0)[:, None, :] | in_tree


def _plan_torch_attention(
    meta: AttentionMetadata, block_size: int, device: torch.device
) -> list[_TorchAttentionGroup]:
    """Group the batch once per step (every layer reuses it): see ``_group_requests``.

    Grouping keeps the CPU cost of a decode or verification step at a few kernel launches
    per layer rather than a few per request. ``tree_mask`` only applies to grouped
    requests: longer chunks carry no tree (their mask is -1).
    """
    plan = []
    for reqs in _group_requests(meta.query_lens_cpu):
        q_len = meta.query_lens_cpu[reqs[0]]
        ctx_len = max(meta.seq_lens_cpu[i] for i in reqs)
        num_blocks = -(-ctx_len // block_size)
        idx = torch.tensor(reqs, device=device)
        q_offsets = torch.arange(q_len, device=device)
        rows = (meta.query_start_loc[idx].long()[:, None] + q_offsets).reshape(-1)
        seq_lens = meta.seq_lens[idx].long()
        num_cached = seq_lens - q_len
        q_pos = num_cached[:, None] + q_offsets[None, :]
        key = torch.arange(ctx_len, device=device)
        visible = (key[None, None, :] <= q_pos[:, :, None]) & (key[None, None, :] < seq_lens[:, None, None])
        if meta.tree_mask is not None and q_len <= _MAX_GROUPED_Q_LEN:
            visible &= _tree_visible(meta.tree_mask, rows, num_cached, q_len, ctx_len)
        plan.append(
            _TorchAttentionGroup(
                rows=rows,
                batch=len(reqs),
                q_len=q_len,
                block_ids=meta.block_tables[idx, :num_blocks].reshape(-1),
                num_blocks=num_blocks,
                ctx_len=ctx_len,
                visible=visible[:, None],  # broadcast over heads
            )
        )
    return plan


def _attend_group(query: torch.Tensor, kv_cache: torch.Tensor, g: _TorchAttentionGroup, scale: float):
    """Masked attention for one group; query head h reads kv head h // (H / Hkv)."""
    _, _, block_size, hkv, d = kv_cache.shape
    h = query.shape[1]
    # index_select is far cheaper than advanced indexing on a large cache tensor.
    k = kv_cache[0].index_select(0, g.block_ids).view(g.batch, -1, hkv, d)[:, : g.ctx_len]
    v = kv_cache[1].index_select(0, g.block_ids).view(g.batch, -1, hkv, d)[:, : g.ctx_len]
    q = query.index_select(0, g.rows).view(g.batch, g.q_len, h, d)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=g.visible,
        scale=scale,
        enable_gqa=h != hkv,
    )
    return out.transpose(1, 2).reshape(g.batch * g.q_len, h, d)


def torch_paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Reference paged attention in plain PyTorch."""
    plan = meta.plan_cache.get("torch")
    if plan is None:
        plan = meta.plan_cache["torch"] = _plan_torch_attention(meta, kv_cache.shape[2], query.device)
    out = torch.empty_like(query)
    for group in plan:
        out.index_copy_(0, group.rows, _attend_group(query, kv_cache, group, scale).to(out.dtype))
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
