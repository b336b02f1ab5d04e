"""The rollout layer's parts on their own, no model: the Request Buffer, the books on
an instance, Seer's placement rule and the Context Manager's order."""

from __future__ import annotations

import pytest

from seer_engine.engine.stats import EngineStats
from seer_engine.rollout.books import InstanceBooks
from seer_engine.rollout.context_manager import ContextManager
from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.policies import ContextAwarePolicy, DividedPolicy
from seer_engine.rollout.request_buffer import RequestBuffer
from seer_engine.rollout.types import Group, InstanceInfo, RolloutSample
from seer_engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=1000)


def _group(i: int = 0, n: int = 4) -> Group:
    return Group(f"g{i}", [1, 2, 3], PARAMS, n, 1000, order=i)


def _sample(group: Group, index: int, generated: int = 0, enqueued: float = 0.0) -> RolloutSample:
    s = RolloutSample(group, index, seed=0, max_tokens=group.max_tokens)
    s.output_token_ids = [1] * generated
    s.enqueued_at = enqueued
    return s


def _instance(index: int, blocks: int = 100, seqs: int = 8) -> InstanceHandle:
    """A real handle with real books; nothing below it is needed to place chunks."""
    inst = InstanceHandle(index)
    inst.info = InstanceInfo(blocks, 16, seqs, 4096)
    inst.books = InstanceBooks(inst.info)
    return inst


# -- Request Buffer --------------------------------------------------------------------


def test_the_buffer_hands_out_what_fits_in_need_order():
    needs: dict[str, int] = {}
    buffer = RequestBuffer(lambda s: needs[s.key])
    g = _group(n=5)
    samples = [_sample(g, i) for i in range(5)]
    for s, need in zip(samples, (7, 3, 9, 3, 1)):
        needs[s.key] = need
        buffer.add(s)
    assert len(buffer) == 5 and samples[2] in buffer
    assert [s.sample_index for s in buffer.fitting(3)] == [4, 1, 3]  # ties keep arrival order
    assert buffer.fitting(0) == [] and len(buffer.fitting(100)) == 5
    needs[samples[0].key] = 1  # a need is fixed while the sample waits
    assert buffer.need(samples[0]) == 7 and samples[0] not in buffer.fitting(6)
    buffer.remove(samples[1])
    assert [s.sample_index for s in buffer.fitting(3)] == [4, 3] and samples[1] not in buffer
    with pytest.raises(KeyError):
        buffer.remove(samples[1])
    for s in list(buffer):
        buffer.remove(s)
    assert not buffer and buffer.fitting(100) == []


# -- books -----------------------------------------------------------------------------


def test_books_reserve_release_and_lose():
    inst = _instance(0, blocks=10, seqs=2)
    books = inst.books
    g = _group()
    a, b = _sample(g, 0), _sample(g, 1)
    books.reserve("a#0", a, 6)
    assert books.free_blocks == 4 and books.has_work and books.has_free_seq
    books.reserve("b#0", b, 3)
    assert books.free_blocks == 1 and not books.has_free_seq and books.group_ids() == ["g0"]
    assert books.release("a#0").sample is a and books.free_blocks == 7
    assert books.release("a#0") is None and books.free_blocks == 7  # released once only
    assert [c.sample for c in books.lose()] == [b]
    assert books.free_blocks == 10 and not books.has_work


# -- placement -------------------------------------------------------------------------


def test_books_count_samples_as_they_hold_them_not_as_the_last_reply_saw_them():
    """/metrics reads the books between replies: a chunk sent since the last reply is
    waiting at the instance, and one released since is no longer counted."""
    books = _instance(0).books
    g = _group()
    books.stats = EngineStats(running=1, waiting=0, generated_tokens=7)  # a reply: a#0 runs
    books.reserve("a#0", _sample(g, 0), 2)
    books.reserve("b#0", _sample(g, 1), 2)  # sent after that reply
    now = books.current_stats()
    assert (now.running, now.waiting, now.generated_tokens) == (1, 1, 7)
    books.release("a#0")
    books.release("b#0")  # both ended; the instance has not answered since
    now = books.current_stats()
    assert (now.running, now.waiting) == (0, 0) and books.stats.running == 1


