"""Loads a Hugging Face folder (single or sharded safetensors) into the decoder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from seer_engine.model_executor.model_config import ModelConfig, ModelLoadError
from seer_engine.model_executor.models.decoder import DecoderForCausalLM


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files, chosen as transformers chooses them: ``model.safetensors``
    where there is one, else the shards the index names (checked to be there). Other
    ``*.safetensors`` beside them (Mistral's consolidated.safetensors, EMA weights, a
    stale copy) are not read: their tensors would override or clash with the model's.
    A folder with neither has its ``*.safetensors`` read, each tensor name once."""
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"checkpoint in {path} is incomplete: missing shard files {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights found in {path}")
    return files


def iterate_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    seen: dict[str, Path] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in seen:
                        raise ModelLoadError(
                            f"checkpoint tensor {name!r} is in both {seen[name].name} and {file.name} "
                            f"in {path}; which one is the model's is unclear"
                        )
                    seen[name] = file
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # a truncated or foreign file
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from e


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """Build the decoder on ``device`` in ``dtype`` and fill it from the folder's weights.

    Parameters are allocated uninitialised (built on the meta device, then made empty on
    ``device``): ``load_weights`` fills every one of them or fails, so a random init would
    only cost startup time. Buffers (the rotary tables) are computed on ``device``."""
    torch_default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = DecoderForCausalLM(cfg)
        model.to_empty(device=device)
        model.tie_weights()
        with torch.device(device):
            model.rotary = model.make_rotary()
    finally:
        torch.set_default_dtype(torch_default)
    # Rotary tables stay float32 (as in the reference); only parameters take the model dtype.
    model.load_weights(iterate_weights(cfg.path))
    return model.eval().requires_grad_(False)
