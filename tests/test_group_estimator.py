"""The Context Manager's group-maximum estimator: the order it gives hand-made groups,
its bounds, and the Context Manager's use of it and of the history store."""

from __future__ import annotations

import math

import pytest

from seer_engine.rollout.context_manager import ContextManager
from seer_engine.rollout.group_estimator import GroupMaxEstimator
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.policies import ContextAwarePolicy
from seer_engine.rollout.types import Group, RolloutSample
from seer_engine.sampling_params import SamplingParams

MAX = 32768


def _estimator(*groups: str, n: int = 8, prompt_len: int = 100) -> GroupMaxEstimator:
    est = GroupMaxEstimator()
    for gid in groups:
        est.register(gid, n, MAX, prompt_len)
    return est


def test_evidence_orders_groups_by_their_longest_response():
    est = _estimator("short", "long", "unknown", "running", "capped")
    for i, n in enumerate((900, 1100, 1300)):
        est.observe_finished("short", i, n)
    for i, n in enumerate((9000, 11000, 12000)):
        est.observe_finished("long", i, n)
    for i in range(8):  # every sibling still running past 14K
        est.observe_progress("running", i, 14000)
    est.observe_finished("capped", 0, MAX)  # hit max_tokens: at least that long
    order = sorted(["short", "long", "unknown", "running", "capped"], key=lambda g: -est.estimate(g))
    assert order[0] == "capped" and order[-1] == "short"
    assert order.index("running") < order.index("long") < order.index("short")
    assert est.estimate("capped") == MAX


def test_estimates_stay_between_what_is_known_and_max_tokens():
    est = _estimator("g")
    assert 0 < est.estimate("g") <= MAX
    est.observe_progress("g", 0, 5000)
    est.observe_finished("g", 1, 7000)
    assert 7000 <= est.estimate("g") <= MAX
    assert est.lower_bound("g") == 7000 and est.finished_max("g") == 7000
    for i in range(8):
        est.observe_finished("g", i, 1000 * (i + 1))
    assert est.estimate("g") == 8000, "every response finished: the estimate is the longest"


def test_more_progress_never_lowers_the_estimate():
    est = _estimator("g")
    before = est.estimate("g")
    seen = []
    for generated in (2000, 4000, 8000, 16000):
        for i in range(8):
            est.observe_progress("g", i, generated)
        seen.append(est.estimate("g"))
    assert seen == sorted(seen) and seen[0] >= before
    est.observe_progress("g", 0, 100)  # a stale, smaller report changes nothing
    assert est.estimate("g") == seen[-1]


def test_one_short_finish_among_running_siblings_is_not_taken_as_the_group_length():
    """Siblings run in step: the first to finish is the group's shortest. Seer's rule takes
    it as the estimate; the posterior also counts the seven still running past it."""
    est = _estimator("g")
    est.observe_finished("g", 0, 6000)
    for i in range(1, 8):
        est.observe_progress("g", i, 6000)
    assert est.estimate("g") > 1.5 * 6000


def test_history_and_prompt_length_rank_groups_before_any_evidence():
    est = _estimator("plain", "seen_long", "seen_short")
    est.set_history("seen_long", [(20000, 1.0)] * 8)
    est.set_history("seen_short", [(1500, 1.0)] * 8)
    assert est.estimate("seen_long") > est.estimate("plain") > est.estimate("seen_short")
    by_prompt = GroupMaxEstimator()
    by_prompt.register("long_prompt", 8, MAX, 400)
    by_prompt.register("short_prompt", 8, MAX, 50)
    assert by_prompt.estimate("long_prompt") > by_prompt.estimate("short_prompt")


def test_the_population_prior_is_refitted_from_the_rollout():
    est = GroupMaxEstimator()
    for k in range(40):
        est.register(f"g{k}", 4, MAX, 100)
    prior, epoch = est._prior_mean, est.epoch
    for k in range(40):
        for i in range(4):
            est.observe_finished(f"g{k}", i, 300)  # every group is short
    assert est.epoch > epoch and est._prior_mean < prior - 1.0
    est.register("new", 4, MAX, 100)
    assert est.estimate("new") < 2000, "a new group is expected to be like the rest"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sigma"):
        GroupMaxEstimator(sigma=0)
    with pytest.raises(ValueError, match="unknown context rule"):
        ContextManager(rule="psychic")


def _sample(group: Group, index: int, generated: int = 0, chunks: int = 0) -> RolloutSample:
    s = RolloutSample(group, index, seed=0, max_tokens=MAX)
    s.output_token_ids = [1] * generated
    s.chunks = chunks
    return s


