"""/tokenize and /detokenize, as vLLM's server has them: a trainer counts or maps tokens
with the served model's own tokenizer (and chat template) without generating.

Both run on a thread of their own with a tokenizer of their own (HF fast tokenizers must
not be shared between threads), so a long prompt never holds up the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from typing import Any

from fastapi import APIRouter

from seer_engine.engine.client import EngineClient
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.entrypoints.openai.errors import APIError, validate_body
from seer_engine.entrypoints.openai.json_body import JSONRequest, JSONRoute
from seer_engine.entrypoints.openai.limits import RequestBounds
from seer_engine.entrypoints.openai.protocol import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from seer_engine.entrypoints.openai.serving_chat import OpenAIServingChat


class ServingTokenize:
    def __init__(self, engine: EngineClient, chat: OpenAIServingChat, bounds: RequestBounds) -> None:
        self.engine = engine
        self.chat = chat
        self.bounds = bounds
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="seer-tokenize")
        self._own: Detokenizer | None = None

    @property
    def _tokenizer(self) -> Detokenizer:
        """Copied from the event loop's on the loop's thread, then used on ``_thread`` only."""
        if self._own is None:
            self._own = copy.deepcopy(self.engine.detokenizer)
        return self._own

    async def tokenize(self, body: Any) -> dict:
        if isinstance(body, dict) and "messages" in body:
            self.bounds.chat(body, truncates=False)
            chat = validate_body(TokenizeChatRequest, body)
            self.chat.check_model(chat.model or None)
            rendered = await self.chat.render_prompt(
                ChatCompletionRequest(
                    messages=chat.messages,
                    tools=chat.tools,
                    documents=chat.documents,
                    add_generation_prompt=chat.add_generation_prompt,
                    continue_final_message=chat.continue_final_message,
                    chat_template=chat.chat_template,
                    chat_template_kwargs=chat.chat_template_kwargs,
                )
            )
            text, special, strs = rendered, chat.add_special_tokens, chat.return_token_strs
        else:
            self.bounds.completion(body, truncates=False)
            req = validate_body(TokenizeCompletionRequest, body)
            self.chat.check_model(req.model or None)
            text, special, strs = req.prompt, req.add_special_tokens, req.return_token_strs
        ids, pieces = await self._run(self._encode, self._tokenizer, text, special, strs)
        max_model_len = self.engine.max_model_len
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": pieces}

    async def detokenize(self, body: Any) -> dict:
        req = validate_body(DetokenizeRequest, body)
        self.chat.check_model(req.model or None)
        vocab = self.engine.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(
                    400, f"tokens.{i}: token id {t} is out of the vocabulary (0..{vocab - 1})", param="tokens"
                )
        return {"prompt": await self._run(self._tokenizer.decode, req.tokens, False)}

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    @staticmethod
    def _encode(
        tokenizer: Detokenizer, text: str, add_special_tokens: bool, strs: bool
    ) -> tuple[list[int], list[str] | None]:
        ids = tokenizer.encode(text, add_special_tokens)
        return ids, tokenizer.token_strings(ids) if strs else None


def tokenize_router(serving: ServingTokenize) -> APIRouter:
    router = APIRouter(tags=["tokenize"], responses=ERROR_RESPONSES, route_class=JSONRoute)

    @router.post("/tokenize")
    async def tokenize(request: JSONRequest) -> dict:
        return await serving.tokenize(await request.json())

    @router.post("/detokenize")
    async def detokenize(request: JSONRequest) -> dict:
        return await serving.detokenize(await request.json())

    return router
