"""Tests of the tiny random-weight model maker (every other test builds on it)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from seer_engine.model_executor import tiny_model
from seer_engine.model_executor.model_source import tiny_model_dir
from seer_engine.model_executor.tiny_model import (
    ARCHITECTURES,
    build_default_tokenizer,
    make_tiny_model,
)
from seer_engine.model_executor.tiny_model_cli import add_cli

transformers.logging.set_verbosity_error()

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shared trace folder sits beside the project (see DESIGN.md).
SHARED_TOKENIZER = REPO_ROOT.parent / "shared" / "traces" / "bpe32k-tokenizer.json"

# Small enough that the whole file runs in a few seconds.
SMALL = dict(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_arch_loads_in_transformers(tmp_path: Path, arch: str) -> None:
    out = make_tiny_model(tmp_path / arch, arch=arch, **SMALL)
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file(), name
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == ARCHITECTURES[arch][1]
    assert len(tok) == model.config.vocab_size == tiny_model.DEFAULT_VOCAB_SIZE

    cfg = json.loads((out / "config.json").read_text())
    # Plain-dict readers find the classic keys next to transformers 5's rope_parameters.
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert cfg["head_dim"] == 8 and cfg["architectures"] == [ARCHITECTURES[arch][1]]
    assert cfg["eos_token_id"] == tok.eos_token_id == 0
    assert cfg["pad_token_id"] == tok.pad_token_id == 0
    assert cfg["bos_token_id"] is None and tok.bos_token_id is None
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, tok.convert_tokens_to_ids("<|im_end|>")]

    # transformers' tokenizer class (Qwen2Tokenizer for qwen2) agrees with tokenizer.json.
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "<|im_start|>user\nWhat is 12 * 34? Café, naïve.<|im_end|>\n"
    assert tok(text).input_ids == raw.encode(text).ids

    ids = torch.tensor([tok("The river bends twice.").input_ids])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_arch_specific_weights(tmp_path: Path) -> None:
    q3 = _weights(make_tiny_model(tmp_path / "q3", arch="qwen3", **SMALL))
    q2 = _weights(make_tiny_model(tmp_path / "q2", arch="qwen2", **SMALL))
    ll = _weights(make_tiny_model(tmp_path / "ll", arch="llama", **SMALL))
    assert "model.layers.0.self_attn.q_norm.weight" in q3
    assert "model.layers.0.self_attn.q_proj.bias" not in q3
    assert "model.layers.0.self_attn.q_proj.bias" in q2
    assert not any(k.endswith(("bias", "q_norm.weight")) for k in ll)
    # Biases and norm weights are random too, so a loader that drops them is caught.
    assert q2["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    assert not torch.allclose(q3["model.norm.weight"], torch.ones(32))


def test_default_tokenizer_round_trip_and_determinism(tmp_path: Path) -> None:
    a = build_default_tokenizer()
    assert a.get_vocab_size() == 1024
    assert [a.token_to_id(t) for t in tiny_model.SPECIAL_TOKENS] == [0, 1, 2]
    for text in ["Hello, world!", "  two  spaces\n\nand 3.14159", "émoji 🙂 and 中文", ""]:
        assert a.decode(a.encode(text).ids, skip_special_tokens=False) == text
    # Common English is compressed, not spelled out byte by byte.
    assert len(a.encode("The library opens every morning.").ids) < 12

    # Same bytes in a fresh process (Rust hash seeds differ between processes).
    code = (
        "from seer_engine.model_executor.tiny_model import build_default_tokenizer as b;"
        "print(b().to_str(), end='')"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    ).stdout
    assert other == a.to_str() == build_default_tokenizer().to_str()

    out1 = make_tiny_model(tmp_path / "a", **SMALL)
    out2 = make_tiny_model(tmp_path / "b", **SMALL)
    assert (out1 / "tokenizer.json").read_bytes() == (out2 / "tokenizer.json").read_bytes()


@pytest.mark.skipif(not SHARED_TOKENIZER.is_file(), reason="shared trace tokenizer not present")
def test_shared_trace_tokenizer(tmp_path: Path) -> None:
    out = make_tiny_model(tmp_path / "m", tokenizer=SHARED_TOKENIZER, **SMALL)
    size = Tokenizer.from_file(str(SHARED_TOKENIZER)).get_vocab_size()
    # The traces README calls it "32k", but the file holds 17,455 tokens (ids 0..17454).
    assert size == 17455
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == size
    assert (out / "tokenizer.json").read_bytes() == SHARED_TOKENIZER.read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == size and tok.eos_token_id == 0
    assert _weights(out)["model.embed_tokens.weight"].shape == (size, 32)


def test_seed_determinism(tmp_path: Path) -> None:
    a = _weights(make_tiny_model(tmp_path / "a", seed=7, **SMALL))
    b = _weights(make_tiny_model(tmp_path / "b", seed=7, **SMALL))
    c = _weights(make_tiny_model(tmp_path / "c", seed=8, **SMALL))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])


def test_logits_are_not_flat(tmp_path: Path) -> None:
    """The larger initializer keeps greedy decoding away from near-ties."""
    out = make_tiny_model(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(3, 1024, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top2 = model(ids).logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median() > 0.1
    assert (gaps < 1e-3).float().mean() < 0.02


def test_chat_template(tmp_path: Path) -> None:
    out = make_tiny_model(tmp_path / "m", **SMALL)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tok(text).input_ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, <|im_end|> are single tokens
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["model_max_length"] == 4096 and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_options(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    out = make_tiny_model(
        tmp_path / "m",
        arch="llama",
        rope_scaling=rope,
        dtype="bfloat16",
        tie_word_embeddings=True,
        head_dim=16,
        intermediate_size=40,
        max_position_embeddings=512,
        **SMALL,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == rope and cfg["rope_theta"] == 10000.0
    assert cfg["rope_parameters"] == {**rope, "rope_theta": 10000.0}
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert cfg["head_dim"] == 16 and cfg["intermediate_size"] == 40
    weights = _weights(out)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.model.rotary_emb.rope_type == "llama3"

    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make_tiny_model(tmp_path / "x", num_heads=4, num_kv_heads=3)
    with pytest.raises(FileNotFoundError):
        make_tiny_model(tmp_path / "x", tokenizer=tmp_path / "missing.json")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seer_engine")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = _parser()
    out = tmp_path / "cli"
    args = parser.parse_args(
        [
            "make-tiny-model",
            str(out),
            "--arch",
            "qwen2",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--seed",
            "3",
        ]
    )
    args.func(args)
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_key_value_heads"] == 1

    for bad in (
        ["make-tiny-model", str(out), "--arch", "gpt2"],
        ["make-tiny-model", str(out), "--tokenizer", str(tmp_path / "nope.json")],
        ["make-tiny-model", str(out), "--layers", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(bad)
        assert exc.value.code == 2
    assert "nope.json" in capsys.readouterr().err

    args = parser.parse_args(["make-tiny-model", str(tmp_path / "bad"), "--hidden", "30", "--heads", "4"])
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    assert exc.value.code == 2 and "divisible" in capsys.readouterr().err

    not_json = tmp_path / "notes.json"
    not_json.write_text("not a tokenizer\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for bad, message in (
        ([str(tmp_path / "tok"), "--tokenizer", str(not_json)], f"{not_json} is not a tokenizer.json file"),
        ([str(a_file)], f"OUT {str(a_file)!r} is a file, not a folder"),
    ):
        args = parser.parse_args(["make-tiny-model", *bad])
        with pytest.raises(SystemExit) as exc:
            args.func(args)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and "Traceback" not in err


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


def test_tiny_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEER_ENGINE_CACHE", str(tmp_path / "cache"))
    # Racing builders (threads here; processes take the same lock) must all end up
    # with the one complete folder and leave no temporary folders behind.
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: tiny_model_dir(), range(3)))
    cache = tmp_path / "cache"
    expected = cache / "tiny-qwen3"
    assert outs == [expected] * 3
    assert _entries(cache) == ["tiny-qwen3"]
    cfg = json.loads((expected / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["hidden_size"] == 64
    transformers.AutoModelForCausalLM.from_pretrained(expected)

    # Same weights as an explicit qwen3/seed-0 build, and the caller's RNG is untouched.
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    ref = make_tiny_model(tmp_path / "ref")
    assert torch.equal(torch.rand(3), before)
    a, b = _weights(expected), _weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A folder left by an older maker version is rebuilt, and what a killed build left
    # behind is removed with it; a current one is reused.
    stamp = expected / "seer_model_source.json"
    stamp.write_text(json.dumps({"format_version": -1}))
    (cache / ".tiny-qwen3.tmp-killed").mkdir()
    assert tiny_model_dir() == expected
    assert json.loads(stamp.read_text())["format_version"] == tiny_model.FORMAT_VERSION
    mtime = (expected / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir() == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == mtime
    assert _entries(cache) == ["tiny-qwen3"]
