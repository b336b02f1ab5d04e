"""Tiny random-weight Hugging Face checkpoints for demos and tests.

The engine must run without downloading anything, so every demo and test uses a
model made here: a genuine Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) written by
transformers itself, so that transformers can serve as the reference
implementation in correctness tests.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE",
    "DEFAULT_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "INIT_STD",
    "build_default_tokenizer",
    "make_tiny_model",
]

# arch name -> (config class name in transformers, architecture string)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

DTYPES = ("float32", "bfloat16", "float16")

# Same specials, in the same order (ids 0, 1, 2), as the shared trace tokenizer, so
# that code paths do not depend on which tokenizer a tiny model was built with.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

DEFAULT_VOCAB_SIZE = 1024
ROPE_THETA = 10000.0

# ChatML, as used by Qwen models: one block per message, then an open assistant
# block when the caller asks for a generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Standard deviation of the random weights (config.initializer_range).
# Why not the usual 0.02: with a 64-wide model the logits are then ~N(0, 0.16^2) and
# the best and second-best next tokens are close: median top-2 gap 0.03, and 1.6-3.3%
# of greedy steps have a gap below 1e-3, so tests comparing greedy tokens with an
# absolute tolerance trip over near-ties, and greedy output tends to loop on a few
# tokens. At 0.2 the logits spread 10x wider (std 1.6): median gap 0.27-0.35 and
# 0.13-0.39% of steps below 1e-3 (measured: qwen3 and llama, 1K and 17K vocab, 32
# random prompts x 48 greedy steps), while fp32 logits of two attention
# implementations still differ by only ~6e-6. Larger values (0.3, 0.5) barely
# lower the near-tie rate further but amplify rounding through the layers more.
INIT_STD = 0.2
# Biases and RMSNorm weights are initialised to 0 and 1 by transformers; we perturb
# them so that a weight loader that forgets them, or a layer that drops the qkv bias
# or uses the wrong norm weight, produces different logits and fails the tests.
NORM_WEIGHT_STD = 0.1

# Bumped whenever the maker's output changes, so cached default models are rebuilt.
FORMAT_VERSION = 1
_STAMP_FILE = "seer_tiny_model.json"
_INIT_LOCK = threading.Lock()


def _corpus_text() -> str:
    """Read the small original English corpus shipped with the package."""
    return (
        resources.files("seer_engine.model_executor").joinpath("tiny_corpus.txt").read_text(encoding="utf-8")
    )


def build_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """Train the built-in byte-level BPE (returns a `tokenizers.Tokenizer`).

    Training takes ~20 ms and is deterministic (ties between equally frequent
    pairs are broken by the trainer's fixed ordering), so nothing is cached.
    The full 256-byte alphabet is seeded, so any text round-trips.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2 import tokenization_qwen2

    tok = Tokenizer(models.BPE())
    # Qwen-style pipeline (NFC, split by transformers' Qwen2 pattern, byte-level).
    # transformers 5 loads qwen2 folders with Qwen2Tokenizer whatever
    # tokenizer_config.json says, and that class rebuilds this very pipeline around
    # our vocab and merges; using its own pattern keeps AutoTokenizer and
    # tokenizer.json in agreement for every arch.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(tokenization_qwen2.PRETOKENIZE_REGEX), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # 1, not 2: the corpus is only a few KB, and 2 stops near 800 tokens.
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_text().splitlines(keepends=True), trainer=trainer)
    return tok


def resolve_tokenizer_file(tokenizer: str | os.PathLike[str]) -> Path:
    """Accept a tokenizer.json file or a folder containing one."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return path


def read_tokenizer_file(path: str | os.PathLike[str]) -> Any:
    """The `tokenizers.Tokenizer` in a tokenizer.json; a file it cannot parse is a
    ValueError naming it (tokenizers raises a bare Exception)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{path} is not a tokenizer.json file: {e}") from None


def _special_ids(tok: Any) -> dict[str, int]:
    """Ids of the three required specials; a clear error if one is missing."""
    ids = {}
    for name in SPECIAL_TOKENS:
        tid = tok.token_to_id(name)
        if tid is None:
            raise ValueError(f"tokenizer lacks the special token {name!r}")
        ids[name] = tid
    return ids


