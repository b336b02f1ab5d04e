"""The engine against transformers: greedy tokens and logprobs must match."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from conftest import hf_greedy

from seer_engine import LLM, SamplingParams
from seer_engine.model_executor import cpu_kernels
from seer_engine.model_executor.model_config import ModelLoadError

NEW_TOKENS = 64


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """8+ prompts of different lengths; three share a long prefix so prefix caching hits."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    shared = tok(40)
    prompts = [tok(n) for n in (3, 9, 17, 31, 50, 70)]
    prompts += [shared + tok(5), shared + tok(12), shared[:33]]
    return prompts


@pytest.fixture(scope="module")
def references(tiny_model, hf_model):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_model(arch)
            model = hf_model(path)
            prompts = _prompts(model.config.vocab_size)
            cache[arch] = (path, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts])
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True, max_num_batched_tokens=2048),
        dict(enable_prefix_caching=False, max_num_batched_tokens=2048),
        dict(enable_prefix_caching=True, max_num_batched_tokens=16),  # forces chunked prefill
    ],
    ids=["prefix-cache", "no-prefix-cache", "chunked-prefill"],
)
def test_greedy_matches_transformers(arch, engine_args, references):
    path, prompts, expected = references(arch)
    llm = LLM(str(path), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, params)
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks, "every block must be free after the run"
    if engine_args["enable_prefix_caching"]:
        assert kv.prefix_hits > 0, "prompts sharing a prefix must hit the prefix cache"
    else:
        assert kv.prefix_hits == 0
    if engine_args["max_num_batched_tokens"] < max(map(len, prompts)):
        assert llm.engine.scheduler.stats.steps > NEW_TOKENS + len(prompts) // 2


def test_logprobs_match_transformers(tiny_model, hf_model):
    path = tiny_model("qwen3")
    model = hf_model(path)
    prompts = _prompts(model.config.vocab_size, seed=1)[:4]
    llm = LLM(str(path))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=5, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        sample = out.outputs[0]
        full = torch.tensor([prompt + sample.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(model(full).logits[0].float(), dim=-1)
        total = 0.0
        for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            row = ref[len(prompt) - 1 + step]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top_ids = torch.topk(row, 5).indices.tolist()
            assert set(top_ids) <= set(entry), "top-5 logprobs must be reported"
            for tid in top_ids:
                assert abs(entry[tid].logprob - row[tid].item()) < 1e-4
            total += entry[token].logprob
        assert sample.cumulative_logprob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("batched_tokens", [2048, 16], ids=["whole-prefill", "chunked-prefill"])
def test_prompt_logprobs_match_transformers(tiny_model, hf_model, batched_tokens):
    """prompt_logprobs (vLLM's layout: None, then each prompt token given those before it)
    equal transformers' at every position, also when the prompt is in the prefix cache
    (scoring computes it anyway) and when its prefill is chunked; a request that does not
    ask gets None."""
    path = tiny_model("qwen3")
    model = hf_model(path)
    prompts = _prompts(model.config.vocab_size, seed=2)
    llm = LLM(str(path), max_num_batched_tokens=batched_tokens)
    plain = llm.generate(prompts, SamplingParams(max_tokens=2))  # fills the prefix cache
    assert all(out.prompt_logprobs is None for out in plain)
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=2, prompt_logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row, token = ref[i - 1], prompt[i]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4, f"position {i}"
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = torch.topk(row, 3).indices.tolist()
            assert set(entry) == {token, *top}
            assert all(abs(entry[t].logprob - row[t].item()) < 1e-4 for t in top)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.pool.num_blocks


@pytest.mark.parametrize(
    "arch,kwargs",
    [
        ("llama", dict(tie_word_embeddings=True)),
        (
            "llama",
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            ),
        ),
        ("mistral", dict(head_dim=32, num_heads=4, hidden_size=96)),
        ("qwen3", dict(num_kv_heads=1)),
    ],
    ids=["tied-embeddings", "llama3-rope", "mistral-head-dim", "qwen3-mqa"],
)
def test_model_variants_match_transformers(arch, kwargs, tiny_model, hf_model):
    path = tiny_model(arch, **kwargs)
    model = hf_model(path)
    prompts = _prompts(model.config.vocab_size, seed=2)[::3]
    prompts.append(list(range(5, 5 + 150)))  # long enough for llama3 scaling to matter
    llm = LLM(str(path))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, min_tokens=24))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 24)


def test_sharded_checkpoint_loads_like_single_file(tiny_model, hf_model, tmp_path):
    path = tiny_model("qwen2")
    model = hf_model(path)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / f).write_bytes((path / f).read_bytes())
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompt = _prompts(model.config.vocab_size)[3]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    sharded = LLM(str(tmp_path)).generate([prompt], params)[0].outputs[0].token_ids
    assert sharded == hf_greedy(model, prompt, 16)


