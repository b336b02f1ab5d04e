"""Turns a GGUF checkpoint (llama.cpp's single-file format) into a Hugging Face folder.

The engine has no quantized kernels, so a GGUF is dequantized once and saved as
plain safetensors that the ordinary weight loader reads. transformers does the
reading: it undoes llama.cpp's q/k row permutation and rebuilds the tokenizer from
the file's metadata. What it saves needs four repairs before both our loader and
transformers 4.x/5.x accept it: the GGUF quantizer marker (``save_pretrained``
refuses a model that still carries it, though the weights are dense by then), a
transformers-5-only tokenizer class name, a config that only has
``rope_parameters``, and a chat template kept in a separate file older readers miss.
RoPE scaling, which transformers' reader drops, is read from the file and put back.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seer_engine.model_executor.model_config import ModelLoadError

__all__ = [
    "CONVERT_DTYPES",
    "GGUF_ARCHITECTURES",
    "GGUFError",
    "GGUFInfo",
    "convert_gguf",
    "read_gguf_info",
    "safetensors_writes",
]

# general.architecture in the file -> the Hugging Face architecture it becomes.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
CONVERT_DTYPES = ("float32", "bfloat16", "float16")
GGUF_MAGIC = b"GGUF"
EXTRA_HINT = "pip install 'seer_engine[real]' (or: pip install gguf accelerate)"

# Tokens that end a turn in common chat formats. llama.cpp stops on these too
# ("end of generation" tokens) when the file marks them as control tokens.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")
_CONTROL = 3  # llama.cpp's token type for control (special) tokens
# Keys transformers 5 writes into tokenizer_config.json that only it understands.
_TOKENIZER_CONFIG_DROP = ("backend", "is_local", "local_files_only")


class GGUFError(ModelLoadError):
    """A GGUF cannot be converted; the message names the file and the problem."""


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF's header says, read without touching its tensor data."""

    path: Path
    architecture: str
    name: str | None
    license: str | None
    context_length: int | None
    head_dim: int | None  # attention.key_length, when the file states it
    tensor_types: dict[str, int]  # GGML type name -> number of tensors of that type
    special_ids: dict[str, int | None]  # bos/eos/pad token ids the file names (None: none)
    rope_scaling: dict[str, Any] | None = None  # Hugging Face rope_scaling (None: plain RoPE)
    sliding_window: int | None = None  # attention.sliding_window, when the file states it

    @property
    def quantization(self) -> str:
        """The type most weights use (e.g. ``Q4_1``); norms stay F32 in every file."""
        quantized = {t: n for t, n in self.tensor_types.items() if t not in ("F32",)}
        pool = quantized or self.tensor_types
        return max(pool, key=lambda t: pool[t]) if pool else "F32"


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError(f"reading GGUF files needs the 'gguf' package: {EXTRA_HINT}") from None
    return gguf


def _field_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except (ValueError, IndexError):
        return None


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Check that ``path`` is a GGUF of a supported architecture and summarise it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e.strerror or e}") from e
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the bytes {GGUF_MAGIC!r})")
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e}") from e
    arch = _field_value(reader, "general.architecture")
    name = _field_value(reader, "general.name")
    if arch == "llama" and isinstance(name, str) and "mistral" in name.lower():
        arch = "mistral"  # llama.cpp files Mistral models under the llama architecture
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported; seer_engine converts "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    types = Counter(t.tensor_type.name for t in reader.tensors)
    file_arch = _field_value(reader, "general.architecture")
    context = _field_value(reader, f"{file_arch}.context_length")
    license_ = _field_value(reader, "general.license")
    head_dim = _field_value(reader, f"{file_arch}.attention.key_length")
    window = _field_value(reader, f"{file_arch}.attention.sliding_window")
    return GGUFInfo(
        path=path,
        architecture=arch,
        name=name if isinstance(name, str) else None,
        license=license_ if isinstance(license_, str) else None,
        context_length=int(context) if isinstance(context, int) else None,
        head_dim=int(head_dim) if isinstance(head_dim, int) else None,
        tensor_types=dict(types),
        special_ids={
            key: value if isinstance(value := _field_value(reader, f"tokenizer.ggml.{key}"), int) else None
            for key in ("bos_token_id", "eos_token_id", "padding_token_id")
        },
        rope_scaling=_rope_scaling(reader, file_arch, path),
        sliding_window=int(window) if isinstance(window, int) else None,
    )


