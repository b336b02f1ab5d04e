"""Continuous batching with one rule: computed tokens chase the target.

Each step grants every running request ``num_tokens - num_computed_tokens`` new
tokens (a decode step is 1, a prefill span is up to the budget), plus the nodes of
its draft when it speculates, then admits waiting requests in policy order while the
token budget, ``max_num_seqs`` and free KV blocks allow. When blocks run out, the
policy's victim is preempted and recomputed later.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from seer_engine.core.kv_cache_manager import KVCacheManager
from seer_engine.core.policies import SchedulingPolicy
from seer_engine.core.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True


@dataclass
class SchedulerOutput:
    """The work of one step, in batch order: each request with its number of new tokens."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    cut: list[Request] = field(default_factory=list)  # cuttable chunks ended for KV (finished)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    chunk_cuts: int = 0  # cuttable rollout chunks ended early for KV instead of preempted
    recomputed_tokens: int = 0  # tokens computed again because preemption dropped their KV
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    sampled_rows: int = 0  # request-steps that emitted tokens (< tokens once drafts are accepted)
    draft_tokens_verified: int = 0  # draft nodes verified
    draft_tokens_accepted: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, policy: SchedulingPolicy) -> None:
        self.config = config
        self.kv = kv_manager
        self.policy = policy
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._lost_tokens: dict[str, int] = {}  # computed tokens dropped at preemption

    # -- queue management ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; unknown ids are ignored."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._finish(request, status)
            done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self._lost_tokens.pop(request.request_id, None)
        del self.requests[request.request_id]

    def finish_truncated(self, request: Request, num_output_tokens: int, status: RequestStatus) -> None:
        """Finish a request whose output ends inside the tokens it emitted in the last
        step (a stop string matched there): the tokens after the end are dropped and
        leave the generated and accepted counters too. A request that already finished
        in that step (at its length) takes the new status: the stop string ended it."""
        dropped = max(0, request.num_output_tokens - num_output_tokens)
        request.truncate_output(num_output_tokens)
        self.stats.generated_tokens -= dropped
        self.stats.draft_tokens_accepted -= dropped
        if request.is_finished:
            request.status = status
        else:
            self.finish_requests([request.request_id], status)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.draft = None
        self.kv.free(request)
        self._lost_tokens[request.request_id] = request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.append(request)
        self.stats.preemptions += 1

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for request in sorted(self.running, key=self.policy.sort_key):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                scheduled = {id(r) for r, _ in out.scheduled}
                victim = self.policy.select_victim([r for r in self.running if id(r) not in scheduled])
                if victim.cut_after is not None and victim.num_output_tokens > victim.cut_after:
                    self._finish(victim, RequestStatus.FINISHED_LENGTH)
                    self.stats.chunk_cuts += 1
                    out.cut.append(victim)
                else:
                    self._preempt(victim)
                    out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                out.scheduled.append((request, num_new))
                budget -= num_new
        for i, (request, num_new) in enumerate(out.scheduled):
            num_draft = self._fit_draft(request, num_new, budget)
            out.scheduled[i] = (request, num_new + num_draft)
            budget -= num_draft
        if not out.preempted and not out.cut:
            budget = self._admit_waiting(out, budget)
        self.stats.steps += 1
        self.stats.scheduled_tokens += out.num_batched_tokens
        return out

    def _fit_draft(self, request: Request, num_new: int, budget: int) -> int:
        """Make room for the request's draft on top of its decode token; returns how
        many draft nodes fit (the draft is shortened to them, or dropped).

        Drafts ride only on a decode row, only in the token budget and free KV blocks
        left once every running request has its own tokens: speculation never
        preempts anyone, nor takes a block another running request needs this step.
        """
        draft = request.draft
        if not draft:
            return 0
        room = min(len(draft), budget) if num_new == 1 else 0
        if room > 0 and self.kv.allocate_slots(request, num_new + room):
            request.draft = draft.truncated(room)
            self.stats.draft_tokens_verified += room
            return room
        request.draft = None
        return 0

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        self.waiting.sort(key=self.policy.sort_key)
        admitted: list[Request] = []
        for request in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.needs_prompt_logprobs:  # it scores every prompt position: no cache hits
                hits, num_hit = [], 0
            else:
                hits, num_hit = self.kv.get_computed_blocks(request)
                if self.kv.prefix_pending(request, len(hits)):
                    continue  # share the blocks a running request is computing right now
            remaining = request.num_tokens - num_hit
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            lost = self._lost_tokens.pop(request.request_id, 0)
            self.stats.recomputed_tokens += max(0, lost - num_hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        if admitted:
            ids = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
        return budget

    def update_from_output(self, out: SchedulerOutput, emitted: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, append emitted tokens, finish requests that stop.

        ``emitted`` holds, for each request whose span reached its last token, the
        tokens it emits: one, or with a draft the accepted nodes' tokens and the bonus
        token. They are appended one by one and a stop condition drops the rest, as if
        they had been decoded one per step. The KV of the accepted nodes is in place
        (the runner moved it), so they count as computed; the slots of rejected nodes
        are given back. Returns the requests that got tokens (finished ones included).
        """
        updated = []
        for request, num_new in out.scheduled:
            draft, request.draft = request.draft, None
            tokens = emitted.get(request.request_id)
            if not tokens:  # a prefill span that has not reached the end of the prompt
                request.num_computed_tokens += num_new
                self.kv.cache_computed_blocks(request)
                continue
            num_draft = len(draft) if draft else 0
            status = None
            num_emitted = 0
            for token in tokens:
                request.append_output_token(token)
                num_emitted += 1
                status = check_stop(request, token, self.config.max_model_len)
                if status is not None:
                    break
            # Accepted draft tokens that a stop cut off were never emitted: not counted.
            self.stats.generated_tokens += num_emitted
            self.stats.sampled_rows += 1
            self.stats.draft_tokens_accepted += num_emitted - 1
            computed = request.num_computed_tokens + num_new - num_draft + num_emitted - 1
            request.num_computed_tokens = min(computed, request.num_tokens - 1)
            self.kv.cache_computed_blocks(request)
            updated.append(request)
            if status is not None:
                self._finish(request, status)
            elif num_draft:
                self.kv.trim(request, request.num_tokens)
        return updated


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Token-level stop conditions; stop strings are checked on text by the engine."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
