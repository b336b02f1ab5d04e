"""Trace replay: the model runs for real, the emitted tokens come from a trace.

This object is the only holder of the trace's responses. Policies and the Context
Manager never receive it, so they cannot learn a response's length before it ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from seer_engine.core.request import Request
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import SamplingParams
from seer_engine.workloads.groups import WorkloadGroup


class TraceReplay:
    """Emits each response's trace tokens, looked up by the request's ``sequence_id``
    (the response's key, e.g. ``t3/5``, which every rollout chunk of it carries)."""

    def __init__(self, responses: Mapping[str, Sequence[int]], eos_token_id: int) -> None:
        self._responses = {k: list(v) for k, v in responses.items()}
        self._eos = eos_token_id

    def next_token(self, request: Request, sampled: int, offset: int = 0) -> int:
        """The trace's token ``offset`` places after this response's next one (EOS past its end)."""
        tokens = self._responses[request.sequence_id]
        position = request.num_output_tokens + offset
        return tokens[position] if position < len(tokens) else self._eos


class ReplayWorkload:
    """Trace groups as a rollout replays them: groups ``t<id>`` of ``samples`` responses
    each, the responses for ``TraceReplay``, and the true lengths (the trace's tokens
    plus EOS, capped at ``max_tokens``) that only the oracle policy is handed."""

    def __init__(
        self, trace_groups: Sequence[WorkloadGroup], samples: int, max_tokens: int, first: int = 0
    ) -> None:
        """``first``: the trace response that is sample 0 (iteration ``k`` of a rollout that
        revisits its prompts takes ``first = k * samples``: disjoint sibling sets)."""
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.samples = samples
        self.prompts: list[tuple[str, list[int]]] = []
        self.responses: dict[str, list[int]] = {}
        for tg in trace_groups:
            if len(tg.response_token_ids) < first + samples:
                raise ValueError(
                    f"trace group {tg.group_id} has only {len(tg.response_token_ids)} responses, "
                    f"{first + samples} needed (responses {first}..{first + samples - 1})"
                )
            gid = f"t{tg.group_id}"
            self.prompts.append((gid, list(tg.prompt_token_ids)))
            for j, tokens in enumerate(tg.response_token_ids[first : first + samples]):
                self.responses[f"{gid}/{j}"] = list(tokens)
        self.true_lengths = {k: min(len(v) + 1, max_tokens) for k, v in self.responses.items()}

    def groups(self) -> list[Group]:
        """Fresh groups (a rollout sets their order), in trace order."""
        return [
            Group(gid, ids, self.params, self.samples, self.params.max_tokens, order=k)
            for k, (gid, ids) in enumerate(self.prompts)
        ]

    def replay(self, eos_token_id: int) -> TraceReplay:
        """The token source for the engines (the model's EOS id ends each response)."""
        return TraceReplay(self.responses, eos_token_id)
