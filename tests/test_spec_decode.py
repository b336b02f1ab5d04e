"""Speculative decoding: drafts never change outputs (greedy: token for token, also
against transformers; seeded sampling: the same tokens as speculation off, and the
target distribution by a chi-square test), for single paths and trees, with chunked
prefill, prefix sharing, rollout chunks and several instances."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from conftest import make_engine as _engine
from conftest import run_waves as _run_waves
from references import chi_square_p

from seer_engine.core.draft import DraftTree, accept
from seer_engine.core.request import RequestStatus
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.model_executor import cpu_kernels
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import SamplingParams
from seer_engine.spec_decode import config as spec_config
from seer_engine.spec_decode import proposers
from seer_engine.spec_decode.budget import AdaptiveBudget, FixedBudget, StepCostModel
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.workloads.replay import TraceReplay

STEP_COST = [0.004, 2e-5]  # pinned, so whether drafts pay does not hang on this machine's load
TREE = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8}
PATH = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8, "multi_path": False}
SPECS = {
    "group-tree": TREE,
    "group-path": PATH,
    "group-adaptive": {"method": "group_suffix", "step_cost": STEP_COST},
    "suffix": {"method": "suffix", "budget": "fixed"},
    "ngram": {"method": "ngram", "budget": "fixed"},
}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def _waves(params: SamplingParams, prompt_len: int = 40):
    prompt = [(7 * i) % 13 + 3 for i in range(prompt_len)]  # repeats: n-gram lookups match
    return [[(f"w{w}-{g}", prompt, params, f"g{g}") for g in range(2)] for w in range(3)]


def test_draft_tree_layout_and_acceptance():
    # root -> 5 (0) -> 6 (1) -> 7 (3); root -> 8 (2); node 0 -> 9 (4)
    tree = DraftTree([5, 6, 8, 7, 9], [-1, 0, -1, 1, 0])
    tree.validate()
    assert tree.depths == [1, 2, 1, 3, 2] and not tree.is_path
    assert tree.row_mask_bits() == [0b1, 0b11, 0b111, 0b1001, 0b10111, 0b100011]
    assert tree.truncated(3) == DraftTree([5, 6, 8], [-1, 0, -1])
    # rows: root samples 5 -> node 0; row 1 samples 9 -> node 4; row 5 samples 2 (bonus)
    verdict = accept(tree, [5, 9, 0, 0, 0, 2])
    assert (verdict.nodes, verdict.tokens, verdict.rows) == ([0, 4], [5, 9, 2], [0, 1, 5])
    assert accept(tree, [4, 0, 0, 0, 0, 0]).tokens == [4]  # nothing matches: just the bonus
    assert accept(None, [11]).tokens == [11]
    with pytest.raises(ValueError, match="parents must come before"):
        DraftTree([1, 2], [1, -1]).validate()


def test_speculative_config_errors():
    assert SpeculativeConfig.parse('{"method": "ngram"}').method == "ngram"
    assert SpeculativeConfig.parse("") is None
    for bad, needle in (
        ("{", "not valid JSON"),
        ('{"method": "eagle"}', "method must be one of"),
        ('{"num_speculative_tokens": 64}', "1..63"),
        ('{"draft": 3}', "unknown --speculative-config keys"),
        ("[1]", "JSON object"),
        ('{"step_cost": [0, 1e-5]}', "step_cost must be"),
        ('{"step_cost": [0.01]}', "step_cost must be"),
    ):
        with pytest.raises(ValueError, match=needle):
            EngineConfig(speculative_config=bad)
    assert SpeculativeConfig.parse('{"step_cost": [0.01, 1e-5]}').step_cost == (0.01, 1e-5)


def test_step_cost_fit_ignores_one_slow_step():
    line = [(t, 0.004 + 2e-5 * t) for t in (1, 4, 16, 8, 32, 128, 16, 64, 256)]
    fit = StepCostModel.fit(line)
    assert fit.fixed_s == pytest.approx(0.004) and fit.per_token_s == pytest.approx(2e-5)
    # A busy machine slowed the largest step 3x: least squares would put the
    # intercept at zero (no draft would ever pay); the medians barely move.
    noisy = StepCostModel.fit(line[:-1] + [(256, 3 * (0.004 + 2e-5 * 256))])
    assert noisy.fixed_s == pytest.approx(0.004, rel=0.2)
    assert noisy.per_token_s == pytest.approx(2e-5, rel=0.5)


def test_adaptive_budget_follows_marginal_benefit():
    from seer_engine.core.request import Request

    budget = AdaptiveBudget(StepCostModel(fixed_s=0.004, per_token_s=2e-5))
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(), 8, seed=i) for i in range(4)]
    rates = {"r0": 0.9, "r1": 0.5, "r2": 0.1, "r3": 0.0}
    alloc = budget.allocate(reqs, lambda r: rates[r.request_id], 16)
    assert alloc[0] == 16 and alloc[0] > alloc[1] > alloc[2] and alloc[3] == 0
    # A big batch has already spent its step on many rows: fewer nodes pay.
    big = [Request(f"b{i}", [1, 2], SamplingParams(), 8, seed=i) for i in range(400)]
    assert budget.allocate(big, lambda r: 0.5, 16)[0] < budget.allocate(big[:4], lambda r: 0.5, 16)[0]
    assert FixedBudget().allocate(reqs, lambda r: 0.0, 5) == [5] * 4


def _one_node_at_a_time(
    rates: list[float], cost: StepCostModel, max_nodes: int, weights: list[float] | None = None, tree=False
) -> list[int]:
    """The marginal-benefit rule step by step: the best node left, while it pays (a
    row's tokens count ``weights[i]`` times in the step's worth; a tree's k-th node adds
    at least a * 0.63 * log2(k / (k - 1)))."""
    w = weights or [1.0] * len(rates)

    def worth(i: int, k: int) -> float:
        r = rates[i]
        tree_node = r if k == 1 else r * 0.63 * math.log2(k / (k - 1))
        return w[i] * max(r**k, tree_node if tree else 0.0)

    budgets = [0] * len(rates)
    tokens, seconds = float(sum(w)), cost.fixed_s + cost.per_token_s * len(rates)
    while True:
        open_rows = [i for i, r in enumerate(rates) if budgets[i] < max_nodes and r > 0]
        left = [(worth(i, budgets[i] + 1), -i) for i in open_rows]
        if not left:
            return budgets
        gain, i = max(left)[0], -max(left)[1]
        if gain * seconds <= cost.per_token_s * tokens:
            return budgets
        budgets[i] += 1
        tokens, seconds = tokens + gain, seconds + cost.per_token_s


@pytest.mark.parametrize("seed", range(6))
def test_adaptive_budget_takes_the_nodes_the_one_at_a_time_rule_takes(seed):
    rng = random.Random(seed)
    rows = rng.choice([1, 3, 16, 200])
    rates = [rng.choice([0.0, 0.5, rng.random(), 0.95]) for _ in range(rows)] + [0.7]
    cost = StepCostModel(fixed_s=rng.choice([7e-4, 0.015, 0.03]), per_token_s=rng.choice([1e-4, 1.5e-5]))
    cap = rng.choice([1, 8, 16])
    assert AdaptiveBudget(cost).allocate_rates(rates, cap) == _one_node_at_a_time(rates, cost, cap)
    weights = [rng.choice([1.0, 1.0, 2.0, 5.0]) for _ in rates]
    assert AdaptiveBudget(cost).allocate_rates(rates, cap, weights) == _one_node_at_a_time(
        rates, cost, cap, weights
    )
    assert AdaptiveBudget(cost, tree=True).allocate_rates(rates, cap, weights) == _one_node_at_a_time(
        rates, cost, cap, weights, tree=True
    )


def test_a_trees_later_nodes_are_worth_more_than_a_paths():
    """A tree's accepted tokens grow by TREE_DOUBLING times its first node's each time its
    budget doubles (the acceptance replay's fit); a path's by a^k. So a batch that drafts
    paths of 4 drafts trees of more nodes."""
    from seer_engine.spec_decode.budget import TREE_DOUBLING, node_worth

    rates = np.array([0.3, 0.54, 0.7, 0.95])
    tree, path = node_worth(rates, 16, tree=True), node_worth(rates, 16, tree=False)
    assert (tree >= path).all() and (np.diff(tree, axis=1) <= 1e-12).all()
    assert tree[1].cumsum()[[0, 1, 3, 7, 15]] == pytest.approx(0.54 * (1 + TREE_DOUBLING * np.arange(5)))
    assert tree[3] == pytest.approx(path[3])  # near-certain drafts: the path is worth more
    cost = StepCostModel(fixed_s=0.03, per_token_s=1.2e-5)
    paths = AdaptiveBudget(cost).allocate_rates([0.54] * 128, 16)
    trees = AdaptiveBudget(cost, tree=True).allocate_rates([0.54] * 128, 16)
    assert 0 < paths[0] < trees[0]


@pytest.mark.parametrize("spec, tree", [(TREE, True), (PATH, False), ({"method": "ngram"}, False)])
def test_the_engines_budget_values_its_drafts_as_trees_when_they_are(model, spec, tree):
    engine = _engine(model, {**spec, "budget": "adaptive", "step_cost": STEP_COST})
    assert engine.drafter.budget.tree is tree


def test_high_priority_requests_draft_deeper_and_take_nodes_from_the_rest():
    """Seer's λ: the engine's drafter weighs a high-priority request's nodes by the
    config's priority_weight, so at equal acceptance it drafts deeper, and the others,
    whose nodes now buy less of the step's worth, draft no deeper than before."""
    from seer_engine.core.request import Request
    from seer_engine.spec_decode.drafter import Drafter

    cost = StepCostModel(fixed_s=0.004, per_token_s=2e-5)
    drafter = Drafter(SpeculativeConfig(priority_weight=2.0), proposer=None, budget=AdaptiveBudget(cost))
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(), 8, seed=i, high_priority=i == 0) for i in range(40)]
    assert drafter.weight(reqs[0]) == 2.0 and drafter.weight(reqs[1]) == 1.0
    weighted = drafter.budget.allocate(reqs, lambda r: 0.6, 16, drafter.weight)
    alike = drafter.budget.allocate(reqs, lambda r: 0.6, 16)
    assert weighted[0] > alike[0] == alike[1] >= weighted[1]
    assert len(set(weighted[1:])) == 1


