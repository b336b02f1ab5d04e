"""The Request Buffer's dispatch in the simulator: strict priority (no backfill past a
higher-priority sample), the priority index, admission rules that never preempt, and
iterations that repeat prompts."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from seer_engine.core.policies import make_policy
from seer_engine.rollout.admission import PeakAdmission, make_admission
from seer_engine.rollout.books import InstanceBooks
from seer_engine.rollout.dispatcher import Dispatcher, check_dispatch_rules
from seer_engine.rollout.policies import RolloutPolicy
from seer_engine.rollout.priority_index import PriorityIndex
from seer_engine.rollout.types import Group, InstanceInfo, RolloutSample
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim import simulator
from seer_engine.sim.admission import KNOWN_ENDS
from seer_engine.sim.instance import SimInstance
from seer_engine.sim.profile import InstanceProfile, StepTimeModel
from seer_engine.sim.simulator import SimPool, policy_for, simulate, synthetic_groups
from seer_engine.sim.world import SimPrompt, SimWorld
from seer_engine.workloads.stats import spearman

MAX_TOKENS = 4096


def _profile(kv_tokens: int = 40_000) -> InstanceProfile:
    step = StepTimeModel(0.02, 2e-5, 2e-9)
    return InstanceProfile(
        "test", step, kv_capacity_tokens=kv_tokens, max_num_seqs=64, max_num_batched_tokens=4096,
        pool_bytes_per_s=1e10, kv_bytes_per_token=1000,
    )  # fmt: skip


class Ranked(RolloutPolicy):
    """Fixed priorities by group id (smaller first)."""

    name = "ranked"

    def __init__(self, rank: dict[str, int]) -> None:
        super().__init__()
        self.rank = rank

    def rank_key(self, sample):
        return (self.rank[sample.group.group_id], sample.sample_index)


@pytest.mark.parametrize("backfill,dispatched", [("none", ["C/0"]), ("any", ["C/0", "B/0"])])
def test_a_sample_that_does_not_fit_holds_back_lower_priority_ones(backfill, dispatched):
    # One instance of 4,000 KV tokens. C (first) takes 1,500; A (second) needs 3,500 and does
    # not fit beside it; B (last) needs 1,100 and would. Strict priority keeps B waiting for A.
    prompts = {"C": 500, "A": 2500, "B": 100}
    world = SimWorld({f"{g}/0": 1000 for g in prompts}, 1000, {g: 1 for g in prompts})
    inst = SimInstance(0, _profile(kv_tokens=4000), world, make_policy("fcfs"), max_model_len=4000)
    policy = Ranked({"C": 0, "A": 1, "B": 2})
    dispatcher = Dispatcher(
        SimPool([inst], True), policy, chunk_tokens=1000, admission="reserve", backfill=backfill
    )
    params = SamplingParams(max_tokens=1000)
    dispatcher.start([Group(g, SimPrompt(n, g), params, 1, 1000) for g, n in prompts.items()])
    dispatcher._dispatch(0.0)
    assert [key for key, _ in dispatcher.dispatch_log] == dispatched
    while dispatcher.has_work:
        dispatcher.step()
    assert sorted(k for k, _ in dispatcher.dispatch_log) == ["A/0", "B/0", "C/0"]


@pytest.mark.parametrize(
    "backfill,dispatched",
    [("none", ["X/0", "Y/0"]), ("claim", ["X/0", "Y/0", "B/0"]), ("any", ["X/0", "Y/0", "B/0", "D/0"])],
)
def test_a_blocked_sample_claims_one_instance_and_the_others_backfill(backfill, dispatched):
    # Two instances of 4,000 KV tokens; X and Y (2,600 each) take one each. A (3,500) fits
    # nowhere now. Under `claim` A holds one instance and B (1,100) backfills the other; D
    # (1,100) would need A's instance too, so it waits. `none` backfills nothing, `any` both.
    prompts = {"X": 1600, "Y": 1600, "A": 2500, "B": 100, "D": 100}
    world = SimWorld({f"{g}/0": 1000 for g in prompts}, 1000, {g: 1 for g in prompts})
    insts = [
        SimInstance(i, _profile(kv_tokens=4000), world, make_policy("fcfs"), max_model_len=4000)
        for i in range(2)
    ]
    policy = Ranked({g: k for k, g in enumerate(prompts)})
    dispatcher = Dispatcher(
        SimPool(insts, True), policy, chunk_tokens=1000, admission="reserve", backfill=backfill
    )
    params = SamplingParams(max_tokens=1000)
    dispatcher.start([Group(g, SimPrompt(n, g), params, 1, 1000) for g, n in prompts.items()])
    dispatcher._dispatch(0.0)
    assert [key for key, _ in dispatcher.dispatch_log] == dispatched
    assert len({inst for _, inst in dispatcher.dispatch_log}) == 2
    while dispatcher.has_work:
        dispatcher.step()
    assert sorted(k for k, _ in dispatcher.dispatch_log) == ["A/0", "B/0", "D/0", "X/0", "Y/0"]


def test_the_priority_index_hands_out_the_policy_order_as_keys_change():
    rng = random.Random(3)

    class Changing(RolloutPolicy):
        def __init__(self):
            super().__init__()
            self.value = {f"g{k}": rng.random() for k in range(20)}
            self.changed: set[str] = set()

        def rank_key(self, sample):
            return (self.value[sample.group.group_id], sample.sample_index)

        def take_changes(self):
            changed, self.changed = self.changed, set()
            return False, changed

    policy = Changing()
    index = PriorityIndex(policy)
    params = SamplingParams(max_tokens=10)
    samples = [
        RolloutSample(Group(f"g{k}", [1], params, 3, 10), i, 0, 10) for k in range(20) for i in range(3)
    ]
    for s in samples:
        index.add(s)
    live = list(samples)
    for _ in range(30):
        for gid in rng.sample(sorted(policy.value), 4):
            policy.value[gid] = rng.random()
            policy.changed.add(gid)
        gone = rng.choice(live)
        index.remove(gone)
        live.remove(gone)
        ranked = index.ranked(0.0)
        first = [next(ranked) for _ in range(5)]  # a dispatch that stops early...
        ranked.close()
        assert first == sorted(live, key=policy.rank_key)[:5]
        assert list(index.ranked(0.0)) == sorted(live, key=policy.rank_key)  # ...loses nothing


def test_the_priority_index_serves_starving_samples_oldest_first_as_the_policy_says():
    """The guard is stated once (``RolloutPolicy.priority``): the index, which marks
    samples starving incrementally as time passes, hands out exactly that order."""
    rng = random.Random(5)

    class Guarded(RolloutPolicy):
        starvation_s = 10.0

        def __init__(self):
            super().__init__()
            self.value = {f"g{k}": rng.random() for k in range(12)}

        def rank_key(self, sample):
            return (self.value[sample.group.group_id], sample.sample_index)

        def take_changes(self):  # a few groups learn something each time: their samples are re-keyed
            changed = set(rng.sample(sorted(self.value), 3))
            for gid in changed:
                self.value[gid] = rng.random()
            return False, changed

    policy = Guarded()
    index = PriorityIndex(policy)
    params = SamplingParams(max_tokens=10)
    live = []
    for k in range(12):
        for i in range(3):
            sample = RolloutSample(Group(f"g{k}", [1], params, 3, 10), i, 0, 10)
            sample.enqueued_at = float(rng.randrange(0, 40))
            live.append(sample)
    for sample in sorted(live, key=lambda s: s.enqueued_at):  # the buffer adds in time order
        index.add(sample)
    for now in (0.0, 12.0, 25.5, 31.0, 60.0):
        ranked = list(index.ranked(now))
        expected = policy.order(live, now)  # equal waits in the order they arrived, re-keyed or not
        assert ranked == expected
        starving = [s for s in expected if now - s.enqueued_at > 10.0]
        assert expected[: len(starving)] == sorted(starving, key=lambda s: s.enqueued_at)
        gone = expected[len(expected) // 2]
        index.remove(gone)
        live.remove(gone)
    assert len(index) == len(live)


def test_reserve_holds_a_groups_prompt_once_per_instance():
    books = InstanceBooks(InstanceInfo(num_blocks=100, block_size=16, max_num_seqs=8, max_model_len=4096))
    group = Group("g", list(range(64)), SamplingParams(max_tokens=64), 2, 64)  # 4 prompt blocks
    a, b = RolloutSample(group, 0, 0, 64), RolloutSample(group, 1, 0, 64)
    shared, per_response = make_admission("reserve"), make_admission("reserve-per-response")
    assert shared.footprint(books, a, 64) == 8
    books.reserve("a", a, 8, 0, 64, shared.prompt_blocks(books, a))
    assert shared.footprint(books, b, 64) == 4 and per_response.footprint(books, b, 64) == 8
    books.reserve("b", b, 8, 0, 64, shared.prompt_blocks(books, b))
    assert books.reserved_blocks == 12
    books.release("a")
    assert books.reserved_blocks == 8, "the sibling left holds the prompt now"
    books.release("b")
    assert books.reserved_blocks == 0


def test_peak_admission_counts_progress_and_chunks_that_end_first():
    books = InstanceBooks(InstanceInfo(num_blocks=1000, block_size=1, max_num_seqs=8, max_model_len=10**6))
    rule = PeakAdmission(slack_tokens=0, headroom=1.0)
    g = Group("g", [0] * 10, SamplingParams(max_tokens=1000), 2, 1000)
    first = RolloutSample(g, 0, 0, 1000)
    books.reserve("first", first, 0, 0, 400)
    # Alone: prompt 10 + 1 partial block, then the chunk grows to 400 (+1 partial block).
    assert rule.peak(books) == 10 + 1 + 1 + 400
    books.progress["first"] = 300  # it is 300 tokens in: 100 to go, the peak is the same
    books.outlook = None
    assert rule.peak(books) == 10 + 1 + 1 + 400
    # A sibling starting now for 50 tokens ends before the first: both at +50.
    assert rule.peak(books, RolloutSample(g, 1, 0, 1000), 0, 50) == 11 + (301 + 50) + (1 + 50)
    # One for 500 tokens outlives it: the peak is just before the first ends (+100), or later alone.
    assert rule.peak(books, RolloutSample(g, 1, 0, 1000), 0, 500) == max(
        11 + (301 + 100) + (1 + 100), 11 + 1 + 500
    )


@pytest.mark.parametrize("admission", ["reserve-per-response", "reserve", "peak", "peak:256", "peak-known"])
@pytest.mark.parametrize("name", ["divided", "context", "seer", "context+history", "oracle"])
def test_admission_rules_never_preempt_and_stay_within_kv(admission, name, sim_instances):
    groups = synthetic_groups(12, 8, MAX_TOKENS, prompt_len=200, seed=4)
    tight = _profile(kv_tokens=14_000)
    finished: list[str] = []
    result = simulate(groups, policy_for(name, groups, MAX_TOKENS, 3600.0), tight, 3, MAX_TOKENS, 1024,
                      on_sample_finished=lambda s: finished.append(s.key), admission=admission)  # fmt: skip
    expected = simulator.true_lengths(groups, MAX_TOKENS)
    assert sorted(finished) == sorted(expected), "every sample exactly once"
    assert {s.key: s.num_generated for ss in result.samples.values() for s in ss} == expected
    assert result.metrics.preemptions == 0
    assert sim_instances and all(inst.peak_kv_tokens <= inst.capacity for inst in sim_instances)
    if admission == "peak:256":
        assert result.metrics.chunk_cuts > 0, "a short horizon overfills: the engine cuts chunks"
    else:
        assert result.metrics.chunk_cuts == 0


@pytest.mark.parametrize("admission", ["reserve", "peak"])
def test_a_speculative_row_at_its_chunks_end_is_not_preempted_for_tokens_past_it(admission, sim_instances):
    """Each response fills its instance to the last token: a step that accepts 2.7 tokens
    where half of one was left counted all 2.7 and preempted the row (the rules never do)."""
    groups = [simulator.SimGroup("g", 27, [55, 52, 58, 64, 59, 60, 56, 56])]
    profile = InstanceProfile("t", StepTimeModel(0.0134, 4.55e-5, 1.22e-8), kv_capacity_tokens=91,
                              max_num_seqs=16, max_num_batched_tokens=16, block_size=1)  # fmt: skip
    policy = policy_for("seer", groups, 64, 3600.0)
    result = simulate(groups, policy, profile, 5, 64, 100, admission=admission)
    assert result.metrics.preemptions == 0
    assert result.metrics.output_tokens == sum(groups[0].lengths)
    assert all(inst.peak_kv_tokens <= inst.capacity for inst in sim_instances)


def test_peak_admission_runs_more_rows_than_reserving_every_chunk_and_fewer_than_knowing_the_ends():
    groups = synthetic_groups(12, 8, MAX_TOKENS, prompt_len=200, seed=4)
    runs = {
        adm: simulate(
            groups,
            policy_for("divided", groups, MAX_TOKENS, 3600.0),
            _profile(kv_tokens=14_000),
            3,
            MAX_TOKENS,
            1024,
            admission=adm,
        )  # fmt: skip
        for adm in ("reserve-per-response", "peak", "peak-known")
    }
    rows = {adm: np.mean([p.running for tl in r.timelines for p in tl]) for adm, r in runs.items()}
    assert rows["peak"] > rows["reserve-per-response"]
    assert rows["peak-known"] > rows["peak"], "knowing where responses end packs more rows"
    assert runs["peak-known"].metrics.makespan_s < runs["peak"].metrics.makespan_s


@pytest.mark.parametrize("name", ["optimistic", "peak:0", "peak:x"])
def test_bad_admission_rules_are_named(name):
    with pytest.raises(ValueError, match="admission"):
        make_admission(name)


def test_only_the_simulator_takes_its_own_admission_rule():
    assert check_dispatch_rules("peak-known", "none", own_rules=(KNOWN_ENDS,)) == KNOWN_ENDS
    with pytest.raises(ValueError, match="unknown admission rule 'peak-known'"):
        check_dispatch_rules("peak-known", "none")  # bench rollout runs real engines
    with pytest.raises(ValueError, match="backfill"):
        check_dispatch_rules("peak-known", "sideways", own_rules=(KNOWN_ENDS,))


def test_iterations_repeat_prompts_with_fresh_samples():
    first = synthetic_groups(200, 8, 65536, 1024, 0, 22386, 0, 0.0, 0.33, 0.5)
    again = synthetic_groups(200, 8, 65536, 1024, 0, 22386, 1, 0.0, 0.33, 0.5)
    moved = synthetic_groups(200, 8, 65536, 1024, 0, 22386, 1, 1.0, 0.33, 0.5)
    assert [g.prompt_key for g in first] == [g.prompt_key for g in again]
    assert [g.prompt_len for g in first] == [g.prompt_len for g in again]
    assert all(a.lengths != b.lengths for a, b in zip(first, again)), "fresh samples"
    means = [np.mean(g.lengths) for g in first]
    assert spearman(means, [np.mean(g.lengths) for g in again]) > 0.7, "each prompt keeps its distribution"
    assert spearman(means, [np.mean(g.lengths) for g in moved]) < 0.5, "--drift moves it"
    other_seed = synthetic_groups(200, 8, 65536, 1024, 1, 22386, 0, 0.0, 0.33, 0.5)
    assert {g.prompt_key for g in other_seed}.isdisjoint(g.prompt_key for g in first)


def test_simulate_cli_iterations_report_every_iteration(tmp_path, capsys):
    from seer_engine.entrypoints.cli import main

    args = ["simulate", "--setup", "moonlight", "--prompts", "6", "--instances", "2", "--max-tokens", "8192",
            "--iterations", "2", "--repeat-prompts", "--policy", "baseline,context,context+history",
            "--report", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "baseline diagnostics" in out and "preemptions per iteration" in out
    report = json.loads((tmp_path / "moonlight" / "report.json").read_text())
    assert [set(it["policies"]) for it in report["iterations"]] == [
        {"baseline", "context", "context+history"}
    ] * 2
    assert report["meta"]["repeat_prompts"] is True and report["meta"]["admission"] == "peak"
    assert len(report["baseline_diagnostics"]["simulated"]) == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--policy", "divided+history"], "unknown policy 'divided+history'"),
        (["--drift", "0.2"], "--drift moves repeated prompts"),
        (["--admission", "peak:x"], "peak:TOKENS needs a positive number of tokens, got 'x'"),
        (["--backfill", "some"], "backfill must be one of none, claim, any"),
    ],
)
def test_simulate_cli_names_bad_iteration_input(args, message, capsys):
    from seer_engine.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--prompts", "4", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_trace_groups_iterations_take_the_benchmarks_sibling_sets(game24_trace):
    """``simulate --trace T --groups G --repeat-prompts``: iteration k replays responses
    k*N .. k*N+N-1 of each group, the same ones ``bench rollout --iterations`` replays."""
    from seer_engine.workloads.groups import select_groups
    from seer_engine.workloads.replay import ReplayWorkload
    from seer_engine.workloads.traces import load_trace

    chosen = select_groups(load_trace(str(game24_trace)), "2:5")
    for iteration in range(3):
        groups = simulator.bench_groups(str(game24_trace), "2:5", 3, 4096, iteration=iteration)
        replay = ReplayWorkload(chosen, 3, 4096, first=iteration * 3)
        assert [g.group_id for g in groups] == [gid for gid, _ in replay.prompts]
        lengths = {f"{g.group_id}/{j}": n for g in groups for j, n in enumerate(g.lengths)}
        assert lengths == replay.true_lengths
    assert len({g.prompt_key for g in groups}) == 3
    first = simulator.bench_groups(str(game24_trace), "2:5", 3, 4096)
    assert [g.prompt_key for g in first] == [g.prompt_key for g in groups]
    assert [g.lengths for g in first] != [g.lengths for g in groups], "disjoint sibling sets"
    too_many = min(g.num_samples for g in chosen) // 3
    with pytest.raises(ValueError, match=f"iteration {too_many + 1} takes responses"):
        simulator.bench_groups(str(game24_trace), "2:5", 3, 4096, iteration=too_many)


def test_simulate_names_a_trace_too_short_for_its_iterations_before_running(game24_trace, capsys):
    from seer_engine.entrypoints.cli import main

    args = ["simulate", "--setup", "moonlight", "--trace", str(game24_trace), "--groups", "2",
            "--samples", "8", "--iterations", "13", "--repeat-prompts", "--policy", "baseline",
            "--max-tokens", "128"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "iteration 13 takes responses 96..103 of each group" in captured.err
    assert "simulated" not in captured.out, "nothing runs before the error"


def test_trace_groups_that_repeat_prompts_take_disjoint_sibling_sets(game24_trace, capsys):
    """``simulate --trace T --repeat-prompts`` (prompts cycled over the trace): a prompt's
    iterations take different responses of its trace group, and a trace too small for
    that is an error before anything runs."""
    from seer_engine.entrypoints.cli import main
    from seer_engine.workloads.groups import scale_lengths
    from seer_engine.workloads.traces import load_trace

    source = load_trace(str(game24_trace))
    scaled = scale_lengths([g.lengths for g in source], 4096)
    n = min(g.num_samples for g in source)
    samples, iterations = n // 3, 3
    runs = [
        simulator.trace_groups(
            str(game24_trace), 5, samples, 4096, seed=0, iteration=it, iterations=iterations
        )
        for it in range(iterations)
    ]
    for k in range(5):
        taken = sorted(x for run in runs for x in run[k].lengths)
        assert taken == sorted(scaled[k][: samples * iterations]), f"prompt {k}: each response once"
    with pytest.raises(ValueError, match=f"take {(samples + 1) * iterations} different responses"):
        simulator.trace_groups(str(game24_trace), 5, samples + 1, 4096, seed=0, iterations=iterations)
    args = ["simulate", "--setup", "moonlight", "--trace", str(game24_trace), "--prompts", "5",
            "--samples", str(samples + 1), "--iterations", "3", "--repeat-prompts", "--policy", "baseline",
            "--max-tokens", "128"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert f"has only {n}; pass fewer --iterations or --samples" in captured.err
    assert "simulated" not in captured.out, "nothing runs before the error"


def _chunk(key: str, prompt: int, max_tokens: int):
    from seer_engine.rollout.types import ChunkRequest

    params = SamplingParams(max_tokens=max_tokens)
    return ChunkRequest(key, SimPrompt(prompt, key), params, key.split("/")[0], key, [])


def _run_all(inst: SimInstance, keys, prompt: int, max_tokens: int) -> list:
    """Submit a chunk per key and step the instance until none is left; the outputs."""
    for key in keys:
        inst.submit(_chunk(key, prompt, max_tokens))
    done = []
    while inst.decoding or inst.prefilling or inst.waiting:
        done += inst.step().outputs
    return done


class _Recording(SimInstance):
    """Records, per planned step, whether it preempted and what it admitted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[tuple[bool, list[str]]] = []
        self.evictions: list[dict[str, int]] = []
        self.victims: list = []

    def _preempt_until_growth_fits(self) -> bool:
        waiting = list(self.waiting)
        self._stopped = super()._preempt_until_growth_fits()
        self.victims += [r for r in self.waiting if r not in waiting]
        return self._stopped

    def _next_segment(self):
        seg = super()._next_segment()
        if seg is not None:
            self.plans.append((self._stopped, [r.key for r in seg.admit]))
        return seg

    def _evict(self) -> None:
        super()._evict()
        self.evictions.append(dict(self.cache))


