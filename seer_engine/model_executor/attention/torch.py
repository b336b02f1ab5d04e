"""The reference attention backend in plain PyTorch (and the fast path on CPU).

Requests are grouped once per step (see ``_group_requests``) so a decode or
verification step costs a few kernel launches per layer, not a few per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seer_engine.model_executor.attention.base import AttentionBackend, AttentionMetadata


def torch_store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference KV store: scatter each token's key/value into its slot."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


# Longest q_len whose requests share a padded group in the torch backend. Verification
# rows (at most 64: the root and up to 63 draft nodes) fall under it; longer prefill
# spans attend alone, so padding never multiplies prefill work.
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
    each longer prefill span is a group of its own. Requests without new tokens are skipped."""
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
    Words are signed: the arithmetic shift by 63 of a negative word still yields bit 63.
    """
    batch = num_cached.shape[0]
    device = tree_mask.device
    tree = tree_mask.index_select(0, rows).view(batch, q_len, 1)
    bits = ((tree >> torch.arange(q_len, device=device)) & 1).bool()  # [B, Q, Q]
    new_idx = torch.arange(ctx_len, device=device)[None, :] - num_cached[:, None]  # [B, ctx_len]
    in_tree = bits.gather(2, new_idx.clamp(0, q_len - 1)[:, None, :].expand(batch, q_len, ctx_len))
    return (new_idx < 0)[:, None, :] | in_tree


def _plan_torch_attention(
    meta: AttentionMetadata, block_size: int, device: torch.device, long_only: bool = False
) -> list[_TorchAttentionGroup]:
    """Group the batch once per step (every layer reuses it): see ``_group_requests``.

    Grouping keeps the CPU cost of a decode or verification step at a few kernel launches
    per layer rather than a few per request. ``tree_mask`` only applies to grouped
    requests: longer prefill spans carry no tree (their mask is -1). ``long_only``: plan
    only the spans longer than ``_MAX_GROUPED_Q_LEN`` (a backend attends the rest itself).
    """
    plan = []
    for reqs in _group_requests(meta.query_lens_cpu):
        if long_only and meta.query_lens_cpu[reqs[0]] <= _MAX_GROUPED_Q_LEN:
            continue
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
