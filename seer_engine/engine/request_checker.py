"""The checks a request passes before any engine queues it.

Its own class so that a front end without an engine in its process (a rollout over
instance processes) refuses bad requests exactly as one engine does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.sampling_params import InvalidRequestError, SamplingParams


@dataclass
class RequestChecker:
    detokenizer: Detokenizer
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int  # of one instance: a request must fit one instance's cache
    block_size: int

    def encode_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return prompt, self.detokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token id {t!r} is out of the vocabulary (valid ids: 0..{self.vocab_size - 1})"
                )
        return None, ids

    def validate_request(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The checks without queuing anything; returns the prompt's ids.

        A server that holds requests while paused refuses bad ones at once with this.
        It also refuses a request that could never fit the KV cache (prompt plus
        max_tokens over all blocks), which would otherwise preempt itself forever.
        """
        return self.check_request(prompt, params)[1]

    def check_request(
        self, prompt: str | Sequence[int], params: SamplingParams, prior_output_token_ids: Sequence[int] = ()
    ) -> tuple[str | None, list[int], list[int], int]:
        """Every check a new request passes: (prompt text, prompt ids, prior output, max_tokens)."""
        params.validate()
        text, ids = self.encode_prompt(prompt)
        prior = list(prior_output_token_ids)
        if prior:
            self.encode_prompt(prior)  # same vocabulary check as a prompt
            if params.n != 1:
                raise InvalidRequestError("prior_output_token_ids needs n == 1")
        if len(ids) + len(prior) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids) + len(prior)} tokens but max_model_len is {self.max_model_len} "
                "(at least one output token must fit)"
            )
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(f"stop token id {t} is out of the vocabulary")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if len(prior) >= max_tokens:
            raise InvalidRequestError(f"max_tokens ({max_tokens}) leaves no room after the prior output")
        needed = -(-(len(ids) + max_tokens) // self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) needs {needed} KV blocks "
                f"but the cache has {self.num_kv_blocks}; lower max_tokens or shorten the prompt"
            )
        return text, ids, prior, max_tokens