def _write_tokenizer(
    out: Path, tokenizer: str | os.PathLike[str] | None, max_position_embeddings: int, add_bos: bool = False
) -> tuple[int, dict[str, int]]:
    """Write tokenizer.json + tokenizer_config.json; return (vocab size, special ids)."""
    from tokenizers import processors

    if tokenizer is None:
        tok = build_default_tokenizer()
        (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    else:
        src = resolve_tokenizer_file(tokenizer)
        tok = read_tokenizer_file(src)
        shutil.copyfile(src, out / "tokenizer.json")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids_present = set(tok.get_vocab(with_added_tokens=True).values())
    if ids_present != set(range(vocab_size)):
        # Embedding rows are indexed by id: a gap would leave rows no token uses.
        raise ValueError("tokenizer ids are not contiguous from 0")
    special = _special_ids(tok)
    if add_bos:
        bos = (IM_START, special[IM_START])
        tok.post_processor = processors.TemplateProcessing(single=f"{IM_START} $A", special_tokens=[bos])
        (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": IM_START if add_bos else None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tid): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for name, tid in special.items()
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
    return vocab_size, special


def _rope_parameters(rope_scaling: dict[str, Any] | None) -> tuple[dict, dict | None]:
    """Split user rope settings into transformers-5 `rope_parameters` and classic
    `rope_scaling` (which must carry `rope_type`; old configs used `type`)."""
    if rope_scaling is None:
        return {"rope_type": "default", "rope_theta": ROPE_THETA}, None
    scaling = dict(rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        raise ValueError("rope_scaling needs a 'rope_type' (or legacy 'type') key")
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    theta = float(scaling.pop("rope_theta", ROPE_THETA))
    return {**scaling, "rope_theta": theta}, scaling


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    arch: str = "qwen3",
    tokenizer: str | os.PathLike[str] | None = None,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    rope_scaling: dict[str, Any] | None = None,
    add_bos: bool = False,
) -> Path:
    """Write a random-weight checkpoint of `arch` to `out_dir` and return its path.

    `tokenizer` is a tokenizer.json (or a folder with one) to copy; None trains the
    built-in ~1K byte-level BPE. vocab_size always equals the tokenizer's size.
    Same arguments and seed give byte-identical weights. `intermediate_size`
    defaults to 3 * hidden_size, `head_dim` to hidden_size // num_heads. `add_bos`: the
    tokenizer prepends <|im_start|> as a BOS, as Llama's prepend theirs (their templates too).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(DTYPES)}")
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) is not divisible by num_heads "
                f"({num_heads}); pass head_dim explicitly"
            )
        head_dim = hidden_size // num_heads
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary embedding), got {head_dim}")
    if intermediate_size is None:
        intermediate_size = 3 * hidden_size

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {str(out)!r} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, special = _write_tokenizer(out, tokenizer, max_position_embeddings, add_bos)
    bos = special[IM_START] if add_bos else None
    eot, im_end = special[ENDOFTEXT], special[IM_END]

    rope_params, classic_scaling = _rope_parameters(rope_scaling)
    config_cls = getattr(transformers, ARCHITECTURES[arch][0])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_params,
        # By default the tokenizer has no BOS (ChatML style); config.eos is the document
        # end. Chat turns end with <|im_end|>, which generation_config adds below.
        bos_token_id=bos,
        eos_token_id=eot,
        pad_token_id=eot,
        architectures=[ARCHITECTURES[arch][1]],
    )
    if arch in ("qwen3", "llama", "mistral"):
        kwargs["head_dim"] = head_dim
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    if arch == "mistral":
        # Full attention everywhere: the engine's attention has no sliding window.
        kwargs["sliding_window"] = None
    config = config_cls(**kwargs)
    if arch == "qwen2":
        # Qwen2Config has no head_dim argument, but Qwen2Attention reads the
        # attribute; setting it lets head_dim differ from hidden/heads here too.
        config.head_dim = head_dim

    # Initialisation draws from torch's global generator: seed it, but restore the
    # caller's state afterwards, and serialise concurrent builds in one process so
    # two threads cannot interleave draws and get weights that depend on timing.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _perturb_biases_and_norms(model, seed)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    # Greedy/sampled chat generation must stop at the end of the assistant turn
    # (<|im_end|>) as well as at <|endoftext|>; config.eos_token_id stays a single
    # id (the tokenizer's eos) for readers that expect an int.
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eot, im_end], pad_token_id=eot)
    model.save_pretrained(out, safe_serialization=True)
    _add_classic_config_keys(out / "config.json", dtype, classic_scaling, head_dim)
    (out / _STAMP_FILE).write_text(
        json.dumps({"format_version": FORMAT_VERSION, "arch": arch, "seed": seed}) + "\n",
        encoding="utf-8",
    )
    return out


def _perturb_biases_and_norms(model: Any, seed: int) -> None:
    """Give biases N(0, INIT_STD) and norm weights 1 + N(0, NORM_WEIGHT_STD)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1_000_003)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + torch.randn(param.shape, generator=gen) * NORM_WEIGHT_STD)


def _add_classic_config_keys(
    path: Path, dtype: str, rope_scaling: dict[str, Any] | None, head_dim: int
) -> None:
    """Add pre-transformers-5 keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and
    `head_dim` so plain-dict readers (our loader, older transformers) need no
    knowledge of `rope_parameters`. transformers 5 accepts both styles."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["rope_theta"] = float(cfg.get("rope_parameters", {}).get("rope_theta", ROPE_THETA))
    cfg["rope_scaling"] = rope_scaling
    cfg["dtype"] = dtype
    cfg["torch_dtype"] = dtype
    cfg["head_dim"] = head_dim
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
