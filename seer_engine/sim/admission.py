"""An admission rule only a simulator can run: ``peak`` told where every response ends.

``peak`` must assume a chunk runs to its limit; most end sooner (a response finishes
inside its chunk), and the KV held back for them is concurrency lost. Given the true
lengths, the same rule admits exactly what fits: no online rule can pack an instance
tighter without preempting. Run with the ``oracle`` order it bounds what any
no-preemption scheduler can reach on a workload (``simulate --admission peak-known``).
"""

from __future__ import annotations

from seer_engine.rollout.admission import PeakAdmission
from seer_engine.rollout.types import RolloutSample

KNOWN_ENDS = "peak-known"


class KnownEndsAdmission(PeakAdmission):
    name = KNOWN_ENDS

    def __init__(self, lengths: dict[str, int]) -> None:
        """``lengths``: each response's true output length (sample key -> tokens)."""
        super().__init__()
        self.name = KNOWN_ENDS
        self.lengths = lengths

    def chunk_end(self, sample: RolloutSample, end: int) -> int:
        return min(end, self.lengths[sample.key])
