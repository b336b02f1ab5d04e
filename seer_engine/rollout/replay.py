"""Trace replay: the model runs for real, the emitted tokens come from a trace.

This object is the only holder of the trace's responses. Policies and the Context
Manager never receive it, so they cannot learn a response's length before it ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from seer_engine.core.request import Request
from seer_engine.rollout.rollout import sample_key_of


class TraceReplay:
    def __init__(self, responses: Mapping[str, Sequence[int]], eos_token_id: int) -> None:
        self._responses = {k: list(v) for k, v in responses.items()}
        self._eos = eos_token_id

    def next_token(self, request: Request, sampled: int, offset: int = 0) -> int:
        """The trace's token ``offset`` places after this response's next one (EOS past its end)."""
        tokens = self._responses[sample_key_of(request.request_id)]
        position = request.num_output_tokens + offset
        return tokens[position] if position < len(tokens) else self._eos
