"""The cluster simulator: conservation, KV capacity, determinism, and that what it
schedules with is the engine's own code (Rollout, policies, Context Manager, budget)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import seer_engine.core.policies as engine_policies
import seer_engine.rollout.dispatcher as engine_dispatcher
import seer_engine.rollout.policies as rollout_policies
from seer_engine.rollout.policies import ROLLOUT_POLICIES, ContextAwarePolicy
from seer_engine.sim import simulator
from seer_engine.sim.acceptance import AcceptanceModel
from seer_engine.sim.instance import SimInstance
from seer_engine.sim.profile import InstanceProfile, StepTimeModel
from seer_engine.sim.simulator import SimGroup, policy_for, simulate, synthetic_groups
from seer_engine.sim.world import SimWorld, TokenCount
from seer_engine.spec_decode.budget import AdaptiveBudget

MAX_TOKENS = 4096
POLICIES = ("baseline", "divided", "context", "seer", "oracle")


def _profile(kv_tokens: int = 40_000, **kw) -> InstanceProfile:
    # GPU-like: a step costs about the same for 1 or 64 rows, so drafts pay in the tail.
    step = kw.pop("step", StepTimeModel(0.02, 2e-5, 2e-9))
    return InstanceProfile("test", step, kv_capacity_tokens=kv_tokens, max_num_seqs=64,
                           max_num_batched_tokens=4096, pool_bytes_per_s=1e10, kv_bytes_per_token=1000,
                           **kw)  # fmt: skip


def _groups(seed: int = 0) -> list[SimGroup]:
    return synthetic_groups(12, 8, MAX_TOKENS, prompt_len=200, seed=seed)


def _run(name: str, groups, profile=None, instances: int = 3, chunk: int = 1024):
    return simulate(groups, policy_for(name, groups, MAX_TOKENS, 3600.0), profile or _profile(), instances,
                    MAX_TOKENS, chunk)  # fmt: skip


@pytest.mark.parametrize("name", POLICIES)
def test_every_response_finishes_once_with_its_length_and_kv_stays_within_capacity(name, sim_instances):
    groups = _groups()
    finished: list[str] = []
    result = simulate(groups, policy_for(name, groups, MAX_TOKENS, 3600.0), _profile(), 3, MAX_TOKENS, 1024,
                      on_sample_finished=lambda s: finished.append(s.key))  # fmt: skip
    expected = simulator.true_lengths(groups, MAX_TOKENS)
    assert sorted(finished) == sorted(expected), "every response finishes exactly once"
    got = {s.key: s.num_generated for ss in result.samples.values() for s in ss}
    assert got == expected
    assert result.metrics.output_tokens == sum(expected.values())
    assert sim_instances and all(0 < inst.peak_kv_tokens <= inst.capacity for inst in sim_instances)
    if name != "baseline":
        assert result.metrics.preemptions == 0, "divided rollout reserves KV per chunk: it never preempts"


@pytest.mark.parametrize(
    "seed,kv_tokens,max_tokens,prompt_len,instances,batched",
    [(24, 129, 64, 1, 1, 4096), (27, 365, 300, 1, 2, 48), (11, 464, 300, 100, 2, 48)],
    ids=["part-filled-blocks", "prefill-past-the-token-budget", "long-prompts"],
)  # fmt: skip
def test_the_baselines_engines_keep_kv_within_capacity(
    seed, kv_tokens, max_tokens, prompt_len, instances, batched, sim_instances
):
    """The modeled engine admits a row only where its part-filled last block fits too, and
    preempts when the next step's prefill spans (not only its decode tokens) have no KV."""
    groups = synthetic_groups(5, 4, max_tokens, prompt_len=prompt_len, seed=seed)
    profile = InstanceProfile("test", StepTimeModel(0.02, 2e-5, 2e-9), kv_capacity_tokens=kv_tokens,
                              max_num_seqs=16, max_num_batched_tokens=batched)  # fmt: skip
    policy = policy_for("baseline", groups, max_tokens, 3600.0)
    result = simulate(groups, policy, profile, instances, max_tokens, chunk_tokens=16)
    assert sim_instances and [i.peak_kv_tokens for i in sim_instances if i.peak_kv_tokens > i.capacity] == []
    assert result.metrics.output_tokens == sum(simulator.true_lengths(groups, max_tokens).values())