def test_a_draft_the_step_left_unverified_is_not_kept_past_a_budget_of_none():
    """A request the token budget left out keeps its draft until the drafter runs
    again; when the budget then gives it no nodes (drafts do not pay in this batch),
    the old draft goes too, rather than being verified against the budget's verdict."""
    from seer_engine.core.request import Request
    from seer_engine.spec_decode.drafter import Drafter

    never_pays = AdaptiveBudget(StepCostModel(fixed_s=1e-9, per_token_s=1.0))
    drafter = Drafter(SpeculativeConfig(), proposers.make_proposer(SpeculativeConfig()), never_pays)
    req = Request("r", [1, 2, 3], SamplingParams(), 8, seed=0)
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens - 1
    req.draft = DraftTree([4, 5], [-1, 0])
    drafter.propose([req])
    assert req.draft is None


def test_the_engine_keeps_a_chunks_priority_for_its_drafter(model):
    from seer_engine.engine.input_processor import CheckedRequest

    engine = _engine(model, SPECS["group-adaptive"])
    params = SamplingParams(max_tokens=4)
    for rid, high in (("a", True), ("b", False)):
        engine.add_checked(rid, CheckedRequest(None, [3, 4, 5], params, 4, []), high_priority=high)
    assert engine.scheduler.requests["a"].high_priority and not engine.scheduler.requests["b"].high_priority


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_outputs_unchanged(model, name):
    """Prefix sharing (n=3), chunked prefill (16-token budget), staggered siblings."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=3)
    waves = _waves(params)
    want = _run_waves(_engine(model, max_num_batched_tokens=16), waves)
    engine = _engine(model, SPECS[name], max_num_batched_tokens=16)
    assert _run_waves(engine, waves) == want
    stats = engine.scheduler.stats
    assert stats.draft_tokens_verified > 0
    if name.startswith("group"):  # siblings draft for each other
        assert stats.draft_tokens_accepted > 0 and stats.generated_tokens > stats.sampled_rows
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    if engine.drafter.proposer.name != "ngram":
        assert len(engine.drafter.proposer.trees) == 0, "finished groups free their trees"


@pytest.mark.parametrize("name", ["suffix", "ngram"])
def test_own_context_drafts_accept_repeats(model, name):
    """Trace replay emits a repeating response: drafting from a request's own tokens
    accepts, and a draft token counts only where it equals the trace's token."""
    pattern = [21, 22, 23, 24, 25, 26, 27]
    response = pattern * 6
    engine = _engine(model, SPECS[name])
    engine.token_source = TraceReplay({"r": response}, eos_token_id=min(engine.eos_token_ids))
    engine.add_request("r", [3, 4, 5], SamplingParams(temperature=0, max_tokens=len(response)))
    out = _run_waves(engine, [])
    assert out == {"r": [response]}
    stats = engine.scheduler.stats
    assert stats.draft_tokens_accepted >= len(response) // 2 and stats.steps < len(response) * 2 // 3


