"""What completions and chat share: model names, sampling params, request ids, logprobs.

The serving classes turn a parsed request into engine requests and engine outputs
into OpenAI response objects. They know nothing about HTTP, so the Batch API runs
its lines through the very same code.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from seer_engine.engine.client import EngineClient
from seer_engine.entrypoints.openai.errors import APIError, as_api_error, error_body
from seer_engine.entrypoints.openai.protocol import UNSUPPORTED_OPTIONS, _SamplingFields
from seer_engine.outputs import RequestOutput, SampleLogprobs
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

MAX_N = 128  # samples per prompt, as in the OpenAI API


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def finite(x: float) -> float:
    """JSON has no infinities: a -inf logprob (a masked token) is reported as -9999."""
    return x if math.isfinite(x) else -9999.0


class RequestRegistry:
    """User-visible request id -> engine request ids, for /abort_requests.

    A completion with several prompts runs as several engine requests
    (``<id>-0``, ``<id>-1``, ...); aborting ``<id>`` must reach all of them, and also a
    one-prompt request that carries the same id meanwhile (its engine request is ``<id>``
    itself). Two requests of several prompts cannot share an id at once: their
    ``<id>-0`` would clash in the engine.
    """

    def __init__(self) -> None:
        self._active: dict[str, list[str]] = {}

    @staticmethod
    def engine_ids(user_id: str, num_prompts: int) -> list[str]:
        return [user_id] if num_prompts == 1 else [f"{user_id}-{i}" for i in range(num_prompts)]

    def add(self, user_id: str, num_prompts: int) -> Callable[[], None]:
        """Link the id to its engine requests; returns what unlinks it once the request has
        ended (idempotent, and it leaves alone a later request's entry under the same id)."""
        if num_prompts == 1:  # its engine request is the id itself: nothing to link
            return lambda: None
        ids = self.engine_ids(user_id, num_prompts)
        self._active[user_id] = ids

        def remove() -> None:
            if self._active.get(user_id) is ids:
                del self._active[user_id]

        return remove

    def __len__(self) -> int:
        return len(self._active)

    def expand(self, ids: Sequence[str]) -> list[str]:
        out: list[str] = []
        for rid in ids:
            out.append(rid)
            out.extend(self._active.get(rid, []))
        return out


class EventStream:
    """A streamed response's server-sent events, and what must end with the response.

    The events come from an async generator whose ``finally`` runs only if it was
    started; a client that hangs up before the first event is sent may leave it never
    started (Starlette drops the body iterator then). ``aclose`` ends the engine requests
    (aborting unfinished ones) and unlinks the request id whether or not the events were
    read; the HTTP layer calls it once the response is over, sent or not.
    """

    def __init__(
        self, events: AsyncGenerator[str, None], streams: Sequence[AsyncIterator], release: Callable[[], None]
    ) -> None:
        self.events = events
        self.streams = list(streams)
        self.release = release

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    async def aclose(self) -> None:
        self.release()
        try:
            await self.events.aclose()
        finally:
            for stream in self.streams:
                await stream.aclose()  # type: ignore[attr-defined]  # aborts an unfinished request


class ServingBase:
    """Model-name checks, sampling parameters and request submission."""

    def __init__(self, engine: EngineClient, served_names: Sequence[str], registry: RequestRegistry) -> None:
        self.engine = engine
        self.served_names = list(served_names)
        self.registry = registry

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def response_model(self, req: _SamplingFields) -> str:
        """The model a response names: the served name the request used (any of them may
        be), as vLLM answers; the first served name when the request names none."""
        return req.model or self.model_name

    def check_request_model(self, req: _SamplingFields) -> None:
        """A request names a served model, or none: absent or "" (vLLM's default) is the first."""
        if req.model:
            self.check_model(req.model)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_names:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.served_names}",
                param="model",
                code="model_not_found",
            )

    def renamed_fields(self, req: _SamplingFields) -> dict[str, tuple[str, str]]:
        """Engine field -> (the request's param for it, how a message calls it), where this
        front end calls a field otherwise (chat: the prompt is rendered from messages)."""
        return {}

    def refusal(
        self, req: _SamplingFields, exc: BaseException, prompt_index: int | None = None
    ) -> BaseException:
        """An engine refusal in this front end's terms, the one place where that happens:
        its param named as the request names it and, for one of several prompts, the
        prompt's index (``prompt.1``, as body errors name it). Other errors pass as they are."""
        if not isinstance(exc, InvalidRequestError):
            return exc
        renamed = self.renamed_fields(req)
        if prompt_index is not None:
            renamed["prompt"] = (f"prompt.{prompt_index}", f"prompt.{prompt_index}")
        message, param = str(exc), exc.param
        first = message.split(" ", 1)[0]
        if first in renamed:  # messages start with the field they refuse
            message = renamed[first][1] + message[len(first) :]
        if param in renamed:
            param = renamed[param][0]
        return APIError(400, message, param=param)

    def sampling_params(
        self,
        req: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Build and validate engine sampling parameters; unsupported options are refused.
        ``prompt_logprobs``: what to score the prompt with when the request does not say."""
        for name, value in (req.model_extra or {}).items():
            neutral = UNSUPPORTED_OPTIONS.get(name)
            if neutral is not None and not any(value == n and type(value) is type(n) for n in neutral):
                raise APIError(400, f"{name} is not supported", param=name)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
        if req.prompt_logprobs is not None and req.stream:  # as vLLM refuses it
            message = "prompt_logprobs is not available when stream is true"
            raise APIError(400, message, param="prompt_logprobs")
        if req.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}, got {req.n}", param="n")
        fields: dict = {
            "n": req.n,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "seed": req.seed,
            "stop": stop_strings(req.stop),
            "stop_token_ids": req.stop_token_ids or [],
            "ignore_eos": req.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs if req.prompt_logprobs is None else req.prompt_logprobs,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
            "add_special_tokens": req.add_special_tokens,
            "fit_max_tokens": False,
            "logit_bias": _token_bias(req.logit_bias),
            "allowed_token_ids": req.allowed_token_ids,
            "truncate_prompt_tokens": req.truncate_prompt_tokens,
        }
        for name in (
            "temperature", "top_p", "top_k", "min_p",
            "presence_penalty", "frequency_penalty", "repetition_penalty",
        ):  # fmt: skip
            value = getattr(req, name)
            if value is not None:
                fields[name] = value
        try:
            return SamplingParams(**fields)
        except InvalidRequestError as e:
            raise self.refusal(req, e) from None

    async def submit(
        self,
        req: _SamplingFields,
        request_id: str,
        prompts: list[str | list[int]],
        params: SamplingParams,
    ) -> tuple[list[AsyncIterator[RequestOutput]], Callable[[], None]]:
        """Submit one engine request per prompt, all at once; on a refusal, abort the
        ones accepted and raise the first refusal (in the request's terms). Returns the
        requests' outputs and what unlinks the request id from the registry once they
        have ended."""
        ids = self.registry.engine_ids(request_id, len(prompts))
        stream, group_id = bool(req.stream), req.group_id
        several = len(prompts) > 1 and group_id is not None
        groups = [f"{group_id}-{i}" if several else group_id for i in range(len(prompts))]
        results = await asyncio.gather(
            *(
                self.engine.generate(rid, prompt, params, stream, groups[i], req.priority)
                for i, (rid, prompt) in enumerate(zip(ids, prompts))
            ),
            return_exceptions=True,
        )
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            accepted = [rid for rid, r in zip(ids, results) if not isinstance(r, BaseException)]
            if accepted:
                await self.engine.abort(accepted)
            index, error = errors[0]
            raise self.refusal(req, error, index if len(prompts) > 1 else None)
        release = self.registry.add(request_id, len(prompts))
        return list(results), release


def _token_bias(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, whose keys are token ids written as strings: ASCII digits only
    (``str.isdigit`` takes "\u00b2", which ``int`` refuses, and ``int`` reads other scripts' digits)."""
    out: dict[int, float] = {}
    for key, value in (logit_bias or {}).items():
        digits = key.strip()
        if not (digits.isascii() and digits.isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


async def final_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    assert last is not None and last.finished
    return last


def token_label(token_id: int, text: str, as_id: bool) -> str:
    """How a logprobs entry names a token: its text, or vLLM's ``token_id:<id>``
    (``return_tokens_as_token_ids``: exact where texts are partial characters or collide)."""
    return f"token_id:{token_id}" if as_id else text


def top_entries(step: dict, top_n: int, as_ids: bool = False) -> list[tuple[int, float, str]]:
    """(token id, logprob, label) of the top-N by rank, best first."""
    ranked = sorted(step.items(), key=lambda kv: kv[1].rank)
    return [
        (tid, lp.logprob, token_label(tid, lp.decoded_token or "", as_ids))
        for tid, lp in ranked
        if lp.rank <= top_n
    ]


def completion_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs, top_n: int, text_offset: int, as_ids: bool = False
) -> tuple[dict, int]:
    """OpenAI completions format (tokens, token_logprobs, top_logprobs, text_offset) and
    the text offset after these tokens."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for tid, step in zip(token_ids, logprobs):
        chosen = step[tid]
        text = chosen.decoded_token or ""
        label = token_label(tid, text, as_ids)
        tokens.append(label)
        token_logprobs.append(finite(chosen.logprob))
        top = {t: finite(lp) for _, lp, t in top_entries(step, top_n, as_ids)}
        top.setdefault(label, finite(chosen.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
    return body, text_offset


def prompt_logprobs_body(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then token id ->
    logprob, rank and text for the token and the top-N at each position."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in step.items()
        }
        for step in out.prompt_logprobs
    ]


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: SampleLogprobs,
    top_n: int,
    token_bytes: Callable[[int, str], bytes],
    as_ids: bool = False,
) -> list[dict]:
    """OpenAI chat format: one entry per token with its top alternatives. ``bytes`` are
    each token's own (``token_bytes(id, text)``), or a ``token_id:<id>`` label's."""

    def entry(tid: int, logprob: float, text: str) -> dict:
        label = token_label(tid, text, as_ids)
        raw = label.encode("utf-8") if as_ids else token_bytes(tid, text)
        return {"token": label, "logprob": finite(logprob), "bytes": list(raw)}

    content = []
    for tid, step in zip(token_ids, logprobs):
        chosen = step[tid]
        content.append(
            {
                **entry(tid, chosen.logprob, chosen.decoded_token or ""),
                "top_logprobs": [entry(t, lp, text) for t, lp, text in top_entries(step, top_n)],
            }
        )
    return content


class TextDeltas:
    """Turns the growing text of one sample into safe-to-send deltas.

    Text is held back while it ends in an incomplete UTF-8 character (decoded as
    U+FFFD) or could still be cut by a stop string, so that no sent text is ever
    taken back.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def delta(self, text: str, finished: bool) -> str:
        start = self.sent
        end = self.visible_end(text, finished)
        return text[start:end]

    def visible_end(self, text: str, finished: bool) -> int:
        """How much of the text may be shown now (it only grows)."""
        if finished:
            end = len(text)
        else:  # an unfinished character may become the start of a stop string
            end = len(text.rstrip("\ufffd")) - self.hold
        self.sent = max(self.sent, end)
        return self.sent


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list; ``""`` is a list of one empty string, refused as vLLM refuses it."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def sse_event(
    request_id: str, obj: str, created: int, model: str, choices: list[dict], usage_obj: dict | None = None
) -> str:
    """One server-sent event of a streamed completion or chat completion."""
    body = {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices, "usage": usage_obj}  # fmt: skip
    return f"data: {json.dumps(body)}\n\n"


def continuous_usage(req: _SamplingFields) -> bool:
    """vLLM's stream_options: usage on every chunk (with include_usage), not only at the end."""
    options = req.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


def sse_error(exc: Exception) -> str:
    """An error raised mid-stream: the status line is already sent, so report it in-band."""
    err = as_api_error(exc)
    return f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def merge_outputs(
    streams: Sequence[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: (prompt index, output).

    Closing the merged iterator cancels the readers, which aborts the requests. The
    readers wait while the consumer is behind, so outputs not read yet stay in the
    requests' own queues, where a newer progress output replaces an older one.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def read(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                await q.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await q.put((i, e))
        await q.put((i, None))

    tasks = [asyncio.create_task(read(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