def test_baseline_preempts_when_kv_runs_out_and_divided_does_not():
    groups = _groups()
    tight = _profile(kv_tokens=12_000)
    base, divided = _run("baseline", groups, tight), _run("divided", groups, tight)
    assert base.metrics.preemptions > 0 and base.metrics.recomputed_tokens > 0
    assert divided.metrics.preemptions == 0
    assert divided.metrics.migrations > 0 and divided.metrics.pool_loads > 0, "full instances move responses"
    assert base.metrics.output_tokens == divided.metrics.output_tokens


def test_same_seed_same_rollout_other_seed_other_rollout():
    a, b, c = _run("seer", _groups(1)), _run("seer", _groups(1)), _run("seer", _groups(2))
    assert a.metrics == b.metrics
    assert a.timelines == b.timelines
    assert a.metrics.makespan_s != c.metrics.makespan_s


def test_seer_drafts_from_the_acceptance_model_and_beats_context():
    groups = _groups()
    seer, context = _run("seer", groups), _run("context", groups)
    m = seer.metrics
    assert m.accepted_tokens_per_step > 0.3 and m.draft_tokens_verified > 0
    assert m.accepted_tokens_per_step_thirds[2] > m.accepted_tokens_per_step_thirds[0], (
        "the tail drafts deeper"
    )
    assert context.metrics.accepted_tokens_per_step == 0
    assert m.throughput_tokens_per_s > 1.2 * context.metrics.throughput_tokens_per_s


def test_coverage_is_how_far_siblings_wrote_past_a_response():
    world = SimWorld({"g/0": 100, "g/1": 100, "g/2": 100}, 100, {"g": 3}, {"g": ["g/0", "g/1", "g/2"]})
    assert world.lead_share("g", "g/0", 16) == 0.0
    world.on_chunk_end("g", "g/1", 8)
    world.on_chunk_end("g", "g/2", 40)
    assert world.lead_share("g", "g/0", 16) == pytest.approx((8 / 16 + 1.0) / 2)
    assert world.lead_share("g", "g/1", 16) == pytest.approx((0 + 1.0) / 2)
    assert world.lead_share("g", "g/2", 16) == 0.0
    version = world.versions["g"]
    world.on_chunk_end("g", "g/2", 40)  # nothing moved: the instances' cached sums stay valid
    assert world.versions["g"] == version


def test_seer_accepts_more_where_siblings_have_written_ahead():
    """The same acceptance numbers, once regardless of coverage and once only for rows
    whose siblings have written past them: responses that start late (3 small instances,
    chunks) draft from the siblings ahead, so the coverage-aware table accepts more."""
    budgets = (1, 2, 4, 8, 16)
    low, high = (0.05, 0.08, 0.1, 0.12, 0.12), (0.7, 1.2, 2.0, 2.8, 3.2)
    flat = AcceptanceModel(budgets, (0.0, 1.0), (low,))
    covered = AcceptanceModel(budgets, (0.0, 1.0), ((low, high),), coverage_edges=(0.0, 0.5, 1.0))
    groups = _groups()
    runs = {
        name: simulate(
            groups,
            policy_for("seer", groups, MAX_TOKENS, 3600.0),
            _profile(kv_tokens=12_000),
            3,
            MAX_TOKENS,
            512,
            acceptance=model,
        )  # fmt: skip
        for name, model in (("flat", flat), ("covered", covered))
    }
    flat_accepted = runs["flat"].metrics.accepted_tokens_per_step
    assert flat_accepted < 0.15
    assert runs["covered"].metrics.accepted_tokens_per_step > 1.5 * flat_accepted
    assert runs["covered"].metrics.output_tokens == runs["flat"].metrics.output_tokens


def test_a_chunk_larger_than_an_instance_is_a_clear_error():
    # The response fits the instance (100 + 900 tokens), a 2048-token chunk of it does not.
    groups = [SimGroup("g", 100, [900])]
    with pytest.raises(RuntimeError, match="more KV blocks than an instance has"):
        simulate(groups, policy_for("divided", groups, 4096, 60.0), _profile(kv_tokens=1024), 1, 4096, 2048)