def test_placement_prefers_the_longest_cached_prefix_until_loads_drift_apart():
    insts = [_instance(i) for i in range(3)]
    held = {0: 0, 1: 512, 2: 40}  # context tokens each instance holds of the response
    placement = SeerPlacement(spread_threshold=2, pull_threshold_tokens=512)
    assert placement.choose(insts, lambda i: held[i.index], [0, 0, 0]) is insts[1]
    g = _group()
    for k in range(3):  # instance 1 takes 3 chunks more than instance 0: spread 3 > 2
        insts[1].books.reserve(f"x{k}", _sample(g, k), 1)
    insts[2].books.reserve("y", _sample(g, 3), 1)
    loads = [len(i.books.in_flight) for i in insts]
    assert placement.choose(insts, lambda i: held[i.index], loads) is insts[0]  # least loaded
    assert placement.choose(insts[1:], lambda i: held[i.index], loads) is insts[2]
    assert not placement.should_pull(512) and placement.should_pull(513)


def test_placement_breaks_prefix_ties_by_load_then_free_blocks():
    insts = [_instance(0, blocks=50), _instance(1, blocks=80), _instance(2, blocks=80)]
    g = _group()
    insts[2].books.reserve("z", _sample(g, 0), 10)
    # Same prefix everywhere, same load on 0 and 1: the roomier instance 1 wins.
    assert SeerPlacement().choose(insts, lambda i: 0, [0, 0, 1]) is insts[1]
    with pytest.raises(ValueError):
        SeerPlacement(spread_threshold=-1)


def test_divided_serves_the_buffer_in_the_order_responses_entered_it():
    policy = DividedPolicy()
    g = [_group(i) for i in range(6)]
    requeued = _sample(g[0], 1, generated=128, enqueued=10.0)  # its first chunk ended at t = 10
    fresh = [_sample(g[5], 0), _sample(g[3], 2)]
    later = _sample(g[1], 0, generated=128, enqueued=12.0)
    order = policy.order([later, requeued, *fresh], now=20.0)
    assert [s.key for s in order] == ["g3/2", "g5/0", "g0/1", "g1/0"]
    assert [policy.rank_key(s) for s in order] == sorted(policy.rank_key(s) for s in order)


@pytest.mark.parametrize("order", ["divided", "estimate"])
def test_the_priority_index_lets_go_of_responses_that_left_it(order):
    """Each buffering queued the response for the starvation guard, and the queue let go of
    an entry only once it starved: under a policy without a guard (divided, oracle, the
    Context Manager's estimate order) a server kept every chunk end it ever buffered, and
    every response with its tokens, for as long as it ran."""
    import gc
    import weakref

    from seer_engine.rollout.priority_index import PriorityIndex

    policy = DividedPolicy() if order == "divided" else ContextAwarePolicy(ContextManager(order=order))
    assert policy.starvation_s is None
    index = PriorityIndex(policy)
    g = _group(n=2)
    policy.context.register(g, 1000)
    left = _sample(g, 0)
    gone = weakref.ref(left)
    index.add(left)
    index.remove(left)
    del left
    running = _sample(g, 1)
    for chunk in range(1, 1001):  # one response, buffered at the end of each of its chunks
        running.enqueued_at = float(chunk)
        index.add(running)
        assert list(index.ranked(float(chunk))) == [running]
        index.remove(running)
    gc.collect()
    assert gone() is None, "a response that left the buffer is still held"
    assert len(index._arrivals) < 100


# -- Context Manager -------------------------------------------------------------------


def test_context_manager_order():
    ctx = ContextManager(starvation_s=100.0, rule="seer")
    params = SamplingParams(max_tokens=1000)
    groups = [Group(f"g{i}", [1], params, 3, 1000, order=i) for i in range(4)]
    for g in groups:
        ctx.register(g, 1000)
    # g1 and g2 each have a finished response: 300 and 700 tokens.
    for g, length in ((groups[1], 300), (groups[2], 700)):
        done = _sample(g, 0, generated=length)
        ctx.on_finished(done)
    assert ctx.estimate("g1") == 300 and ctx.estimate("g2") == 700 and ctx.estimate("g0") == 1000
    pending = [
        _sample(groups[1], 1),
        _sample(groups[2], 1),
        _sample(groups[0], 1),
        _sample(groups[3], 0, generated=50),  # probe with 50 generated
        _sample(groups[0], 0, generated=10),  # probe with 10 generated
        _sample(groups[2], 2, enqueued=-500.0),  # starving
    ]
    order = ContextAwarePolicy(ctx).order(pending, now=0.0)
    assert [s.key for s in order] == ["g2/2", "g0/0", "g3/0", "g0/1", "g2/1", "g1/1"]


