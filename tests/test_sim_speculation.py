"""The modeled drafters size drafts as the engine's drafter does: each response learns
its own estimate from its verdicts since its chunk began, and the budget follows it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from seer_engine.core.draft import Acceptance
from seer_engine.sim.acceptance import AcceptanceModel
from seer_engine.sim.speculation import BandShape, SimSpeculation
from seer_engine.spec_decode.budget import AdaptiveBudget, StepCostModel
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.drafter import Drafter

STEP = StepCostModel(fixed_s=0.03, per_token_s=0.0005)  # a GPU-like step: drafts pay in small batches


def _model(low: float, high: float) -> AcceptanceModel:
    """One stage; rows no sibling covers accept ``low`` per node, covered rows ``high``
    (geometrically along the draft)."""

    def row(p: float) -> tuple[float, ...]:
        return tuple(sum(p**d for d in range(1, b + 1)) for b in (1, 2, 4, 8, 16))

    budgets = (1, 2, 4, 8, 16)
    return AcceptanceModel(budgets, (0.0, 1.0), ((row(low), row(high)),), coverage_edges=(0.0, 0.5, 1.0))


def _rates(spec: SimSpeculation, rows: int, stage: float, coverage, step, chunk_tokens: float = 0.0):
    """One band of ``rows`` decoding rows (normal priority)."""
    return spec.band_rates((BandShape(rows, stage, coverage),), step, chunk_tokens)[0]


def test_rows_start_each_chunk_at_the_prior_and_learn_their_own_rate():
    spec = SimSpeculation(_model(0.05, 0.9), "adaptive", 16)
    uncovered, covered, mixed = (1.0, 0.0), (0.0, 1.0), (0.5, 0.5)
    at_prior = _rates(spec, 8, 0.5, mixed, STEP, 0.0)[0]
    for coverage in (uncovered, covered):  # a fresh chunk: every row drafts at the prior
        assert _rates(spec, 8, 0.5, coverage, STEP, 0.0)[0] == pytest.approx(at_prior)
    # Rows that learnt their drafts fail draft less, rows that learnt they land draft more.
    fresh = _rates(spec, 8, 0.5, uncovered, STEP, 0.0)[0]
    failed = _rates(spec, 8, 0.5, uncovered, STEP, 200.0)[0]
    landed = _rates(spec, 8, 0.5, covered, STEP, 200.0)[0]
    assert failed < fresh < landed
    # In a mixed batch the covered half gets the deeper drafts, so it accepts more per
    # node than a batch where every row drafted alike.
    drafted, accepted, _ = _rates(spec, 8, 0.5, mixed, STEP, 200.0)
    alike_drafted, alike_accepted, _ = _rates(spec, 8, 0.5, mixed, STEP, 0.0)
    assert accepted / drafted > alike_accepted / alike_drafted


def test_a_fixed_budget_drafts_in_full_whatever_was_learnt():
    spec = SimSpeculation(_model(0.05, 0.9), "fixed", 8)
    for chunk_tokens in (0.0, 500.0):
        assert _rates(spec, 4, 0.5, (0.5, 0.5), STEP, chunk_tokens)[0] == 8


def _engine_drafting(p: float, rows: int, step: StepCostModel, rounds: int, batches: int) -> list[float]:
    """Mean draft nodes per row at each step of a chunk, from the engine's own Drafter and
    AdaptiveBudget over ``batches`` batches of ``rows`` responses whose draft nodes each
    hold with probability ``p`` once the one before them did."""
    totals = [0.0] * rounds
    rng = random.Random(7)
    for batch in range(batches):
        drafter = Drafter(SpeculativeConfig(), proposer=None, budget=AdaptiveBudget(step, tree=True))
        requests = [SimpleNamespace(sequence_id=f"{batch}/{i}") for i in range(rows)]
        for r in range(rounds):
            for req, k in zip(requests, drafter.budget.allocate(requests, drafter.acceptance, 16)):
                totals[r] += k / (rows * batches)
                if k:
                    m = 0
                    while m < k and rng.random() < p:
                        m += 1
                    drafter._learn(req, Acceptance(list(range(m)), [0] * (m + 1), [0] * (m + 1), k))
    return totals


def test_the_modeled_drafting_follows_the_engines_drafter_through_a_chunk():
    """Near the budget's threshold the responses' estimates spread: the ones whose drafts
    failed stop drafting and never learn again in the chunk, so a batch drafts less and
    less as its chunk goes on, as the engine's drafter does."""
    p, rows, rounds, step = 0.45, 4, 60, StepCostModel(7e-4, 1e-4)
    engine = _engine_drafting(p, rows, step, rounds, batches=300)
    spec = SimSpeculation(_model(p, 0.9), "adaptive", 16)
    modeled, chunk_tokens = [], 0.0
    for _ in range(rounds):
        rates = _rates(spec, rows, 0.5, (1.0, 0.0), step, chunk_tokens)
        modeled.append(rates.drafted)
        chunk_tokens += 1.0 + rates.accepted

    def window(xs, start):
        return sum(xs[start : start + 10]) / 10

    assert window(engine, 50) < 0.6 * window(engine, 0), "the engine's drafting dies down in the chunk"
    for start in range(0, rounds, 10):
        assert window(modeled, start) == pytest.approx(window(engine, start), rel=0.15, abs=0.05), (
            start,
            [round(x, 2) for x in engine[::5]],
            [round(x, 2) for x in modeled[::5]],
        )


