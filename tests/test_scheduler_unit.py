"""Scheduler + KVCacheManager without a model, the way vLLM tests its scheduler.

Requests are built directly; each step calls ``schedule()`` and then
``update_from_output()`` with tokens made up by the test, emitted (as the model runner
does) only for requests whose scheduled span reaches their last token. Blocks hold 4
tokens so that block boundaries are easy to reason about.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest

from seer_engine.core.draft import DraftTree
from seer_engine.core.kv_cache_manager import KVCacheManager, hash_block
from seer_engine.core.policies import make_policy
from seer_engine.core.request import Request, RequestStatus
from seer_engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from seer_engine.sampling_params import SamplingParams

BLOCK = 4
EOS = 2
TOKEN = 9  # what requests emit unless a test scripts something else
STOP = 77

Emit = Callable[[Request], list[int]]


def make_scheduler(
    *,
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    chunked: bool = True,
    policy: str = "fcfs",
    prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, chunked)
    return Scheduler(config, kv, make_policy(policy))


def make_request(
    rid: str, prompt: int | Sequence[int], *, max_tokens: int = 16, priority: int = 0, **params
) -> Request:
    """``prompt``: the token ids, or a length (ids from a range unique to ``rid``)."""
    if isinstance(prompt, int):
        start = 100 + 1000 * (sum(map(ord, rid)) % 50)
        prompt = list(range(start, start + prompt))
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    return Request(
        rid, list(prompt), sampling, max_tokens, seed=0, eos_token_ids=frozenset({EOS}), priority=priority
    )


def always(token: int = TOKEN) -> Emit:
    return lambda request: [token]


EMIT_TOKEN = always()


def script(tokens: Sequence[int]) -> Emit:
    """Emit ``tokens[i]`` as output token i (``TOKEN`` past the end)."""
    return lambda r: [tokens[r.num_output_tokens] if r.num_output_tokens < len(tokens) else TOKEN]


def step(sched: Scheduler, emit: Emit = EMIT_TOKEN) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with made-up model output."""
    out = sched.schedule()
    emitted = {}
    for request, num_new in out.scheduled:
        num_draft = len(request.draft) if request.draft else 0
        if request.num_computed_tokens + num_new - num_draft == request.num_tokens:
            emitted[request.request_id] = emit(request)
    return out, sched.update_from_output(out, emitted)


def spans(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def run_to_end(sched: Scheduler, emit: Emit = EMIT_TOKEN, max_steps: int = 1000) -> int:
    for steps in range(1, max_steps + 1):
        step(sched, emit)
        if not sched.has_unfinished_requests():
            return steps
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_blocks and not kv.pending and not kv.num_hashed
    assert not sched.requests and not sched.running and not sched.waiting


def path(tokens: Sequence[int]) -> DraftTree:
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))


# -- token budget, max_num_seqs ----------------------------------------------------------


def test_budget_is_split_between_decode_rows_and_prefill_spans() -> None:
    """Running decode rows go first, one token each; a new prompt gets what is left of
    the budget per step and emits only once its last prefill span is computed."""
    sched = make_scheduler(budget=16)
    a, b = make_request("a", 3), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert spans(out) == [("a", 3), ("b", 3)]
    c = make_request("c", 30)
    sched.add_request(c)
    out, _ = step(sched)
    assert spans(out) == [("a", 1), ("b", 1), ("c", 14)] and out.num_batched_tokens == 16
    assert (c.num_computed_tokens, c.num_output_tokens) == (14, 0)
    out, _ = step(sched)
    assert spans(out) == [("a", 1), ("b", 1), ("c", 14)]
    assert (c.num_computed_tokens, c.num_output_tokens) == (28, 0)
    out, updated = step(sched)
    assert spans(out) == [("a", 1), ("b", 1), ("c", 2)]
    assert c in updated and (c.num_computed_tokens, c.num_output_tokens) == (30, 1)
    assert sched.stats.scheduled_tokens == 6 + 16 + 16 + 4


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget() -> None:
    sched = make_scheduler(budget=16, chunked=False)
    for rid in "ab":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    step(sched)
    sched.add_request(make_request("c", 15))
    out, _ = step(sched)
    assert spans(out) == [("a", 1), ("b", 1)], "15 tokens do not fit in the 14 left"
    out, _ = step(sched)
    assert spans(out) == [("c", 15)]


