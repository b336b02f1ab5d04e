"""/v1/chat/completions: messages through the tokenizer's chat template -> chat completions."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from seer_engine.engine.client import EngineClient
from seer_engine.entrypoints.openai.chat_messages import content_text, template_message
from seer_engine.entrypoints.openai.chat_output import ChatOutputSplitter, ThinkReasoningParser
from seer_engine.entrypoints.openai.errors import APIError
from seer_engine.entrypoints.openai.protocol import ChatCompletionRequest
from seer_engine.entrypoints.openai.serving_base import (
    EventStream,
    RequestRegistry,
    ServingBase,
    chat_logprobs,
    continuous_usage,
    final_output,
    prompt_logprobs_body,
    random_id,
    sse_error,
    sse_event,
    stop_strings,
    usage,
)
from seer_engine.entrypoints.openai.tool_parsers import HermesToolParser, tool_call_id
from seer_engine.outputs import CompletionOutput


def _max_tokens_field(req: ChatCompletionRequest) -> str:
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def echoed_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the final message's text, written before each answer when the
    answer is in its role (the message being continued, or an assistant message before a
    fresh generation prompt)."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return ""
    return content_text(last, len(req.messages) - 1)


class OpenAIServingChat(ServingBase):
    def __init__(
        self,
        engine: EngineClient,
        served_names: Sequence[str],
        registry: RequestRegistry,
        tool_parser: HermesToolParser | None = None,
        reasoning_parser: ThinkReasoningParser | None = None,
    ) -> None:
        super().__init__(engine, served_names, registry)
        self.tool_parser = tool_parser  # None: automatic tool choice is off (vLLM's default)
        self.reasoning_parser = reasoning_parser  # None: reasoning stays in the content

    def renamed_fields(self, req: ChatCompletionRequest) -> dict[str, tuple[str, str]]:  # type: ignore[override]
        """The chat fields that carry an engine field: the prompt is rendered from
        ``messages``, logprobs is ``top_logprobs``, max_tokens may be ``max_completion_tokens``."""
        max_name = _max_tokens_field(req)
        return {
            "prompt": ("messages", "the prompt rendered from messages"),
            "logprobs": ("top_logprobs", "top_logprobs"),
            "max_tokens": (max_name, max_name),
        }

    async def render_prompt(self, req: ChatCompletionRequest) -> str:
        """The conversation as one prompt string, through the model's chat template.

        Rendered on a worker thread: the template is Python (jinja), so a long conversation
        shares the interpreter with the event loop instead of stopping it. Rendering with
        ``tokenize=False`` does not touch the (thread-unsafe) Rust tokenizer.
        """
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        kwargs = req.chat_template_kwargs or {}
        if req.reasoning_effort is not None:  # chat_template_kwargs name it more precisely
            kwargs = {"reasoning_effort": req.reasoning_effort, **kwargs}
        detokenizer = self.engine.detokenizer
        detokenizer.check_template_kwargs(kwargs)  # before the thread, whose errors blame the template
        messages = [template_message(m, i) for i, m in enumerate(req.messages)]
        render = functools.partial(
            detokenizer.apply_chat_template,
            messages,
            req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            template_kwargs=kwargs,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            documents=req.documents,
        )
        try:
            return await asyncio.to_thread(render)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault or the model's
            param = "chat_template" if req.chat_template is not None else "messages"
            raise APIError(400, f"cannot apply the chat template: {e}", param=param) from None

    async def create(self, req: ChatCompletionRequest) -> dict | EventStream:
        self.check_request_model(req)
        parser = self._tool_parser_for(req)
        if req.top_logprobs and not req.logprobs:  # 0 asks for nothing: served, as by vLLM
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt = await self.render_prompt(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, getattr(req, _max_tokens_field(req)), logprobs)
        if parser is not None:  # some models' call tags are special tokens: keep them to be parsed
            params = params.clone(skip_special_tokens=False)
        request_id = req.request_id or random_id("chatcmpl-")
        (stream,), release = await self.submit(req, request_id, [prompt], params)
        splitter = self._splitters(req, prompt, parser)
        if req.stream:
            return EventStream(self._stream(req, request_id, stream, splitter), [stream], release)
        try:
            out = await final_output(stream)
        finally:
            release()
        echo = echoed_text(req)
        choices = [self._choice(req, out.prompt_token_ids, s, splitter(), echo) for s in out.outputs]
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.response_model(req),
            "choices": choices,
            "usage": usage(len(out.prompt_token_ids), sum(len(s.token_ids) for s in out.outputs)),
            "system_fingerprint": None,
        }
        if req.prompt_logprobs is not None:  # vLLM's, beside the choices
            body["prompt_logprobs"] = prompt_logprobs_body(out)
        return body

    def _tool_parser_for(self, req: ChatCompletionRequest) -> HermesToolParser | None:
        """The parser that reads tool calls back from this request's responses (None: the
        text is the content), by vLLM's rules for ``tool_choice``."""
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if req.tools else "none"
        if choice == "none":
            return None
        if not isinstance(choice, str) or choice == "required":
            shown = choice if isinstance(choice, str) else "a named function"
            message = f"tool_choice {shown!r} is not supported (guided decoding): use 'auto' or 'none'"
            raise APIError(400, message, param="tool_choice")
        if choice != "auto":
            raise APIError(400, f"tool_choice must be 'none' or 'auto', got {choice!r}", param="tool_choice")
        if not req.tools:
            raise APIError(400, "tool_choice 'auto' needs tools", param="tool_choice")
        if self.tool_parser is None:
            message = (
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                "(or send tool_choice 'none': the tools are still shown to the model)"
            )
            raise APIError(400, message, param="tool_choice")
        return self.tool_parser

    def _splitters(
        self, req: ChatCompletionRequest, prompt: str, tools: HermesToolParser | None
    ) -> Callable[[], ChatOutputSplitter]:
        """What makes each choice's splitter; whether the prompt left a reasoning block
        open is read once. A final message being continued is the answer so far: its tags
        count as the answer's; the other messages' texts open and close nothing."""
        reasoning, prompt_open = self.reasoning_parser, False
        if reasoning is not None:
            quoted = req.messages[:-1] if req.continue_final_message else req.messages
            prompt_open = reasoning.opens(prompt, [content_text(m, i) for i, m in enumerate(quoted)])
        parallel = req.parallel_tool_calls is not False
        return functools.partial(
            ChatOutputSplitter, stop_strings(req.stop), reasoning, tools, prompt_open, parallel
        )

    def _choice(
        self,
        req: ChatCompletionRequest,
        prompt_ids: list[int],
        sample: CompletionOutput,
        splitter: ChatOutputSplitter,
        echo: str = "",
    ) -> dict:
        parts = splitter.parts(sample.text)
        content = echo + (parts.content or "") if echo else parts.content
        message: dict = {"role": "assistant", "content": content}
        if parts.reasoning is not None and req.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = parts.reasoning
        finish_reason = sample.finish_reason
        if parts.tool_calls:
            message["tool_calls"] = [call.body(tool_call_id()) for call in parts.tool_calls]
            finish_reason = "tool_calls"
        choice = {
            "index": sample.index,
            "message": message,
            "logprobs": self._logprobs(req, sample.token_ids, sample),
            "finish_reason": finish_reason,
            "stop_reason": sample.stop_reason,
        }
        if req.return_token_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = sample.token_ids
        return choice

    def _logprobs(
        self, req: ChatCompletionRequest, token_ids: list[int], sample: CompletionOutput, start: int = 0
    ) -> dict | None:
        if not req.logprobs or sample.logprobs is None:
            return None
        top_n, as_ids = req.top_logprobs or 0, req.return_tokens_as_token_ids
        token_bytes = self.engine.detokenizer.token_bytes
        return {"content": chat_logprobs(token_ids, sample.logprobs[start:], top_n, token_bytes, as_ids)}

    async def _stream(
        self, req: ChatCompletionRequest, request_id: str, stream, splitter: Callable[[], ChatOutputSplitter]
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        echo = echoed_text(req)
        deltas: dict[int, ChatOutputSplitter] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        prompt_tokens = 0

        def chunk(choices: list[dict], usage_obj: dict | None = None) -> str:
            obj = "chat.completion.chunk"
            return sse_event(request_id, obj, created, self.response_model(req), choices, usage_obj)

        try:
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                choices = []
                for sample in out.outputs:
                    i = sample.index
                    if i in done:
                        continue
                    first = i not in deltas
                    if first:
                        deltas[i] = splitter()
                        sent_tokens[i] = 0
                    reasoning, text, calls = deltas[i].step(sample.text, sample.finished())
                    reasoning = reasoning if req.include_reasoning else ""
                    new_ids = sample.token_ids[sent_tokens[i] :]
                    if not (text or reasoning or new_ids or sample.finished() or first):
                        continue
                    delta: dict = {"content": text}
                    if first:
                        delta = {"role": "assistant", "content": echo + text}
                    if reasoning:
                        delta["reasoning"] = delta["reasoning_content"] = reasoning
                    finish_reason = sample.finish_reason
                    if calls:
                        delta["tool_calls"] = [
                            {"index": k, **c.body(tool_call_id())} for k, c in enumerate(calls)
                        ]
                        finish_reason = "tool_calls"
                    choice: dict = {
                        "index": i,
                        "delta": delta,
                        "logprobs": self._logprobs(req, new_ids, sample, sent_tokens[i]),
                        "finish_reason": finish_reason,
                        "stop_reason": sample.stop_reason,
                    }
                    if req.return_token_ids:
                        if first:
                            choice["prompt_token_ids"] = out.prompt_token_ids
                        choice["token_ids"] = new_ids
                    sent_tokens[i] = len(sample.token_ids)
                    if sample.finished():
                        done.add(i)
                    choices.append(choice)
                if choices:
                    so_far = usage(prompt_tokens, sum(sent_tokens.values()))
                    yield chunk(choices, so_far if continuous_usage(req) else None)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], usage(prompt_tokens, sum(sent_tokens.values())))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"
