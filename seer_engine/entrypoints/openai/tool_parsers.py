"""Tool calls read back from a model's text (vLLM's ``--tool-call-parser``).

A chat with ``tools`` renders them through the chat template; with automatic tool
choice the response's text is then split into the content before the first call and
the calls themselves, returned as OpenAI ``tool_calls``. One parser per family of
templates; each says how far a growing text can be streamed as content (never text
that may turn out to be a call), so streamed and whole responses agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def body(self, call_id: str) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": call_id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when no text comes before the calls
    tool_calls: list[ToolCall]


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class HermesToolParser:
    """Hermes / Qwen2.5 / Qwen3 templates: each call is a JSON object
    ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``
    (a last one left open counts, for a model stopped at its EOS). If any call is not
    such an object the whole text is content, as vLLM's parser answers."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _calls = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.start)
        if at < 0:
            return ParsedOutput(text, [])
        calls = []
        for closed, open_ in self._calls.findall(text[at:]):
            call = _call(closed or open_)
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(text[:at] or None, calls)

    def content_end(self, text: str) -> int:
        """How much of a still-growing text is content for sure: up to the first call, and
        short of a tail that may still become the start of one."""
        at = text.find(self.start)
        return at if at >= 0 else len(text) - partial_tag_len(text, self.start)


def partial_tag_len(text: str, tag: str) -> int:
    """How many of the text's last characters may be the start of ``tag`` still being written."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


def _call(raw: str) -> ToolCall | None:
    try:
        obj = json.loads(raw.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


TOOL_PARSERS = {HermesToolParser.name: HermesToolParser}


def make_tool_parser(name: str) -> HermesToolParser:
    if name not in TOOL_PARSERS:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown --tool-call-parser {name!r}; choose from {known}")
    return TOOL_PARSERS[name]()