def test_a_response_longer_than_half_the_finished_ones_is_long_tail(monkeypatch):
    """Seer's high-priority requests: a response that has already written more than the
    median finished response did in all. Nothing is, before anything has finished; the
    median is over the latest finishes only."""
    from seer_engine.rollout import context_manager

    ctx = ContextManager()
    groups = [_group(i) for i in range(3)]
    for g in groups:
        ctx.register(g, 1000)
    runner = _sample(groups[0], 1, generated=900)
    assert not ctx.long_tail(runner)
    for length in (100, 200, 600):
        ctx.on_finished(_sample(groups[1], length // 100, generated=length))
    assert ctx.long_tail(_sample(groups[0], 2, generated=201))
    assert not ctx.long_tail(_sample(groups[0], 2, generated=200))
    policy = ContextAwarePolicy(ctx)
    assert policy.high_priority(runner) and not DividedPolicy(ctx).high_priority(runner)
    monkeypatch.setattr(context_manager, "RECENT_LENGTHS", 3)
    for length in (950, 960, 970):  # the three latest finishes are all longer
        ctx.on_finished(_sample(groups[2], length % 10, generated=length))
    assert not ctx.long_tail(runner) and ctx.long_tail(_sample(groups[0], 3, generated=961))


@pytest.mark.parametrize("order", ["wait", "estimate"])
def test_groupmax_orders_known_prompts_by_estimate_only_when_asked(order):
    """``order="estimate"``: groups the history store knows go longest-estimate-first
    across waits, ahead of unknown ones (which keep the wait order); ``"wait"``: every
    group in wait order, the shorter estimate first among equal waits."""
    from seer_engine.rollout.history import HistoryStore

    store = HistoryStore()
    prompts = {"long": [5, 6], "short": [7, 8], "new": [9, 10]}
    for length in (900, 950, 980):
        store.record(prompts["long"], length)
    for length in (40, 60, 50):
        store.record(prompts["short"], length)
    store.next_iteration()
    ctx = ContextManager(starvation_s=1e6, history=store, order=order)
    groups = {
        name: Group(name, tokens, PARAMS, 3, 1000, order=i)
        for i, (name, tokens) in enumerate(prompts.items())
    }
    for g in groups.values():
        ctx.register(g, 1000)
    assert ctx.estimate("long") > 900 > 100 > ctx.estimate("short")
    pending = [
        _sample(groups["short"], 1, generated=32, enqueued=1.0),
        _sample(groups["new"], 1, enqueued=0.0),
        _sample(groups["long"], 1, generated=32, enqueued=5.0),
        _sample(groups["new"], 2, generated=32, enqueued=3.0),
        _sample(groups["long"], 2, generated=32, enqueued=1.0),
    ]
    keys = [s.key for s in ContextAwarePolicy(ctx).order(pending, now=6.0)]
    if order == "wait":
        assert keys == ["new/1", "short/1", "long/2", "new/2", "long/1"]
    else:
        assert keys == ["long/1", "long/2", "short/1", "new/1", "new/2"]
    with pytest.raises(ValueError, match="unknown context order"):
        ContextManager(order="longest")


@pytest.mark.parametrize("spread", [0.1, 3.0])
def test_auto_order_ranks_known_prompts_by_estimate_only_when_prompts_differ_far_more_than_siblings(spread):
    """``order="auto"``: while prompts the history store knows differ in length about as
    much as one prompt's responses do, the wait order; once they differ far more (log
    sd across prompts over twice that within), longest estimate first, as "estimate"."""
    import math

    from seer_engine.rollout.context_manager import AUTO_MIN_PROMPTS
    from seer_engine.rollout.history import HistoryStore

    store = HistoryStore()
    prompts = [[100 + k, 200 + k] for k in range(AUTO_MIN_PROMPTS)]
    for k, tokens in enumerate(prompts):
        center = 300 * math.exp(spread * (k - AUTO_MIN_PROMPTS / 2) / AUTO_MIN_PROMPTS)
        for factor in (0.8, 1.0, 1.25):  # log sd within a prompt ~0.18
            store.record(tokens, round(center * factor))
    store.next_iteration()
    ctx = ContextManager(starvation_s=1e6, history=store)
    groups = [Group(f"p{k}", tokens, PARAMS, 3, 100_000, order=k) for k, tokens in enumerate(prompts)]
    for g in groups[:-1]:
        ctx.register(g, 100_000)
    assert ctx.effective_order == "wait", "too few prompts known to tell"
    ctx.take_changes()
    ctx.register(groups[-1], 100_000)
    expected = "estimate" if spread > 1 else "wait"
    assert ctx.effective_order == expected
    assert ctx.take_changes()[0] == (expected == "estimate"), "a switch re-keys every sample"
    assert ctx.guard_s == (None if expected == "estimate" else 1e6), "the guard would undo the order"
    first, last = groups[0], groups[-1]  # the shortest prompt waited longest
    pending = [_sample(first, 1, enqueued=0.0), _sample(last, 1, enqueued=5.0)]
    keys = [s.key for s in ContextAwarePolicy(ctx).order(pending, now=6.0)]
    assert keys == (["p7/1", "p0/1"] if expected == "estimate" else ["p0/1", "p7/1"])
    assert ctx.spread.prompts == AUTO_MIN_PROMPTS
    assert ContextManager(history=store, order="wait").effective_order == "wait"


@pytest.mark.parametrize("policy", ["baseline", "divided", "context"])
def test_the_context_manager_lets_go_of_finished_groups(policy):
    """Groups whose rank keys changed wait in the Context Manager for the priority index
    to take them; baseline and divided have no index, so under them every group that
    ever ran stayed there (a server runs millions). A finished group has nothing left
    to re-key: it leaves with the rest of its state."""
    from seer_engine.rollout.policies import make_rollout_policy

    ctx = make_rollout_policy(policy).context
    for i in range(50):
        g = _group(i, n=2)
        ctx.register(g, g.max_tokens)
        ctx.raise_budget(g.group_id, 2000)
        first, second = _sample(g, 0, generated=5), _sample(g, 1, generated=9)
        ctx.on_chunk_end(first)
        ctx.on_finished(first)
        ctx.on_finished(second)
        ctx.forget(g.group_id)
    assert ctx.take_changes()[1] == set()


# -- Engine pool -------------------------------------------------------------------------


def test_a_lost_instance_collects_no_finished_groups():
    """With a draft server, finished group ids ride on each instance's next step; a lost
    instance takes no step again, so it must not collect them (a server runs for days)."""
    from types import SimpleNamespace

    from seer_engine.kv_connector.factory import KVPool
    from seer_engine.rollout.pool import EnginePool, WallClock
    from seer_engine.spec_decode.draft_server import DraftServer

    instances = [_instance(0), _instance(1)]
    config = SimpleNamespace(speculative_config=None)
    pool = EnginePool(config, instances, KVPool.recompute(), WallClock(), "mp", draft_server=DraftServer())
    instances[1].alive = False
    for i in range(3):
        pool.finish_group(f"g{i}")
    assert pool._draft_traffic(instances[0])[1] == ["g0", "g1", "g2"]
    assert pool._finished_groups[1] == []


def test_an_instance_that_never_ran_a_group_is_not_told_it_finished():
    """Finished group ids ride on each instance's next step, for its draft trees; one
    that never ran the group has nothing to free. Under one request at a time every
    chunk went to one instance and the idle one collected an id per group for good
    (100 after 100 sequential requests): the dispatcher now says where the group ran."""
    from types import SimpleNamespace

    from seer_engine.kv_connector.factory import KVPool
    from seer_engine.rollout.dispatcher import Dispatcher
    from seer_engine.rollout.policies import make_rollout_policy
    from seer_engine.rollout.pool import EnginePool, WallClock
    from seer_engine.spec_decode.draft_server import DraftServer

    finished: list[tuple] = []

    class Pool:
        instances = [_instance(0), _instance(1)]
        kv_connector = SimpleNamespace(name="recompute")

        def finish_group(self, group_id, ran_on=None):
            finished.append((group_id, ran_on))

    dispatcher = Dispatcher(Pool(), make_rollout_policy("divided"), chunk_tokens=8)
    for i in range(3):
        samples = [_sample(_group(i, n=2), k) for k in range(2)]
        dispatcher.add_samples(samples)
        dispatcher._group_instances[f"g{i}"] = {0}  # its chunks ran on instance 0 only
        dispatcher.abort([s.key for s in samples])  # buffered again: the group ends here
    assert finished == [("g0", {0}), ("g1", {0}), ("g2", {0})]
    assert dispatcher._group_instances == {}

    instances = [_instance(0), _instance(1)]
    config = SimpleNamespace(speculative_config=None)
    pool = EnginePool(config, instances, KVPool.recompute(), WallClock(), "mp", draft_server=DraftServer())
    for i in range(3):
        pool.finish_group(f"g{i}", {0})
    assert pool._finished_groups == {0: ["g0", "g1", "g2"], 1: []}
    assert EnginePool.finish_group.__defaults__ == (None,)  # None: every live instance, as before


def _reply(draft_updates=(), progress=None):
    from seer_engine.engine.stats import EngineStats
    from seer_engine.kv_connector.base import ConnectorStats
    from seer_engine.rollout.types import StepReply

    return StepReply([], 0.0, EngineStats(), None, ConnectorStats(), draft_updates=list(draft_updates),
                     progress=progress or {})  # fmt: skip


def test_progress_of_a_chunk_released_before_its_step_reply_is_not_kept():
    """An abort releases a chunk while its instance's step is in flight (instances in other
    processes); the step's reply, read later, still reports the chunk's progress. That
    entry was kept for good (only a release pops one): one per abort on a server."""
    inst = _instance(0)
    inst.books.reserve("g0/0#0", _sample(_group(0), 0), 1)
    inst.books.reserve("g1/0#0", _sample(_group(1), 0), 1)
    inst.books.release("g0/0#0")
    inst.books.record(_reply(progress={"g0/0#0": 2, "g1/0#0": 1}), 1.0)
    assert inst.books.progress == {"g1/0#0": 1}
    inst.books.release("g1/0#0")
    assert inst.books.progress == {}


class _RemoteInstance(InstanceHandle):
    """An instance in another process: ``replies`` are the step replies read already
    (an abort reads the reply of the step in flight before its own)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.info = InstanceInfo(100, 16, 8, 4096)
        self.books = InstanceBooks(self.info)
        self.replies: list = []

    def start_step(self, draft_updates=None, finished_groups=None) -> None:
        self.stepping = True

    def poll_reply(self):
        self.stepping = False
        return self.replies.pop(0) if self.replies else None


@pytest.mark.parametrize("read_by_the_abort", [False, True])
def test_draft_records_of_a_group_an_abort_finished_are_not_published(read_by_the_abort):
    """An abort finishes a group while an instance's step is in flight; the step's reply,
    read later, carries the aborted response's draft records. Published, they made the
    draft server a log for the finished group that nothing drops again (finish_group had
    run already): one per aborted group on a server. The abort may read that reply
    itself (the instance is no longer stepping, so the next step starts first)."""
    from types import SimpleNamespace

    from seer_engine.kv_connector.factory import KVPool
    from seer_engine.rollout.pool import EnginePool, WallClock
    from seer_engine.spec_decode.draft_server import DraftServer, TokenAppend

    records = [TokenAppend("g0", "g0/0", 0, (5, 6), None), TokenAppend("g1", "g1/0", 0, (7,), None)]
    inst = _RemoteInstance(0)
    config = SimpleNamespace(speculative_config=None)
    pool = EnginePool(config, [inst], KVPool.recompute(), WallClock(), "mp", draft_server=DraftServer())
    inst.books.reserve("g0/0#0", _sample(_group(0, n=1), 0), 1)
    inst.books.reserve("g1/0#0", _sample(_group(1, n=1), 0), 1)  # still running: the reply is read
    inst.stepping = not read_by_the_abort
    inst.replies.append(_reply(records))
    inst.books.release("g0/0#0")  # the dispatcher's abort: the chunk, then its group, are done
    pool.finish_group("g0")
    assert pool.advance() is not None
    assert pool.draft_server.num_groups == 1 and pool.draft_server.num_records("g1") == 1
    pool.finish_group("g1")
    assert pool.draft_server.num_groups == 0
