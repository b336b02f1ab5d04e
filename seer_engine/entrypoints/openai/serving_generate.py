"""SGLang's native /generate, for trainers written against SGLang (slime, AReaL, veRL's
SGLang rollout): text or token ids and SGLang's ``sampling_params`` in; ``text``,
``output_ids`` and ``meta_info`` (``finish_reason.type``, ``output_token_logprobs`` as
``[logprob, token_id, text]``, ...) out. The same engine, checks and request ids as
/v1/completions serve it; only the names and the shape of the answer are SGLang's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field

from seer_engine.entrypoints.openai.errors import APIError, validate_body
from seer_engine.entrypoints.openai.protocol import CompletionRequest, _Strict
from seer_engine.entrypoints.openai.serving_base import (
    EventStream,
    ServingBase,
    TextDeltas,
    final_output,
    merge_outputs,
    random_id,
    sse_error,
    stop_strings,
    top_entries,
)
from seer_engine.outputs import CompletionOutput, Logprob, RequestOutput
from seer_engine.sampling_params import SamplingParams

# SGLang's sampling parameter -> this server's (the engine's vLLM names).
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}


class SGLangSamplingParams(_Strict):
    """SGLang's ``sampling_params``; a key SGLang does not know is refused, as SGLang
    refuses it, and so are the constrained-decoding ones this engine lacks."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(default=1, ge=1)
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None  # how often SGLang streams: every step here
    json_schema: None = None
    regex: None = None
    ebnf: None = None
    structural_tag: None = None
    custom_params: None = None