def test_a_response_larger_than_an_instance_is_named_before_anything_runs():
    groups = [SimGroup("g", 100, [3000])]
    with pytest.raises(ValueError, match="response need KV for 3100 tokens but an instance holds 1024"):
        simulate(groups, policy_for("divided", groups, 4096, 60.0), _profile(kv_tokens=1024), 1, 4096, 2048)


@pytest.mark.parametrize("name", ["baseline", "seer"])
def test_a_response_that_fits_the_capacity_but_not_whole_blocks_is_named_before_anything_runs(name):
    """2,250 tokens in 64-token blocks are 2,240, a row's last block part-filled: a 2,245-token
    response passed the check, then stalled on 'lower chunk_tokens', which cannot help."""
    groups = [SimGroup("g", 1000, [1245])]
    with pytest.raises(ValueError, match=r"need KV for 2245 tokens .* 2208.5 tokens fit"):
        simulate(groups, policy_for(name, groups, 4096, 60.0), _profile(2250, block_size=64), 1, 4096, 2048)


def test_the_simulator_schedules_with_the_engines_own_classes():
    # No second implementation: the names the simulator uses are the engine's objects.
    assert simulator.Dispatcher is engine_dispatcher.Dispatcher
    assert simulator.make_rollout_policy is rollout_policies.make_rollout_policy
    assert set(ROLLOUT_POLICIES.values()) >= {
        type(policy_for(n, _groups(), MAX_TOKENS, 1.0)) for n in POLICIES
    }
    # ...and a policy handed in is the one that orders the buffer.
    calls = []

    class Counting(ContextAwarePolicy):
        def rank_key(self, sample):
            calls.append(sample.key)
            return super().rank_key(sample)

    groups = _groups()
    result = simulate(groups, Counting(), _profile(), 3, MAX_TOKENS, 1024)
    assert calls and result.metrics.policy == "context"


def test_the_modeled_engines_use_the_engines_scheduling_and_budget_policies(monkeypatch):
    from seer_engine.sim import speculation

    seen = []
    real_allocate = AdaptiveBudget.allocate_rates

    def allocate_rates(self, rates, max_nodes, weights=None):
        seen.append(len(rates))
        return real_allocate(self, rates, max_nodes, weights)

    monkeypatch.setattr(AdaptiveBudget, "allocate_rates", allocate_rates)
    monkeypatch.setattr(speculation, "_TRAJECTORIES", {})  # none computed by earlier tests
    _run("seer", _groups(3))
    assert seen, "seer's draft budgets come from the engine's AdaptiveBudget"
    inst = SimInstance(0, _profile(), None, engine_policies.make_policy("fcfs"))
    assert type(inst.scheduling) is engine_policies.FCFSPolicy