def test_a_preempted_response_keeps_the_start_of_its_context_as_the_engine_does():
    """KV runs out: the engine preempts, admits nobody in that step, and the victim's freed
    blocks are handed out from its end as running rows grow, so when it is readmitted it
    recomputes what was taken (more than its last token, less than all of it)."""
    lengths = {"a/0": 600, "b/0": 900, "c/0": 900}  # c is preempted; a ends while c waits
    world = SimWorld(lengths, 900, {g: 1 for g in "abc"})
    inst = _Recording(0, _profile(kv_tokens=1600), world, make_policy("fcfs"), max_model_len=1600)
    done = _run_all(inst, lengths, 100, 900)
    stats = inst._stats
    assert stats.preemptions >= 1
    assert all(not admitted for stopped, admitted in inst.plans if stopped), inst.plans
    victim = inst.victims[0]
    kept = [c[victim.key] for c in inst.evictions if victim.key in c]
    assert any(0 < n < victim.lost for n in kept), (victim.lost, kept)  # trimmed, not dropped whole
    assert stats.preemptions < stats.recomputed_tokens < sum(v.lost for v in inst.victims)
    assert sorted(len(o.outputs[0].token_ids) for o in done) == [600, 900, 900]


@pytest.mark.parametrize("block_size, preempts", [(16, True), (1, False)])
def test_rows_hold_whole_kv_blocks_as_the_engine_allocates_them(block_size, preempts):
    """Ten rows of 25 tokens need 250 KV tokens but two 16-token blocks each (320): an
    engine with 288 tokens of KV preempts; counted in single tokens it would not. The
    model charges each row its last block's mean unused half."""
    lengths = {f"r{i}/0": 15 for i in range(10)}
    world = SimWorld(lengths, 15, {k.split("/")[0]: 1 for k in lengths})
    profile = _profile(kv_tokens=288)
    profile = InstanceProfile(
        "test", profile.step, kv_capacity_tokens=288, max_num_seqs=64, max_num_batched_tokens=4096,
        pool_bytes_per_s=1e10, kv_bytes_per_token=1000, block_size=block_size,
    )  # fmt: skip
    inst = SimInstance(0, profile, world, make_policy("fcfs"), max_model_len=288)
    done = _run_all(inst, lengths, 10, 15)
    assert (inst._stats.preemptions > 0) is preempts
    assert inst.peak_kv_tokens <= 288
    assert sorted(len(o.outputs[0].token_ids) for o in done) == [15] * 10


def test_a_preempted_row_finds_its_prompt_in_the_blocks_its_running_siblings_hold():
    """The engine never evicts blocks a running row uses: a preempted response of a group
    whose siblings still run recomputes its own tokens, not the prompt they share."""
    lengths = {"g/0": 700, "g/1": 900, "g/2": 900}
    world = SimWorld(lengths, 900, {"g": 3})

    class _Readmissions(_Recording):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.readmitted: list[tuple[int, bool]] = []

        def _next_segment(self):
            seg = super()._next_segment()
            for req in seg.admit if seg is not None else []:
                if req in self.victims:
                    self.readmitted.append((req.hit, req.group_id in self.groups))
            return seg

    inst = _Readmissions(0, _profile(kv_tokens=1600), world, make_policy("fcfs"), max_model_len=1600)
    done = _run_all(inst, lengths, 300, 900)
    assert inst.victims, "the scenario must preempt"
    assert any(running for _, running in inst.readmitted), inst.readmitted
    assert all(hit >= 300 for hit, running in inst.readmitted if running), inst.readmitted
    assert sorted(len(o.outputs[0].token_ids) for o in done) == [700, 900, 900]
