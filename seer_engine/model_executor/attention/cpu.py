"""The CPU attention backend over the C++ kernels (``cpu_kernels``).

Decode and verification rows (spans of at most 64 tokens) attend straight from the paged
cache, every request and KV head in one call per layer: no gather of the context and no
padded mask, which the torch reference pays for on every layer. Longer prefill spans are
compute-bound and go through the reference's SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seer_engine.model_executor import cpu_kernels
from seer_engine.model_executor.attention.base import AttentionBackend, AttentionMetadata
from seer_engine.model_executor.attention.torch import (
    _MAX_GROUPED_Q_LEN,
    _attend_group,
    _plan_torch_attention,
    _TorchAttentionGroup,
)


@dataclass
class _CpuPlan:
    short: torch.Tensor | None  # int64 indices of requests with 0 < q_len <= 64
    long: list[_TorchAttentionGroup]


class CpuAttentionBackend(AttentionBackend):
    """C++ KV store and short-span attention; the torch path for long prefill spans."""

    name = "cpu"

    def __init__(self) -> None:
        ops = cpu_kernels.native()
        if ops is None:
            raise ValueError("the 'cpu' attention backend needs the C++ CPU kernels (seer_engine._cpu_ops)")
        self.ops = ops

    def store_kv(self, key, value, kv_cache, meta):
        self.ops.store_kv(_heads_in_rows(key), _heads_in_rows(value), kv_cache, meta.slot_mapping)

    def native_requests(self, meta, kv_cache):
        plan = self._plan_for(meta, kv_cache)
        return None if plan.long else plan.short

    def _plan_for(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> _CpuPlan:
        plan = meta.plan_cache.get("cpu")
        if plan is None:
            block_size, head_dim = kv_cache.shape[2], kv_cache.shape[-1]
            plan = meta.plan_cache["cpu"] = _plan(meta, block_size, head_dim, kv_cache.device)
        return plan

    def attend(self, query, kv_cache, meta, scale):
        plan = self._plan_for(meta, kv_cache)
        query = _heads_in_rows(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.short is not None:
            self.ops.paged_attention(
                out,
                query,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.tree_mask,
                plan.short,
                scale,
            )
        for group in plan.long:
            out.index_copy_(0, group.rows, _attend_group(query, kv_cache, group, scale).to(out.dtype))
        return out


def _heads_in_rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, heads, D]`` with each row's heads contiguous, as the kernels read them (the
    fused qkv views already are; any other layout is copied)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _plan(meta: AttentionMetadata, block_size: int, head_dim: int, device: torch.device) -> _CpuPlan:
    """Short spans to the kernel (head_dim a multiple of 16 up to 128), the rest to the torch path."""
    if head_dim % 16 or head_dim > 128:
        return _CpuPlan(short=None, long=_plan_torch_attention(meta, block_size, device))
    short = [i for i, n in enumerate(meta.query_lens_cpu) if 0 < n <= _MAX_GROUPED_Q_LEN]
    return _CpuPlan(
        short=torch.tensor(short, dtype=torch.int64) if short else None,
        long=_plan_torch_attention(meta, block_size, device, long_only=True),
    )