def test_max_num_seqs_caps_the_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abcd":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    seen = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert sched.num_running <= 2
        seen.append(sorted(r.request_id for r, _ in out.scheduled))
    assert seen == [["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]]


# -- prefix cache ------------------------------------------------------------------------


def test_siblings_share_prompt_blocks_after_a_one_step_wait() -> None:
    """The second sample of a prompt waits while the first computes the prompt's full
    blocks, then adopts them as prefix hits instead of computing a private copy."""
    prompt = list(range(500, 510))  # two full blocks and two tokens
    sched = make_scheduler()
    a, b = make_request("a", prompt), make_request("b", prompt)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert spans(out) == [("a", 10)] and b.status is RequestStatus.WAITING
    out, _ = step(sched)
    assert spans(out) == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 8
    kv = sched.kv
    a_blocks, b_blocks = kv.block_ids("a"), kv.block_ids("b")
    assert a_blocks[:2] == b_blocks[:2] and a_blocks[2] != b_blocks[2]
    assert [kv.pool.blocks[i].ref_cnt for i in b_blocks[:2]] == [2, 2]
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)


def test_a_request_running_across_a_cache_reset_registers_no_block_until_preempted() -> None:
    """After a reset (a weight update) the blocks a running request fills attend to its
    stale KV: none is registered. Preempted, it recomputes all of it and registers again."""
    sched = make_scheduler(budget=16)
    a = make_request("a", 8, max_tokens=12)
    sched.add_request(a)
    step(sched)
    kv = sched.kv
    assert len(kv.pool.cached) == 2  # the prompt's blocks
    kv.reset_prefix_cache()
    for _ in range(6):
        step(sched)
    assert a.num_computed_tokens == 14 and not kv.pool.cached  # a third block filled, unregistered
    sched._preempt(a)
    step(sched)
    assert a.num_computed_tokens == 15 and len(kv.pool.cached) == 3
    run_to_end(sched)
    assert_all_blocks_free(sched)
    assert not kv.stale


def test_block_hashes_do_not_collide_where_pythons_hash_does() -> None:
    """A prefix hit reuses KV without comparing tokens. Python hashes an int modulo
    2**61 - 1, so (5,) and (5 + 2**61 - 1,) hash alike as tuples; the block digests
    must differ, and a context built on one must not hit the other's cached blocks."""
    wrap = 2**61 - 1
    first, second = [5, 6, 7, 8], [5 + wrap, 6, 7, 8]
    assert hash((None, tuple(first))) == hash((None, tuple(second)))  # what the cache must not trust
    assert hash_block(None, first) != hash_block(None, second)
    parent = hash_block(None, [1, 2, 3, 4])
    assert hash_block(parent, first) != hash_block(parent, second)
    assert hash_block(parent, first) != hash_block(hash_block(None, [1, 2, 3, 5]), first)  # chained
    assert hash_block(None, first).bit_length() > 64  # a 128-bit digest, not a 64-bit hash

    kv = KVCacheManager(8, BLOCK, True)
    owner = make_request("a", first + [9])
    assert kv.allocate_slots(owner, 5)
    owner.num_computed_tokens = 5
    kv.cache_computed_blocks(owner)
    assert kv.cached_prefix(kv.block_hashes(first)) != []
    assert kv.cached_prefix(kv.block_hashes(second)) == []


def test_block_hashes_are_equal_in_another_process() -> None:
    """A digest of the tokens alone: the same in every process, whatever its
    PYTHONHASHSEED."""
    code = "from seer_engine.core.kv_cache_manager import hash_block as h; print(h(h(None, [1, 2]), [3]))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    ).stdout  # fmt: skip
    assert int(out) == hash_block(hash_block(None, [1, 2]), [3])


def test_without_prefix_caching_siblings_compute_their_own_blocks() -> None:
    prompt = list(range(500, 510))
    sched = make_scheduler(prefix_caching=False)
    sched.add_request(make_request("a", prompt))
    sched.add_request(make_request("b", prompt))
    out, _ = step(sched)
    assert spans(out) == [("a", 10), ("b", 10)]
    assert not set(sched.kv.block_ids("a")) & set(sched.kv.block_ids("b"))


# -- preemption ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix_caching,recomputed,resumed_span",
    [(False, 8, 9), (True, 4, 5)],  # with the cache, the victim's first block survives
)
def test_preemption_takes_the_policys_victim_and_counts_recomputation(
    prefix_caching: bool, recomputed: int, resumed_span: int
) -> None:
    """Three requests fill 6 of 7 blocks; when they need a third block each, FCFS preempts
    the last arrival, which later recomputes its prompt and output (less what the prefix
    cache still holds) and finishes as if nothing happened."""
    sched = make_scheduler(num_blocks=7, prefix_caching=prefix_caching)
    r0, r1 = make_request("r0", 7, max_tokens=3), make_request("r1", 7, max_tokens=3)
    r2 = make_request("r2", 7, max_tokens=5)
    for r in (r0, r1, r2):
        sched.add_request(r)
    step(sched)
    step(sched)
    assert sched.kv.num_free_blocks == 1 and r2.num_computed_tokens == 8
    out, _ = step(sched)
    assert out.preempted == [r2] and spans(out) == [("r0", 1), ("r1", 1)]
    assert r2.status is RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_preemptions == 1 and sched.stats.preemptions == 1
    assert r2.output_token_ids == [TOKEN, TOKEN], "preemption keeps the tokens, drops the KV"
    assert r0.is_finished and r1.is_finished
    out, _ = step(sched)
    assert spans(out) == [("r2", resumed_span)]
    assert sched.stats.recomputed_tokens == recomputed
    run_to_end(sched)
    assert r2.output_token_ids == [TOKEN] * 5 and r2.status is RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(sched)


