"""The C++ CPU kernels against the torch ops they replace, and the engine on both.

Float32 throughout. Element-wise kernels (RoPE, the KV store) must match bit for bit;
the GEMM, the norms and attention sum in another order than torch, so they match to
float32 rounding, and the engine must emit the same greedy tokens either way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_triton_kernels import (
    MIXED,
    SCALE,
    check_any_layout,
    dense_tree_attention,
    make_batch,
    make_tree_batch,
    strided,
)

from seer_engine import SamplingParams
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.model_executor import cpu_kernels
from seer_engine.model_executor.attention import get_attention_backend, torch_paged_attention, torch_store_kv
from seer_engine.model_executor.layers import Linear, RMSNorm, RotaryEmbedding, silu_and_mul

ops = cpu_kernels.native()
pytestmark = pytest.mark.skipif(ops is None, reason="C++ CPU kernels not built or no AVX-512 on this CPU")
F32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("out_features,in_features", [(48, 32), (50, 33), (17, 5), (100, 33), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    """Ragged last blocks (1-47 of 48 columns), tiles of 1-8 rows, with and without bias."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    expected = layer(x)
    layer.use_native(ops)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    wide = torch.randn(2, rows, in_features + 7, generator=gen)[..., :in_features]  # strided rows, 3-D
    torch.testing.assert_close(layer(wide), F.linear(wide, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_bfloat16_weights_are_the_rounded_weights(rows: int) -> None:
    """The opt-in bfloat16 packing: the product equals float32 math on the weights rounded
    to bfloat16 (activations and accumulation stay float32)."""
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(96, 50, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(50, 96, generator=gen))
        layer.bias.copy_(torch.randn(50, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    layer.use_native(ops, torch.bfloat16)
    assert layer._packed.dtype == torch.bfloat16
    expected = F.linear(x, layer.weight.to(torch.bfloat16).float(), layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_linear_rejects_bad_input() -> None:
    packed = cpu_kernels.pack_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(torch.randn(2, 8, dtype=torch.float64), packed, None, 20)
    with pytest.raises(RuntimeError, match="features"):
        ops.linear(torch.randn(2, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="blocks"):
        ops.linear(torch.randn(2, 8), packed, None, 60)


@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_norms_match_torch(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
    x, residual = torch.randn(tokens, 576, generator=gen), torch.randn(tokens, 576, generator=gen)
    plain, (added, new_residual) = norm(x), norm(x, residual)
    norm.use_native(ops)
    torch.testing.assert_close(norm(x), plain, **F32)
    x2, residual2 = x.clone(), residual.clone()
    out, out_residual = norm(x2, residual2)
    assert out.data_ptr() == x2.data_ptr() and out_residual.data_ptr() == residual2.data_ptr(), "in place"
    assert torch.equal(out_residual, new_residual)
    torch.testing.assert_close(out, added, **F32)


@pytest.mark.parametrize("width", [2 * 1536, 2 * 20])
def test_silu_and_mul_matches_torch(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=gen) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul(x), **F32)
    wide = torch.randn(3, width + 5, generator=gen)[:, :width]  # strided rows
    torch.testing.assert_close(ops.silu_and_mul(wide), silu_and_mul(wide), **F32)


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}]
)
def test_rope_is_bitwise_torch(scaling: dict | None) -> None:
    """In place on the q and k views of fused qkv rows, bit for bit what the torch path gives."""
    heads, kv_heads, dim = 6, 2, 32
    rotary = RotaryEmbedding(dim, 512, 10000.0, scaling)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 100, 7, 511, 3, 3, 64])
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    q_ref, k_ref = rotary.for_positions(positions, torch.float32)(q, k)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    rotary.use_native(ops)
    q_out, k_out = rotary.for_positions(positions, torch.float32)(q, k)
    assert q_out.data_ptr() == qkv.data_ptr(), "q is rotated in place"
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before), "values untouched"
    with pytest.raises(RuntimeError, match="position"):
        rotary.for_positions(torch.tensor([512]), torch.float32)(q[:1], k[:1])


def test_store_kv_matches_reference() -> None:
    query, key, value, kv_cache, meta = make_batch(MIXED, 4, 2, 32)
    expected = kv_cache.clone()
    torch_store_kv(key, value, expected, meta.slot_mapping)
    ops.store_kv(key, value, kv_cache, meta.slot_mapping)
    assert torch.equal(kv_cache, expected)
    with pytest.raises(RuntimeError, match="slot"):
        ops.store_kv(key[:1], value[:1], kv_cache, torch.tensor([kv_cache.shape[1] * kv_cache.shape[2]]))


