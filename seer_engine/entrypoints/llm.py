"""The offline API, shaped like vLLM's ``LLM``: build once, ``generate`` many times."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Mapping, Sequence

from tqdm import tqdm

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.entrypoints.openai.chat_messages import template_message
from seer_engine.entrypoints.openai.protocol import ChatMessage
from seer_engine.outputs import RequestOutput
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

# Text, token ids, or vLLM's TextPrompt / TokensPrompt: {"prompt": ...} / {"prompt_token_ids": ...}.
Prompt = str | Sequence[int] | Mapping[str, object]


def _engine_prompt(prompt: Prompt) -> str | Sequence[int]:
    """The text or token ids of a prompt as vLLM's ``LLM`` takes it: a prompt dict is
    unpacked, and numpy integer ids (``list(array)``) become ints, which the engine checks."""
    if isinstance(prompt, Mapping):
        extra = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
        if extra:  # multi_modal_data, cache_salt, ...: run without them, the output would not be theirs
            why = f"a prompt dict holds 'prompt' or 'prompt_token_ids'; unsupported keys {extra}"
            raise InvalidRequestError(why, param="prompt")
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]  # type: ignore[assignment]
            if isinstance(prompt, (str, bytes)):  # else its text would run as the prompt
                why = f"prompt_token_ids must be a list of token ids, got {prompt!r}"
                raise InvalidRequestError(why, param="prompt_token_ids")
        elif "prompt" in prompt:
            prompt = prompt["prompt"]  # type: ignore[assignment]
        else:
            keys = sorted(map(str, prompt))
            raise InvalidRequestError(
                f"a prompt dict must hold 'prompt' or 'prompt_token_ids', got keys {keys}", param="prompt"
            )
    if hasattr(prompt, "tolist"):  # a numpy array or torch tensor of ids
        prompt = prompt.tolist()  # type: ignore[union-attr]
    if isinstance(prompt, (list, tuple)):
        return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt]
    return prompt  # type: ignore[return-value]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """``generate``'s prompts as a list, one prompt (text, ids, a dict) becoming a list of one;
    the rows of a 2-D array of ids are prompts."""
    if getattr(prompts, "ndim", 1) == 2:
        return list(prompts)  # type: ignore[arg-type]
    if isinstance(prompts, (str, Mapping)) or hasattr(prompts, "tolist"):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):  # bytes: not ids
        kind = type(prompts).__name__
        raise TypeError(f"prompts must be text, token ids, a prompt dict or a list of them, got {kind}")
    listed = list(prompts)
    return [listed] if listed and isinstance(listed[0], numbers.Integral) else listed  # type: ignore[list-item]


def _param_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt, as vLLM's ``LLM`` takes them: one for all, or a list."""
    params = SamplingParams() if sampling_params is None else sampling_params
    param_list = [params] * num_prompts if isinstance(params, SamplingParams) else list(params)
    if len(param_list) != num_prompts:
        raise ValueError(f"got {len(param_list)} SamplingParams for {num_prompts} prompts")
    for i, p in enumerate(param_list):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return param_list


class LLM:
    """``LLM(model="tiny").generate(["Hello"], SamplingParams(max_tokens=32))``."""

    def __init__(self, model: str = "tiny", **engine_args: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.detokenizer.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids or a vLLM prompt dict); outputs in
        prompt order."""
        prompts = _prompt_list(prompts)
        param_list = _param_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if priority is not None and any(priority) and self.engine.config.scheduling_policy != "priority":
            raise ValueError("priority needs scheduling_policy='priority' (the engine schedules fcfs)")
        ids = []
        done: dict[str, RequestOutput] = {}
        # An error or an interrupt (Ctrl-C) aborts this call's requests: left in the
        # engine, they would run on and end up among a later call's outputs.
        try:
            for i, (prompt, p) in enumerate(zip(prompts, param_list)):
                rid = str(next(self._ids))
                try:
                    engine_prompt = _engine_prompt(prompt)
                    self.engine.add_request(rid, engine_prompt, p, priority=priority[i] if priority else 0)
                except InvalidRequestError as e:  # of several prompts, say which
                    if len(prompts) == 1:
                        raise
                    raise InvalidRequestError(f"prompts[{i}]: {e}", e.param) from e
                ids.append(rid)
            pending = set(ids)
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
                while len(done) < len(ids):
                    for out in self.engine.step():
                        if out.request_id in pending:  # not a request added to the engine elsewhere
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([rid for rid in ids if rid not in done])
            raise
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, object]] | Sequence[Sequence[Mapping[str, object]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation or a list of them, each rendered with the
        model's chat template as the server's chat route renders it (text content parts
        joined) and generated; the template writes the special tokens, so the rendered text
        is tokenized without adding them again."""
        one = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        prompts = [
            self.engine.detokenizer.apply_chat_template(
                [template_message(ChatMessage.model_validate(m), i) for i, m in enumerate(conversation)],
                add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                template_kwargs=chat_template_kwargs,
                tools=tools,
                documents=documents,
            )
            for conversation in conversations
        ]
        chat_params = [p.clone(add_special_tokens=False) for p in _param_list(sampling_params, len(prompts))]
        return self.generate(prompts, chat_params, use_tqdm=use_tqdm)  # type: ignore[arg-type]

    def get_tokenizer(self):
        return self.tokenizer

    def abort(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        return self.engine.abort_request(request_ids)