def test_priority_policy_preempts_its_lowest_priority_request() -> None:
    """Under the priority policy the victim is the request it would run last, even the
    earliest arrival."""
    sched = make_scheduler(num_blocks=6, policy="priority")
    reqs = [make_request(f"r{i}", 7, max_tokens=8, priority=p) for i, p in enumerate((1, 0, 0))]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted == [reqs[0]]
    assert spans(out) == [("r1", 1), ("r2", 1)]


def test_no_admission_in_a_step_that_preempted() -> None:
    """A step that had to preempt admits no one, even a request that would fit in the
    block the preemption left free: blocks are short, so it would be preempted next."""
    sched = make_scheduler(num_blocks=6, policy="priority", prefix_caching=False)
    for rid, prompt in (("r0", 7), ("r1", 5), ("r2", 5)):
        sched.add_request(make_request(rid, prompt, max_tokens=8))
    step(sched)
    step(sched)
    sched.add_request(make_request("late", 1, priority=-1))
    out, _ = step(sched)
    assert [r.request_id for r in out.preempted] == ["r2"] and spans(out) == [("r0", 1), ("r1", 1)]
    assert sched.kv.num_free_blocks == 1
    out, _ = step(sched)
    assert ("late", 1) in spans(out)


# -- order -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy,order", [("fcfs", ["r0", "r1", "r2"]), ("priority", ["r1", "r2", "r0"])])
def test_admission_order_follows_the_policy(policy: str, order: list[str]) -> None:
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for i, priority in enumerate((2, 0, 1)):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=1, priority=priority))
    admitted = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        admitted += [r.request_id for r, _ in out.scheduled]
    assert admitted == order


# -- drafts --------------------------------------------------------------------------------


def test_a_draft_rides_only_on_a_decode_row() -> None:
    """A request still in its prompt gets no draft nodes, budget left or not: the draft
    is dropped."""
    sched = make_scheduler(budget=8)
    r = make_request("r", 10)
    sched.add_request(r)
    step(sched)
    r.draft = path([5, 6])
    out, _ = step(sched)
    assert spans(out) == [("r", 2)] and r.draft is None
    assert sched.stats.draft_tokens_verified == 0


def test_a_draft_is_cut_to_the_budget_left() -> None:
    sched = make_scheduler(budget=4)
    r = make_request("r", 3)
    sched.add_request(r)
    step(sched)
    r.draft = path([5, 6, 7, 8, 9, 10])
    out = sched.schedule()
    assert spans(out) == [("r", 4)]
    assert r.draft == path([5, 6, 7]) and sched.stats.draft_tokens_verified == 3