def test_context_manager_ranks_equal_waits_shortest_estimated_group_first():
    ctx = ContextManager(starvation_s=1e9)
    params = SamplingParams(max_tokens=MAX)
    groups = {
        name: Group(name, [1] * 100, params, n=4, max_tokens=MAX, order=k)
        for k, name in enumerate(("a", "b", "c"))
    }
    for g in groups.values():
        ctx.register(g, MAX)
    for i in range(3):  # a: short; b: running long; c: nothing known
        ctx.on_finished(_sample(groups["a"], i + 1, 800 + 100 * i, chunks=1))
        ctx.on_chunk_end(_sample(groups["b"], i + 1, 12000, chunks=2))
    pending = [
        _sample(groups["a"], 0, 800, chunks=1),
        _sample(groups["b"], 0, 0),  # b's probe has not run: it goes first
        _sample(groups["b"], 1, 12000, chunks=2),
        _sample(groups["b"], 2, 12000, chunks=2),
        _sample(groups["c"], 1, 0),
        _sample(groups["c"], 0, 4000, chunks=1),  # c's probe after its first chunk
    ]
    assert ctx.estimate("a") < ctx.estimate("c") < ctx.estimate("b")
    order = ContextAwarePolicy(ctx).order(pending, now=0.0)
    assert [s.key for s in order] == ["b/0", "a/0", "c/0", "c/1", "b/1", "b/2"]
    assert ctx.take_changes()[1] == {"a", "b"}, "the groups whose keys moved"
    assert ctx.take_changes() == (False, set())


def test_context_manager_serves_wait_order_first_and_the_shorter_group_among_equal_waits():
    ctx = ContextManager(starvation_s=1e9)
    params = SamplingParams(max_tokens=MAX)
    long, short = (
        Group(name, [1] * 100, params, n=4, max_tokens=MAX, order=k) for k, name in enumerate("ls")
    )
    for g in (long, short):
        ctx.register(g, MAX)
    for i in (1, 2):
        ctx.on_finished(_sample(short, i, 500, chunks=1))
        ctx.on_chunk_end(_sample(long, i, 12000, chunks=2))
    assert ctx.estimate("l") > ctx.estimate("s")
    requeued = _sample(long, 1, 12000, chunks=2)
    requeued.enqueued_at = 50.0  # its chunk ended at t = 50
    waiting = _sample(short, 3, 0)  # in the buffer since t = 0
    together = _sample(long, 2, 12000, chunks=2)
    together.enqueued_at = 50.0
    order = ContextAwarePolicy(ctx).order([requeued, waiting, together], now=60.0)
    assert [s.key for s in order] == ["s/3", "l/1", "l/2"], "wait order first"
    shorter = _sample(short, 0, 400, chunks=1)
    shorter.enqueued_at = 50.0
    policy = ContextAwarePolicy(ctx)
    assert policy.priority(shorter, 60.0) < policy.priority(together, 60.0), "shorter group among equals"


def test_context_manager_records_into_and_reads_from_its_history():
    store = HistoryStore()
    params = SamplingParams(max_tokens=MAX)
    prompt = [3] * 50
    ctx = ContextManager(history=store)
    group = Group("g", prompt, params, n=2, max_tokens=MAX)
    ctx.register(group, MAX)
    before = ctx.estimate("g")
    ctx.on_finished(_sample(group, 0, 20000, chunks=3))
    ctx.on_finished(_sample(group, 1, 24000, chunks=3))
    store.next_iteration()
    later = ContextManager(history=store)
    later.register(Group("g-again", prompt, params, n=2, max_tokens=MAX), MAX)
    assert later.estimate("g-again") > max(before, 20000)
    assert math.isclose(later.estimator.history_weight, 1.0)


def test_a_larger_budget_stretches_the_estimate():
    """A server's groups may ask for any max_tokens: the estimator covers them all."""
    est = GroupMaxEstimator()
    est.register("small", 4, 64, 10)
    est.register("large", 4, MAX, 10)
    assert est.estimate("small") <= 64 < est.estimate("large") <= MAX
    est.raise_budget("small", 4 * MAX)
    assert est.estimate("small") <= 4 * MAX


def test_seer_rule_keeps_the_papers_order():
    ctx = ContextManager(starvation_s=1e9, rule="seer")
    params = SamplingParams(max_tokens=MAX)
    a, b = (Group(n, [1] * 10, params, n=2, max_tokens=MAX, order=k) for k, n in enumerate("ab"))
    ctx.register(a, MAX)
    ctx.register(b, MAX)
    ctx.on_finished(_sample(a, 1, 500, chunks=1))
    assert ctx.estimate("a") == 500 and ctx.estimate("b") == MAX
    probe_a, probe_b = _sample(a, 0, 300, chunks=1), _sample(b, 0, 300, chunks=1)
    policy = ContextAwarePolicy(ctx)
    assert policy.priority(probe_b, 0.0) < policy.priority(probe_a, 0.0), "b's probe still probes"
