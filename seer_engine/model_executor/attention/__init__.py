"""Attention backends over the paged KV cache, by name.

``base`` holds the batch metadata and the backend interface, ``torch`` the reference
backend, ``cpu`` the fast CPU backend over the C++ kernels (float32), ``triton`` the GPU
backend (a thin wrapper over ``seer_engine.kernels``; it is imported only when asked
for, as it needs triton).
"""

from __future__ import annotations

from seer_engine.model_executor.attention.base import AttentionBackend, AttentionMetadata
from seer_engine.model_executor.attention.torch import (
    TorchAttentionBackend,
    torch_paged_attention,
    torch_store_kv,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
    "torch_paged_attention",
    "torch_store_kv",
]


def get_attention_backend(name: str) -> AttentionBackend:
    """A backend by name: ``torch``, ``cpu`` or ``triton``."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        from seer_engine.model_executor.attention.cpu import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "triton":
        from seer_engine.model_executor.attention.triton import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch', 'cpu' or 'triton'")