class GenerateRequest(_Strict):
    """SGLang's GenerateReqInput, the fields that change what this engine generates;
    others that would (images, embeddings, LoRA, sessions) are refused when set."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1)  # >= 0: the prompt's logprobs from this position too
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None


@dataclass(frozen=True)
class _Item:
    """One prompt of a /generate request, as /v1/completions would take it."""

    request: CompletionRequest
    prompt: str | list[int]
    params: SamplingParams
    scores_only: bool  # max_new_tokens 0: the prompt is scored, no generated token is shown


_REFUSED_FIELDS = ("input_embeds", "image_data", "video_data", "audio_data", "lora_path",
                   "custom_logit_processor", "session_params", "token_ids_logprob")  # fmt: skip


class ServingGenerate(ServingBase):
    def renamed_fields(self, req: Any) -> dict[str, tuple[str, str]]:
        """Refusals name SGLang's fields: the sampling parameters under sampling_params."""
        names = SGLangSamplingParams.model_fields
        out = {_RENAMED.get(k, k): (f"sampling_params.{k}", k) for k in names}
        out["prompt"] = ("text", "text") if isinstance(req.prompt, str) else ("input_ids", "input_ids")
        out["logprobs"] = ("top_logprobs_num", "top_logprobs_num")
        out["request_id"] = ("rid", "rid")
        return out

    async def create(self, body: Any) -> dict | list | EventStream:
        req = validate_body(GenerateRequest, body)
        for name in _REFUSED_FIELDS:
            if isinstance(body, dict) and body.get(name) is not None:
                raise APIError(400, f"{name} is not supported", param=name)
        prompts = _prompts(req)
        rids = _rids(req.rid, len(prompts))
        params = req.sampling_params
        each = params if isinstance(params, list) else [params or {}] * len(prompts)
        if len(each) != len(prompts):
            message = f"sampling_params has {len(each)} entries for {len(prompts)} prompts"
            raise APIError(400, message, param="sampling_params")
        items = [self._item(req, p, rid, sp) for p, rid, sp in zip(prompts, rids, each)]
        submitted = await asyncio.gather(*(self._submit(item) for item in items), return_exceptions=True)
        failed = [r for r in submitted if isinstance(r, BaseException)]
        if failed:
            for r in submitted:
                if not isinstance(r, BaseException):
                    for stream in r[0]:
                        await stream.aclose()  # type: ignore[attr-defined]
                    r[1]()
            raise failed[0]
        streams = [s for r in submitted for s in r[0]]  # type: ignore[union-attr]
        releases = [r[1] for r in submitted]  # type: ignore[index]
        if isinstance(req.rid, str) and len(prompts) > 1:  # a batch's one rid aborts its <rid>-<i>
            releases.append(self.registry.add(req.rid, len(prompts)))

        def release() -> None:
            for r in releases:
                r()

        if req.stream:
            return EventStream(self._stream(req, items, streams), streams, release)
        try:
            outputs = [await final_output(s) for s in streams]
        finally:
            release()
        answers = [self._answer(req, out, s, item.scores_only)
                   for item, out in zip(items, outputs) for s in out.outputs]  # fmt: skip
        return answers if _batched(req) or len(answers) > 1 else answers[0]

    def _item(self, req: GenerateRequest, prompt: str | list[int], rid: str, params: dict[str, Any]) -> _Item:
        sp = validate_body(SGLangSamplingParams, params, "sampling_params.")
        if not sp.spaces_between_special_tokens:
            message = "spaces_between_special_tokens false is not supported"
            raise APIError(400, message, param="sampling_params.spaces_between_special_tokens")
        scores_prompt = req.return_logprob and req.logprob_start_len >= 0
        if scores_prompt and req.stream:
            message = "logprob_start_len >= 0 (the prompt's logprobs) is not available when stream is true"
            raise APIError(400, message, param="logprob_start_len")
        kept = sp.model_fields_set - {"spaces_between_special_tokens", "stream_interval"}
        fields = {_RENAMED.get(k, k): getattr(sp, k) for k in kept}
        scores_only = sp.max_new_tokens == 0
        fields.update(
            prompt=prompt, request_id=rid, stream=req.stream,
            max_tokens=1 if scores_only else sp.max_new_tokens,
            logprobs=req.top_logprobs_num if req.return_logprob else None,
            prompt_logprobs=req.top_logprobs_num if scores_prompt else None,
        )  # fmt: skip
        completion = CompletionRequest.model_construct(**fields)
        engine_params = self.sampling_params(completion, completion.max_tokens, completion.logprobs)
        # Left unset, max_new_tokens (SGLang's default) ends with the context, as SGLang clamps it.
        engine_params.fit_max_tokens = "max_new_tokens" not in sp.model_fields_set
        return _Item(completion, prompt, engine_params, scores_only)

    async def _submit(self, item: _Item):
        request = item.request
        return await self.submit(request, request.request_id or random_id("gen-"), [item.prompt], item.params)

    # -- answers -------------------------------------------------------------------------

    def _answer(
        self, req: GenerateRequest, out: RequestOutput, sample: CompletionOutput, scores_only: bool
    ) -> dict:
        sample = _scored_only(sample) if scores_only else sample
        meta: dict[str, Any] = {
            "id": out.request_id if len(out.outputs) == 1 else f"{out.request_id}-{sample.index}",
            "finish_reason": _finish_reason(sample),
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(sample.token_ids),
            "weight_version": self.engine.weight_version,
        }
        if req.return_logprob:
            text = req.return_text_in_logprobs
            steps = sample.logprobs or []
            pairs = zip(sample.token_ids, steps)
            meta["output_token_logprobs"] = [_entry(step[t], t, text) for t, step in pairs]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [_tops(step, req.top_logprobs_num, text) for step in steps]
            if req.logprob_start_len >= 0:
                meta.update(self._prompt_logprobs(req, out))
        return {"text": sample.text, "output_ids": sample.token_ids, "meta_info": meta}

    @staticmethod
    def _prompt_logprobs(req: GenerateRequest, out: RequestOutput) -> dict:
        start, text = req.logprob_start_len, req.return_text_in_logprobs
        ids, scored = out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        if start > len(ids):  # as SGLang aborts it; a text prompt's length is known once tokenized
            message = f"logprob_start_len ({start}) is higher than the number of input tokens ({len(ids)})"
            raise APIError(400, message, param="logprob_start_len")
        pairs = zip(ids[start:], scored[start:])
        entries = [[None, t, None] if step is None else _entry(step[t], t, text) for t, step in pairs]
        body: dict = {"input_token_logprobs": entries}
        if req.top_logprobs_num:
            body["input_top_logprobs"] = [
                None if step is None else _tops(step, req.top_logprobs_num, text) for step in scored[start:]
            ]
        return body

    async def _stream(
        self, req: GenerateRequest, items: list[_Item], streams: list
    ) -> AsyncGenerator[str, None]:
        """SGLang's stream: each event is one output's answer so far (cumulative text and
        ids), with ``index`` where the request has several outputs. The text leaves out an
        unfinished character and what a stop string may still cut, so it only grows."""
        several = _batched(req) or any(item.request.n > 1 for item in items)
        starts = [
            sum(item.request.n for item in items[:p]) for p in range(len(items))
        ]  # prompts' n may differ
        shown: dict[int, TextDeltas] = {}
        try:
            async for p, out in merge_outputs(streams):
                for sample in out.outputs:
                    if items[p].scores_only and not sample.finished():
                        continue  # a prompt scored alone: only its end is shown
                    answer = self._answer(req, out, sample, items[p].scores_only)
                    index = starts[p] + sample.index
                    held = shown.setdefault(index, TextDeltas(stop_strings(items[p].request.stop)))
                    answer["text"] = answer["text"][: held.visible_end(answer["text"], sample.finished())]
                    if several:
                        answer["index"] = index  # its place in the whole answer
                    yield f"data: {json.dumps(answer)}\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"


