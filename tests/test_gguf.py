"""GGUF loading: a tiny model written as GGUF must come back as the same model.

Each test writes a tiny random-weight model as a GGUF itself (tests/gguf_writer.py,
llama.cpp's layout), lets seer_engine convert it, and compares with the original
safetensors folder: weights bit for bit, tokenizer, and greedy tokens.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="GGUF support needs the 'real' extra (gguf, accelerate)")
pytest.importorskip("accelerate", reason="GGUF support needs the 'real' extra (gguf, accelerate)")

from gguf_writer import quantize_roundtrip, write_gguf  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from seer_engine import LLM, SamplingParams  # noqa: E402
from seer_engine.engine.detokenizer import Detokenizer  # noqa: E402
from seer_engine.engine.llm_engine import resolve_model_path  # noqa: E402
from seer_engine.model_executor.gguf import GGUFError, convert_gguf, read_gguf_info  # noqa: E402
from seer_engine.model_executor.model_config import ModelConfig  # noqa: E402
from seer_engine.model_executor.model_source import ModelFetchError, resolve_model  # noqa: E402
from seer_engine.model_executor.tiny_model import make_tiny_model  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
PROMPTS = ["Once upon a time", "The quick brown fox jumps over", "1 + 2 = 3, 40 + 2 ="]
TEXTS = [*PROMPTS, "  leading spaces\nand lines\n\n", "café naïve — 12345", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SEER_ENGINE_CACHE", str(root))
    return root


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def greedy(model: str, max_tokens: int = 24) -> list[list[int]]:
    llm = LLM(model=model, num_kv_blocks=64, max_model_len=256, num_threads=1)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_is_the_safetensors_model(arch, tiny_model, tmp_path, cache):
    """Weights bit for bit, same config and tokenizer, same greedy tokens."""
    src = tiny_model(arch)
    gguf_file = write_gguf(src, tmp_path / f"tiny-{arch}.gguf")
    folder = resolve_model_path(str(gguf_file))
    assert folder.is_relative_to(cache)

    want, got = weights(src), weights(folder)
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name

    a, b = ModelConfig.from_pretrained(src), ModelConfig.from_pretrained(folder)
    fields = [f for f in vars(a) if f not in ("path", "rope_scaling")]
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}

    ta, tb = Detokenizer.from_pretrained(src), Detokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ta.encode(text) == tb.encode(text), text
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ta.apply_chat_template(chat) == tb.apply_chat_template(chat)

    assert greedy(str(src)) == greedy(str(gguf_file))


def test_converted_folder_loads_in_transformers(tiny_model, tmp_path):
    """The folder is a plain Hugging Face folder: transformers gives the original logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model("llama")
    folder = convert_gguf(write_gguf(src, tmp_path / "m.gguf"), tmp_path / "out")
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" in tok_cfg and not (folder / "chat_template.jinja").exists()
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    assert cfg["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == 1e-6 and cfg["bos_token_id"] is None
    assert "Converted by seer_engine" in (folder / "NOTICE").read_text()

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.encode(PROMPTS[1]) == AutoTokenizer.from_pretrained(src).encode(PROMPTS[1])
    ids = torch.tensor([tok.encode(PROMPTS[1])])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("kind", ["llama3", "linear", "yarn"])
def test_rope_scaling_survives_conversion(kind, tiny_model, tmp_path, monkeypatch):
    """llama.cpp keeps linear RoPE scaling as metadata and Llama 3's as a ``rope_freqs``
    tensor of per-frequency divisors; transformers' GGUF reader drops both, so the
    folder must get them back (or, for a kind the engine lacks, the file be refused)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from seer_engine.model_executor.layers import _llama3_inv_freq

    scaling = LLAMA3_ROPE if kind == "llama3" else {"rope_type": kind, "factor": 4.0}
    src = tiny_model("llama", rope_scaling=scaling if kind != "yarn" else None)
    write_header = gguf.GGUFWriter.write_header_to_file

    def with_scaling(self, *args, **kwargs):  # as llama.cpp's convert_hf_to_gguf.py writes it
        if kind == "llama3":
            inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
            self.add_tensor("rope_freqs.weight", (inv_freq / _llama3_inv_freq(inv_freq, scaling)).numpy())
        else:
            self.add_rope_scaling_type(gguf.RopeScalingType(kind))
            self.add_rope_scaling_factor(scaling["factor"])
        return write_header(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_scaling)
    gguf_file = write_gguf(src, tmp_path / "m.gguf")
    monkeypatch.undo()
    if kind == "yarn":
        with pytest.raises(GGUFError, match="m.gguf: RoPE scaling 'yarn' is not supported"):
            convert_gguf(gguf_file, tmp_path / "out")
        return
    folder = convert_gguf(gguf_file, tmp_path / "out")
    assert ModelConfig.from_pretrained(folder).rope_scaling == scaling
    ids = torch.tensor([list(range(5, 105))])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)
    assert greedy(str(folder), max_tokens=16) == greedy(str(src), max_tokens=16)


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
def test_quantized_gguf_dequantizes_exactly(tensor_type, tiny_model, tmp_path):
    """A quantized file gives back exactly the values it stores (gguf's own dequantizer as reference)."""
    src = tiny_model("llama")
    folder = convert_gguf(write_gguf(src, tmp_path / "m.gguf", tensor_type), tmp_path / "out")
    assert read_gguf_info(tmp_path / "m.gguf").quantization == tensor_type
    want, got = weights(src), weights(folder)
    changed = 0
    for name, tensor in want.items():
        expected = torch.from_numpy(quantize_roundtrip(tensor.numpy(), tensor_type))
        assert torch.equal(got[name], expected), name
        changed += not torch.equal(got[name], tensor)
    assert changed > 0  # the file really was quantized
    text = greedy(str(folder), max_tokens=8)
    assert all(len(t) == 8 for t in text)


def test_dtype_folders_and_cache_reuse(tiny_model, tmp_path, cache, capsys):
    src = tiny_model("qwen2")
    gguf_file = write_gguf(src, tmp_path / "m.gguf")
    f32 = resolve_model(str(gguf_file))
    assert "converting m.gguf" in capsys.readouterr().err
    assert resolve_model(str(gguf_file)) == f32 and resolve_model(str(gguf_file), "float32") == f32
    assert capsys.readouterr().err == ""  # cached: nothing converted again

    bf16 = resolve_model(str(gguf_file), "bfloat16")
    assert bf16 != f32 and "casting" in capsys.readouterr().err
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name, tensor in weights(f32).items():
        assert torch.equal(weights(bf16)[name], tensor.to(torch.bfloat16)), name
    assert ModelConfig.from_pretrained(bf16).dtype == torch.bfloat16

    direct = convert_gguf(gguf_file, tmp_path / "direct", "bfloat16")  # no float32 folder to cast
    assert all(torch.equal(weights(direct)[k], v) for k, v in weights(bf16).items())

    os.utime(gguf_file, ns=(1, 1))  # a changed file is converted again
    assert resolve_model(str(gguf_file)) != f32


def test_gguf_errors_are_clear(tmp_path, cache):
    import gguf

    with pytest.raises(GGUFError, match="GGUF file not found: .*missing.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(GGUFError, match="notes.gguf is not a GGUF file"):
        resolve_model(str(text))
    gpt2 = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(gpt2), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported; .*llama, mistral, qwen2"):
        resolve_model(str(gpt2))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gpt2.read_bytes()[:40])
    with pytest.raises(GGUFError, match="cannot read GGUF file .*cut.gguf"):
        resolve_model(str(truncated))
    with pytest.raises(GGUFError, match="cannot convert to dtype 'int8'"):
        convert_gguf(gpt2, tmp_path / "out", "int8")
    if os.path.exists("/proc/self/mem"):  # a file that cannot be read (EIO), even by root
        unreadable = tmp_path / "unreadable.gguf"
        unreadable.symlink_to("/proc/self/mem")
        with pytest.raises(GGUFError, match="cannot read GGUF file .*mem: Input/output error$"):
            resolve_model(str(unreadable))  # not blamed on the cache, which it never reached
    assert not cache.exists() or not any((cache / "gguf").glob("*"))  # nothing half-written left


def test_cli_reports_a_bad_gguf(tmp_path):
    """The CLI exits 2 with the message, not a traceback."""
    env = {**os.environ, "SEER_ENGINE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "seer_engine.entrypoints.cli", "generate", "--model",
         str(tmp_path / "nope.gguf"), "--prompt", "hi"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "GGUF file not found" in proc.stderr and "Traceback" not in proc.stderr


def test_a_killed_conversion_leaves_nothing_behind_after_the_next(tiny_model, tmp_path, cache):
    """A conversion killed half way (SIGKILL: no cleanup ran) leaves its temporary folder; the
    next conversion of that entry removes it instead of keeping a model's worth of disk forever."""
    gguf_file = write_gguf(tiny_model("qwen2"), tmp_path / "m.gguf")
    folder = resolve_model(str(gguf_file))
    left = folder.parent / f".{folder.name}.tmp-killed"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 1000)  # a half-written weight file
    stale = folder.parent / f".{folder.name}.stale-killed"
    stale.mkdir()
    shutil.rmtree(folder)
    assert resolve_model(str(gguf_file)) == folder
    assert not left.exists() and not stale.exists()
    assert weights(folder)  # rebuilt whole


def test_an_unwritable_cache_is_a_clear_error(tiny_model, tmp_path, monkeypatch):
    """A cache folder that is a file (or read-only, or full) names the path and the variable
    to set, from the library and from the CLI (exit 2, no traceback)."""
    gguf_file = write_gguf(tiny_model("qwen2"), tmp_path / "m.gguf")
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("SEER_ENGINE_CACHE", str(not_a_folder))
    with pytest.raises(
        ModelFetchError, match=rf"cannot write the model cache at {not_a_folder}.*SEER_ENGINE_CACHE"
    ):
        resolve_model(str(gguf_file))
    proc = subprocess.run(
        [sys.executable, "-m", "seer_engine.entrypoints.cli", "generate", "--model", str(gguf_file),
         "--prompt", "hi"],
        capture_output=True, text=True, env=dict(os.environ), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "cannot write the model cache" in proc.stderr and "Traceback" not in proc.stderr


def _files_capped_at(limit: int) -> Callable[[], None]:
    """A child's ``preexec_fn``: writes past ``limit`` bytes fail (EFBIG) as on a full disk."""

    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return cap


def test_a_full_disk_is_a_clear_error(tiny_model, tmp_path, cache):
    """Writing the weights fails (disk full) while converting and while casting: the CLI says
    which cache could not be written, exit 2, no traceback, and nothing is left half-built."""
    gguf_file = write_gguf(tiny_model("qwen2"), tmp_path / "m.gguf")
    resolve_model(str(gguf_file), "float32")  # a float32 folder to cast from
    fresh = write_gguf(tiny_model("llama"), tmp_path / "fresh.gguf")
    for model, dtype in ((fresh, "float32"), (gguf_file, "bfloat16")):
        proc = subprocess.run(
            [sys.executable, "-m", "seer_engine.entrypoints.cli", "generate", "--model", str(model),
             "--dtype", dtype, "--prompt", "hi"],
            capture_output=True, text=True, env=dict(os.environ), timeout=300,
            preexec_fn=_files_capped_at(200_000),
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "cannot write the model cache" in proc.stderr and "Traceback" not in proc.stderr
    assert not [p for p in (cache / "gguf").iterdir() if p.name.startswith(".") and ".tmp-" in p.name]


def test_a_disk_that_fills_while_the_tokenizer_is_saved_is_a_clear_error(tmp_path, cache):
    """The Rust tokenizer reports a failed write as a plain Exception: the CLI still says which
    cache could not be written, exit 2, no traceback. The weights here are smaller than the
    tokenizer, so the cap falls between them."""
    small = make_tiny_model(
        tmp_path / "small", arch="llama", hidden_size=8, num_heads=2, num_kv_heads=1, num_layers=1,
        tie_word_embeddings=True,
    )  # fmt: skip
    gguf_file = write_gguf(small, tmp_path / "small.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "seer_engine.entrypoints.cli", "generate", "--model", str(gguf_file),
         "--prompt", "hi"],
        capture_output=True, text=True, env=dict(os.environ), timeout=300,
        preexec_fn=_files_capped_at(50_000),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "cannot save the tokenizer" in proc.stderr and "Traceback" not in proc.stderr


def test_serving_one_dtype_converts_only_that_one(tiny_model, tmp_path, cache, monkeypatch):
    """``serve --dtype bfloat16`` on an empty cache: the server's tokenizer and the KV pool's
    sizing read the bfloat16 folder the engine loads; no float32 one is converted for them."""
    from seer_engine.engine.async_engine import AsyncEngine
    from seer_engine.engine.config import EngineConfig
    from seer_engine.entrypoints.openai.api_server import ServerSettings, build_engine_client
    from seer_engine.kv_connector.factory import kv_pool_for
    from seer_engine.rollout.config import RolloutConfig

    gguf_file = write_gguf(tiny_model("qwen2"), tmp_path / "m.gguf")
    config = EngineConfig(model=str(gguf_file), dtype="bfloat16")
    monkeypatch.setattr(AsyncEngine, "start", lambda self, timeout=None: self)  # builds no engine
    uses = {
        "kv pool": lambda: kv_pool_for("local", config, capacity_gib=0.01).close(),
        "engine": lambda: build_engine_client(config, ServerSettings(["m"])),
        "rollout": lambda: build_engine_client(
            config, ServerSettings(["m"], rollout=RolloutConfig(rollout_mode=True))
        ),
    }
    for name, use in uses.items():
        shutil.rmtree(cache, ignore_errors=True)
        use()
        built = [p.name.rsplit("-", 1)[1] for p in (cache / "gguf").iterdir() if not p.name.startswith(".")]
        assert built == ["bfloat16"], name
