"""The one place a request is checked and its prompt tokenized.

Every front end (the offline ``LLM``, the server, a rollout over instance
processes) turns a prompt and its sampling parameters into a ``CheckedRequest``
here, once; engines and the Request Buffer take that as given and never tokenize or
check again. The server runs this off the engine thread, so one huge prompt delays
no other request, and bounds a text prompt by its length in characters before it
spends any time tokenizing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.outputs import CompletionOutput, RequestOutput
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

# A token is rarely longer than this many characters; a text prompt longer than
# max_model_len times this cannot fit and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 32


def too_long_for_context(what: str, count: int, max_model_len: int, unit: str = "tokens") -> str:
    """The refusal of an input that leaves no room for an output token, in the words
    vLLM's and OpenAI's refusals use ("maximum context length")."""
    return (
        f"{what} has {count} {unit} but the model's maximum context length (max_model_len) is "
        f"{max_model_len} tokens; at least one output token must fit"
    )


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check: engines take it as it is."""

    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None, never beyond the model's context
    prior_output_token_ids: list[int] = field(default_factory=list)  # a resumed response's tokens

    def aborted_output(self, request_id: str) -> RequestOutput:
        """The final output of this request aborted before it reached an engine: no tokens."""
        logprobs = [] if self.params.logprobs is not None else None
        samples = [
            CompletionOutput(i, "", [], None, logprobs=logprobs, finish_reason="abort")
            for i in range(self.params.n)
        ]
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, samples, finished=True)


@dataclass
class InputProcessor:
    tokenizer: Detokenizer
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int  # of one instance: a request must fit one instance's cache
    block_size: int

    def __post_init__(self) -> None:  # as EngineConfig names them: a front end may build this first
        for name in ("num_kv_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def process(
        self, prompt: str | Sequence[int], params: SamplingParams, prior_output_token_ids: Sequence[int] = ()
    ) -> CheckedRequest:
        params.validate()
        text, ids = self.tokenize(prompt, params.add_special_tokens, self._kept_prompt_tokens(params))
        prior = list(prior_output_token_ids)
        if prior:
            self._check_ids(prior, "prior output", None)
            if params.n != 1:
                raise InvalidRequestError("prior_output_token_ids needs n == 1", param="n")
        if len(ids) + len(prior) >= self.max_model_len:
            raise InvalidRequestError(
                too_long_for_context("prompt", len(ids) + len(prior), self.max_model_len), param="prompt"
            )
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"stop token id {t} is out of the vocabulary", param="stop_token_ids"
                )
        named = {"logit_bias": params.logit_bias, "allowed_token_ids": params.allowed_token_ids or ()}
        for name, token_ids in named.items():
            for t in token_ids:
                if t >= self.vocab_size:
                    raise InvalidRequestError(
                        f"{name} token id {t} is out of the vocabulary (0..{self.vocab_size - 1})", param=name
                    )
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room and not params.fit_max_tokens:
            raise InvalidRequestError(
                f"max_tokens is too large: {params.max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and the prompt has {len(ids)} tokens "
                f"({params.max_tokens} > {self.max_model_len} - {len(ids)})",
                param="max_tokens",
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if len(prior) >= max_tokens:
            raise InvalidRequestError(
                f"max_tokens ({max_tokens}) leaves no room after the prior output", param="max_tokens"
            )
        needed = -(-(len(ids) + max_tokens) // self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) needs {needed} KV blocks "
                f"but the cache has {self.num_kv_blocks}; lower max_tokens or shorten the prompt",
                param="max_tokens",
            )
        return CheckedRequest(text, ids, params, max_tokens, prior)

    def _kept_prompt_tokens(self, params: SamplingParams) -> int | None:
        """How many of the prompt's last tokens truncate_prompt_tokens keeps (None: all)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return None
        if k > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({k}) is greater than the model's maximum context length "
                f"(max_model_len: {self.max_model_len} tokens); request a smaller truncation size",
                param="truncate_prompt_tokens",
            )
        return self.max_model_len if k == -1 else k

    def tokenize(
        self, prompt: str | Sequence[int], add_special_tokens: bool = True, keep_last: int | None = None
    ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a text or token-id prompt, within the model's length;
        ``add_special_tokens``: the tokenizer's own (e.g. a BOS) around a text prompt;
        ``keep_last``: only the prompt's last tokens (a cut text's text is decoded from them)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            limit = self.max_model_len * MAX_CHARS_PER_TOKEN
            if len(prompt) > limit and keep_last is None:  # a cut prompt may be longer
                raise InvalidRequestError(
                    f"prompt has {len(prompt)} characters; a prompt that fits max_model_len "
                    f"({self.max_model_len} tokens) has at most {limit}",
                    param="prompt",
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(
                    f"prompt is not valid Unicode: {e.reason} at character {e.start} ({prompt[e.start]!r})",
                    param="prompt",
                ) from None
            ids = self.tokenizer.encode(prompt, add_special_tokens)
            if not ids:
                raise InvalidRequestError("prompt is empty once tokenized", param="prompt")
            if keep_last is not None and len(ids) > keep_last:
                ids, prompt = self._truncated(prompt, ids, add_special_tokens, keep_last)
            outside = self._first_outside_vocabulary(ids)
            if outside is not None:
                raise InvalidRequestError(
                    f"prompt tokenizes to token id {ids[outside]}, outside the model's vocabulary "
                    f"(0..{self.vocab_size - 1}): the tokenizer does not match the model",
                    param="prompt",
                )
            return prompt, ids
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                f"prompt must be text or a list of token ids, got {prompt!r:.40}",
                param="prompt",
            )
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if keep_last is not None:
            ids = ids[-keep_last:]
        self._check_ids(ids, "prompt", "prompt")
        return None, ids

    def _truncated(
        self, text: str, ids: list[int], add_special_tokens: bool, keep: int
    ) -> tuple[list[int], str]:
        """The text's last tokens, ``keep`` in all with the special tokens the tokenizer
        puts around it (a BOS stays first), as a tokenizer truncating on the left gives;
        and the text they keep (special tokens written in it stay, the added ones do not)."""
        plain = self.tokenizer.encode(text, False) if add_special_tokens else ids
        head = next((i for i in range(len(ids) - len(plain) + 1) if ids[i : i + len(plain)] == plain), 0)
        tail = len(ids) - head - len(plain)
        room = keep - head - tail
        if room < 1:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({keep}) leaves no room for the prompt's text beside the "
                f"{head + tail} special tokens the tokenizer adds",
                param="truncate_prompt_tokens",
            )
        kept = plain[-room:]
        text = self.tokenizer.decode(kept, skip_special_tokens=False)
        return ids[:head] + kept + ids[len(ids) - tail :], text

    def _check_ids(self, ids: list[int], what: str, param: str | None) -> None:
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(too_long_for_context(what, len(ids), self.max_model_len), param=param)
        outside = self._first_outside_vocabulary(ids)
        if outside is not None:
            raise InvalidRequestError(
                f"{what} token id {ids[outside]!r} is out of the vocabulary "
                f"(valid ids: 0..{self.vocab_size - 1})",
                param=param,
            )

    def _first_outside_vocabulary(self, ids: Sequence[int]) -> int | None:
        """Index of the first id that names no token of the model (a non-integer included)."""
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                return i
        return None
