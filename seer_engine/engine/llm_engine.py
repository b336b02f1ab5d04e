"""One engine instance: add_request / step / abort over scheduler + model runner."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import torch

from seer_engine.core.draft import Acceptance, accept
from seer_engine.core.kv_cache_manager import KVCacheManager
from seer_engine.core.policies import SchedulingPolicy, make_policy
from seer_engine.core.request import Request, RequestStatus
from seer_engine.core.scheduler import Scheduler, SchedulerConfig
from seer_engine.core.seeds import child_seed
from seer_engine.engine.client import Health
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.input_processor import CheckedRequest, InputProcessor
from seer_engine.engine.output_processor import OutputProcessor, UserRequest, append_logprob
from seer_engine.engine.stats import EngineStats, StepShape
from seer_engine.model_executor import cpu_kernels
from seer_engine.model_executor.model_config import ModelConfig, parse_dtype
from seer_engine.model_executor.model_runner import (
    ModelRunner,
    ScheduledRequest,
    kv_cache_bytes_per_block,
)
from seer_engine.model_executor.weight_loader import safetensors_files
from seer_engine.outputs import RequestOutput
from seer_engine.sampling_params import InvalidRequestError, SamplingParams
from seer_engine.spec_decode.budget import AdaptiveBudget, StepCostModel, make_budget
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.drafter import Drafter
from seer_engine.spec_decode.proposers import Proposer, make_proposer

logger = logging.getLogger(__name__)


def resolve_model_path(model: str, dtype: str = "auto") -> Path:
    """A folder, ``tiny``, an alias (``smollm2-135m``) or a ``.gguf`` file as a model
    folder; aliases and GGUF files are fetched/converted on first use (model_source)."""
    from seer_engine.model_executor.model_source import resolve_model

    return resolve_model(model, dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


class TokenSource(Protocol):
    """Decides the emitted token after the model ran (trace replay). The model still
    runs for real; only the token that is appended changes. ``offset`` is the row's
    distance past the request's next token (draft nodes verify later positions), so
    a draft token is accepted iff it equals the source's token there."""

    def next_token(self, request: Request, sampled: int, offset: int = 0) -> int: ...