def test_a_draft_never_preempts() -> None:
    """Both requests fill their two blocks; the draft would need a third block, so it is
    dropped rather than preempting the other request."""
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 6), make_request("b", 6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    a.draft = path([5, 6, 7])
    out, _ = step(sched)
    assert out.preempted == [] and spans(out) == [("a", 1), ("b", 1)]
    assert a.draft is None and sched.stats.preemptions == 0


def test_a_draft_never_takes_a_block_a_later_decode_row_needs() -> None:
    """The last free block would hold a's draft or b's next token: b's token comes
    first, so the draft is dropped and nobody is preempted for it."""
    sched = make_scheduler(num_blocks=3)
    a, b = make_request("a", 3), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 4 tokens in one block; b: 5 tokens, its fifth needs a second block
    a.draft = path([5, 6])
    out, _ = step(sched)
    assert out.preempted == [] and spans(out) == [("a", 1), ("b", 1)]
    assert a.draft is None and sched.stats.preemptions == 0


def test_accepted_draft_tokens_advance_and_rejected_slots_are_trimmed() -> None:
    sched = make_scheduler(num_blocks=16)
    r = make_request("r", 6)
    sched.add_request(r)
    step(sched)  # 7 tokens: two blocks
    r.draft = path([40, 41, 42, 43, 44, 45])
    out = sched.schedule()
    assert spans(out) == [("r", 7)] and len(sched.kv.block_ids("r")) == 4  # 13 slots
    # Two draft nodes accepted, then the bonus token.
    sched.update_from_output(out, {"r": [40, 41, 50]})
    assert r.output_token_ids == [TOKEN, 40, 41, 50] and r.draft is None
    assert r.num_computed_tokens == r.num_tokens - 1 == 9
    assert len(sched.kv.block_ids("r")) == 3 and sched.kv.num_free_blocks == 13
    stats = sched.stats
    assert (stats.draft_tokens_verified, stats.draft_tokens_accepted) == (6, 2)
    assert (stats.generated_tokens, stats.sampled_rows) == (4, 2)


def test_rejected_draft_slots_leave_the_prefix_cache_alone() -> None:
    """Most steps a's draft needs one more block, which its rejection gives back. Such blocks
    hold nothing, so they are the next to be reused: steps of drafting never evict the
    cached prompt of a finished request (a rollout chunk resumes from such a prefix)."""
    sched = make_scheduler(num_blocks=16)
    done = make_request("done", 8, max_tokens=1)
    sched.add_request(done)
    run_to_end(sched)
    a = make_request("a", 3, max_tokens=30)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        if a.num_computed_tokens == a.num_tokens - 1:
            a.draft = path([40, 41, 42])
        step(sched)  # emits TOKEN: every draft is rejected
    assert sched.stats.draft_tokens_verified >= 60
    again = make_request("again", [*done.prompt_token_ids, TOKEN], max_tokens=1)
    assert sched.kv.get_computed_blocks(again)[1] == 8
    assert_all_blocks_free(sched)


@pytest.mark.parametrize(
    "params,tokens,status",
    [
        ({}, [40, EOS, 42, 43], RequestStatus.FINISHED_STOPPED),
        ({"stop_token_ids": [STOP]}, [40, STOP, 42, 43], RequestStatus.FINISHED_STOPPED),
        ({"max_tokens": 3}, [40, 41, 42, 43], RequestStatus.FINISHED_LENGTH),
    ],
    ids=["eos", "stop-token", "max-tokens"],
)
def test_accepted_tokens_cut_by_a_stop_are_not_counted(params: dict, tokens: list[int], status) -> None:
    """Three accepted nodes and a bonus token, but the second token ends the request:
    only one accepted draft token was emitted."""
    sched = make_scheduler()
    r = make_request("r", 6, **{"max_tokens": 16, **params})
    sched.add_request(r)
    step(sched)
    r.draft = path(tokens[:3])
    out = sched.schedule()
    sched.update_from_output(out, {"r": tokens})
    assert r.status is status and r.output_token_ids == [TOKEN, *tokens[:2]]
    assert sched.stats.generated_tokens == 3
    assert sched.stats.draft_tokens_accepted == 1
    assert_all_blocks_free(sched)


def test_finish_truncated_drops_tokens_from_the_counters() -> None:
    """A stop string ending inside the accepted tokens (the engine checks text) removes
    the tokens after it from the output and from the counters."""
    sched = make_scheduler()
    r = make_request("r", 6)
    sched.add_request(r)
    step(sched)
    r.draft = path([40, 41, 42])
    sched.update_from_output(sched.schedule(), {"r": [40, 41, 42, 43]})
    assert (sched.stats.generated_tokens, sched.stats.draft_tokens_accepted) == (5, 3)
    sched.finish_truncated(r, 3, RequestStatus.FINISHED_STOPPED)
    assert r.output_token_ids == [TOKEN, 40, 41] and r.status is RequestStatus.FINISHED_STOPPED
    assert (sched.stats.generated_tokens, sched.stats.draft_tokens_accepted) == (3, 1)
    assert_all_blocks_free(sched)


# -- stops -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,emitted,output,status,reason",
    [
        ({}, [TOKEN, TOKEN, EOS], 3, RequestStatus.FINISHED_STOPPED, None),
        ({"ignore_eos": True, "max_tokens": 5}, [EOS] * 5, 5, RequestStatus.FINISHED_LENGTH, None),
        ({"stop_token_ids": [STOP]}, [TOKEN, STOP], 2, RequestStatus.FINISHED_STOPPED, STOP),
        ({"max_tokens": 4}, [], 4, RequestStatus.FINISHED_LENGTH, None),
        ({"max_tokens": 100, "max_model_len": 10}, [], 4, RequestStatus.FINISHED_LENGTH, None),
    ],
    ids=["eos", "ignore-eos", "stop-token", "max-tokens", "max-model-len"],
)
def test_stop_conditions(kwargs: dict, emitted: list[int], output: int, status, reason) -> None:
    max_model_len = kwargs.pop("max_model_len", 256)
    sched = make_scheduler(max_model_len=max_model_len)
    r = make_request("r", 6, **kwargs)
    sched.add_request(r)
    run_to_end(sched, script(emitted))
    assert r.num_output_tokens == output and r.status is status and r.stop_reason == reason
    assert r.output_token_ids[: len(emitted)] == emitted[:output]
    assert_all_blocks_free(sched)


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    sched = make_scheduler()
    r = make_request("r", 6, min_tokens=3, stop_token_ids=[STOP])
    sched.add_request(r)
    run_to_end(sched, script([EOS, STOP, EOS, TOKEN]))
    assert r.output_token_ids == [EOS, STOP, EOS] and r.status is RequestStatus.FINISHED_STOPPED