def _rope_scaling(reader: Any, file_arch: str, path: Path) -> dict[str, Any] | None:
    """The Hugging Face ``rope_scaling`` a GGUF describes (transformers' GGUF reader drops it).

    llama.cpp keeps linear scaling as metadata (``{arch}.rope.scaling.type``/``.factor``)
    and Llama 3's as a tensor of per-frequency divisors (``rope_freqs.weight``), from
    which the llama3 parameters are recovered. Other kinds are refused by name."""
    kind = _field_value(reader, f"{file_arch}.rope.scaling.type")
    factor = _field_value(reader, f"{file_arch}.rope.scaling.factor")
    if kind == "linear" and isinstance(factor, (int, float)) and factor != 1.0:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind not in (None, "none", "linear"):
        raise GGUFError(f"{path}: RoPE scaling {kind!r} is not supported (supported: llama3, linear)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    theta = _field_value(reader, f"{file_arch}.rope.freq_base") or 10000.0
    scaling = _llama3_from_freq_factors([float(x) for x in freqs.data.reshape(-1)], float(theta))
    if scaling is None:
        raise GGUFError(f"{path}: its rope_freqs tensor is not Llama 3 RoPE scaling; not supported")
    return scaling


def _llama3_factors(scaling: dict[str, Any], theta: float, n: int) -> list[float]:
    """llama.cpp's rope_freqs for Llama 3 scaling: each frequency's divisor."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for i in range(n):
        wavelen = 2 * math.pi * theta ** (2 * i / (2 * n))
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama3_from_freq_factors(factors: list[float], theta: float) -> dict[str, Any] | None:
    """The llama3 parameters that give ``factors`` (None if none do). Only the ratios of
    original_max_position_embeddings, low_freq_factor and high_freq_factor matter, so
    low_freq_factor is taken as 1; two frequencies on the smooth ramp fix the other two."""
    n, factor = len(factors), max(factors)
    if factor <= 1.0:
        return None
    # On the ramp 1/r = (1 - s)/factor + s, with s = (old_len / wavelen - 1) / (high - 1).
    ramp = [
        (2 * math.pi * theta ** (i / n), s)
        for i, r in enumerate(factors)
        if 1e-4 < (s := (1 / r - 1 / factor) / (1 - 1 / factor)) < 1 - 1e-4
    ]
    if len(ramp) < 2:
        return None
    (w0, s0), (w1, s1) = ramp[0], ramp[-1]
    slope = (s1 - s0) / (1 / w1 - 1 / w0)  # old_len / (high - 1)
    intercept = s0 - slope / w0  # -1 / (high - 1)
    if intercept >= 0:
        return None
    high = round(1 - 1 / intercept, 4)
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": round(slope * (high - 1)),
    }
    if not all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(_llama3_factors(scaling, theta, n), factors)):
        return None
    return scaling


def _eog_token_ids(path: Path) -> list[int]:
    """The file's EOS/EOT/EOM ids plus control tokens named like an end of turn."""
    reader = _import_gguf().GGUFReader(str(path))
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field_value(reader, f"tokenizer.ggml.{key}")
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    tokens = _field_value(reader, "tokenizer.ggml.tokens") or []
    types = _field_value(reader, "tokenizer.ggml.token_type") or []
    for tid, (token, kind) in enumerate(zip(tokens, types)):
        if kind == _CONTROL and token in _END_OF_TURN and tid not in ids:
            ids.append(tid)
    return ids


def _load_dense(info: GGUFInfo, dtype: str) -> tuple[Any, Any]:
    """(model, tokenizer) from transformers, every weight dequantized to ``dtype``."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise GGUFError(f"transformers needs the 'accelerate' package to read GGUF files: {EXTRA_HINT}")
    folder, file = str(info.path.parent), info.path.name
    kwargs: dict[str, Any] = {"gguf_file": file, "dtype": getattr(torch, dtype)}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        # Newer transformers may keep weights packed in GGUF blocks when a kernel is
        # installed; ask for the dense model the engine can load.
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        if info.head_dim and getattr(config, "head_dim", None) != info.head_dim:
            # transformers reads no head_dim for some architectures (qwen3) and falls
            # back to the config class default, which need not be the file's.
            config.head_dim = info.head_dim
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, **kwargs)
    except (ValueError, OSError, KeyError, NotImplementedError, RuntimeError) as e:
        raise GGUFError(f"transformers could not read {info.path}: {e}") from e
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:
        raise GGUFError(f"{info.path}: transformers kept weights packed ({packed}); cannot save them dense")
    return model, tokenizer


@contextmanager
def safetensors_writes(folder: Path) -> Iterator[None]:
    """Raise safetensors' write failures as the OSError they are: its Rust writer reports a
    full or read-only disk as ``SafetensorError``, which callers would not take for one."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise OSError(None, str(e), str(folder)) from e


def _clear_quantizer(model: Any) -> None:
    """Drop the GGUF quantizer marker so ``save_pretrained`` writes the dense weights."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _float32_repr(value: float) -> float:
    """A float the file stored as float32, written the way it was meant (1e-06, not 9.99e-07)."""
    import numpy as np

    return float(str(np.float32(value)))


def _repair_config(out: Path, dtype: str, info: GGUFInfo) -> None:
    """Add the classic keys (``rope_theta``, ``torch_dtype``) older readers need; take the
    special token ids from the file, not from the config class defaults."""
    path = out / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    if isinstance(cfg.get("rms_norm_eps"), float):
        cfg["rms_norm_eps"] = _float32_repr(cfg["rms_norm_eps"])
    ids = info.special_ids
    cfg["bos_token_id"] = ids.get("bos_token_id")
    for key, file_key in (("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        if ids.get(file_key) is not None:
            cfg[key] = ids[file_key]
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = float(rope["rope_theta"])
    if info.rope_scaling is not None:
        cfg["rope_parameters"] = {**info.rope_scaling, "rope_theta": cfg.get("rope_theta", 10000.0)}
        cfg["rope_scaling"] = dict(info.rope_scaling)
    elif rope.get("rope_type", "default") != "default" and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = dict(rope)
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    cfg["architectures"] = [GGUF_ARCHITECTURES[info.architecture]]
    cfg["model_type"] = info.architecture  # transformers reads llama.cpp's Mistral as llama
    if info.architecture == "mistral":
        # The file's window or none (as llama.cpp runs it), not MistralConfig's default of 4096.
        cfg["sliding_window"] = info.sliding_window
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _repair_tokenizer(out: Path, context_length: int | None) -> None:
    """Name a tokenizer class every transformers version has; inline the chat template."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in _TOKENIZER_CONFIG_DROP:
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if context_length:
        cfg["model_max_length"] = context_length
    template_file = out / "chat_template.jinja"
    if template_file.is_file():
        cfg["chat_template"] = template_file.read_text(encoding="utf-8")
        template_file.unlink()
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _repair_generation_config(out: Path, eog_ids: list[int]) -> None:
    """Stop on every end-of-turn token, not only the file's single EOS."""
    path = out / "generation_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    # Marked "from the model config", transformers may rebuild it from config.json
    # at generate time and lose the extra stop tokens.
    cfg.pop("_from_model_config", None)
    if eog_ids:
        cfg["eos_token_id"] = eog_ids if len(eog_ids) > 1 else eog_ids[0]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def default_notice(info: GGUFInfo, dtype: str) -> str:
    """Where the weights came from, for a GGUF that no alias describes."""
    lines = [
        f"Converted by seer_engine from the GGUF file {info.path}",
        f"(model name in the file: {info.name or 'unknown'}; "
        f"license in the file: {info.license or 'not stated'}).",
        f"The weights were dequantized from {info.quantization} and saved as {dtype} safetensors;",
        "they carry the quantization error of the GGUF, not the original weights.",
        "The model's own license applies to this folder.",
    ]
    return "\n".join(lines) + "\n"


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    notice: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the dequantized Hugging Face folder of ``gguf_path`` into ``out_dir``.

    ``out_dir`` must be empty or absent; callers that share a cache write into a
    temporary folder and rename it (see ``model_source``). ``notice`` is the text
    of the NOTICE file (default: the file's provenance as far as its header says).
    """
    if dtype not in CONVERT_DTYPES:
        raise GGUFError(f"cannot convert to dtype {dtype!r}; choose one of {', '.join(CONVERT_DTYPES)}")
    info = read_gguf_info(gguf_path)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise GGUFError(f"output folder {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _msg: None)
    size_mb = info.path.stat().st_size / 1e6
    say(
        f"converting {info.path.name} ({info.architecture}, {info.quantization}, {size_mb:.0f} MB) "
        f"to a {dtype} Hugging Face folder"
    )
    model, tokenizer = _load_dense(info, dtype)
    _clear_quantizer(model)
    say("saving the dequantized weights")
    try:
        with safetensors_writes(out):
            model.save_pretrained(out, safe_serialization=True)
    except ValueError as e:
        raise GGUFError(f"cannot save the dequantized weights of {info.path}: {e}") from e
    try:
        tokenizer.save_pretrained(out)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - the Rust tokenizer's write errors (a full disk) are plain
        raise OSError(f"cannot save the tokenizer: {e}") from e
    _repair_config(out, dtype, info)
    _repair_tokenizer(out, info.context_length)
    _repair_generation_config(out, _eog_token_ids(info.path))
    (out / "NOTICE").write_text(notice or default_notice(info, dtype), encoding="utf-8")
    return out
