"""One stats record per engine, one name per counter.

``EngineStats`` is what an engine reports (load gauges and cumulative counters); a
rollout sums it over its instances, the server publishes it under /metrics, and
rollout reports total it per policy. The scheduler keeps the counters it owns in
``SchedulerStats`` under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seer_engine.core.request import Request


@dataclass
class EngineStats:
    running: int = 0  # samples running in the engine
    waiting: int = 0  # samples waiting for admission
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    steps: int = 0
    preemptions: int = 0
    chunk_cuts: int = 0  # cuttable rollout chunks ended early for KV instead of preempted
    recomputed_tokens: int = 0  # tokens computed again because preemption dropped their KV
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    sampled_rows: int = 0  # request-steps that emitted tokens; < generated_tokens with drafts
    draft_tokens_verified: int = 0
    draft_tokens_accepted: int = 0  # accepted draft tokens that were emitted
    drafter_s: float = 0.0  # CPU time feeding and querying the draft proposer

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def counters(self) -> EngineStats:
        """The counts since start, without the figures of the moment (running, waiting,
        KV): what a lost instance still adds to a sum of counters that must never drop."""
        return replace(self, running=0, waiting=0, kv_used_blocks=0, kv_total_blocks=0)

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0

    @property
    def accepted_tokens_per_step(self) -> float:
        """Draft tokens accepted per request-step (0 without speculative decoding)."""
        return self.draft_tokens_accepted / self.sampled_rows if self.sampled_rows else 0.0


@dataclass(frozen=True)
class StepShape:
    """What one step computed, for a step-time model to price (the simulator's profiles,
    and real engines run on a modeled clock)."""

    scheduled_tokens: int
    kv_tokens: int  # context each row attends, once per row (a GPU reads a row's KV once)
    kv_pairs: int  # query-key pairs (a CPU computes every new token against its context)
    logit_tokens: int  # tokens whose logits are computed (LM head, sampling)
    kind: str = "decode"  # "prefill" (every row in its prompt), "mixed" or "decode"

    @classmethod
    def of_step(cls, scheduled: list[tuple[Request, int]]) -> StepShape:
        """From a step's (request, new tokens) rows."""
        return cls.of(
            [
                (
                    r.num_computed_tokens,
                    n,
                    r.num_prompt_tokens,
                    r.num_tokens,
                    r.prompt_rows_to_score(r.num_computed_tokens, r.num_computed_tokens + n),
                )
                for r, n in scheduled
            ]
        )

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int, int]]) -> StepShape:
        """From (computed tokens before the step, new tokens, prompt tokens, all tokens,
        prompt positions scored) of every scheduled row; a row reaching its last token
        computes logits for it and each draft node after it, and a prompt scored for
        prompt_logprobs computes logits for each position scored."""
        kv = pairs = logits = prompts = 0
        for computed, new, prompt, num_tokens, scored in rows:
            kv += computed + new
            pairs += new * computed + new * (new + 1) // 2
            logits += max(0, computed + new - num_tokens + 1) + scored
            prompts += computed < prompt
        kind = "prefill" if prompts == len(rows) else "mixed" if prompts else "decode"
        return cls(sum(r[1] for r in rows), kv, pairs, logits, kind)


def total(stats: list[EngineStats]) -> EngineStats:
    out = EngineStats()
    for s in stats:
        out = out + s
    return out
