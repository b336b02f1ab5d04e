"""Speculation stays exact where one verification step crosses a boundary: drafts that
know the target's tokens are accepted deep, so stop token ids, min_tokens, stop strings,
max_tokens and penalties fall inside a step, and every output (tokens, text, finish and
stop reasons, logprobs) equals speculation off. Sampled tokens under temperature,
top-k, top-p, min-p and penalties follow the exact target distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, run_waves
from references import chi_square_p

from seer_engine.core.draft import DraftTree
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.sampling_params import SamplingParams
from seer_engine.spec_decode import proposers

PROMPT = [(5 * i) % 40 + 2 for i in range(24)]  # its greedy output repeats tokens
SPEC = {"method": "suffix", "budget": "fixed", "num_speculative_tokens": 12}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


class _Oracle(proposers.Proposer):
    """Drafts a response's known continuation as a tree: before each true token a wrong
    sibling, in turn EOS, one of ``decoys`` (stop ids) and the true token + 1."""

    name = "oracle"

    def __init__(self, known: dict[str, list[int]], decoys: list[int]) -> None:
        self.known = known
        self.decoys = decoys
        self.turn = 0

    def propose(self, request, budget: int, multi_path: bool) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        right = -1
        for token in self.known[request.request_id][request.num_output_tokens :]:
            if len(tokens) + 2 > budget:
                break
            self.turn += 1
            wrong = [min(request.eos_token_ids), *self.decoys, token + 1][self.turn % (len(self.decoys) + 2)]
            if wrong != token:
                tokens.append(wrong)
                parents.append(right)
            tokens.append(token)
            parents.append(right)
            right = len(tokens) - 1
        return DraftTree(tokens, parents)


def _outputs(engine, params: SamplingParams) -> dict[str, tuple]:
    engine.add_request("r", PROMPT, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    (out,) = done
    ids = ["r"] if params.n == 1 else [f"r-{i}" for i in range(params.n)]
    return {
        rid: (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
        for rid, c in zip(ids, out.outputs)
    }


def _same_logprobs(a, b) -> bool:
    if a is None or b is None:
        return a is b

    def close(x, y) -> bool:
        return x.keys() == y.keys() and all(
            abs(x[t].logprob - y[t].logprob) < 1e-5 and x[t].rank == y[t].rank for t in x
        )

    return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))


GREEDY = {"temperature": 0.0, "max_tokens": 30, "logprobs": 2}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "min_p": 0.02, "seed": 3, "n": 2, "max_tokens": 30, "logprobs": 2}
# (params, what the oracle knows beyond them): stop ids and strings do not change the
# sampled tokens, so the oracle drafts on past where they end the output. "STOP" stands
# for three characters of the output's text from its ninth token on.
CASES = {
    "stop token id": ({"stop_token_ids": [1004]}, {"stop_token_ids": []}),
    "min_tokens over stop ids and EOS": ({"min_tokens": 5, "stop_token_ids": [352, 615]}, {}),
    "stop string": ({"stop": ["STOP"]}, {"stop": []}),
    "stop string kept": ({"stop": ["STOP"], "include_stop_str_in_output": True}, {"stop": []}),
    "max_tokens": ({"max_tokens": 13, "ignore_eos": True}, {}),
    "penalties": ({"repetition_penalty": 1.4, "presence_penalty": 0.6, "frequency_penalty": 0.4}, {}),
}


@pytest.mark.parametrize("base", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("case", list(CASES))
def test_boundaries_inside_a_verification_step(model, base, case):
    change, beyond = CASES[case]
    params = SamplingParams(**{**base, **change})
    if params.stop:
        tokens = _outputs(make_engine(model), params.clone(stop=[]))["r" if params.n == 1 else "r-0"][0]
        detok = make_engine(model).detokenizer
        text, start = detok.decode(tokens), len(detok.decode(tokens[:8]))
        params = params.clone(stop=[text[start : start + 3]])
        assert text.find(params.stop[0]) == start
    want = _outputs(make_engine(model), params)
    known = {rid: out[0] for rid, out in _outputs(make_engine(model), params.clone(**beyond)).items()}
    config = EngineConfig(model=str(model), num_kv_blocks=64, speculative_config=SPEC)
    engine = LLMEngine(config, proposer=_Oracle(known, [352, 615, 1004]))
    got = _outputs(engine, params)
    for rid, (*fields, logprobs, cumulative) in want.items():
        assert got[rid][:4] == tuple(fields) and _same_logprobs(got[rid][4], logprobs)
        assert got[rid][5] == pytest.approx(cumulative, abs=1e-4)
    stats = engine.scheduler.stats
    assert stats.generated_tokens >= stats.sampled_rows + len(want) * 3, "steps emitted several tokens"
    assert engine.drafter.stats.moved_kv_slots > 0


def test_penalized_sampling_keeps_the_target_distribution(model, hf_model):
    """The first three tokens of 360 seeded samples drafted by their siblings against the
    exact distribution from transformers' logits with penalties, temperature, min-p,
    top-k and top-p applied as vLLM does. The prompt's continuation repeats tokens, so
    a penalty within a verification step shifts it (total variation 0.44), and so does
    each of min-p, top-k and top-p."""
    hf = hf_model(model)
    temperature, top_k, top_p, min_p = 1.0, 5, 0.8, 0.3
    presence, frequency, repetition = 0.5, 1.0, 1.3

    def dist(path: tuple[int, ...]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(path)])).logits[0, -1].double()
        for t in set(PROMPT) | set(path):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(path):
            logits[t] -= frequency * path.count(t) + presence
        logits /= temperature
        probs = logits.softmax(-1)
        logits[probs < min_p * probs.max()] = float("-inf")
        logits[logits < logits.topk(top_k).values[-1]] = float("-inf")
        probs = logits.softmax(-1)
        kept: dict[int, float] = {}
        for t in probs.argsort(descending=True).tolist():
            if sum(kept.values()) >= top_p or probs[t] == 0:
                break
            kept[t] = float(probs[t])
        return {t: p / sum(kept.values()) for t, p in kept.items()}

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        exact = {path + (t,): p * q for path, p in exact.items() for t, q in dist(path).items()}
    params = {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "max_tokens": 4, "n": 8,
        "presence_penalty": presence, "frequency_penalty": frequency, "repetition_penalty": repetition,
    }  # fmt: skip
    waves = [
        [(f"w{w}-{i}", PROMPT, SamplingParams(**params, seed=1000 * w + i), "g") for i in range(15)]
        for w in range(3)
    ]
    spec = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8}
    engine = make_engine(model, spec, max_num_seqs=128)
    samples = [tuple(t[:3]) for outs in run_waves(engine, waves, head_start=2).values() for t in outs]
    assert len(samples) == 360 and engine.scheduler.stats.draft_tokens_accepted > 100
    counts = dict.fromkeys(exact, 0)
    for s in samples:
        counts[s] += 1  # a KeyError would mean a token outside the target's support
    p = chi_square_p(list(counts.values()), [exact[k] * len(samples) for k in counts])
    assert p > 1e-3, f"chi-square p = {p:.2e}"
