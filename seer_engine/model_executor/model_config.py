"""Reads a Hugging Face model folder's config.json into what the decoder needs.

One decoder implementation serves the Llama family; the differences between
architectures are a handful of switches recorded here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from seer_engine.core.numbers import is_int

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# The MLP is SiLU-gated; transformers names that activation either way.
_SILU = ("silu", "swish")
# A config without "architectures": transformers' Auto classes go by model_type.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Which architectures read the bias switches (the others ignore them in transformers).
_READS_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_READS_MLP_BIAS = ("LlamaForCausalLM",)
# Their sliding window is off unless use_sliding_window, and covers the layers that
# layer_types marks, else those from max_window_layers on. Llama has none.
_LAYERED_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DEFAULT_WINDOW = 4096  # transformers' default sliding_window (Mistral, Qwen2, Qwen3)
_DEFAULT_MAX_WINDOW_LAYERS = 28
# transformers' defaults where config.json has no max_position_embeddings
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 131072,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
}
# transformers' defaults where config.json has no num_key_value_heads (Llama's, and an
# explicit null's: as many as num_attention_heads)
_DEFAULT_KV_HEADS = {"MistralForCausalLM": 8, "Qwen2ForCausalLM": 32, "Qwen3ForCausalLM": 32}
# The rope scalings RotaryEmbedding implements (besides plain RoPE).
_ROPE_SCALINGS = ("linear", "llama3")


class ModelLoadError(ValueError):
    """The model folder cannot be served; the message says what is wrong or missing."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16")
    return _DTYPES[key]


@dataclass
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    sliding_window: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def replay_eos(self) -> int:
        """The EOS id a trace replay ends its responses with (the lowest the model lists)."""
        if not self.eos_token_ids:
            raise ModelLoadError(
                f"{self.path}: neither config.json nor generation_config.json names an EOS token id "
                "in the vocabulary, and a trace replay ends each response with one"
            )
        return min(self.eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(f"model path {str(path)!r} is not a directory")
        if not config_file.is_file():
            raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model folder")
        cfg = _json_object(config_file)
        try:
            return cls._from_dict(path, config_file, cfg)
        except ModelLoadError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a field of the wrong type
            raise ModelLoadError(f"{config_file} has a field of the wrong type or value: {e!r}") from e

    @classmethod
    def _from_dict(cls, path: Path, config_file: Path, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs and cfg.get("model_type") in _MODEL_TYPES:
            archs = [_MODEL_TYPES[cfg["model_type"]]]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in {config_file}; "
                f"seer_engine serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        typed = _MODEL_TYPES.get(cfg.get("model_type"))
        if typed is not None and typed != arch:  # transformers' Auto classes run model_type's
            raise ModelLoadError(
                f"{config_file} names architecture {arch!r} but model_type {cfg['model_type']!r} "
                f"({typed} in transformers); which model it is is unclear"
            )

        def need(key: str) -> Any:
            if key not in cfg:
                raise ModelLoadError(f"{config_file} lacks required key {key!r}")
            return cfg[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ModelLoadError(
                f"{path} holds a quantized checkpoint (quant_method {method!r}, per the "
                f"quantization_config in {config_file}); seer_engine loads unquantized weights only"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in _SILU:
            raise ModelLoadError(
                f"unsupported hidden_act {act!r} in {config_file}; seer_engine's MLP is SiLU-gated (silu)"
            )
        # transformers' Qwen3Config defaults head_dim to 128, not hidden_size // heads.
        default_head_dim = 128 if arch == "Qwen3ForCausalLM" and "head_dim" not in cfg else hidden // heads
        max_positions = cfg.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
        rope_scaling, rope_theta = _rope(cfg, max_positions, config_file)
        layers = need("num_hidden_layers")
        sliding = _sliding_window(arch, cfg, layers)
        if sliding is not None and not (is_int(sliding) and sliding > 0):  # transformers fails on it
            raise ModelLoadError(f"sliding_window {sliding!r} in {config_file} is not a positive token count")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = arch in _READS_ATTENTION_BIAS and bool(cfg.get("attention_bias", False))
        return cls(
            path=path,
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", _DEFAULT_KV_HEADS.get(arch)) or heads,
            head_dim=cfg.get("head_dim") or default_head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=arch in _READS_MLP_BIAS and bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            # transformers 5 keeps "dtype" where the legacy "torch_dtype" is there too
            dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            sliding_window=sliding,
            eos_token_ids=_eos_ids(path, cfg, need("vocab_size")),
            bos_token_id=cfg.get("bos_token_id"),
        )


def _json_object(file: Path) -> dict[str, Any]:
    """The object a JSON file holds; anything else is a ModelLoadError naming the file."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def _rope(cfg: dict[str, Any], max_positions: int, config_file: Path) -> tuple[dict[str, Any] | None, float]:
    """(scaling, theta) as transformers 5 reads them: a legacy ``rope_scaling`` replaces
    ``rope_parameters``; theta comes from that dict, else the top-level ``rope_theta``;
    llama3's original length is a top-level ``original_max_position_embeddings`` where
    config.json has one (the Phi-3 layout: transformers' rotary embedding takes it over
    the dict's), else the dict's, else ``max_positions``. Scalings the rotary embedding
    does not implement are refused here, naming the file, before any weight is read."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None, theta
    if kind not in _ROPE_SCALINGS:
        raise ModelLoadError(
            f"unsupported rope scaling type {kind!r} in {config_file}; "
            f"seer_engine implements {', '.join(_ROPE_SCALINGS)}"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        # transformers' scaled rotary tables cover only that part of a head, which its
        # Llama-family attention cannot apply; the decoder here would rotate whole heads.
        raise ModelLoadError(
            f"partial_rotary_factor {partial!r} with {kind} rope scaling in {config_file} is "
            "unsupported; seer_engine rotates whole heads"
        )
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ModelLoadError(f"{kind} rope scaling in {config_file} needs a factor > 0, got {factor!r}")
    if kind == "llama3":
        if cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_positions)
    return params, theta


def _sliding_window(arch: str, cfg: dict[str, Any], layers: int) -> int | None:
    """The window some layer attends within, as transformers' config classes default it
    (None: every layer attends to the whole context)."""
    if arch == "MistralForCausalLM":
        return cfg.get("sliding_window", _DEFAULT_WINDOW)
    if arch not in _LAYERED_WINDOW or not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window", _DEFAULT_WINDOW)
    kinds = cfg.get("layer_types")
    if kinds is not None:
        slides = "sliding_attention" in kinds
    else:
        slides = cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS) < layers
    return window if slides else None


def _eos_ids(path: Path, cfg: dict[str, Any], vocab_size: int) -> list[int]:
    """EOS ids as transformers' ``generate`` stops on them: generation_config.json's
    (which may list several) where it names any, else config.json's; a config.json id
    the generation config leaves out does not stop transformers, so it must not stop us.
    Ids outside the vocabulary are left out: the model never emits them, and banning
    them before min_tokens would index past (or, negative, wrap around) the logits."""
    gen_file = path / "generation_config.json"
    eos = _json_object(gen_file).get("eos_token_id") if gen_file.is_file() else None
    if eos is None or eos == []:
        eos = cfg.get("eos_token_id")
    ids: list[int] = []
    for e in eos if isinstance(eos, list) else [eos]:
        if is_int(e) and 0 <= e < vocab_size and e not in ids:
            ids.append(e)
    return ids