def test_weights_come_from_the_files_transformers_reads(tiny_model, hf_model, tmp_path):
    """model.safetensors is the checkpoint, as transformers reads it: other *.safetensors
    beside it (EMA weights under the same names, which were loaded over it; Mistral's
    consolidated.safetensors under its own, which were refused) are left alone. A folder
    with neither model.safetensors nor an index, whose files share a name, is refused."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_model("mistral"), folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v * 0.9 for k, v in weights.items()}, str(folder / "model_ema.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    save_file({"tok_embeddings.weight": embed}, str(folder / "consolidated.safetensors"))
    model = hf_model(folder)
    prompts = _prompts(model.config.vocab_size, seed=9)[1:3]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for prompt, out in zip(prompts, LLM(str(folder)).generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)
    (folder / "consolidated.safetensors").unlink()
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    with pytest.raises(ModelLoadError, match="'lm_head.weight' is in both model_ema.safetensors and weights"):
        LLM(str(folder))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_transformers(dtype, tiny_model, hf_model):
    """Low precision: rounding differs from the reference, so compare the first tokens."""
    path = tiny_model("qwen3")
    torch_dtype = getattr(torch, dtype)
    model = hf_model(path, torch_dtype)
    prompts = _prompts(model.config.vocab_size, seed=3)[:3]
    llm = LLM(str(path), dtype=dtype)
    assert llm.engine.runner.model.embed_tokens.weight.dtype == torch_dtype
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, min_tokens=4))
    agree = sum(o.outputs[0].token_ids[:2] == hf_greedy(model, p, 2) for p, o in zip(prompts, outs))
    assert agree >= 2


def test_qwen3_without_head_dim_key_uses_its_default(tiny_model, hf_model, tmp_path):
    """Qwen3Config defaults head_dim to 128, not hidden_size // num_heads (here 16)."""
    src = tiny_model("qwen3", head_dim=128)
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["head_dim"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    model = hf_model(tmp_path / "m")
    assert model.config.head_dim == 128
    prompts = _prompts(model.config.vocab_size, seed=4)[:2]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outs = LLM(str(tmp_path / "m")).generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)