# -- cleanup -----------------------------------------------------------------------------


def test_every_block_is_free_after_a_mixed_workload() -> None:
    """Shared prompts, chunked prefill, preemption and drafts with random acceptance:
    every request gets its full output and every block comes back."""
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, budget=16, max_num_seqs=8)
    requests = []
    for g in range(4):
        prompt = [1000 * g + i for i in range(rng.randint(5, 30))]
        for s in range(3):
            requests.append(make_request(f"g{g}-{s}", prompt, max_tokens=rng.randint(3, 14)))
            sched.add_request(requests[-1])

    def emit(r: Request) -> list[int]:
        accepted = rng.randint(0, len(r.draft)) if r.draft else 0
        return [*(r.draft.tokens[:accepted] if r.draft else []), TOKEN]

    for _ in range(500):
        for r in sched.running:
            if r.num_computed_tokens == r.num_tokens - 1 and rng.random() < 0.5:
                r.draft = path([TOKEN] * rng.randint(1, 6))
        step(sched, emit)
        if not sched.has_unfinished_requests():
            break
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    assert sched.stats.preemptions > 0 and sched.stats.draft_tokens_accepted > 0
    assert sched.kv.prefix_hits > 0
    assert_all_blocks_free(sched)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    """Aborting a running, a mid-prefill and a waiting request frees their blocks; a
    sibling that waited for the aborted prefill's blocks is admitted next step."""
    sched = make_scheduler(budget=8)
    running = make_request("running", 3)
    prompt = list(range(500, 520))
    prefill, sibling = make_request("prefill", prompt), make_request("sibling", prompt)
    waiting = make_request("waiting", 3)
    sched.add_request(running)
    step(sched)
    for r in (prefill, sibling, waiting):
        sched.add_request(r)
    out, _ = step(sched)
    assert spans(out) == [("running", 1), ("prefill", 7)]
    assert sibling.status is RequestStatus.WAITING and waiting.status is RequestStatus.WAITING
    done = sched.finish_requests(["running", "prefill", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert done == [running, prefill, waiting]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in done)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks and not sched.kv.pending
    assert sched.finish_requests(["running"], RequestStatus.FINISHED_ABORTED) == []
    out, _ = step(sched)
    assert spans(out) == [("sibling", 8)]
    run_to_end(sched)
    assert_all_blocks_free(sched)
