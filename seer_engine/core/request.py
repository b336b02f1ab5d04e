"""A request as the scheduler sees it: tokens, how many are computed, and its status."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from seer_engine.core.draft import DraftTree
from seer_engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

_arrival_counter = itertools.count()


@dataclass
class Request:
    """One sequence being generated.

    The scheduling rule is uniform: ``num_computed_tokens`` chases ``num_tokens``
    (prompt + output so far). A prefill span, a prefix-cache hit, a decode step and
    recomputation after preemption all just move ``num_computed_tokens`` forward.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, never beyond the model's context
    seed: int  # resolved: every request has one, so sampling depends on (seed, position) only
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    priority: int = 0  # smaller runs first under the priority policy
    group_id: str | None = None
    sample_index: int = 0
    # The response this request generates (a rollout chunk continues one): drafters key
    # their per-response state by it. Defaults to request_id.
    sequence_id: str | None = None
    # A cuttable rollout chunk: out of KV, the scheduler ends it where it is (finish reason
    # "length", its KV left in the prefix cache) instead of preempting it, once it has more
    # output tokens than this (the tokens it started from). None: never cut.
    cut_after: int | None = None
    # A long-tail response (Seer's high-priority requests): the draft budget weighs its
    # nodes priority_weight times, so it drafts deeper than the rest of the batch.
    high_priority: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    # Prompt tokens 1.. with their logprob entries, for a request that reports them (the
    # first sample of one asking for prompt_logprobs, before it has any output).
    prompt_logprobs: list[dict[int, tuple[float, int]]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    # Chained hashes of this request's full blocks, extended lazily by the KV manager.
    block_hashes: list[int] = field(default_factory=list)
    # Draft to verify in the next step (speculative decoding); the scheduler may shorten
    # or drop it and clears it once the step is done.
    draft: DraftTree | None = None

    def __post_init__(self) -> None:
        # Output tokens may arrive with the request: a rollout chunk resuming a sample.
        self.all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        wants = self.sampling_params.prompt_logprobs is not None and self.sample_index == 0
        if wants and not self.output_token_ids and self.prompt_logprobs is None:
            self.prompt_logprobs = []
        if self.sequence_id is None:
            self.sequence_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions are still to be scored: the prompt must be computed, not
        taken from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def prompt_rows_to_score(self, start: int, end: int) -> int:
        """Prompt positions a step computing positions [start, end) scores for
        prompt_logprobs (position p's logits score prompt token p + 1)."""
        if not self.needs_prompt_logprobs or not start <= len(self.prompt_logprobs) < end:
            return 0
        return min(end, self.num_prompt_tokens - 1) - len(self.prompt_logprobs)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens after the first ``num_output_tokens`` (a stop string ended
        the output inside a step that emitted several tokens), with their logprobs."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
        if self.logprobs:
            for entry in self.logprobs[len(self.logprobs) - drop :]:
                self.cumulative_logprob -= next(iter(entry.values()))[0]
            del self.logprobs[len(self.logprobs) - drop :]
