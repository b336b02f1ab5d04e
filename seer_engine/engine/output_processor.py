"""User requests and the outputs they become.

A user request of n samples runs as n scheduler requests; the output processor keeps
them together, turns finished samples into ``CompletionOutput``s (text, stop-string
trimming, logprobs) and reports a ``RequestOutput`` when all have finished (or every
step, for a streaming request).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from seer_engine.core.request import Request, RequestStatus
from seer_engine.engine.detokenizer import Detokenizer, new_stop_match
from seer_engine.engine.stream_text import StreamText
from seer_engine.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from seer_engine.sampling_params import SamplingParams


def append_logprob(
    entries: list[dict[int, tuple[float, int]]], token: int, lp: tuple[float, int, list[tuple[int, float]]]
) -> float:
    """Append a token's logprob entry (the token and the top-N: id -> (logprob, rank));
    returns the token's logprob."""
    chosen, rank, top = lp
    entry = {token: (chosen, rank)}
    for r, (tid, value) in enumerate(top, start=1):
        entry.setdefault(tid, (value, r))
    entries.append(entry)
    return chosen


@dataclass
class UserRequest:
    """A user request; its n samples run as separate scheduler requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request] = field(default_factory=list)
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)  # finished samples
    stream: bool = False  # report progress every step, not only at the end

    @property
    def finished(self) -> bool:
        return len(self.outputs) == len(self.children)


class OutputProcessor:
    def __init__(self, detokenizer: Detokenizer, on_finished: Callable[[UserRequest], None]) -> None:
        """``on_finished``: called when a user request's last sample finished."""
        self.detokenizer = detokenizer
        self.on_finished = on_finished
        self.requests: dict[str, UserRequest] = {}
        self._of_child: dict[str, UserRequest] = {}
        # Streaming samples' logprobs converted so far (the engine's entries beside the
        # output ones): each step converts only the new entries, not the whole output again.
        self._shown_logprobs: dict[str, tuple[list, SampleLogprobs]] = {}
        self._stream_texts: dict[str, StreamText] = {}  # unfinished streaming samples' text

    def add(self, request: UserRequest) -> None:
        self.requests[request.request_id] = request
        for child in request.children:
            self._of_child[child.request_id] = request

    def child_ids(self, request_ids: list[str]) -> list[str]:
        """Scheduler request ids of user ids (sample ids pass through)."""
        out: list[str] = []
        for rid in request_ids:
            request = self.requests.get(rid)
            out.extend([c.request_id for c in request.children] if request else [rid])
        return out

    def collect(self, updated: list[Request]) -> list[RequestOutput]:
        """Final outputs of user requests whose samples all finished, plus progress of
        streaming ones (``finished=False``, every sample's tokens so far)."""
        touched: dict[str, UserRequest] = {}
        for req in updated:
            parent = self._of_child.get(req.request_id)
            if parent is None:
                continue
            touched[parent.request_id] = parent
            if req.is_finished:
                parent.outputs[req.sample_index] = self.completion(req)
                del self._of_child[req.request_id]
                self._shown_logprobs.pop(req.request_id, None)
                self._stream_texts.pop(req.request_id, None)
        outputs = []
        for parent in touched.values():
            if not (parent.finished or parent.stream):
                continue
            if parent.finished:
                del self.requests[parent.request_id]
                self.on_finished(parent)
            samples = [parent.outputs.get(c.sample_index) or self.completion(c) for c in parent.children]
            scored = parent.children[0].prompt_logprobs  # the first sample scores the prompt
            prompt_logprobs = None if scored is None else [None, *self.detokenizer.logprobs_to_output(scored)]
            outputs.append(
                RequestOutput(
                    parent.request_id, parent.prompt, parent.prompt_token_ids, samples, parent.finished,
                    prompt_logprobs,
                )
            )  # fmt: skip
        return outputs

    def completion(self, req: Request) -> CompletionOutput:
        params = req.sampling_params
        text_ids = req.output_token_ids
        if (
            req.status is RequestStatus.FINISHED_STOPPED
            and not isinstance(req.stop_reason, str)
            and not params.include_stop_str_in_output
        ):
            text_ids = text_ids[:-1]  # the stop token (EOS or a stop token id) is not text, as in vLLM
        if not req.is_finished and req.request_id in self._of_child:  # a streaming sample's progress
            text = self._stream_text(req).text(text_ids)
        else:
            text = self._final_text(req, text_ids)
        return CompletionOutput(
            index=req.sample_index,
            text=text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=self._logprobs(req),
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
        )

    def _final_text(self, req: Request, text_ids: list[int]) -> str:
        """A finished sample's text, decoded whole, once, and cut at its stop string."""
        params = req.sampling_params
        lead = self.detokenizer.text_lead(req.prompt_token_ids)
        text = self.detokenizer.output_text(lead, text_ids, params.skip_special_tokens)
        if isinstance(req.stop_reason, str):
            # Cut at the match the last token completed, not at an earlier occurrence.
            before = self.detokenizer.output_text(lead, text_ids[:-1], params.skip_special_tokens)
            hit = new_stop_match(before, text, [req.stop_reason])
            if hit is not None:
                text = text[: hit[0] + (len(req.stop_reason) if params.include_stop_str_in_output else 0)]
        return text

    def _stream_text(self, req: Request) -> StreamText:
        stream = self._stream_texts.get(req.request_id)
        if stream is None:
            lead = self.detokenizer.text_lead(req.prompt_token_ids)
            skip = req.sampling_params.skip_special_tokens
            stream = self._stream_texts[req.request_id] = StreamText(self.detokenizer, lead, skip)
        return stream

    def _logprobs(self, req: Request) -> SampleLogprobs | None:
        """The sample's logprobs as output, converting only entries not converted at an
        earlier step of a streaming request (entries are only appended, or cut from the
        end by a stop string); a fresh list each time, as outputs cross threads."""
        if req.logprobs is None:
            return None
        parent = self._of_child.get(req.request_id)
        if parent is None or not parent.stream:  # converted once, when the sample finishes
            return self.detokenizer.logprobs_to_output(req.logprobs)
        sources, shown = self._shown_logprobs.setdefault(req.request_id, ([], []))
        keep = min(len(sources), len(req.logprobs))
        if keep and sources[keep - 1] is not req.logprobs[keep - 1]:
            keep = 0  # not the entries converted before: convert them all again
        del sources[keep:], shown[keep:]
        new = req.logprobs[keep:]
        sources.extend(new)
        shown.extend(self.detokenizer.logprobs_to_output(new) or [])
        return list(shown)
