"""Sampling parameters, named and defaulted as in vLLM so trainer code ports unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from seer_engine.core.numbers import is_int, is_real


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the offending field, and ``param``
    names it as the OpenAI API does (``prompt``, ``stop_token_ids``, ``request_id``...;
    None where no one field is at fault). Front ends that call a field otherwise (chat's
    ``messages``) rename it in one place (the server's ``ServingBase.refusal``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # keeps param across processes (rollout instances)
        return type(self), (str(self), self.param)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    # vLLM's penalties: presence and frequency subtract from the logits of tokens already
    # generated (once, or per occurrence); repetition divides positive and multiplies
    # negative logits of tokens in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs besides the sampled token's
    # vLLM's prompt_logprobs: each prompt token's logprob (the first has none) and the
    # top-N at its position, for the request's first sample. The prompt is then computed
    # in full, without prefix-cache hits.
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: token id -> a number in [-100, 100] added to its logit before
    # penalties and sampling (-100 in effect bans a token, 100 all but forces it).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: only these tokens may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A text prompt is tokenized with the tokenizer's special tokens (a Llama BOS), as
    # transformers and vLLM's completions do; a chat template writes its own, so chat
    # turns this off. Token-id prompts are taken as they are.
    add_special_tokens: bool = True
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens (a text prompt
    # keeps the tokenizer's special tokens, e.g. a BOS, as a left-truncating tokenizer
    # does); -1: the model's max_model_len.
    truncate_prompt_tokens: int | None = None
    # A max_tokens past what the context leaves after the prompt is cut to fit, as vLLM's
    # offline LLM does; False refuses it, as vLLM's OpenAI server does (the server's
    # requests set it).
    fit_max_tokens: bool = True

    def __post_init__(self) -> None:
        # A string is one stop string; lists and tuples are copied; anything else (a number,
        # a mapping) is left for validate() to name, not iterated into something else.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])
        elif isinstance(self.stop_token_ids, (set, frozenset)):  # vLLM lists what it is given
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.logit_bias, dict) or self.logit_bias is None:
            self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether logits depend on the tokens so far (any penalty set)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:  # every message starts with the field at fault
                raise InvalidRequestError(msg, param=msg.split(" ", 1)[0])

        check(is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(
            # inf would divide banned (-inf) logits into NaNs: no distribution to sample from.
            is_real(self.temperature) and self.temperature >= 0.0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        check(is_real(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(
            is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
            f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}",
        )
        check(
            is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}"
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(is_real(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value!r}")
        check(
            is_real(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
        )
        check(
            self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**63),
            f"seed must be a 64-bit signed integer, got {self.seed!r}",
        )
        check(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(
            is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a list of non-empty strings, got {self.stop!r}",
        )
        check(
            isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
        )
        allowed = self.allowed_token_ids
        check(
            allowed is None
            or (isinstance(allowed, list) and allowed and all(is_int(t) and t >= 0 for t in allowed)),
            f"allowed_token_ids must be a non-empty list of token ids >= 0, got {allowed!r}",
        )
        bias = self.logit_bias
        check(
            isinstance(bias, dict)
            and all(is_int(t) and t >= 0 and is_real(b) and -100.0 <= b <= 100.0 for t, b in bias.items()),
            f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {bias!r}",
        )
        # A flag must be a boolean: a JSON line's "ignore_eos": "false" is truthy.
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "add_special_tokens", "fit_max_tokens"):  # fmt: skip
            value = getattr(self, name)
            check(type(value) is bool, f"{name} must be a boolean, got {value!r}")
        k = self.truncate_prompt_tokens
        check(
            k is None or (is_int(k) and (k >= 1 or k == -1)),
            f"truncate_prompt_tokens must be an integer >= 1 or -1, got {k!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (is_int(value) and 0 <= value <= 20),
                f"{name} must be an integer in [0, 20], got {value!r}",
            )

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)