def test_greedy_equals_transformers(model, hf_model):
    prompt = [(5 * i) % 40 + 2 for i in range(24)]
    want = hf_greedy(hf_model(model), prompt, 32)
    engine = _engine(model, TREE)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    waves = [[("a", prompt, params, "g")], [("b", prompt, params, "g")]]
    assert _run_waves(engine, waves, head_start=20) == {"a": [want], "b": [want]}
    assert engine.scheduler.stats.draft_tokens_accepted >= 10


@pytest.mark.parametrize("name", ["group-tree", "group-path", "suffix"])
def test_seeded_sampling_unchanged(model, name):
    """Top-k 3 makes siblings share continuations, so tree drafts branch and accept. A
    response's own tree drafts from the repeating prompt, but random samples seldom
    repeat it, so there drafts are verified and mostly refused (its acceptance is
    checked on repeating responses: ``test_own_context_drafts_accept_repeats``)."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=24, seed=5, n=4, logprobs=2)
    waves = _waves(params, prompt_len=20)
    want = _run_waves(_engine(model), waves)
    engine = _engine(model, SPECS[name])
    assert _run_waves(engine, waves) == want
    stats = engine.scheduler.stats
    assert (stats.draft_tokens_verified if name == "suffix" else stats.draft_tokens_accepted) > 0
    if name == "group-tree":
        assert engine.drafter.stats.tree_drafts > 0 and engine.drafter.stats.moved_kv_slots > 0


def test_seer_rollout_across_instances_and_chunks(model):
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    prompts = [[(3 * i + j) % 30 + 2 for i in range(12 + 5 * j)] for j in range(3)]

    def run(policy: str, instances: int, chunk: int):
        groups = [Group(f"g{j}", p, params, 4, params.max_tokens) for j, p in enumerate(prompts)]
        spec = {"method": "group_suffix", "step_cost": STEP_COST} if policy == "seer" else None
        cfg = EngineConfig(model=str(model), num_kv_blocks=9, max_num_seqs=3, speculative_config=spec)
        pol = make_rollout_policy(policy)
        pool = EnginePool.start(cfg, instances, policy=pol)
        rollout = Dispatcher(pool, pol, chunk_tokens=chunk)
        result = rollout.run(groups)
        outs = {k: [s.output_token_ids for s in v] for k, v in result.samples.items()}
        return outs, pool, rollout

    want, _, _ = run("context", 1, 10_000)
    got, pool, rollout = run("seer", 2, 8)
    assert got == want
    assert pool.proposer is not None and len(pool.proposer.trees) == 0
    assert sum(i.engine.scheduler.stats.draft_tokens_accepted for i in pool) > 0
    assert rollout.counters.migrations > 0, "responses moved between instances and kept drafting"


class _LadderProposer(proposers.Proposer):
    """Drafts that know the greedy answer: at each depth a wrong sibling, then the true
    token, and the true token again alone to fill an odd budget. The accepted nodes sit
    at odd indices (their KV moves), and with 63 nodes the last one, verification row
    63 (the sign bit of the int64 tree mask), is on the accepted path: if it could not
    see itself, the bonus token after it would differ from greedy decoding."""

    name = "ladder"

    def __init__(self, want: list[int], vocab_size: int) -> None:
        self.want = want
        self.vocab_size = vocab_size
        self.sizes: list[int] = []

    def propose(self, request, budget: int, multi_path: bool) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        right = -1
        for token in self.want[request.num_output_tokens :]:
            if len(tokens) == budget:
                break
            if len(tokens) + 2 <= budget:
                tokens.append((token + 1) % self.vocab_size)
                parents.append(right)
            tokens.append(token)
            parents.append(right)
            right = len(tokens) - 1
        self.sizes.append(len(tokens))
        return DraftTree(tokens, parents)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_widest_draft_tree_keeps_greedy_output(model, backend):
    """A draft of 63 nodes (MAX_DRAFT_NODES) goes through a real step: verification rows
    0..63 use all 64 bits of the tree mask, and greedy output stays token for token (the
    Triton backend runs under the interpreter without a GPU)."""
    if backend == "cpu" and cpu_kernels.native() is None:
        pytest.skip("C++ CPU kernels not built or no AVX-512 on this CPU")
    prompt = [(5 * i) % 40 + 2 for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    reference = _engine(model, attention_backend=backend)
    want = _run_waves(reference, [[("r", prompt, params, "g")]])["r"][0]
    assert len(want) == 80
    proposer = _LadderProposer(want, reference.vocab_size)
    spec = {"method": "suffix", "budget": "fixed", "num_speculative_tokens": spec_config.MAX_DRAFT_NODES}
    engine = LLMEngine(
        EngineConfig(model=str(model), num_kv_blocks=256, speculative_config=spec, attention_backend=backend),
        proposer=proposer,
    )
    got = _run_waves(engine, [[("r", prompt, params, "g")]])
    assert got == {"r": [want]}
    assert proposer.sizes[0] == spec_config.MAX_DRAFT_NODES == 63
    stats = engine.scheduler.stats
    assert stats.draft_tokens_verified >= 63 and stats.draft_tokens_accepted >= 32
    assert engine.drafter.stats.moved_kv_slots >= 32
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


@pytest.mark.parametrize("name", ["group-tree", "group-path"])
def test_sampling_keeps_the_target_distribution(model, hf_model, name):
    """The first three tokens of 360 seeded samples (top-k 3, so 27 outcomes) against
    the exact distribution from transformers."""
    hf = hf_model(model)
    prompt = [11, 12, 13, 14, 15, 16]
    top_k, depth = 3, 3

    def dist(context: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([context])).logits[0, -1].float()
        values, ids = torch.topk(logits, top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        exact = {
            path + (t,): p * q for path, p in exact.items() for t, q in dist(prompt + list(path)).items()
        }
    engine = _engine(model, SPECS[name], max_num_seqs=128)

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_k=top_k, max_tokens=6, seed=seed, n=8)

    waves = [[(f"w{w}-{i}", prompt, params(1000 * w + i), "g") for i in range(15)] for w in range(3)]
    outs = _run_waves(engine, waves, head_start=2)
    samples = [tuple(t[:depth]) for per_request in outs.values() for t in per_request]
    assert len(samples) == 360
    assert engine.scheduler.stats.draft_tokens_accepted > 100
    counts = {path: 0 for path in exact}
    for s in samples:
        counts[s] += 1  # a KeyError would mean a token outside the target's support
    keys = list(exact)
    p = chi_square_p([counts[k] for k in keys], [exact[k] * len(samples) for k in keys])
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_chi_square_helper_rejects_a_wrong_distribution():
    rng = itertools.cycle([0, 0, 0, 1])  # 75% / 25%
    observed = [0, 0]
    for _ in range(400):
        observed[next(rng)] += 1
    assert chi_square_p(observed, [300.0, 100.0]) > 0.5
    assert chi_square_p(observed, [200.0, 200.0]) < 1e-6


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_adaptive_budget_profiles_within_a_short_models_positions(tiny_model, hf_model, backend):
    """The step-cost profile at start-up runs dummy requests of 64 context tokens plus up
    to 15 draft nodes; a model whose rotary table is shorter (max_position_embeddings 48)
    must still start, and its drafts still change no greedy token."""
    if backend == "cpu" and cpu_kernels.native() is None:
        pytest.skip("the C++ CPU kernels are not built here")
    short = tiny_model("llama", max_position_embeddings=48)
    kernels = dict(attention_backend=backend, cpu_kernels=backend == "cpu")
    engine = _engine(short, {"method": "group_suffix"}, **kernels)
    assert engine.drafter.budget.cost.per_token_s >= 0
    prompt = [(5 * i) % 40 + 2 for i in range(16)]
    want = hf_greedy(hf_model(short), prompt, 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    waves = [[("a", prompt, params, "g")], [("b", prompt, params, "g")]]
    assert _run_waves(engine, waves, head_start=12) == {"a": [want], "b": [want]}


@pytest.mark.parametrize("blocks,block_size", [(3, 16), (1, 16), (1, 8)])
def test_adaptive_budget_profiles_within_a_small_kv_cache(tiny_model, blocks, block_size):
    """The profile's dummy requests (64 context tokens plus up to 15 draft nodes) need 5
    blocks of 16: an engine with fewer (``rollout --rollout-mode --num-kv-blocks 3``, whose
    seer policy drafts with the adaptive budget) did not start ("a step cost model needs at
    least one (tokens, seconds) point"). It profiles what its cache holds; drafts change
    no greedy token."""
    model = tiny_model("qwen3")
    engine = _engine(model, {"method": "group_suffix"}, num_kv_blocks=blocks, block_size=block_size)
    assert engine.drafter.budget.cost.per_token_s >= 0
    tokens = blocks * block_size
    params = SamplingParams(temperature=0, max_tokens=tokens - 4, ignore_eos=True)
    waves = [[("a", [5, 6, 7, 8], params, "g")]]
    plain = _engine(model, num_kv_blocks=blocks, block_size=block_size)
    assert _run_waves(engine, waves) == _run_waves(plain, waves)
