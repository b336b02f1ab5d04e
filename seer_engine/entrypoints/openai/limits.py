"""How big a request may be: the body size limits and the cheap bounds that run on a
request's parsed JSON before pydantic builds a model from it.

The event loop parses and validates every body, so the work one request can make it
do must be bounded by the model, not by what a client cares to send. Three layers:

1. The body size (``BodySizeLimitMiddleware``): refused by Content-Length before a byte
   is read, or as soon as the bytes read pass the limit.
2. ``RequestBounds``, on the parsed JSON: lengths of lists and strings that pydantic
   would otherwise walk element by element (a 1 MB list of prompts costs pydantic
   ~0.3 s), against ``max_model_len`` where the model decides.
3. The intake (``InputProcessor``), off the event loop: characters, then tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from seer_engine.engine.input_processor import MAX_CHARS_PER_TOKEN, too_long_for_context
from seer_engine.entrypoints.openai.errors import APIError

# A character of a JSON string takes at most 6 bytes on the wire: a \uXXXX escape, as
# Python's json.dumps and other ASCII-safe encoders write any non-ASCII character.
# (An astral character is a 12-byte escape pair, but no prompt that fits the model
# is made of them: each one is at least a token.)
JSON_BYTES_PER_CHAR = 6
# Room for everything besides one prompt: the other fields, message framing, several
# prompts in one request; and a floor for models with a short context.
BODY_HEADROOM_BYTES = 1 << 20
UPLOAD_PATH = "/v1/files"
DEFAULT_MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # the OpenAI limit for a batch input file

MAX_PROMPTS = 2048  # prompts in one completion request (each one is a request of n samples)
# Stop strings are searched for in the decoded tail of every sample at every step, on
# the engine thread: their number and length are part of every step's cost.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256  # checked against every generated token


def default_max_body_bytes(max_model_len: int) -> int:
    """The default body limit of the JSON routes: a prompt at the intake's character bound
    (``max_model_len * MAX_CHARS_PER_TOKEN``) with every character escaped, plus headroom.

    Anything larger cannot be a single prompt the model accepts; at 512 tokens this is
    1.1 MiB, at 32k tokens 7 MiB, so a 20 MB prompt is refused before it is read.
    """
    return max_model_len * MAX_CHARS_PER_TOKEN * JSON_BYTES_PER_CHAR + BODY_HEADROOM_BYTES


@dataclass(frozen=True)
class BodyLimits:
    """Body size limits: file uploads have their own, every other route the JSON one."""

    json_bytes: int
    upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    sized_to: int | None = None  # max_model_len, when json_bytes is its default

    @classmethod
    def for_model(cls, max_model_len: int, json_bytes: int | None, upload_bytes: int) -> BodyLimits:
        if json_bytes is None:
            return cls(default_max_body_bytes(max_model_len), upload_bytes, sized_to=max_model_len)
        return cls(json_bytes, upload_bytes)

    def limit(self, method: str, path: str) -> tuple[int, str]:
        """(bytes, where that number comes from) for a request."""
        if method == "POST" and path == UPLOAD_PATH:
            return self.upload_bytes, "--max-upload-bytes"
        if self.sized_to is None:
            return self.json_bytes, "--max-body-bytes"
        return self.json_bytes, f"--max-body-bytes; the default is sized to max_model_len {self.sized_to}"


@dataclass(frozen=True)
class RequestBounds:
    """Length checks on a generation request's JSON, before pydantic validates it.

    Only lists and strings are measured; a field of the wrong type is left to pydantic,
    which names it. Batch lines go through the same checks.
    """

    max_model_len: int

    @property
    def max_chars(self) -> int:
        return self.max_model_len * MAX_CHARS_PER_TOKEN

    def completion(self, body: Any, truncates: bool = True) -> None:
        """``truncates``: whether the route honours truncate_prompt_tokens (then a prompt it
        cuts may be longer than the context)."""
        if not isinstance(body, dict):
            return
        prompt, cut = body.get("prompt"), truncates and _truncated(body)
        if isinstance(prompt, str):
            self._text(prompt, "prompt", cut)
        elif isinstance(prompt, list) and prompt:
            if isinstance(prompt[0], (str, list)):
                if len(prompt) > MAX_PROMPTS:
                    raise APIError(
                        400,
                        f"prompt has {len(prompt)} prompts; one request takes at most {MAX_PROMPTS}",
                        param="prompt",
                    )
                for i, one in enumerate(prompt):
                    if isinstance(one, str):
                        self._text(one, f"prompt.{i}", cut)
                    elif isinstance(one, list):
                        self._ids(one, f"prompt.{i}", cut)
            else:
                self._ids(prompt, "prompt", cut)
        self._sampling(body)

    def chat(self, body: Any, truncates: bool = True) -> None:
        if not isinstance(body, dict):
            return
        messages = body.get("messages")
        if isinstance(messages, list):
            if len(messages) >= self.max_model_len:  # kept when truncating: pydantic walks each one
                message = too_long_for_context("messages", len(messages), self.max_model_len, "messages")
                raise APIError(400, f"{message} (each message takes at least one token)", param="messages")
            chars = sum(_content_chars(m) for m in messages)
            if chars > self.max_chars and not (truncates and _truncated(body)):
                raise APIError(
                    400,
                    f"the messages have {chars} characters of content; a conversation that fits "
                    f"max_model_len ({self.max_model_len} tokens) has at most {self.max_chars}",
                    param="messages",
                )
        self._sampling(body)

    def _text(self, text: str, name: str, cut: bool) -> None:
        if len(text) > self.max_chars and not cut:
            raise APIError(
                400,
                f"{name} has {len(text)} characters; a prompt that fits max_model_len "
                f"({self.max_model_len} tokens) has at most {self.max_chars}",
                param=name,
            )

    def _ids(self, ids: list, name: str, cut: bool) -> None:
        if len(ids) >= self.max_model_len and not cut:
            message = too_long_for_context(name, len(ids), self.max_model_len, "token ids")
            raise APIError(400, message, param=name)

    @staticmethod
    def _sampling(body: dict) -> None:
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(
                400, f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop"
            )
        for i, s in enumerate(stops):
            if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
                name = "stop" if isinstance(stop, str) else f"stop.{i}"
                raise APIError(
                    400,
                    f"{name} has {len(s)} characters; a stop string has at most {MAX_STOP_CHARS}",
                    param=name,
                )
        ids = body.get("stop_token_ids")
        if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(
                400,
                f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
                param="stop_token_ids",
            )


def _truncated(body: dict) -> bool:
    """Whether the request keeps only its prompt's last tokens (vLLM's truncate_prompt_tokens):
    its prompt may then be longer than the context, bounded by the body size alone."""
    k = body.get("truncate_prompt_tokens")
    return isinstance(k, int) and not isinstance(k, bool)


def _content_chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        texts = (p.get(key) for p in content if isinstance(p, dict) for key in ("text", "refusal"))
        return sum(len(t) for t in texts if isinstance(t, str))
    return 0