class LLMEngine:
    def __init__(
        self, config: EngineConfig, policy: SchedulingPolicy | None = None, proposer: Proposer | None = None
    ) -> None:
        """``proposer``: a draft source shared with other engines (a rollout pool's draft
        server), which then also decides when a group's drafts are dropped; by default
        the engine makes its own from ``config.speculative_config``."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model_path(config.model, config.dtype)
        self.model_config = ModelConfig.from_pretrained(path)
        self.tokenizer_path = Path(config.tokenizer or path)
        self.detokenizer = Detokenizer.from_pretrained(self.tokenizer_path)
        self.device = resolve_device(config.device)
        self.dtype = self.model_config.dtype if config.dtype == "auto" else parse_dtype(config.dtype)
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.max_model_len = self._max_model_len()
        num_blocks = self._num_kv_blocks()
        backend = config.attention_backend
        native = config.cpu_kernels and cpu_kernels.usable(self.device, self.dtype)
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "cpu" if native else "torch"
        self.runner = ModelRunner(
            self.model_config,
            self.dtype,
            self.device,
            config.block_size,
            num_blocks,
            backend,
            native,
            parse_dtype(config.cpu_weight_dtype),
        )
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.input_processor = InputProcessor(
            self.detokenizer, self.vocab_size, self.max_model_len, num_blocks, config.block_size
        )
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        self.scheduler = Scheduler(
            sched_cfg, self.kv_manager, policy or make_policy(config.scheduling_policy)
        )
        self._seed_rng = random.Random(config.seed)
        # Trace replay swaps sampled tokens for recorded ones; None in normal serving.
        self.token_source: TokenSource | None = None
        self.last_step_shape: StepShape | None = None  # what the latest step computed
        self._sleeping = False  # KV cache freed (and weights off the accelerator)
        self.outputs = OutputProcessor(self.detokenizer, self._release_group)
        self.drafter = self._make_drafter(config.speculative_config, proposer)
        # Live user requests per group, when this engine frees its own groups' drafts.
        self._group_live: dict[str, int] | None = {} if self.drafter and proposer is None else None

    def _make_drafter(self, spec: SpeculativeConfig | None, proposer: Proposer | None) -> Drafter | None:
        if spec is None:
            return None
        cost = StepCostModel(*spec.step_cost) if spec.step_cost else self._profile_step_cost
        budget = make_budget(spec.budget, cost, tree=spec.trees)
        if isinstance(budget, AdaptiveBudget):
            budget.cost  # profile now, while the KV cache is empty  # noqa: B018
        return Drafter(spec, proposer or make_proposer(spec), budget)

    def _profile_step_cost(self) -> StepCostModel:
        model = StepCostModel.fit(self.runner.profile_step_cost())
        logger.info("profiled step cost: %.3g s + %.3g s/token", model.fixed_s, model.per_token_s)
        return model

    # -- sizing --------------------------------------------------------------------

    def _max_model_len(self) -> int:
        cfg = self.model_config
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:
            limit = min(limit, cfg.sliding_window)  # no sliding-window attention: stay inside it
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds what the model supports ({limit})")
        return wanted

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_cache_bytes_per_block(self.model_config, cfg.block_size, self.dtype)
        budget, fix = 1 << 30, "lower --block-size or raise --kv-cache-memory-gb"
        if cfg.kv_cache_memory_gb is not None:
            budget = int(cfg.kv_cache_memory_gb * (1 << 30))
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1 - cfg.gpu_memory_utilization) * total) - self._weight_bytes()
            fix = "lower --block-size or raise --gpu-memory-utilization or --kv-cache-memory-gb"
        if budget < per_block:
            size = f"{cfg.block_size} tokens ({per_block} bytes)"
            raise ValueError(f"the KV cache budget ({max(budget, 0)} bytes) holds no block of {size}: {fix}")
        needed = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        return min(budget // per_block, needed)

    def _weight_bytes(self) -> int:
        """Size of the weights once loaded in the engine dtype, from the checkpoint files."""
        files = safetensors_files(self.model_config.path)
        on_disk = sum(f.stat().st_size for f in files)
        return on_disk * self.dtype.itemsize // self.model_config.dtype.itemsize

    # -- requests ------------------------------------------------------------------

    def make_input_processor(self) -> InputProcessor:
        """The same checks with a tokenizer of its own, for a thread other than the
        one that steps this engine (HF fast tokenizers must not be shared)."""
        p = self.input_processor
        tokenizer = Detokenizer.from_pretrained(self.tokenizer_path)
        return InputProcessor(tokenizer, p.vocab_size, p.max_model_len, p.num_kv_blocks, p.block_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        group_id: str | None = None,
        stream: bool = False,
        prior_output_token_ids: Sequence[int] = (),
    ) -> list[Request]:
        """Check and queue a request (n samples); returns the scheduler requests it became.
        ``prior_output_token_ids``: see ``add_checked``."""
        checked = self.input_processor.process(prompt, params, prior_output_token_ids)
        return self.add_checked(request_id, checked, priority, group_id, stream)

    def add_checked(
        self,
        request_id: str,
        checked: CheckedRequest,
        priority: int = 0,
        group_id: str | None = None,
        stream: bool = False,
        sequence_id: str | None = None,
        cuttable: bool = False,
        high_priority: bool = False,
    ) -> list[Request]:
        """Queue a request that passed the input processor.

        ``checked.prior_output_token_ids`` resumes a sample that already generated
        tokens (the next chunk of a divided rollout): they count towards max_tokens,
        min_tokens, stop strings and sampling positions, and their KV is recomputed or
        taken from the prefix cache like any other context. Logprobs cover only new
        tokens. ``sequence_id`` names the response the request continues (drafters keep
        their per-response state under it); it defaults to the request's own id.
        ``cuttable``: a rollout chunk the scheduler may end early, once it has new tokens,
        when KV runs out (instead of preempting it). ``high_priority``: its draft nodes
        weigh the speculative config's ``priority_weight`` in the draft budget.
        """
        if self._sleeping:
            # Its KV cache is gone: the model would run without attention, silently.
            raise InvalidRequestError("the engine is asleep (KV cache freed): call wake_up() first")
        if request_id in self.outputs.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if priority and self.config.scheduling_policy != "priority":  # vLLM refuses it too, not ignores it
            raise InvalidRequestError(f"priority {priority} needs --scheduling-policy priority", "priority")
        params, ids = checked.params, checked.prompt_token_ids
        # Sample ids ("id-i" when n > 1) may clash with another request's: refuse before
        # any state changes, or the clash would leave a request that never finishes.
        sample_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        clash = [sid for sid in sample_ids if sid in self.scheduler.requests]
        if clash:
            raise InvalidRequestError(
                f"sample id {clash[0]!r} of request {request_id!r} is already in use", param="request_id"
            )
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        parent = UserRequest(request_id, checked.prompt, ids, params, stream=stream)
        for i in range(params.n):
            child = Request(
                request_id=sample_ids[i],
                prompt_token_ids=ids,
                sampling_params=params,
                max_tokens=checked.max_tokens,
                seed=child_seed(base_seed, i),
                eos_token_ids=self.eos_token_ids,
                prompt=checked.prompt,
                priority=priority,
                group_id=group_id if group_id is not None else request_id,
                sample_index=i,
                output_token_ids=list(checked.prior_output_token_ids),
                cut_after=len(checked.prior_output_token_ids) if cuttable else None,
                high_priority=high_priority,
                sequence_id=None
                if sequence_id is None
                else (sequence_id if params.n == 1 else f"{sequence_id}-{i}"),
            )
            parent.children.append(child)
        self.outputs.add(parent)
        if self._group_live is not None:
            gid = parent.children[0].group_id
            self._group_live[gid] = self._group_live.get(gid, 0) + 1
        for child in parent.children:
            self.scheduler.add_request(child)
        return parent.children

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests by id (user ids or sample ids); returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = self.scheduler.finish_requests(self.outputs.child_ids(ids), RequestStatus.FINISHED_ABORTED)
        return self.outputs.collect(done)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.outputs.requests)

    # -- stepping ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns finished user requests (and streaming progress)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.last_step_shape = None
            return self.outputs.collect(sched.cut)
        self.last_step_shape = StepShape.of_step(sched.scheduled)
        batch = [
            ScheduledRequest(req, n, self.kv_manager.block_ids(req.request_id)) for req, n in sched.scheduled
        ]
        result = self.runner.execute(batch)
        by_id = {req.request_id: req for req, _ in sched.scheduled}
        for rid, scored in result.prompt_logprobs.items():
            for token, lp in scored:
                append_logprob(by_id[rid].prompt_logprobs, token, lp)
        if self.token_source is not None:
            result.sampled = {rid: self._replayed(by_id[rid], rows) for rid, rows in result.sampled.items()}
        verdicts = {rid: accept(by_id[rid].draft, rows) for rid, rows in result.sampled.items()}
        self._move_accepted_kv(batch, verdicts)
        counts = {rid: by_id[rid].num_output_tokens for rid in verdicts}
        updated = self.scheduler.update_from_output(sched, {rid: v.tokens for rid, v in verdicts.items()})
        for req in updated:
            rid = req.request_id
            num_new = req.num_output_tokens - counts[rid]
            lps = result.logprobs.get(rid)
            if lps is not None:
                new_tokens = req.output_token_ids[counts[rid] :]
                for token, row in zip(new_tokens, verdicts[rid].rows[:num_new]):
                    req.cumulative_logprob += append_logprob(req.logprobs, token, lps[row])
            if req.sampling_params.stop:
                self._check_stop_strings(req, num_new)
        if self.drafter is not None:
            self.drafter.after_step(updated, verdicts, self.scheduler.running)
        return self.outputs.collect(updated + sched.cut)

    def _replayed(self, req: Request, rows: list[int]) -> list[int]:
        """Trace replay: every row emits the trace's token at its position."""
        depths = [0] + (req.draft.depths if req.draft else [])
        return [self.token_source.next_token(req, tok, d) for tok, d in zip(rows, depths)]

    def _move_accepted_kv(self, batch: list[ScheduledRequest], verdicts: dict[str, Acceptance]) -> None:
        """Accepted nodes of a tree computed their KV at slot num_tokens + node; the
        sequence needs it at num_tokens + depth - 1 (a single path is already there)."""
        moves = []
        for scheduled in batch:
            verdict = verdicts.get(scheduled.request.request_id)
            if verdict is None:
                continue
            base, blocks = scheduled.request.num_tokens, scheduled.block_ids
            for j, node in enumerate(verdict.nodes):
                if node != j:
                    moves.append((self.runner.slot(blocks, base + node), self.runner.slot(blocks, base + j)))
        if moves:
            self.runner.move_kv(moves)
            self.drafter.stats.moved_kv_slots += len(moves)

    def _check_stop_strings(self, req: Request, num_new: int) -> None:
        """A stop string completed by one of this step's ``num_new`` tokens finishes the request
        there; tokens after it (accepted draft tokens) are dropped. A request that just finished
        is checked too: a stop string completed by its last token (at max_tokens) makes it stop,
        as in vLLM. One ended by EOS or a stop token id is checked up to the token before: that
        token adds no text. As in vLLM, only tokens past the first min_tokens complete one (EOS
        and stop ids are banned up to there).
        """
        params = req.sampling_params
        total = req.num_output_tokens
        last = total - 1 if req.status is RequestStatus.FINISHED_STOPPED else total
        lead = self.detokenizer.text_lead(req.prompt_token_ids)
        for length in range(max(total - num_new + 1, params.min_tokens + 1), last + 1):
            output_ids = req.output_token_ids[:length]
            hit = self.detokenizer.find_stop_string(output_ids, params.stop, params.skip_special_tokens, lead)
            if hit is not None:
                req.stop_reason = hit
                self.scheduler.finish_truncated(req, length, RequestStatus.FINISHED_STOPPED)
                return

    def _release_group(self, request: UserRequest) -> None:
        """The last request of a group finished: its drafts are of no further use."""
        if self._group_live is None:
            return
        group_id = request.children[0].group_id
        self._group_live[group_id] -= 1
        if self._group_live[group_id] == 0:
            del self._group_live[group_id]
            self.drafter.proposer.finish_group(group_id)

    # -- serving primitives: stats, RL weight sync, memory release -----------------------
    #
    # Used by the server (AsyncEngine). Between rollouts an RL trainer loads new
    # weights and wants the accelerator memory back while it trains; these calls do
    # that without rebuilding the engine.

    _ARCHITECTURE_FIELDS = (
        "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
        "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "sliding_window",
    )  # fmt: skip

    def stats(self) -> EngineStats:
        """Load and counters (requests counted per sample)."""
        sched, kv = self.scheduler, self.kv_manager.stats()
        return EngineStats(
            running=sched.num_running,
            waiting=sched.num_waiting,
            kv_used_blocks=kv.num_blocks - kv.num_free_blocks,
            kv_total_blocks=kv.num_blocks,
            drafter_s=self.drafter.stats.observe_s + self.drafter.stats.propose_s if self.drafter else 0.0,
            **asdict(sched.stats),
        )

    def health(self) -> Health:
        return Health()

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (their KV is stale after a weight update)."""
        self.kv_manager.reset_prefix_cache()

    # KV blocks for a KV connector (kv_connector.base.KVBlockIO): a response's context
    # moves between instances as blocks of the prefix cache.

    @property
    def kv_block_size(self) -> int:
        return self.kv_manager.block_size

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        c = self.model_config
        return (c.num_layers, 2, self.kv_manager.block_size, c.num_kv_heads, c.head_dim)

    @property
    def kv_block_dtype(self) -> torch.dtype:
        return self.dtype

    def kv_block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        return self.kv_manager.block_hashes(token_ids)

    def cached_kv_blocks(self, hashes: Sequence[int]) -> list[int]:
        return self.kv_manager.cached_prefix(hashes)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.read_kv_blocks(block_ids)

    def adopt_kv_blocks(self, hashes: Sequence[int], start: int) -> list[int] | None:
        return self.kv_manager.adopt_blocks(hashes, start)

    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.runner.write_kv_blocks(block_ids, blocks)

    def update_weights(self, path: str | Path) -> None:
        """Load new weights of the same architecture from a Hugging Face folder.

        The config is compared first so that a wrong checkpoint fails with a clear
        message before anything is loaded; tensor shapes are checked while loading,
        and on any error the current weights stay in place. Running requests keep
        going on the new weights (their earlier KV stays), as in partial rollouts.
        An empty path is refused: as a Path it is the working directory.
        """
        if not str(path).strip():
            raise InvalidRequestError(
                "model_path is empty: give the folder of the new weights", param="model_path"
            )
        new_cfg = ModelConfig.from_pretrained(Path(path).expanduser())
        diffs = [
            f"{name}: {getattr(self.model_config, name)!r} -> {getattr(new_cfg, name)!r}"
            for name in self._ARCHITECTURE_FIELDS
            if getattr(self.model_config, name) != getattr(new_cfg, name)
        ]
        if diffs:
            raise InvalidRequestError(
                f"cannot update weights from {new_cfg.path}: the model differs in " + "; ".join(diffs),
                param="model_path",
            )
        # Asleep, build them on the host (wake_up moves them): the accelerator stays free.
        asleep_off_host = self.is_sleeping and self.device.type != "cpu"
        self.runner.load_weights_from(new_cfg, torch.device("cpu") if asleep_off_host else None)
        self.model_config = new_cfg
        self.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the KV cache and, on an accelerator, move the weights to host memory.

        Refuses while requests are in flight (their KV would be lost): callers abort
        them or let them finish first. The prefix cache is cleared with the KV.
        """
        if self.is_sleeping:
            return
        if self.has_unfinished_requests():
            raise InvalidRequestError(
                f"cannot sleep with {self.num_unfinished_requests} requests in flight; abort them "
                "or wait for them to finish first"
            )
        self.reset_prefix_cache()
        self.runner.free_kv_cache()
        if self.device.type != "cpu":
            self.runner.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._sleeping = True

    def wake_up(self) -> None:
        """Undo sleep(): weights back on the device, a fresh (empty) KV cache."""
        if not self.is_sleeping:
            return
        if self.device.type != "cpu":
            self.runner.model.to(self.device)
        self.runner.restore_kv_cache()
        self._sleeping = False