def test_index_tensors_are_read_by_stride_and_sized() -> None:
    """Slot mappings and positions that are strided views are read by stride (they were
    read as flat arrays: wrong slots, wrong angles), and their lengths must match the rows
    (a short one was read past its end)."""
    query, key, value, kv_cache, meta = make_batch(MIXED, 4, 2, 32)
    expected = kv_cache.clone()
    torch_store_kv(key, value, expected, meta.slot_mapping)
    ops.store_kv(key, value, kv_cache, strided(meta.slot_mapping))
    assert torch.equal(kv_cache, expected)
    with pytest.raises(RuntimeError, match="one slot per key"):
        ops.store_kv(key, value, kv_cache, meta.slot_mapping[:-1])
    rotary = RotaryEmbedding(16, 64, 10000.0, None)
    qk = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([3, 60, 0, 17, 9])
    rotated = qk.clone()
    ops.rope_(rotated, positions, rotary.cos, rotary.sin, 2, 16)
    ops.rope_(qk, strided(positions), rotary.cos, rotary.sin, 2, 16)
    assert torch.equal(qk, rotated)
    with pytest.raises(RuntimeError, match="one position per row"):
        ops.rope_(qk, positions[:4], rotary.cos, rotary.sin, 2, 16)
    out = torch.empty_like(query)
    reqs = torch.arange(len(MIXED))
    with pytest.raises(RuntimeError, match="one contiguous word per query row"):
        ops.paged_attention(out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            torch.full((3,), -1), reqs, SCALE)  # fmt: skip


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 2, 16), (8, 1, 12), (4, 4, 8)])
def test_attention_matches_dense_reference(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    """Prefill spans (one past 64 rows, taken by the torch path), decode rows and random
    draft trees of up to 64 nodes over contexts crossing blocks, in one batch."""
    query, kv_cache, meta, trees = make_tree_batch(num_heads, num_kv_heads, block_size, torch.float32, seed=7)
    expected = dense_tree_attention(query, kv_cache, meta, trees, SCALE)
    actual = get_attention_backend("cpu").attend(query, kv_cache, meta, SCALE)
    torch.testing.assert_close(actual, expected, **F32)


def test_attention_on_strided_query_matches_torch_backend() -> None:
    """The query as the model passes it: a view of the fused qkv rows."""
    query, key, value, kv_cache, meta = make_batch(MIXED, 6, 2, 64)
    qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q = qkv[:, : 6 * 64].view(-1, 6, 64)
    expected = torch_paged_attention(query, kv_cache, meta, SCALE)
    torch.testing.assert_close(get_attention_backend("cpu").attend(q, kv_cache, meta, SCALE), expected, **F32)


def test_any_layout_of_query_key_value() -> None:
    check_any_layout("cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_tokens_do_not_depend_on_the_kernels(tiny_model, arch: str) -> None:
    """Greedy tokens with and without the C++ kernels: chunked prefill spans, prefix-cache
    hits, and (with speculation) verification rows of draft trees all go through them.
    Later waves of a group draft from earlier ones (a fixed budget keeps that independent
    of timing)."""
    path = tiny_model(arch)
    prompt = [(7 * i) % 13 + 3 for i in range(40)]
    params = SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True)
    spec = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8}
    outs = {}
    for native in (False, True):
        for speculative in (None, spec):
            engine = LLMEngine(
                EngineConfig(
                    model=str(path),
                    max_num_batched_tokens=24,
                    cpu_kernels=native,
                    speculative_config=speculative,
                )
            )
            assert engine.runner.backend.name == ("cpu" if native else "torch")
            done = {}
            for wave in range(3):
                engine.add_request(f"w{wave}", prompt[: 30 + 5 * wave], params, group_id="g")
                for _ in range(6):
                    done.update((o.request_id, o) for o in engine.step() if o.finished)
            while engine.has_unfinished_requests():
                done.update((o.request_id, o) for o in engine.step() if o.finished)
            outs[native, speculative is None] = {k: [c.token_ids for c in o.outputs] for k, o in done.items()}
            if speculative:
                assert engine.scheduler.stats.draft_tokens_accepted > 0, "drafts must be verified"
    assert outs[True, True] == outs[False, True]
    assert outs[True, False] == outs[False, False]


def test_bfloat16_weights_stay_close_to_float32(tiny_model) -> None:
    """The opt-in numerics: next-token log-probabilities after each prompt within 0.05 of
    the float32 engine's, on the same top tokens."""
    path = tiny_model("llama")
    prompts = [[(5 * i + j) % 200 + 3 for i in range(n)] for j, n in enumerate((3, 17, 40))]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    got = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model=str(path), cpu_weight_dtype=dtype))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{dtype}-{i}", prompt, params)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        got[dtype] = {o.request_id.split("-")[1]: o.outputs[0].logprobs[0] for o in outs}
    for i in got["float32"]:
        ref, low = got["float32"][i], got["bfloat16"][i]
        for token, entry in ref.items():
            assert token in low, "the same top tokens"
            assert abs(low[token].logprob - entry.logprob) < 0.05
    with pytest.raises(ValueError, match="cpu_weight_dtype"):
        EngineConfig(model=str(path), cpu_weight_dtype="float16")


class _CountingDecoder:
    """The model's C++ decoder, counting the steps it ran."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def run(self, *args):
        self.calls += 1
        return self.inner.run(*args)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("speculative", [False, True])
def test_native_decoder_equals_the_layer_by_layer_path(tiny_model, arch: str, speculative: bool) -> None:
    """Decode steps run every layer in one C++ call (``NativeDecoder``): the same ops in the
    same order as the Python layers, so tokens and log-probabilities match bit for bit.
    Prompts longer than 64 tokens make steps with long prefill spans, which stay on the
    layer-by-layer path; draft-tree verification rows go through the C++ decoder."""
    path = tiny_model(arch)
    prompts = [[(7 * i + j) % 13 + 3 for i in range(n)] for j, n in enumerate((90, 12, 33))]
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    spec = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8} if speculative else None
    outs = {}
    for native in (True, False):
        engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=128, speculative_config=spec))
        model = engine.runner.model
        assert model._native is not None
        model._native = _CountingDecoder(model._native) if native else None
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params, group_id="g")
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        outs[native] = {
            k: [(c.token_ids, [{t: e.logprob for t, e in d.items()} for d in c.logprobs]) for c in o.outputs]
            for k, o in done.items()
        }
        if native:
            assert 0 < model._native.calls < engine.scheduler.stats.steps, "both paths ran"
        if speculative:
            assert engine.scheduler.stats.draft_tokens_accepted > 0, "drafts must be verified"
    assert outs[True] == outs[False]


def test_qk_norm_models_keep_the_layer_by_layer_path(tiny_model) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model("qwen3"))))
    assert engine.runner.model._native is None