def test_a_segment_of_steady_drafting_ends_where_the_rates_change():
    spec = SimSpeculation(_model(0.45, 0.9), "adaptive", 16)
    step = StepCostModel(7e-4, 1e-4)
    rates = _rates(spec, 4, 0.5, (1.0, 0.0), step, 0.0)
    assert 0 < rates.steady_tokens < 100
    assert _rates(spec, 4, 0.5, (1.0, 0.0), step, rates.steady_tokens * 0.999)[:2] == rates[:2]
    assert _rates(spec, 4, 0.5, (1.0, 0.0), step, rates.steady_tokens)[:2] != rates[:2]
    # A batch too large for any draft to pay at the prior never drafts, so never learns.
    assert _rates(spec, 64, 0.5, (1.0, 0.0), step, 0.0) == (0.0, 0.0, float("inf"))


def test_what_a_chunk_drafts_does_not_depend_on_what_was_asked_before(monkeypatch):
    """Trajectories are shared by every run in the process: the rates read at a point of
    a chunk are the same whether or not later points were computed first."""
    from seer_engine.sim import speculation

    step = StepCostModel(7e-4, 1e-4)
    points = (0.0, 3.0, 17.5, 40.0)
    answers = []
    for first in (None, 500.0):
        monkeypatch.setattr(speculation, "_TRAJECTORIES", {})
        spec = SimSpeculation(_model(0.45, 0.9), "adaptive", 16)
        if first is not None:
            _rates(spec, 4, 0.5, (0.5, 0.5), step, first)
        answers.append([_rates(spec, 4, 0.5, (0.5, 0.5), step, t) for t in points])
    assert answers[0] == answers[1]