def test_configs_the_decoder_does_not_implement_are_refused(tiny_model, tmp_path):
    """A switch the one decoder lacks fails at load, naming it, rather than running a
    different model: a non-SiLU activation, an unsupported RoPE scaling, and the 'cpu'
    attention backend (float32 kernels) under a half-precision model. A partial rotary
    factor beside a scaled RoPE (transformers' tables then cover part of a head, and its
    attention fails) ran silently with whole heads rotated, a sliding window of 0
    tokens (transformers fails on it) as full attention, and architectures naming
    another model than model_type (transformers runs model_type's: here a window) as
    the architecture's."""
    src = tiny_model("llama")
    cfg = json.loads((src / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    for i, (change, error, match) in enumerate(
        [
            ({"hidden_act": "gelu"}, ModelLoadError, "unsupported hidden_act 'gelu'"),
            ({"rope_scaling": yarn}, ModelLoadError, r"rope scaling type 'yarn' in .*config\.json"),
            ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ModelLoadError, "type 'dynamic'"),
            ({"rope_scaling": {"rope_type": "linear"}}, ModelLoadError, "linear rope scaling .* factor > 0"),
            ({"rope_scaling": {"rope_type": "llama3", "factor": 0}}, ModelLoadError, "factor > 0, got 0"),
            (
                {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
                ModelLoadError,
                r"partial_rotary_factor 0.5 with linear rope scaling in .*config\.json",
            ),
            (
                {"model_type": "mistral", "architectures": None, "sliding_window": 0},
                ModelLoadError,
                "sliding_window 0 in",
            ),
            (
                {"model_type": "mistral", "sliding_window": 8},
                ModelLoadError,
                "architecture 'LlamaForCausalLM' but model_type 'mistral' .MistralForCausalLM",
            ),
            (
                {"rope_scaling": {"type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.25},
                ModelLoadError,
                "partial_rotary_factor 0.25 with linear",
            ),
        ]
    ):
        folder = tmp_path / str(i)
        shutil.copytree(src, folder)
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(error, match=match):
            LLM(str(folder))
    match = "float32" if cpu_kernels.native() is not None else "C.. CPU kernels"
    with pytest.raises(ValueError, match=match):
        LLM(str(src), dtype="bfloat16", attention_backend="cpu")


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_config_keys_transformers_ignores_for_an_architecture_are_ignored(
    arch, tiny_model, hf_model, tmp_path
):
    """No "architectures" (transformers goes by model_type); attention_bias / mlp_bias,
    which Qwen2 and Mistral do not read; and (Qwen2) a sliding window that covers no
    layer (max_window_layers = all of them), so prompts longer than it still run."""
    src = tiny_model(arch)
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architectures"]
    cfg.update(attention_bias=True, mlp_bias=True)
    if arch == "qwen2":
        cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=cfg["num_hidden_layers"])
    (folder / "config.json").write_text(json.dumps(cfg))
    model = hf_model(folder)
    prompts = [p for p in _prompts(model.config.vocab_size, seed=5) if len(p) > 8][:2]
    assert prompts
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for prompt, out in zip(prompts, LLM(str(folder)).generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)


def _hf_window(hf_config) -> int | None:
    """The window transformers' attention applies on some layer (None: none does)."""
    kinds = getattr(hf_config, "layer_types", None)
    window = getattr(hf_config, "sliding_window", None)
    if hf_config.model_type == "llama":
        return None
    if kinds is not None and hf_config.model_type != "mistral":
        return window if "sliding_attention" in kinds else None
    return window


@pytest.mark.parametrize(
    ("arch", "change"),
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2,
                       layer_types=["full_attention", "sliding_attention"])),
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, num_hidden_layers=30,
                       max_window_layers="absent", layer_types="absent")),  # default 28: 2 slide
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers="absent",
                       layer_types="absent")),  # 2 layers < 28: none slides
        ("qwen3", dict(use_sliding_window=False, sliding_window=16,
                       layer_types=["sliding_attention", "sliding_attention"])),
        ("mistral", dict(sliding_window=None)),
        ("mistral", dict(sliding_window="absent")),  # transformers' default: 4096
        ("llama", dict(sliding_window=16)),  # Llama has none
        ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_theta=1e4,
                       rope_scaling=None)),
        ("llama", dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5)),
        ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0}, max_position_embeddings=256)),
        ("llama", dict(max_position_embeddings="absent")),
    ],
)  # fmt: skip
def test_config_reading_follows_transformers(arch, change, tiny_model, tmp_path):
    """Windows, RoPE and lengths read from config.json as transformers' config classes
    read them, defaults included (a key set to "absent" is removed)."""
    from transformers import AutoConfig

    from seer_engine.model_executor.model_config import ModelConfig

    folder = tmp_path / "m"
    shutil.copytree(tiny_model(arch), folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        cfg.pop(key, None)
        if value != "absent":
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(folder)
    ours = ModelConfig.from_pretrained(folder)
    assert ours.sliding_window == _hf_window(hf)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == hf.max_position_embeddings
    scaling = ours.rope_scaling or {}
    assert scaling.get("rope_type", scaling.get("type", "default")) == hf.rope_parameters["rope_type"]
    for key in ("factor", "original_max_position_embeddings"):
        if key in hf.rope_parameters:
            assert scaling[key] == hf.rope_parameters[key]


def test_a_layer_window_caps_the_context_and_shorter_prompts_match(tiny_model, hf_model, tmp_path):
    """layer_types slides one Qwen2 layer: the engine (full attention only) stays inside the
    window, refuses a longer prompt by name, and matches transformers within it."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_model("qwen2"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=24, max_window_layers=cfg["num_hidden_layers"])
    cfg["layer_types"] = ["full_attention"] * (cfg["num_hidden_layers"] - 1) + ["sliding_attention"]
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder))
    assert llm.engine.max_model_len == 24
    model = hf_model(folder)
    prompt = _prompts(model.config.vocab_size, seed=6)[2]  # 17 tokens
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(model, prompt, 6)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(5, 45))], params)


def test_llama3_rope_takes_a_top_level_original_length(tiny_model, hf_model, tmp_path):
    """A top-level original_max_position_embeddings (the Phi-3 layout) is the one
    transformers' rotary embedding uses for llama3 scaling, over the rope dict's own
    value or its default (max_position_embeddings); prompts past it must match."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    src = tiny_model("llama", head_dim=32, num_heads=2, max_position_embeddings=512)
    cfg = json.loads((src / "config.json").read_text())
    for i, rope in enumerate([scaling, {**scaling, "original_max_position_embeddings": 2048}]):
        folder = tmp_path / str(i)
        shutil.copytree(src, folder)
        change = dict(rope_scaling=rope, rope_parameters={**rope, "rope_theta": 10000.0})
        change["original_max_position_embeddings"] = 32
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        model = hf_model(folder)
        assert model.config.rope_parameters["original_max_position_embeddings"] == 32
        prompts = [list(range(5, 205)), list(range(300, 400))]
        params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
        for prompt, out in zip(prompts, LLM(str(folder)).generate(prompts, params)):
            assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("stored", ["both", "lm_head-only"])
def test_tied_embeddings_follow_the_tensors_the_checkpoint_holds(stored, tiny_model, hf_model, tmp_path):
    """tie_word_embeddings, but the checkpoint holds an LM head: transformers unties the
    two when both are stored with different values (the config is wrong, the tensors
    win), and ties the embedding to the head when only the head is stored."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_model("llama", tie_word_embeddings=True), folder)
    weights = load_file(str(folder / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = torch.randn(embed.shape, generator=torch.Generator().manual_seed(1)) * 0.2
    if stored == "lm_head-only":
        del weights["model.embed_tokens.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = hf_model(folder)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (stored == "lm_head-only")
    prompts = _prompts(model.config.vocab_size, seed=7)[:4]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    for kwargs in (dict(), dict(cpu_kernels=False, attention_backend="torch")):
        for prompt, out in zip(prompts, LLM(str(folder), **kwargs).generate(prompts, params)):
            assert out.outputs[0].token_ids == hf_greedy(model, prompt, 12)


def test_a_missing_kv_head_count_takes_the_architectures_default(tiny_model, hf_model, tmp_path):
    """Without num_key_value_heads transformers' MistralConfig has 8 KV heads (Qwen2's and
    Qwen3's 32, Llama's as many as query heads), not num_attention_heads."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_model("mistral", hidden_size=64, num_heads=16, num_kv_heads=8, head_dim=8), folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (folder / "config.json").write_text(json.dumps(cfg))
    model = hf_model(folder)
    assert model.config.num_key_value_heads == 8
    prompts = _prompts(model.config.vocab_size, seed=8)[:3]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for prompt, out in zip(prompts, LLM(str(folder)).generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)