def _batched(req: GenerateRequest) -> bool:
    """Whether the prompts came as a list (a batch, answered with a list, as SGLang's)."""
    prompt = req.text if req.text is not None else req.input_ids
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _prompts(req: GenerateRequest) -> list[str | list[int]]:
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give either text or input_ids", param="text")
    if req.text is not None:
        if req.text == []:
            raise APIError(400, "text is an empty list", param="text")
        return [req.text] if isinstance(req.text, str) else list(req.text)
    ids = req.input_ids or []
    return [ids] if not ids or isinstance(ids[0], int) else list(ids)  # type: ignore[list-item]


def _rids(rid: str | list[str] | None, count: int) -> list[str]:
    if isinstance(rid, list):
        if len(rid) != count:
            raise APIError(400, f"rid has {len(rid)} ids for {count} prompts", param="rid")
        return rid
    base = rid or random_id("gen-")
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


def _finish_reason(sample: CompletionOutput) -> dict | None:
    """SGLang's finish_reason: its type and what ended the output."""
    if sample.finish_reason is None:
        return None
    if sample.finish_reason == "length":
        return {"type": "length", "length": len(sample.token_ids)}
    if sample.finish_reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    matched = sample.stop_reason
    if matched is None and sample.token_ids:  # an EOS token
        matched = sample.token_ids[-1]
    return {"type": "stop", "matched": matched}


def _entry(lp: Logprob, token_id: int, with_text: bool) -> list:
    return [lp.logprob, token_id, lp.decoded_token if with_text else None]


def _tops(step: dict[int, Logprob], top_n: int, with_text: bool) -> list[list]:
    return [[lp, t, text if with_text else None] for t, lp, text in top_entries(step, top_n)]


def _scored_only(sample: CompletionOutput) -> CompletionOutput:
    """A max_new_tokens 0 output: the token run to score the prompt is not shown."""
    logprobs = None if sample.logprobs is None else []
    return dataclasses.replace(
        sample, text="", token_ids=[], logprobs=logprobs, finish_reason="length", stop_reason=None
    )
