"""The Triton attention backend: the GPU path (and, under TRITON_INTERPRET=1, testable
on CPU). The kernels live in ``seer_engine.kernels.paged_attention``; this module only
unpacks ``AttentionMetadata`` into the tensors and numbers they take."""

from __future__ import annotations

import torch

from seer_engine.kernels.paged_attention import triton_paged_attention, triton_store_kv
from seer_engine.model_executor.attention.base import AttentionBackend, AttentionMetadata


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    block_q: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """The kernel on one batch's metadata; ``block_q``/``tile_n`` override the tiling."""
    return triton_paged_attention(
        query,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        scale,
        meta.tree_mask,
        block_q=block_q,
        tile_n=tile_n,
    )


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels behind the backend interface."""

    name = "triton"

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        triton_store_kv(key, value, kv_cache, meta.slot_mapping)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return paged_attention(query, kv_cache, meta, scale)
