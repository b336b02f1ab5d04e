"""What a chat response's text becomes: ``reasoning_content``, ``content`` and
``tool_calls`` (vLLM's ``--reasoning-parser`` and ``--tool-call-parser``).

One splitter per choice serves both a whole response and a stream, so the two always
agree: a stream shows, at each step, the growing parts of what the whole response
would show, never text it would later have to take back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from seer_engine.entrypoints.openai.serving_base import TextDeltas
from seer_engine.entrypoints.openai.tool_parsers import HermesToolParser, ToolCall, partial_tag_len


class ThinkReasoningParser:
    """``<think> ... </think>`` (DeepSeek-R1, Qwen3): what a response writes inside the
    block is its reasoning, what follows its content. A response is thinking when it
    opens the block itself or its prompt left one open (templates that pre-fill
    ``<think>``); one cut off before closing it is all reasoning. A response that is not
    thinking (Qwen3 with ``enable_thinking`` off) is all content."""

    names = ("deepseek_r1", "qwen3")
    start, end = "<think>", "</think>"

    def opens(self, prompt: str, quoted: Sequence[str] = ()) -> bool:
        """Whether the prompt leaves a block open (its last start after its last end); the
        ``quoted`` texts (the messages' own) open and close nothing: only the template's tags do."""
        for text in quoted:
            if self.start in text or self.end in text:
                prompt = prompt.replace(text, "")
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def split(self, text: str, prompt_open: bool, finished: bool) -> tuple[str | None, str]:
        """(reasoning or None when not thinking, content) of the text so far; a growing
        text's parts only grow (a tag still being written is held back)."""
        if not finished and self.start.startswith(text):  # may still open a block (again)
            return ("" if prompt_open else None), ""
        if not prompt_open and not text.startswith(self.start):
            return None, text
        body = text.removeprefix(self.start) if text.startswith(self.start) else text
        at = body.find(self.end)
        if at >= 0:
            return body[:at], body[at + len(self.end) :]
        held = 0 if finished else partial_tag_len(body, self.end)
        return body[: len(body) - held], ""


REASONING_PARSERS = {name: ThinkReasoningParser for name in ThinkReasoningParser.names}


@dataclass
class ChatParts:
    reasoning: str | None  # None: the response did not reason (or no reasoning parser)
    content: str | None
    tool_calls: list[ToolCall]


class ChatOutputSplitter:
    """One choice's text -> its parts, whole (``parts``) or as stream deltas (``step``)."""

    def __init__(
        self,
        stops: list[str],
        reasoning: ThinkReasoningParser | None,
        tools: HermesToolParser | None,
        prompt_open: bool = False,
        parallel_calls: bool = True,
    ) -> None:
        """``prompt_open``: the prompt left a reasoning block open (``reasoning.opens``);
        ``parallel_calls`` false (OpenAI's ``parallel_tool_calls``): only the first call is kept."""
        self.reasoning = reasoning
        self.tools = tools
        self.prompt_open = prompt_open
        self.max_calls = None if parallel_calls else 1
        self._visible = TextDeltas(stops)
        self._sent_reasoning = 0
        self._sent_content = 0

    def parts(self, text: str) -> ChatParts:
        """A whole response's parts."""
        reasoning, content, content_end, calls = self._split(text, True)
        if reasoning is not None or calls:
            return ChatParts(reasoning, content[:content_end] or None, calls)
        return ChatParts(None, content, calls)

    def step(self, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """(new reasoning, new content, the tool calls once finished) since the last step."""
        shown = text[: self._visible.visible_end(text, finished)]
        reasoning, content, content_end, calls = self._split(shown, finished)
        new_reasoning = (reasoning or "")[self._sent_reasoning :]
        new_content = content[self._sent_content : content_end] if content_end > self._sent_content else ""
        self._sent_reasoning += len(new_reasoning)
        self._sent_content += len(new_content)
        return new_reasoning, new_content, calls

    def _split(self, text: str, finished: bool) -> tuple[str | None, str, int, list[ToolCall]]:
        """(reasoning, content, how much of the content is surely content (the rest may
        still become a tool call), the tool calls once finished)."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.prompt_open, finished)
        if self.tools is None:
            return reasoning, content, len(content), []
        if not finished:
            return reasoning, content, self.tools.content_end(content), []
        parsed = self.tools.parse(content)
        if parsed.tool_calls:
            return reasoning, content, len(parsed.content or ""), parsed.tool_calls[: self.max_calls]
        return reasoning, content, len(content), []
