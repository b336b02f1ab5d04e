"""Chat messages as a chat template sees them, for the server's chat route and ``LLM.chat``
alike, so both render a conversation into the same prompt."""

from __future__ import annotations

import json
from typing import Any

from seer_engine.entrypoints.openai.protocol import ChatMessage
from seer_engine.sampling_params import InvalidRequestError

# Part type -> the field that holds its text: OpenAI's text parts, an assistant's refusal
# parts (as OpenAI's API sends them back), and the Responses API's text parts, as vLLM reads them.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def content_text(message: ChatMessage, index: int) -> str:
    """A message's text; its text parts are joined by newlines, as vLLM renders them for a
    template that reads ``content`` as a string (the same prompt tokens as under vLLM)."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        field = TEXT_PARTS.get(part.type)
        if field is None:
            raise InvalidRequestError(
                f"only text content parts are supported, got {part.type!r}", param=f"messages.{index}"
            )
        text = getattr(part, field)
        if text is None:
            raise InvalidRequestError(
                f"a {part.type!r} content part needs its {field!r} field", param=f"messages.{index}"
            )
        texts.append(text)
    return "\n".join(texts)


def template_message(message: ChatMessage, index: int) -> dict:
    """What the template sees of a message: its text, name and extra fields as sent; an
    assistant's tool calls with their arguments as objects (OpenAI sends them as JSON
    text; templates write them out as objects), and an assistant's reasoning under both its
    names, ``reasoning`` (vLLM's now) and ``reasoning_content`` (which templates read), as
    vLLM hands them over."""
    out = {**(message.model_extra or {}), "role": message.role, "content": content_text(message, index)}
    if message.name is not None:
        out["name"] = message.name
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_arguments_as_object(call) for call in out["tool_calls"]]
    if message.role == "assistant":
        for name, alias in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
            if out.get(name) is not None and out.get(alias) is None:
                out[alias] = out[name]
    return out


def _arguments_as_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call
