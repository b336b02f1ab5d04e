"""The C++ CPU decode kernels (``seer_engine._cpu_ops``, built from ``csrc/cpu_ops.cpp``).

Stock torch on a small CPU runs a decode step far below the machine's limits: its
small-M matmul reads weights at half the memory bandwidth and each norm or rotary
embedding is half a dozen dispatched ops. The kernels here (a GEMM over block-packed
weights, fused residual+RMSNorm, in-place RoPE, paged attention without a context
gather) cover float32 on AVX-512 CPUs; elsewhere, or when the extension was not built,
``native()`` is None and the model runs plain torch ops.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BLOCK = 48  # output columns per packed block, as csrc/cpu_ops.cpp lays them out


@functools.cache
def native() -> ModuleType | None:
    """The extension module, or None where it cannot run (not built, failed to load, no
    AVX-512); the reason is logged once, as a warning, since the model then runs the
    slower torch ops."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        logger.warning("C++ CPU kernels need AVX-512 (this CPU: %s); running torch ops", capability)
        return None
    try:
        import seer_engine._cpu_ops as _cpu_ops
    except (ImportError, OSError) as e:
        logger.warning("C++ CPU kernels unavailable (%s); running torch ops", e)
        return None
    return _cpu_ops


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels serve a model in ``dtype`` on ``device`` (float32 on CPU)."""
    return device.type == "cpu" and dtype == torch.float32 and native() is not None


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/48), K, 48]`` in ``dtype`` (float32, or bfloat16 to halve the
    bytes a step streams): each 48-column block one contiguous stream."""
    ops = native()
    weight = weight.detach().to(dtype)
    if ops is not None and weight.device.type == "cpu":
        return ops.pack_weight(weight)
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = F.pad(weight, (0, 0, 0, blocks * BLOCK - n))
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def pad_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The bias zero-padded to whole blocks, as the kernel reads it."""
    if bias is None:
        return None
    return F.pad(bias.detach(), (0, -(-n // BLOCK) * BLOCK - n)).contiguous()
