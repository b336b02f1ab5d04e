"""Request bodies of the server, as pydantic models (they also make the OpenAPI schema).

Models are strict (no "1" -> 1, no true -> 1): a wrong type is an error, not a guess.
Values (n >= 1, temperature >= 0, ...) are checked by ``SamplingParams`` so that the
engine and the server refuse the same things with the same messages. Unknown fields
are ignored, as OpenAI clients send fields this server does not use. ``null`` for an
optional field is the same as leaving it out (OpenAI's fields are nullable: the
``openai`` client sends ``n=None`` as ``"n": null``); where ``None`` is a value of its
own (``max_tokens``: up to the context length) it is kept.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _allows_none(annotation: Any) -> bool:
    return annotation is None or (
        get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)
    )


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """``"field": null`` for an optional field that cannot be None: its default."""
        if not isinstance(data, dict):
            return data
        defaulted = [
            name
            for name, f in cls.model_fields.items()
            if data.get(name, ...) is None and not f.is_required() and not _allows_none(f.annotation)
        ]
        return {k: v for k, v in data.items() if k not in defaulted} if defaulted else data


# ----------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object; every 4xx/5xx body of this server has this shape."""

    error: ErrorInfo


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 415, 503)
}


# ----------------------------------------------------------------------- generation


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk too


# Options of vLLM or OpenAI that change what is generated and that this server does not
# implement: a request setting one to anything but its neutral value is refused (400),
# never served as if it had not asked. Other unknown fields are ignored, as vLLM does.
UNSUPPORTED_OPTIONS: dict[str, tuple[object, ...]] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
    "prediction": (None,),
    "spaces_between_special_tokens": (None, True),
    # The deprecated way to ask for tool calls (``tools`` and ``tool_choice`` replace it).
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}


class _SamplingFields(_Strict):
    """Sampling fields shared by completions and chat (vLLM names for the extras).
    Unknown fields are kept (``model_extra``) so ``UNSUPPORTED_OPTIONS`` can be refused."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's; 1 is no penalty
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    user: str | None = None
    priority: int = 0  # vLLM's: lower first under --scheduling-policy priority
    # Extensions for RL rollouts and debugging.
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    request_id: str | None = Field(
        default=None, description="Engine request id (for /abort_requests); one is made when absent."
    )
    group_id: str | None = Field(default=None, description="Group of related samples (a GRPO group).")
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top-N
    skip_special_tokens: bool = True
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None
    refusal: str | None = None  # OpenAI's assistant part {"type": "refusal", "refusal": ...}


class ChatMessage(_Strict):
    """A message; fields besides these (``tool_calls``, ``tool_call_id``,
    ``reasoning_content``, ...) are kept and reach the chat template as sent."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ToolFunction(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None


class ChatTool(_Strict):
    """OpenAI's tool: a function the model may call (rendered by the chat template)."""

    type: Literal["function"]
    function: ToolFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # "none", "auto" (the default with tools: needs a server started with
    # --enable-auto-tool-choice); "required" and a named function are refused.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: only the first call the model writes is returned
    documents: list[dict[str, str]] | None = None  # vLLM's: retrieval documents the template renders
    add_special_tokens: bool = False  # vLLM's: the chat template writes its own BOS
    echo: bool = False  # vLLM's: a continued final message is written before each answer
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the response
    # OpenAI's: reaches the template as ``reasoning_effort`` (templates that read it, e.g. gpt-oss)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


# -------------------------------------------------------------------------- tokenize


class TokenizeCompletionRequest(_Strict):
    """vLLM's /tokenize for a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's /tokenize for a conversation, rendered as /v1/chat/completions renders it."""

    model: str | None = None
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    documents: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- batches


# OpenAI's metadata: at most 16 pairs, keys of up to 64 characters, values of up to 512.
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class BatchCreateRequest(_Strict):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)


# ------------------------------------------------------------------------ RL control


class UpdateWeightsRequest(_Strict):
    model_path: str
    weight_version: str | None = None


class PauseRequest(_Strict):
    # SGLang's "in_place" and "retract" both hold running requests and continue them at the
    # resume with the same tokens: "keep" (this engine keeps their KV for either).
    mode: Literal["abort", "wait", "keep", "in_place", "retract"] = "abort"

    def engine_mode(self) -> Literal["abort", "wait", "keep"]:
        return "keep" if self.mode in ("in_place", "retract") else self.mode  # type: ignore[return-value]


class SGLangAbortRequest(_Strict):
    """SGLang's /abort_request: one request by ``rid``, or every one with ``abort_all``; an
    empty ``rid`` without ``abort_all`` aborts nothing, as in SGLang."""

    rid: str = ""
    abort_all: bool = False


class AbortRequest(_Strict):
    request_ids: list[str] | None = None
    all: bool = False
