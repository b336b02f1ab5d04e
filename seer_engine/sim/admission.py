"""An admission rule only a simulator can run: ``peak`` told where every response ends.

``peak`` must assume a chunk runs to its limit; most end sooner (a response finishes
inside its chunk), and the KV held back for them is concurrency lost. Given the true
lengths, the same rule holds back nothing for them. Beside ``peak`` it shows how much
of a gap to the baseline is the admission's caution rather than the dispatch order
(``simulate --admission peak-known``). It bounds the admission, not the order: under
it, longest-first (``oracle``) is not always the fastest order.
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
        self.lengths = lengths

    def chunk_end(self, sample: RolloutSample, end: int) -> int:
        return min(end, self.lengths[sample.key])
