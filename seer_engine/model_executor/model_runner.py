"""Runs one scheduled step: lays out the flattened batch, runs the model, samples.

Only requests whose span reaches the end of their tokens produce logits; prefill
spans that stop mid-prompt (chunked prefill) only fill the KV cache, unless their
request scores its prompt (prompt_logprobs): then each prompt position of the span
gives the next prompt token's logprob. A request with
a draft samples at its last token and at every draft node; which of those tokens
are kept is decided by ``core.draft.accept``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

from seer_engine.core.draft import DraftTree
from seer_engine.core.request import Request
from seer_engine.model_executor import cpu_kernels as native_kernels
from seer_engine.model_executor.attention import AttentionMetadata, get_attention_backend
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.model_executor.sampler import Penalties, Sampler, SamplingRow, token_logprobs
from seer_engine.model_executor.weight_loader import load_model
from seer_engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's part of a step: ``num_new_tokens`` tokens from its first uncomputed
    one (a decode row, a prefill span, or a decode row plus its draft nodes)."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]


@dataclass
class StepResult:
    """Tokens sampled this step at every row that samples, by request id: one row, or
    with a draft the root row and one per draft node (see core.draft). Logprobs
    per row where asked for."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]]
    # Per request scoring its prompt: (prompt token, its logprob, rank, top-N) for the
    # prompt tokens this step scored, in order.
    prompt_logprobs: dict[str, list[tuple[int, tuple[float, int, list[tuple[int, float]]]]]] = field(
        default_factory=dict
    )


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
        cpu_kernels: bool = False,
        cpu_weight_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``cpu_kernels``: run linear layers, norms and RoPE on the C++ CPU kernels where
        they serve this device and dtype (see ``cpu_kernels.usable``), their weights packed
        in ``cpu_weight_dtype`` (bfloat16: opt-in, half the bytes, other numerics). On a
        GPU, norms and RoPE run as Triton kernels (``kernels.norm_rope``), as attention does."""
        self.cfg = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = get_attention_backend(attention_backend)
        if self.backend.name == "cpu" and not native_kernels.usable(device, dtype):
            # Its kernels take float32 CPU tensors only; refuse now, not at the first step.
            raise ValueError(
                f"the 'cpu' attention backend runs float32 models on a CPU; this one runs "
                f"{str(dtype).removeprefix('torch.')} on {device}: use attention backend 'torch'"
            )
        self.native = fused_ops(device, dtype, cpu_kernels)
        self.cpu_weight_dtype = cpu_weight_dtype
        self.model = load_model(model_config, dtype, device)
        self.model.use_native(self.native, cpu_weight_dtype)
        self.sampler = Sampler()
        try:
            self.kv_caches = self._allocate_kv_cache()
        except RuntimeError as e:  # out of memory (torch.OutOfMemoryError on a GPU)
            raise ValueError(
                f"cannot allocate the KV cache of {self.num_blocks} blocks of {self.block_size} tokens "
                f"(--num-kv-blocks, --block-size, --kv-cache-memory-gb): {e}"
            ) from None

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        c = self.cfg
        shape = (2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    def restore_kv_cache(self) -> None:
        if not self.kv_caches:
            self.kv_caches = self._allocate_kv_cache()

    def load_weights_from(self, model_config: ModelConfig, device: torch.device | None = None) -> None:
        """Swap in new weights of the same architecture (RL weight sync). ``device``: where
        to build them instead of this runner's device (the host while the engine sleeps);
        they keep the current rotary tables, as built on this runner's device."""
        model = load_model(model_config, self.dtype, device or self.device)
        if device is not None:
            model.rotary = self.model.rotary
        model.use_native(self.native, self.cpu_weight_dtype)
        self.model = model
        self.cfg = model_config

    # -- one step ------------------------------------------------------------------

    def _prepare(self, batch: list[ScheduledRequest]):
        """The flattened batch. A request with a draft verifies it in the same pass: its
        nodes follow its last token, parents before children, at slots num_tokens + i
        but at RoPE positions by tree depth; a tree (not a single path) adds a mask."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        samplers: list[SamplerRows] = []  # requests whose span reaches their last token
        scored: list[tuple[Request, int, int, int]] = []  # (request, first row, first position, rows)
        trees: list[tuple[int, list[int]]] = []  # (first row, row mask bits) of tree drafts
        for scheduled in batch:
            req, blocks, draft = scheduled.request, scheduled.block_ids, scheduled.request.draft
            num_draft = len(draft) if draft else 0
            start = req.num_computed_tokens
            end = start + scheduled.num_new_tokens
            committed_end = end - num_draft
            count = req.prompt_rows_to_score(start, committed_end)
            if count:
                first = len(req.prompt_logprobs)
                scored.append((req, len(input_ids) + first - start, first, count))
            input_ids.extend(req.all_token_ids[start:committed_end])
            positions.extend(range(start, committed_end))
            if draft:
                input_ids.extend(draft.tokens)
                positions.extend(committed_end - 1 + d for d in draft.depths)
                if not draft.is_path:  # a path's mask is the causal one
                    trees.append((len(input_ids) - num_draft - 1, draft.row_mask_bits()))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(len(input_ids))
            seq_lens.append(end)
            if committed_end == req.num_tokens:
                first = len(input_ids) - 1 - num_draft
                logits_rows.extend(range(first, len(input_ids)))
                samplers.append(SamplerRows(req, num_draft))
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
            tree_mask=_tree_mask(trees, len(input_ids), dev),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, logits_rows, samplers, scored

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> StepResult:
        if not batch:
            return StepResult({}, {})
        ids, pos, meta, logits_rows, samplers, scored = self._prepare(batch)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend)
        result = StepResult({}, {})
        for req, row, first, count in scored:  # position p's logits score prompt token p + 1
            targets = req.prompt_token_ids[first + 1 : first + 1 + count]
            top_n = req.sampling_params.prompt_logprobs or 0
            result.prompt_logprobs[req.request_id] = self._score(hidden[row : row + count], targets, top_n)
        if not samplers:
            return result
        logits = self.model.logits(hidden[torch.tensor(logits_rows, device=self.device)])
        rows = [row for s in samplers for row in sampling_rows(s.request)]
        out = self.sampler(logits, rows)
        i = 0
        for s in samplers:
            rid, n = s.request.request_id, s.num_draft + 1
            result.sampled[rid] = out.token_ids[i : i + n]
            if s.request.sampling_params.logprobs is not None:
                result.logprobs[rid] = out.logprobs[i : i + n]
            i += n
        return result

    def _score(self, hidden: torch.Tensor, targets: list[int], top_n: int, rows_per_pass: int = 256):
        """Each target token's (token, (logprob, rank, top-N)) under the logits of the row
        before it, a few hundred rows at a time (a row of logits is a vocabulary wide)."""
        out = []
        for lo in range(0, len(targets), rows_per_pass):
            logprobs = torch.log_softmax(self.model.logits(hidden[lo : lo + rows_per_pass]).float(), dim=-1)
            want = targets[lo : lo + rows_per_pass]
            out.extend(zip(want, token_logprobs(logprobs, want, top_n)))
        return out

    @torch.inference_mode()
    def move_kv(self, moves: list[tuple[int, int]]) -> None:
        """Copy keys/values from slot ``src`` to slot ``dst`` in every layer: accepted
        draft nodes of a tree move to the positions they now hold in the sequence."""
        if not moves:
            return
        src = torch.tensor([m[0] for m in moves], dtype=torch.int64, device=self.device)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.int64, device=self.device)
        for cache in self.kv_caches:
            flat = cache.view(2, -1, *cache.shape[3:])
            flat.index_copy_(1, dst, flat.index_select(1, src))

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' keys and values, ``[n, layers, 2, block_size, kv_heads,
        head_dim]``: each block contiguous, the unit a KV pool stores."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        per_layer = [cache.index_select(1, idx) for cache in self.kv_caches]  # [2, n, ...]
        return torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5).contiguous()

    @torch.inference_mode()
    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_kv_blocks``: fill the blocks from a pool's copy."""
        c = self.cfg
        shape = (len(block_ids), len(self.kv_caches), 2, self.block_size, c.num_kv_heads, c.head_dim)
        if tuple(data.shape) != shape:
            raise ValueError(f"KV blocks of shape {tuple(data.shape)} do not fit this model's {shape}")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = data.to(device=self.device, dtype=self.dtype)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, idx, data[:, layer].transpose(0, 1))

    def profile_step_cost(
        self,
        batch_sizes: tuple[int, ...] = (1, 4, 16),
        draft_lens: tuple[int, ...] = (0, 7, 15),
        context: int = 64,
    ) -> list[tuple[int, float]]:
        """(scheduled tokens, seconds) of decode-shaped steps with path drafts, for the
        draft budget's cost model. Dummy requests write into the first KV blocks, so
        call it before serving (the cache is empty then). Their positions stay inside the
        model's rotary table and their KV inside the cache: a model with fewer positions,
        or a cache of fewer blocks, profiles a shorter context."""
        points: list[tuple[int, float]] = []
        params = SamplingParams(temperature=0.0, max_tokens=1)
        max_positions = self.cfg.max_position_embeddings
        room = min(max_positions, self.num_blocks * self.block_size) - max(draft_lens)
        context = max(1, min(context, room))
        for draft_len in draft_lens:
            blocks = list(range(-(-(context + draft_len) // self.block_size)))
            if len(blocks) > self.num_blocks or context + draft_len > max_positions:
                continue
            for size in batch_sizes:
                batch = []
                for i in range(size):
                    req = Request(f"profile-{i}", [i % self.cfg.vocab_size] * context, params, 1, seed=i)
                    req.num_computed_tokens = context - 1
                    if draft_len:
                        req.draft = DraftTree([0] * draft_len, list(range(-1, draft_len - 1)))
                    batch.append(ScheduledRequest(req, 1 + draft_len, blocks))
                times = []
                for _ in range(4):  # the first run warms up; the fastest of the rest counts
                    start = time.perf_counter()
                    self.execute(batch)
                    times.append(time.perf_counter() - start)
                points.append((size * (1 + draft_len), min(times[1:])))
        return points

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size


def fused_ops(device: torch.device, dtype: torch.dtype, cpu_kernels: bool) -> ModuleType | None:
    """The kernel set the model runs its fused ops on here: Triton on a GPU, the C++ CPU
    kernels where they serve (and are wanted), else None (plain torch ops)."""
    if device.type == "cuda":
        from seer_engine.kernels import norm_rope

        return norm_rope
    if cpu_kernels and native_kernels.usable(device, dtype):
        return native_kernels.native()
    return None


def _tree_mask(trees: list[tuple[int, list[int]]], num_tokens: int, device: torch.device):
    """Per-token visibility bits (see AttentionMetadata.tree_mask); None without trees.

    Rows come as unsigned 64-bit patterns (a 63-node draft's last row sets bit 63) and
    are stored as the signed int64 with the same bits, which both backends read."""
    if not trees:
        return None
    bits = [-1] * num_tokens
    for first, rows in trees:
        bits[first : first + len(rows)] = [as_int64(word) for word in rows]
    return torch.tensor(bits, dtype=torch.int64, device=device)


def as_int64(word: int) -> int:
    """The signed (two's complement) int64 with the bits of the unsigned 64-bit ``word``."""
    if not 0 <= word < 1 << 64:
        raise ValueError(f"a tree-mask row has 64 bits, got {word:#x}")
    return word - (1 << 64) if word >> 63 else word


@dataclass
class SamplerRows:
    """A request that samples this step, at its last token and at each draft node."""

    request: Request
    num_draft: int


def sampling_rows(request: Request) -> list[SamplingRow]:
    """One row at the request's next position, then one per draft node at its depth
    (with a penalty, each node's row counts the draft tokens on its path as output)."""
    draft = request.draft
    if not draft:
        return [sampling_row(request)]
    if not request.sampling_params.penalized:
        return [sampling_row(request)] + [sampling_row(request, d) for d in draft.depths]
    rows, paths = [sampling_row(request)], []
    for token, parent in zip(draft.tokens, draft.parents):
        path = (paths[parent] if parent >= 0 else []) + [token]
        paths.append(path)
        rows.append(sampling_row(request, len(path), path))
    return rows


def sampling_row(request: Request, depth: int = 0, draft_path: Sequence[int] = ()) -> SamplingRow:
    """The row that samples the token ``depth`` places after the request's next one
    (``draft_path``: the ``depth`` draft tokens before it, which penalties count)."""
    p = request.sampling_params
    banned: list[int] = []
    if request.num_output_tokens + depth < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
    penalties = None
    if p.penalized:
        output = [*request.output_token_ids, *draft_path] if draft_path else request.output_token_ids
        penalties = Penalties(
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty, request.prompt_token_ids, output
        )
    return SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=request.seed,
        position=request.num_tokens + depth,
        banned_token_ids=banned,
        num_logprobs=p.logprobs,
        penalties=penalties,
        logit_bias=p.logit_bias or None,
        allowed_token_ids=p.allowed_token_ids,
    )
