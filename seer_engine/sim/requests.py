"""What a modeled engine schedules: its chunks in flight and its stretches of work."""

from __future__ import annotations

from dataclasses import dataclass, field

from seer_engine.outputs import CompletionOutput, RequestOutput
from seer_engine.sim.world import TokenCount


@dataclass(eq=False)
class SimRequest:
    """One dispatched chunk inside a modeled engine."""

    request_id: str
    key: str  # the response (sample key)
    group_id: str
    prompt_len: int
    generated: float  # output tokens (as of ``progress_start`` while decoding)
    end: int  # output tokens at which the chunk stops
    finish_reason: str  # what it reports when it gets there
    arrival_order: int
    hit: int = 0  # context tokens it will find in place when admitted
    computed: float = 0.0  # context tokens whose KV is in place (prefill rows)
    lost: float = 0.0  # computed tokens a preemption dropped
    progress_start: float = 0.0
    priority: int = 0  # the engine's scheduling policies read this and arrival_order
    cuttable: bool = False  # out of KV, the engine ends the chunk where it is (KV kept), not preempts it
    band: int = 0  # its decoding band: 1 if its drafts weigh the priority weight (a long response)

    @property
    def context(self) -> float:
        return self.prompt_len + self.generated

    def output(self, reason: str) -> RequestOutput:
        """The chunk's final output (token counts stand in for tokens)."""
        n = int(round(self.generated))
        completion = CompletionOutput(0, "", TokenCount(n), None, None, finish_reason=reason)
        return RequestOutput(self.request_id, None, TokenCount(self.prompt_len), [completion], finished=True)


@dataclass
class Segment:
    """The instance's next stretch of work: ``steps`` alike decode steps, or one mixed step."""

    steps: int
    seconds: float
    end: float
    rows: tuple[int, ...] = ()  # decoding rows per band
    gain: tuple[float, ...] = ()  # tokens each decoding row of a band gains per step
    drafted: tuple[float, ...] = ()  # draft nodes per decoding row of a band and step
    prefill: list[tuple[SimRequest, float]] = field(default_factory=list)  # (request, new tokens): one step
    admit: list[SimRequest] = field(default_factory=list)

    @property
    def mixed(self) -> bool:
        return bool(self.prefill or self.admit)

    @property
    def decoding_rows(self) -> int:
        return sum(self.rows)

    @property
    def decode_tokens(self) -> float:
        """Tokens the decoding rows schedule each step (their own and their drafts)."""
        return sum(n * (1 + d) for n, d in zip(self.rows, self.drafted))

    @property
    def growth(self) -> float:
        """Tokens the decoding rows gain each step, all together."""
        return sum(n * g for n, g in zip(self.rows, self.gain))


def prefill_spans(prefilling: list[SimRequest], budget: float) -> list[tuple[SimRequest, float]]:
    """The context tokens each row still prefilling computes in the next step, in order,
    within the step's token ``budget``."""
    spans = []
    for req in prefilling:
        n = min(req.context - req.computed, max(budget, 0))
        if n > 0:
            spans.append((req, n))
            budget -= n
    return spans
