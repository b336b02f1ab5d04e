"""/v1/completions: prompts (text or token ids, one or many) -> OpenAI text completions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator

from seer_engine.entrypoints.openai.errors import APIError
from seer_engine.entrypoints.openai.protocol import CompletionRequest
from seer_engine.entrypoints.openai.serving_base import (
    EventStream,
    ServingBase,
    TextDeltas,
    completion_logprobs,
    continuous_usage,
    final_output,
    merge_outputs,
    prompt_logprobs_body,
    random_id,
    sse_error,
    sse_event,
    stop_strings,
    token_label,
    usage,
)
from seer_engine.outputs import CompletionOutput, RequestOutput


def normalize_prompts(prompt: str | list) -> list[str | list[int]]:
    """The four OpenAI prompt shapes as a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


class OpenAIServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest) -> dict | EventStream:
        """A response dict, or SSE lines when ``req.stream``. Refusals raise before any output."""
        self.check_request_model(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
        prompts = normalize_prompts(req.prompt)
        # An echoed prompt with logprobs reports its tokens' logprobs too, as vLLM's does.
        echoed = req.logprobs if req.echo and req.prompt_logprobs is None else None
        # echo with max_tokens 0 scores a prompt: one token is generated, none returned.
        params = self.sampling_params(req, 1 if _scores_only(req) else req.max_tokens, req.logprobs, echoed)
        request_id = req.request_id or random_id("cmpl-")
        streams, release = await self.submit(req, request_id, prompts, params)
        if req.stream:
            return EventStream(self._stream(req, request_id, streams), streams, release)
        try:
            outputs = [_shown(req, await final_output(s)) for s in streams]
        finally:
            release()
        return self._response(req, request_id, outputs)

    # -- whole responses -----------------------------------------------------------------

    def _prompt_text(self, out: RequestOutput) -> str:
        """The prompt an echo shows: the request's text, or its token ids' (a truncated
        prompt's: what was kept), special tokens included, as its logprobs' tokens spell it."""
        if out.prompt is not None:
            return out.prompt
        return self.engine.detokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _response(self, req: CompletionRequest, request_id: str, outputs: list[RequestOutput]) -> dict:
        choices = []
        prompt_tokens = completion_tokens = 0
        for p, out in enumerate(outputs):
            prompt_tokens += len(out.prompt_token_ids)
            prefix = self._prompt_text(out) if req.echo else ""
            for sample in out.outputs:
                completion_tokens += len(sample.token_ids)
                choice = {
                    "index": p * req.n + sample.index,
                    "text": prefix + sample.text,
                    "logprobs": self._logprobs(req, out, sample),
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
                if req.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                    choice["token_ids"] = sample.token_ids
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_body(out)
                choices.append(choice)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.response_model(req),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
            "system_fingerprint": None,
        }

    def _logprobs(self, req: CompletionRequest, out: RequestOutput, sample: CompletionOutput) -> dict | None:
        if req.logprobs is None or sample.logprobs is None:
            return None
        as_ids = req.return_tokens_as_token_ids
        if not req.echo:
            return completion_logprobs(sample.token_ids, sample.logprobs, req.logprobs, 0, as_ids)[0]
        echoed, end = self._echo_logprobs(req, out)
        return _concat(
            echoed, completion_logprobs(sample.token_ids, sample.logprobs, req.logprobs, end, as_ids)[0]
        )

    def _echo_logprobs(self, req: CompletionRequest, out: RequestOutput) -> tuple[dict, int]:
        """The echoed prompt's tokens, which come first, and the offset after them: the
        first token has no logprob (nothing comes before it), the others the engine's."""
        ids, scored = out.prompt_token_ids, out.prompt_logprobs
        as_ids = req.return_tokens_as_token_ids
        first = self.engine.detokenizer.piece(ids[0])
        head = {
            "tokens": [token_label(ids[0], first, as_ids)], "token_logprobs": [None], "top_logprobs": [None],
            "text_offset": [0],
        }  # fmt: skip
        if scored is None or len(scored) != len(ids):  # aborted before its first sample scored it: null
            rest, end = self._unscored(ids[1:], len(first), as_ids)
        else:
            rest, end = completion_logprobs(ids[1:], scored[1:], req.logprobs or 0, len(first), as_ids)
        return _concat(head, rest), end

    @staticmethod
    def _unscored_yet(req: CompletionRequest, out: RequestOutput) -> bool:
        """An echo with logprobs whose prompt is still being scored (by the first sample,
        which another may outrun); the request's final output waits for nothing."""
        scored = out.prompt_logprobs
        waiting = scored is None or len(scored) != len(out.prompt_token_ids)
        return req.echo and req.logprobs is not None and waiting and not out.finished

    def _unscored(self, ids: list[int], offset: int, as_ids: bool) -> tuple[dict, int]:
        pieces = [self.engine.detokenizer.piece(t) for t in ids]
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        nulls = [None] * len(pieces)
        labels = [token_label(t, piece, as_ids) for t, piece in zip(ids, pieces)]
        return {
            "tokens": labels,
            "token_logprobs": nulls,
            "top_logprobs": nulls,
            "text_offset": offsets,
        }, offset

    # -- streaming ---------------------------------------------------------------------------

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        streams: list,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        n = req.n
        deltas = {}
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()
        prompt_tokens: dict[int, int] = {}

        model = self.response_model(req)

        def chunk(choices: list[dict], usage_obj: dict | None = None) -> str:
            return sse_event(request_id, "text_completion", created, model, choices, usage_obj)

        try:
            async for p, generated in merge_outputs(streams):
                out = _shown(req, generated)
                prompt_tokens[p] = len(out.prompt_token_ids)
                choices = []
                for sample in out.outputs:
                    index = p * n + sample.index
                    if index in done:
                        continue
                    first = index not in deltas
                    echoed = None
                    if first and self._unscored_yet(req, out):
                        continue  # an echo's first chunk carries the prompt's logprobs: wait for them
                    if first:
                        deltas[index] = TextDeltas(stop_strings(req.stop))
                        sent_tokens[index] = 0
                        offsets[index] = 0
                        if req.echo and req.logprobs is not None:
                            echoed, offsets[index] = self._echo_logprobs(req, out)
                    text = deltas[index].delta(sample.text, sample.finished())
                    if first and req.echo:
                        text = self._prompt_text(out) + text
                    new_ids = sample.token_ids[sent_tokens[index] :]
                    if not (text or new_ids or sample.finished() or first):
                        continue
                    choice: dict = {
                        "index": index,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": sample.finish_reason,
                        "stop_reason": sample.stop_reason,
                    }
                    if req.logprobs is not None and sample.logprobs is not None:
                        lp, offsets[index] = completion_logprobs(
                            new_ids, sample.logprobs[sent_tokens[index] :], req.logprobs, offsets[index],
                            req.return_tokens_as_token_ids,
                        )  # fmt: skip
                        choice["logprobs"] = lp if echoed is None else _concat(echoed, lp)
                    if req.return_token_ids:
                        if first:
                            choice["prompt_token_ids"] = out.prompt_token_ids
                        choice["token_ids"] = new_ids
                    sent_tokens[index] = len(sample.token_ids)
                    if sample.finished():
                        done.add(index)
                    choices.append(choice)
                if choices:
                    so_far = usage(sum(prompt_tokens.values()), sum(sent_tokens.values()))
                    yield chunk(choices, so_far if continuous_usage(req) else None)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], usage(sum(prompt_tokens.values()), sum(sent_tokens.values())))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"


def _scores_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated."""
    return req.echo and req.max_tokens == 0


def _shown(req: CompletionRequest, out: RequestOutput) -> RequestOutput:
    """What a response shows of an output: for a prompt scored alone, samples without the
    token generated to run it (an empty completion that ended at its length of 0)."""
    if not _scores_only(req):
        return out
    samples = [
        dataclasses.replace(
            s, text="", token_ids=[], cumulative_logprob=None if s.logprobs is None else 0.0,
            logprobs=None if s.logprobs is None else [], finish_reason="length" if s.finished() else None,
            stop_reason=None,
        )
        for s in out.outputs
    ]  # fmt: skip
    return dataclasses.replace(out, outputs=samples)


def _concat(first: dict, then: dict) -> dict:
    """Two runs of completions logprobs, one after the other."""
    return {key: first[key] + then[key] for key in first}
