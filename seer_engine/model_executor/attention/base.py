"""Paged attention over one flattened variable-length batch: the metadata and the
interface every backend implements.

Every step the model runner lays the scheduled tokens of all requests end to end
(``num_tokens`` rows). Each request contributes ``q_len = query_start_loc[i+1] -
query_start_loc[i]`` new tokens that sit at the end of its context of ``seq_lens[i]``
tokens, so prefill spans, prefix-cache hits and decode steps are one operation: new
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
    # num_cached + j, num_cached = seq_len - q_len). Each word is the 64-bit pattern
    # read as a signed (two's complement) int64, so bit 63 is the sign bit; -1 (all
    # bits) means plain causal. Keys before num_cached are always visible; causality
    # (k <= q) always applies, as draft nodes are laid out parents before children.
    # Requests with a tree have q_len <= 64.
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

    def native_requests(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """Where the C++ decoder (``cpu_kernels``) can attend every request of this step in
        its one call, the int64 indices of those requests; else None (the layers run one
        op at a time)."""
        return None

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
