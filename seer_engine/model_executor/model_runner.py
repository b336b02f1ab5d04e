"""Runs one scheduled step: lays out the flattened batch, runs the model, samples.

Only rows whose chunk reaches the end of their request's tokens produce logits;
mid-prompt chunks of a chunked prefill only fill the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seer_engine.core.request import Request
from seer_engine.model_executor.attention import AttentionMetadata, get_attention_backend
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.model_executor.sampler import Sampler, SamplerOutput, SamplingRow
from seer_engine.model_executor.weight_loader import load_model


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    block_ids: list[int]


@dataclass
class StepResult:
    """Tokens sampled this step, by request id, with logprobs where asked for."""

    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]]


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        attention_backend: str = "torch",
    ) -> None:
        self.cfg = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = get_attention_backend(attention_backend)
        self.model = load_model(model_config, dtype, device)
        self.sampler = Sampler()
        self.kv_caches = self._allocate_kv_cache()

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        c = self.cfg
        shape = (2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    def restore_kv_cache(self) -> None:
        if not self.kv_caches:
            self.kv_caches = self._allocate_kv_cache()

    def load_weights_from(self, model_config: ModelConfig) -> None:
        """Swap in new weights of the same architecture (RL weight sync)."""
        self.model = load_model(model_config, self.dtype, self.device)
        self.cfg = model_config

    # -- one step ------------------------------------------------------------------

    def _prepare(self, batch: list[ScheduledChunk]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        samplers: list[Request] = []  # requests whose chunk reaches their last token
        for chunk in batch:
            req, blocks = chunk.request, chunk.block_ids
            start = req.num_computed_tokens
            end = start + chunk.num_new_tokens
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(len(input_ids))
            seq_lens.append(end)
            if end == req.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                samplers.append(req)
        width = max(-(-n // bs) for n in seq_lens)
        tables = [c.block_ids[:width] + [0] * (width - min(width, len(c.block_ids))) for c in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(c.num_new_tokens for c in batch),
            max_seq_len=max(seq_lens),
            query_lens_cpu=[c.num_new_tokens for c in batch],
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, logits_rows, samplers

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledChunk]) -> StepResult:
        if not batch:
            return StepResult({}, {})
        ids, pos, meta, logits_rows, samplers = self._prepare(batch)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend)
        if not samplers:
            return StepResult({}, {})
        logits = self.model.logits(hidden[torch.tensor(logits_rows, device=self.device)])
        out = self.sampler(logits, [sampling_row(r) for r in samplers])
        return _to_result(samplers, out)


def sampling_row(request: Request) -> SamplingRow:
    p = request.sampling_params
    banned: list[int] = []
    if request.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
    return SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=request.seed,
        position=request.num_tokens,
        banned_token_ids=banned,
        num_logprobs=p.logprobs,
    )


def _to_result(requests: list[Request], out: SamplerOutput) -> StepResult:
    sampled = {r.request_id: t for r, t in zip(requests, out.token_ids)}
    logprobs = {r.request_id: lp for r, lp in zip(requests, out.logprobs) if lp is not None}
    return StepResult(sampled, logprobs)