def test_a_high_priority_band_drafts_deeper_than_the_rest_of_its_batch():
    """Seer's λ: in one batch, rows whose tokens weigh more get the nodes that would not
    pay for the others, so they draft and accept more per step."""
    spec = SimSpeculation(_model(0.5, 0.5), "adaptive", 16, priority_weight=4.0)
    step = StepCostModel(0.002, 1e-4)
    normal, high = spec.band_rates(
        (BandShape(16, 0.5, (1.0, 0.0)), BandShape(16, 0.5, (1.0, 0.0))), step, 0.0
    )
    assert high.drafted > normal.drafted and high.accepted > normal.accepted
    assert high.steady_tokens == normal.steady_tokens
    # With equal weights the two bands are the same rows twice over.
    alike = SimSpeculation(_model(0.5, 0.5), "adaptive", 16, priority_weight=1.0)
    a, b = alike.band_rates((BandShape(16, 0.5, (1.0, 0.0)), BandShape(16, 0.5, (1.0, 0.0))), step, 0.0)
    assert a[:2] == pytest.approx(b[:2])
    # A band with no rows drafts nothing; the other band drafts as a batch of its own rows.
    idle, only = spec.band_rates((BandShape(0, 0.0, (0.0, 0.0)), BandShape(8, 0.5, (1.0, 0.0))), step, 0.0)
    assert idle == (0.0, 0.0, float("inf")) and only.drafted > 0


def _instance_with_bands(priority_weight: float):
    from seer_engine.core.policies import make_policy
    from seer_engine.rollout.types import ChunkRequest
    from seer_engine.sampling_params import SamplingParams
    from seer_engine.sim.instance import SimInstance
    from seer_engine.sim.profile import InstanceProfile, StepTimeModel
    from seer_engine.sim.world import SimPrompt, SimWorld

    keys = [f"g{i}/0" for i in range(16)]
    world = SimWorld({k: 600 for k in keys}, 600, {k.split("/")[0]: 1 for k in keys})
    profile = InstanceProfile(
        "test", StepTimeModel(0.002, 1e-4, 0.0), kv_capacity_tokens=100_000, max_num_seqs=64,
        max_num_batched_tokens=8192, pool_bytes_per_s=1e10, kv_bytes_per_token=1000,
    )  # fmt: skip
    spec = SimSpeculation(_model(0.5, 0.5), "adaptive", 16, priority_weight=priority_weight)
    inst = SimInstance(0, profile, world, make_policy("fcfs"), spec)
    for i, key in enumerate(keys):
        params, group = SamplingParams(max_tokens=600), key.split("/")[0]
        chunk = ChunkRequest(key, SimPrompt(50, key), params, group, key, [], high_priority=i % 2 == 1)
        inst.submit(chunk)
    ended: dict[str, float] = {}
    while inst.decoding or inst.prefilling or inst.waiting:
        reply = inst.step()
        for out in reply.outputs:
            ended[out.request_id] = inst.clock
            assert len(out.outputs[0].token_ids) == 600
    return inst, [ended[k] for k in keys[0::2]], [ended[k] for k in keys[1::2]]


def test_high_priority_rows_of_a_modeled_engine_write_faster_than_the_rest():
    inst, normal, high = _instance_with_bands(4.0)
    assert len(inst.bands) == 2
    assert max(high) < min(normal), (high, normal)  # same lengths, deeper drafts: done first
    stats = inst._stats
    # A stretch's last step may carry a row past its end (its output is cut to the end).
    assert stats.generated_tokens == pytest.approx(16 * 600, rel=0.01)
    assert stats.draft_tokens_accepted == pytest.approx(stats.generated_tokens - stats.sampled_rows)
    # Weighing them alike puts every row in one band: they end together.
    _, normal, high = _instance_with_bands(1.0)
    assert max(high + normal) - min(high + normal) < 1e-9