def test_simulate_cli_writes_the_bench_report_keys_and_a_png(tmp_path, capsys):
    from seer_engine.entrypoints.cli import main

    assert main(["simulate", "--setup", "moonlight", "--prompts", "6", "--max-tokens", "8192",
                 "--policy", "baseline,context,seer", "--report", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "mean over iterations" in out and "seer" in out
    report = json.loads((tmp_path / "moonlight" / "report.json").read_text())
    assert set(report["policies"]) == {"baseline", "context", "seer"}
    assert {"throughput_tokens_per_s", "makespan_s", "tail_s", "preemptions", "idle_fraction"} <= set(
        report["policies"]["seer"]
    )
    assert "vs_baseline" in report and report["meta"]["setup"] == "moonlight"
    assert (tmp_path / "moonlight" / "report.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args,message",
    [
        (["--setup", "gpt5"], "unknown setup 'gpt5'"),
        (["--policy", "fastest"], "unknown policy 'fastest'"),
        (["--iterations", "0"], "--iterations must be >= 1"),
        (["--groups", "8"], "pass --trace too"),
        (["--profile", "/nonexistent.json"], "not found"),
        (["--trace", "/nonexistent.jsonl.gz"], "trace '/nonexistent.jsonl.gz' not found"),
        (["--acceptance", "/nonexistent.json"], "acceptance model '/nonexistent.json' not found"),
        (["--report", "/dev/null"], "--report '/dev/null' is not a directory this run can write to"),
    ],
)
def test_simulate_cli_names_bad_input(args, message, capsys):
    from seer_engine.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_simulate_takes_an_acceptance_model_fitted_elsewhere(tmp_path, capsys):
    """``--acceptance``: speculation drafts as the given fit says (here the committed
    history fit, which accepts more than the default) and the report names it."""
    from seer_engine.entrypoints.cli import main

    history_fit = Path(simulator.__file__).parent / "profiles" / "acceptance_qwen3_history.json"
    accepted = {}
    for name, extra in (("default", []), ("fitted", ["--acceptance", str(history_fit)])):
        args = ["simulate", "--setup", "moonlight", "--prompts", "6", "--instances", "2",
                "--max-tokens", "8192", "--policy", "seer", "--report", str(tmp_path / name),
                *extra]  # fmt: skip
        assert main(args) == 0
        report = json.loads((tmp_path / name / "moonlight" / "report.json").read_text())
        accepted[name] = report["policies"]["seer"]["accepted_tokens_per_step"]
        assert report["meta"]["acceptance"] == (str(history_fit) if extra else "default")
    capsys.readouterr()
    assert accepted["fitted"] > accepted["default"] > 0


def test_the_context_managers_batch_order_is_its_one_by_one_order():
    groups = _groups()
    policy = policy_for("context", groups, MAX_TOKENS, 50.0)
    rollout = simulator.Dispatcher(
        simulator.SimPool([SimInstance(0, _profile(), None, None)], True), policy, 1024
    )
    samples = rollout.start(
        [
            simulator.Group(
                g.group_id,
                TokenCount(g.prompt_len),
                simulator.SamplingParams(max_tokens=MAX_TOKENS),
                len(g.lengths),
                MAX_TOKENS,
            )
            for g in groups
        ]
    )
    flat = [s for ss in samples.values() for s in ss]
    for k, s in enumerate(flat):  # probes half done, some groups with finished responses, some starving
        s.output_token_ids = TokenCount(k % 7 * 100)
        s.enqueued_at = -100.0 if k % 11 == 0 else 0.0
        if k % 5 == 0 and s.sample_index:
            policy.context.on_finished(s)
    assert policy.order(flat, now=0.0) == sorted(flat, key=lambda s: policy.priority(s, 0.0))


@pytest.mark.parametrize("name", ["divided", "seer"])
def test_seer_marks_the_long_responses_high_priority_and_they_draft_deeper(name, monkeypatch):
    """The dispatcher asks the policy which chunks are long-tail (Seer's high-priority
    requests); the modeled engines decode those in their own band (that it drafts deeper
    is ``test_sim_speculation``'s)."""
    submitted: list[tuple[bool, int]] = []
    instances: list[SimInstance] = []
    real_submit, real_init = SimInstance.submit, SimInstance.__init__

    def submit(self, chunk):
        submitted.append((chunk.high_priority, len(chunk.prior_output_token_ids)))
        real_submit(self, chunk)

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        instances.append(self)

    monkeypatch.setattr(SimInstance, "submit", submit)
    monkeypatch.setattr(SimInstance, "__init__", init)
    high_rows = []
    real_rates = SimInstance._rates

    def rates(self, rows):
        out = real_rates(self, rows)
        if rows[1]:
            high_rows.append((rows, out))
        return out

    monkeypatch.setattr(SimInstance, "_rates", rates)
    weighted = {"method": "group_suffix", "priority_weight": 2}
    monkeypatch.setattr(rollout_policies.SeerPolicy, "speculative", weighted)
    _run(name, _groups())
    flagged = [generated for high, generated in submitted if high]
    if name == "divided":
        assert not flagged and not high_rows
        return
    assert flagged and min(flagged) > 0, "only responses that have written something are long"
    assert len(flagged) < len(submitted)
    assert high_rows, "the modeled engines decode high-priority chunks in their own band"
    assert all(gain[1] > 1.0 for _, (gain, _, _) in high_rows[:5]), "and they draft"
