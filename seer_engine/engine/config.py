"""Engine configuration: one dataclass, vLLM-named fields, shared by the API and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from seer_engine.spec_decode.config import SpeculativeConfig


@dataclass
class EngineConfig:
    model: str = "tiny"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    cpu_kernels: bool = True
    cpu_weight_dtype: str = "float32"
    scheduling_policy: str = "fcfs"
    seed: int = 0
    num_threads: int | None = None
    # Parsed in __post_init__ into a SpeculativeConfig (None: no speculative decoding).
    speculative_config: str | dict | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        gb = self.kv_cache_memory_gb
        if gb is not None and not (isinstance(gb, (int, float)) and 0 < gb < math.inf):
            raise ValueError(f"kv_cache_memory_gb must be a finite number > 0, got {gb!r}")
        if self.device != "auto" and not _is_device(self.device):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.cpu_weight_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"cpu_weight_dtype must be float32 or bfloat16, got {self.cpu_weight_dtype!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (``--max-num-seqs`` for ``max_num_seqs``), as vLLM names them."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if isinstance(default, bool):
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=f"{FIELD_HELP[f.name]} (default: {'on' if default else 'off'})",
                )
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" | ")[0].replace("'", ""), str)
            parser.add_argument(flag, type=kind, default=default, help=FIELD_HELP[f.name])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# What each field (and its flag) means; ``--help`` adds the default where this does not say it.
FIELD_HELP = {
    "model": "a model folder (Hugging Face format), a .gguf file, smollm2-135m (fetched and "
    "converted on first use) or tiny (a built-in random model)",
    "tokenizer": "a tokenizer folder (default: the model's)",
    "dtype": "weights and activations: auto, float32, bfloat16 or float16",
    "device": "auto, cpu or cuda[:N]",
    "max_model_len": "longest prompt + output in tokens (default: the model's context length)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step (prefill chunks and decodes together)",
    "block_size": "tokens per KV cache block (a power of two)",
    "num_kv_blocks": "KV cache blocks, overriding the memory-based sizing",
    "kv_cache_memory_gb": "KV cache budget in GiB (default: 1 on CPU; on GPU what "
    "--gpu-memory-utilization leaves after the weights)",
    "gpu_memory_utilization": "share of the GPU's memory the engine may use",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prefills over steps, beside the decodes",
    "attention_backend": "auto, torch, cpu (C++ paged attention) or triton",
    "cpu_kernels": "the C++ CPU kernels (packed GEMM, fused norm and RoPE, paged attention) for "
    "float32 on AVX-512 CPUs where the extension is built; off runs plain torch ops",
    "cpu_weight_dtype": "float32, or bfloat16 to pack the CPU kernels' linear weights in half the "
    "bytes (activations, norms, attention and KV stay float32; greedy output may then differ "
    "from float32 transformers)",
    "scheduling_policy": "fcfs, or priority (a request's lower priority value first)",
    "seed": "seeds the seeds of requests that name none",
    "num_threads": "torch CPU threads for this instance (default: torch's)",
    "speculative_config": 'JSON, e.g. \'{"method": "group_suffix", "num_speculative_tokens": 16}\' '
    "(default: no speculative decoding)",
}


def _is_device(name: object) -> bool:
    """``cpu``, ``cuda`` or ``cuda:N`` (as torch spells them); whether CUDA is there is
    checked where the engine starts."""
    import torch

    try:
        return isinstance(name, str) and torch.device(name).type in ("cpu", "cuda")
    except RuntimeError:
        return False