def test_running_groups_keep_each_bands_stage_and_coverage():
    """The acceptance model reads each band's own rows: their groups' stages and how far
    their siblings wrote past them."""
    from seer_engine.sim.requests import SimRequest
    from seer_engine.sim.running_groups import RunningGroups
    from seer_engine.sim.world import SimWorld

    members = {"a": ["a/0", "a/1"], "b": ["b/0", "b/1"]}
    world = SimWorld({k: 100 for ks in members.values() for k in ks}, 100, {"a": 2, "b": 4}, members)
    world.on_response_end("a")  # group a: half finished; group b: none
    world.on_chunk_end("b", "b/1", 90)  # b/1 wrote far past b/0
    spec = SimSpeculation(_model(0.5, 0.9), "adaptive", 16, priority_weight=2.0)
    groups = RunningGroups(2)
    rows = [SimRequest(k, k, k[0], 10, 0, 100, "stop", i, band=band)
            for i, (k, band) in enumerate([("a/1", 1), ("b/0", 0), ("b/1", 1)])]  # fmt: skip
    for req in rows:
        groups.join(req)
    assert groups.mean_stages(world) == pytest.approx((0.0, 0.25))
    normal, high = groups.coverage_shares(world, spec)
    assert normal == (0.0, 1.0)  # b/0: its sibling wrote ahead of it
    assert high == (1.0, 0.0)  # a/1 and b/1: nobody ahead
    groups.leave(rows[0])
    assert groups.mean_stages(world) == pytest.approx((0.0, 0.0))
    groups.leave(rows[2])
    assert groups.mean_stages(world) == (0.0, 0.0) and groups.coverage_shares(world, spec)[1] == (0.0, 0.0)


@pytest.mark.parametrize("chunk", [8, 64])
def test_draft_tokens_a_chunks_end_cut_off_are_not_counted(chunk, sim_instances):
    """A row accepts more tokens in its chunk's last step than it has left; the engine
    counts only the tokens it emitted (``Scheduler``), so the modeled engines' generated
    tokens are the responses'. Accepted ones are those past each step's own token: a
    last step that writes less than one accepts none."""
    from seer_engine.sim.profile import InstanceProfile, StepTimeModel
    from seer_engine.sim.simulator import policy_for, simulate, synthetic_groups

    groups = synthetic_groups(6, 8, 600, prompt_len=50, seed=1)
    profile = InstanceProfile("t", StepTimeModel(0.02, 2e-5, 2e-9), kv_capacity_tokens=20_000,
                              max_num_seqs=64, max_num_batched_tokens=4096)  # fmt: skip
    result = simulate(groups, policy_for("seer", groups, 600, 3600.0), profile, 2, 600, chunk)
    stats = [inst._stats for inst in sim_instances]
    rows = sum(s.sampled_rows for s in stats)
    generated = sum(s.generated_tokens for s in stats)
    accepted = sum(s.draft_tokens_accepted for s in stats)
    chunks = sum(s.chunks for samples in result.samples.values() for s in samples)
    m = result.metrics
    assert m.draft_tokens_accepted > 0
    assert generated == pytest.approx(m.output_tokens, abs=1e-6)
    assert m.output_tokens - rows - 1e-6 <= accepted <= m.output_tokens - rows + chunks
    assert m.accepted_tokens_per_step == pytest.approx(accepted / rows)


def test_accepted_tokens_per_step_is_never_negative_in_any_third(sim_instances):
    """Rows whose chunks end in a third after accepting drafts in the one before: their
    last steps, cut short by their ends, must not take back what the earlier third counted."""
    from seer_engine.sim.profile import InstanceProfile, StepTimeModel
    from seer_engine.sim.simulator import policy_for, simulate, synthetic_groups

    groups = synthetic_groups(15, 2, 64, prompt_len=10, seed=22, across_sigma=1.6, prompt_len_sigma=0.5)
    profile = InstanceProfile("t", StepTimeModel(0.02, 2e-5, 2e-9), kv_capacity_tokens=20_000,
                              max_num_seqs=64, max_num_batched_tokens=1024)  # fmt: skip
    result = simulate(groups, policy_for("seer", groups, 64, 0.0), profile, 4, 64, 16, admission="peak-known")
    assert result.metrics.accepted_tokens_per_step > 0
    assert min(result.metrics.accepted_tokens_per_step_thirds) >= 0
    for inst in sim_instances:
        counts = [p.draft_tokens_accepted for p in inst.books.timeline]
        assert counts == sorted(counts), "a cumulative count never falls"
