"""Token sampling: allowed tokens, logit bias, penalties, greedy, temperature, min-p, top-k,
top-p, logprobs.

Random draws use the exponential-race trick (argmax of p / q with q ~ Exp(1) is a
sample from p) with noise seeded by (request seed, position) only, through
``core.seeds.position_seed``. So a request's tokens never depend on which other
requests share its batch, on prefill spans, on rollout chunks, on migration or on
speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from seer_engine.core.seeds import position_seed


@dataclass(frozen=True)
class Penalties:
    """vLLM's penalties for one row and the tokens they look at."""

    presence: float
    frequency: float
    repetition: float
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # before the sampled token: a draft node's path included


@dataclass
class SamplingRow:
    """What the sampler needs from one request that samples this step."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    position: int  # index of the token being sampled within the whole sequence
    banned_token_ids: list[int]  # e.g. EOS / stop ids before min_tokens is reached
    num_logprobs: int | None
    penalties: Penalties | None = None  # only for a request that sets a penalty
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # None: every token may be sampled


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or (sampled logprob, sampled rank, [(token, logprob), ...top-N])
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def exponential_noise(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(position_seed(seed, position))
    return torch.empty(vocab, device=device).exponential_(generator=gen)


def apply_min_p_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask one row's temperature-scaled logits to the allowed set (in place), in vLLM's
    order: min-p first, then top-k and top-p over what it keeps."""
    vocab = logits.shape[-1]
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits.masked_fill_(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop_sorted[0] = False  # a top_p below float32's smallest number rounds to 0
        logits[order[drop_sorted]] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """One row's raw logits with vLLM's penalties applied (in place): repetition over the
    prompt and the output, then frequency and presence over the output."""
    vocab, dev = logits.shape[-1], logits.device
    output = torch.as_tensor(penalties.output_token_ids, dtype=torch.long, device=dev)
    if penalties.repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.as_tensor(penalties.prompt_token_ids, dtype=torch.long, device=dev)] = True
        seen[output] = True
        values = logits[seen]
        r = penalties.repetition
        logits[seen] = torch.where(values > 0, values / r, values * r)
    if (penalties.frequency != 0.0 or penalties.presence != 0.0) and len(output):
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= penalties.frequency * counts + penalties.presence * (counts > 0).to(logits.dtype)
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits`` ``[len(rows), vocab]`` float32 -> one token per row."""
        raw_logprobs = None
        if any(r.num_logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.allowed_token_ids is not None:
                keep = torch.as_tensor(row.allowed_token_ids, dtype=torch.long, device=logits.device)
                allowed = logits[i, keep].clone()
                logits[i] = float("-inf")
                logits[i, keep] = allowed
            if row.logit_bias:  # before penalties, as vLLM applies it
                ids = torch.tensor(list(row.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(row.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i, ids] += bias
            if row.penalties is not None:
                apply_penalties(logits[i], row.penalties)
            if row.banned_token_ids:
                kept = logits[i, row.banned_token_ids].clone()
                logits[i, row.banned_token_ids] = float("-inf")
                if not torch.isfinite(logits[i]).any():
                    # Every allowed token is a stop token: allowed_token_ids is a hard
                    # constraint, min_tokens (what banned them) cannot be met.
                    logits[i, row.banned_token_ids] = kept
        tokens = logits.argmax(dim=-1)
        for i, row in enumerate(rows):
            if row.temperature == 0.0:
                continue
            scaled = logits[i] / row.temperature
            if not torch.isfinite(scaled.max()):
                # A temperature so small that the top logit overflowed (to +inf, or to -inf
                # when negative): softmax would give NaNs and argmax the first NaN, token 0.
                # The limit of such temperatures is greedy.
                continue
            scaled = apply_min_p_top_k_top_p(scaled, row.top_k, row.top_p, row.min_p)
            probs = scaled.softmax(-1)
            noise = exponential_noise(row.seed, row.position, probs.shape[-1], probs.device)
            tokens[i] = (probs / noise).argmax()
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, rows))

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], rows: list[SamplingRow]):
        out: list[tuple[float, int, list[tuple[int, float]]] | None] = [None] * len(rows)
        if raw is None:
            return out
        for i, row in enumerate(rows):
            if row.num_logprobs is not None:
                out[i] = token_logprobs(raw[i : i + 1], [tokens[i]], row.num_logprobs)[0]
        return out


def token_logprobs(
    logprobs: torch.Tensor, tokens: Sequence[int], top_n: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Per row of log-probabilities: its token's logprob, the token's rank (1 = the most
    likely) and the top-N (id, logprob); what sampled and prompt tokens both report."""
    chosen = logprobs.gather(1, torch.as_tensor(tokens, device=logprobs.device).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [(float(chosen[i]), ranks[i], tops[i]) for i in range(len(tokens))]
