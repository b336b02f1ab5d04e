"""Presence, frequency and repetition penalties (vLLM's semantics) and OpenAI's logit_bias:
greedy output equals transformers (repetition, logit_bias as its sequence_bias) and a
PyTorch reference (presence, frequency) token for token;
drafts verified under penalties change neither greedy nor seeded outputs; a divided
rollout moving responses across instances and chunks gives the same tokens; the server
takes them and refuses values out of range."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import hf_greedy, make_engine, run_waves

from seer_engine.engine.config import EngineConfig
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

PROMPT = [(5 * i) % 40 + 2 for i in range(24)]
TREE = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def _reference(hf, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding with presence and frequency penalties, written out on transformers' logits."""
    tokens = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1])
            logits = (
                logits - frequency * counts[: logits.shape[-1]] - presence * (counts[: logits.shape[-1]] > 0)
            )
            out.append(int(logits.argmax()))
            tokens.append(out[-1])
    return out


def test_repetition_penalty_greedy_equals_transformers(model, hf_model):
    hf = hf_model(model)
    plain = hf_greedy(hf, PROMPT, 32)
    want = hf_greedy(hf, PROMPT, 32, repetition_penalty=1.8)
    assert want != plain, "the penalty must change this continuation for the test to mean anything"
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.8)
    assert run_waves(make_engine(model), [[("r", PROMPT, params, None)]]) == {"r": [want]}


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.7), (-0.5, 1.2)])
def test_presence_and_frequency_penalties_greedy_equal_the_reference(model, hf_model, presence, frequency):
    hf = hf_model(model)
    want = _reference(hf, PROMPT, 32, presence, frequency)
    assert want != _reference(hf, PROMPT, 32, 0.0, 0.0)
    params = SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
    )
    assert run_waves(make_engine(model), [[("r", PROMPT, params, None)]]) == {"r": [want]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_verified_under_penalties_change_no_output(model, temperature):
    """Siblings draft for each other; each draft node's row counts the draft tokens on its
    path, so verification samples what decoding without drafts would have."""
    params = SamplingParams(
        temperature=temperature, top_k=3, max_tokens=40, ignore_eos=True, seed=7,
        frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.1,
    )  # fmt: skip
    waves = [[(f"w{w}-{i}", PROMPT, params.clone(seed=7 + i), "g") for i in range(3)] for w in range(2)]
    want = run_waves(make_engine(model), waves, head_start=30)
    engine = make_engine(model, TREE)
    assert run_waves(engine, waves, head_start=30) == want
    assert engine.scheduler.stats.draft_tokens_accepted > 0


def test_divided_rollout_keeps_penalized_outputs(model):
    """A response's earlier chunks count as its output wherever its next chunk runs."""
    params = SamplingParams(temperature=1.0, max_tokens=36, ignore_eos=True, seed=3, frequency_penalty=1.0)
    prompts = [[(3 * i + j) % 30 + 2 for i in range(12 + 5 * j)] for j in range(3)]

    def run(policy: str, instances: int, chunk: int):
        groups = [Group(f"g{j}", p, params, 4, params.max_tokens) for j, p in enumerate(prompts)]
        cfg = EngineConfig(model=str(model), num_kv_blocks=9, max_num_seqs=3)
        pol = make_rollout_policy(policy)
        with EnginePool.start(cfg, instances, policy=pol) as pool:
            rollout = Dispatcher(pool, pol, chunk_tokens=chunk)
            result = rollout.run(groups)
        return {k: [s.output_token_ids for s in v] for k, v in result.samples.items()}, rollout

    want, _ = run("baseline", 1, 10_000)
    got, rollout = run("context", 2, 8)
    assert got == want and rollout.counters.migrations > 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 10]"),
        ("repetition_penalty", True, "repetition_penalty must be in (0, 10]"),
        ("logit_bias", {5: 100.5}, "logit_bias must map token ids >= 0 to numbers in [-100, 100]"),
        ("logit_bias", {-1: 1.0}, "logit_bias must map"),
        ("logit_bias", {"5": 1.0}, "logit_bias must map"),
        ("logit_bias", {5: float("inf")}, "logit_bias must map"),
        ("logit_bias", [5, 1.0], "logit_bias must map"),
        ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list of token ids >= 0"),
        ("allowed_token_ids", [3, -1], "allowed_token_ids must be a non-empty list"),
        ("allowed_token_ids", 5, "allowed_token_ids must be a non-empty list"),
    ],
)
def test_penalties_out_of_range_are_refused(field, value, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(message)


def test_logit_bias_greedy_equals_transformers(model, hf_model):
    """OpenAI's logit_bias adds to the raw logits; transformers' sequence_bias of single
    tokens is the same thing. One bias bans the greedy first token, another lifts a token."""
    hf = hf_model(model)
    plain = hf_greedy(hf, PROMPT, 32)
    lifted = next(t for t in range(3, 40) if t not in plain)
    bias = {plain[0]: -100.0, lifted: 4.0}
    want = hf_greedy(hf, PROMPT, 32, sequence_bias={(t,): b for t, b in bias.items()})
    assert want != plain and want[0] != plain[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias=bias)
    assert run_waves(make_engine(model), [[("r", PROMPT, params, None)]]) == {"r": [want]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_verified_under_logit_bias_change_no_output(model, temperature):
    params = SamplingParams(temperature=temperature, top_k=3, max_tokens=40, ignore_eos=True, seed=7)
    waves = [[(f"w{w}-{i}", PROMPT, params.clone(seed=7 + i), "g") for i in range(3)] for w in range(2)]
    unbiased = run_waves(make_engine(model), waves, head_start=30)
    counts = collections.Counter(t for outs in unbiased.values() for out in outs for t in out)
    common = counts.most_common(1)[0][0]
    bias = {common: -4.0, next(t for t in range(3, 60) if t not in counts): 3.0}
    waves = [[(rid, prompt, prm.clone(logit_bias=bias), g) for rid, prompt, prm, g in wave] for wave in waves]
    want = run_waves(make_engine(model), waves, head_start=30)
    assert want != unbiased, "the bias must change the output for the test to mean anything"
    engine = make_engine(model, TREE)
    assert run_waves(engine, waves, head_start=30) == want
    assert engine.scheduler.stats.draft_tokens_accepted > 0


def test_allowed_token_ids_greedy_equals_the_reference_and_drafts_change_nothing(model, hf_model):
    """vLLM's allowed_token_ids: greedy output is the argmax over the allowed tokens of
    transformers' logits at every step; seeded samples stay inside the set; drafts
    verified under the restriction change no output."""
    hf = hf_model(model)
    allowed = [5, 9, 13, 21, 34]
    tokens, want = list(PROMPT), []
    with torch.no_grad():
        for _ in range(24):
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            want.append(allowed[int(logits[allowed].argmax())])
            tokens.append(want[-1])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    assert run_waves(make_engine(model), [[("r", PROMPT, params, None)]]) == {"r": [want]}
    sampled = params.clone(temperature=1.0, seed=5, max_tokens=40)
    waves = [[(f"w{w}-{i}", PROMPT, sampled.clone(seed=5 + i), "g") for i in range(3)] for w in range(2)]
    plain = run_waves(make_engine(model), waves, head_start=30)
    assert {t for outs in plain.values() for out in outs for t in out} <= set(allowed)
    engine = make_engine(model, TREE)
    assert run_waves(engine, waves, head_start=30) == plain
    assert engine.scheduler.stats.draft_tokens_accepted > 0


def test_allowed_token_ids_of_stop_tokens_alone_win_over_min_tokens(model):
    """min_tokens bans stop tokens; where every allowed token is one, the allowed set wins:
    a token outside it is never sampled, and the response stops once min_tokens is met
    (as vLLM, a stop token before min_tokens does not stop it)."""
    engine = make_engine(model)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, min_tokens=4)
        params = params.clone(stop_token_ids=[9], allowed_token_ids=[9])
        assert run_waves(engine, [[("r", PROMPT, params, None)]]) == {"r": [[9] * 4]}
    both = params.clone(temperature=0, allowed_token_ids=[9, 7])
    out = run_waves(engine, [[("b", PROMPT, both, None)]])["b"][0]
    assert out[:4] == [7] * 4 and set(out) <= {7, 9}, out