def test_a_text_prompt_takes_the_tokenizers_bos_as_transformers_does(tiny_model, hf_model):
    """``LLM.generate`` on text tokenizes as ``tokenizer(text)`` does (with a Llama-style
    BOS) and then continues as transformers does; ``add_special_tokens=False`` leaves the
    BOS out."""
    from transformers import AutoTokenizer

    path = tiny_model("llama", add_bos=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    texts = ["Once upon a time", "The cat sat on"]
    llm = LLM(str(path))
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=8, min_tokens=8))
    for text, out in zip(texts, outs):
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_model(path), ids, 8)
    bare = llm.generate(texts[:1], SamplingParams(max_tokens=1, add_special_tokens=False))[0]
    assert bare.prompt_token_ids == tok(texts[0], add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="add_special_tokens must be a boolean"):
        SamplingParams(add_special_tokens=1)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 3.0},  # not a power of two: rounding shows
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ],
    ids=["default", "linear-3", "llama3"],
)  # fmt: skip
def test_rotary_tables_are_transformers_bit_for_bit(scaling, tiny_model, hf_model):
    """The cos/sin tables of every scaling the loader accepts, as transformers' rotary
    embedding computes them (linear scaling divides the frequencies, not the positions)."""
    from seer_engine.model_executor.layers import RotaryEmbedding

    path = tiny_model("llama", head_dim=32, num_heads=2, max_position_embeddings=4096, rope_scaling=scaling)
    model = hf_model(path)
    positions = torch.arange(4096)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(32, 4096, model.config.rope_parameters["rope_theta"], scaling)
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])


def test_eos_ids_are_generation_configs_where_it_names_them(tiny_model, hf_model, tmp_path):
    """transformers stops on generation_config.json's EOS ids and ignores a different
    one in config.json; the engine stopped on both, ending outputs transformers continues."""
    src, folder = tiny_model("llama"), tmp_path / "m"
    shutil.copytree(src, folder)
    prompts = _prompts(1024, seed=8)[:2]
    greedy = [hf_greedy(hf_model(src), p, 10) for p in prompts]
    gen_eos, cfg_eos = greedy[0][3], greedy[1][2]
    assert gen_eos not in greedy[1][:3] and cfg_eos not in greedy[0][:4]
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": cfg_eos}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [gen_eos], "pad_token_id": 0}))
    model = hf_model(folder)
    outs = LLM(str(folder)).generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :]
        assert out.outputs[0].token_ids == ref.tolist()
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 10]


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", "float32"), ("float32", "float16")])
def test_the_dtype_key_wins_over_legacy_torch_dtype(dtype, torch_dtype, tiny_model, tmp_path):
    """With both keys in config.json transformers 5 loads "auto" in "dtype"; the engine's
    "auto" took "torch_dtype", running another precision than the reference."""
    from transformers import AutoConfig

    from seer_engine.model_executor.model_config import ModelConfig

    folder = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "dtype": dtype, "torch_dtype": torch_dtype}))
    assert AutoConfig.from_pretrained(folder).dtype == getattr(torch, dtype)
    assert ModelConfig.from_pretrained(folder).dtype == getattr(torch, dtype)
