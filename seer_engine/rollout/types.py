"""What a rollout is made of, as the Request Buffer and the instances exchange it.

A group is one prompt sampled n times; each response (``RolloutSample``) runs in
chunks; each chunk is one ``ChunkRequest`` to an instance, which answers with
``StepReply``s. Ids travel as fields: a chunk names its response's group and key,
and nothing parses an id string to find them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from seer_engine.engine.client import EngineDeadError
from seer_engine.engine.stats import EngineStats, StepShape
from seer_engine.kv_connector.base import ConnectorStats
from seer_engine.outputs import RequestOutput
from seer_engine.sampling_params import SamplingParams
from seer_engine.spec_decode.drafter import SpecDecodeStats


@dataclass
class Group:
    """One prompt sampled n times: the unit RL trainers submit and Seer schedules by."""

    group_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams
    n: int
    max_tokens: int  # each response's budget, as the input processor resolved it
    prompt: str | None = None
    order: int = 0  # submission order within the rollout


def sample_key(group_id: str, index: int) -> str:
    """A response's name in pools, drafts, reports and the simulator (built, never parsed)."""
    return f"{group_id}/{index}"


@dataclass(eq=False)
class RolloutSample:
    """One response of a group as the Request Buffer tracks it across chunks.

    It holds what a real scheduler can know: the tokens generated so far and where
    its KV was last, never how long it will get.
    """

    group: Group
    sample_index: int  # unique within the group; index 0 is the group's probe
    seed: int
    max_tokens: int  # the budget of the whole response
    params: SamplingParams | None = None  # this response's own; None: the group's
    stream: bool = False  # report progress every step, not only at chunk ends
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output so far, stop strings trimmed (as of the last chunk end)
    logprobs: list = field(default_factory=list)  # of finished chunks
    chunk_logprobs: list = field(default_factory=list)  # of the running chunk (streaming progress)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list | None = None  # prompt_logprobs, scored by the first chunk of one asking
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    instance: int | None = None  # engine instance holding its KV (prefix cache) after a chunk
    enqueued_at: float = 0.0  # when it last entered the Request Buffer
    finished_at: float | None = None
    chunks: int = 0  # chunks dispatched so far
    chunk_start: int = 0  # output tokens when its running chunk began (a lost chunk restarts here)

    def __post_init__(self) -> None:
        if self.params is None:
            self.params = self.group.sampling_params

    @property
    def key(self) -> str:
        """The response's name in pools, drafts and reports (built, never parsed)."""
        return sample_key(self.group.group_id, self.sample_index)

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def chunk_params(self, limit: int) -> SamplingParams:
        """The engine's params for a chunk ending at ``limit`` output tokens. The engine
        counts the resumed output towards max_tokens and min_tokens, so both bound the
        whole response. min_tokens stays the response's even past the chunk's limit (set
        after the check that refuses that in a request): a chunk that ends short of it
        must not stop on a stop string, a stop id or EOS, as the response would not."""
        p = self.params
        params = p.clone(n=1, seed=self.seed, max_tokens=limit, min_tokens=min(p.min_tokens, limit))
        params.min_tokens = p.min_tokens
        return params

    def chunk_request_id(self) -> str:
        """The engine request id of the chunk dispatched last."""
        return f"{self.key}#{self.chunks - 1}"


@dataclass
class ChunkRequest:
    """One dispatch of a response: run it from its tokens so far up to ``params.max_tokens``."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    group_id: str
    sequence_id: str  # the response's key: its pool entry and draft-tree sequence
    prior_output_token_ids: list[int]
    stream: bool = False
    load_kv: bool = False  # pull the context's KV from the pool before admitting it
    save_kv: bool = False  # push the context's KV to the pool if the chunk ends by length
    cuttable: bool = False  # out of KV, the engine may end the chunk early (KV kept) instead of preempting
    high_priority: bool = False  # a long response: its drafts weigh the config's priority_weight
    kv_epoch: int = 0  # the weights' version: the pool serves only KV saved under it

    @property
    def context(self) -> list[int]:
        return list(self.prompt_token_ids) + self.prior_output_token_ids


@dataclass
class InstanceInfo:
    """What the Request Buffer needs to know of an instance to place chunks on it."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    vocab_size: int = 0
    pid: int = 0  # of the process the engine runs in (an operator may need to find it)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass
class StepReply:
    """What an instance reports after one step (or, simulated, one stretch of steps)."""

    outputs: list[RequestOutput]  # chunks that ended, and streaming progress
    elapsed_s: float  # the step plus the pool loads and saves it carried
    stats: EngineStats  # cumulative
    drafter: SpecDecodeStats | None
    connector: ConnectorStats
    loads: list = field(default_factory=list)  # (request id, context tokens, LoadResult) per pool load
    shapes: list[StepShape] = field(default_factory=list)  # what each engine step in it computed
    draft_updates: list = field(default_factory=list)  # new tokens for the draft server (processes)
    progress: dict[str, int] = field(default_factory=dict)  # request id -> output tokens, chunks held


class RolloutStalled(EngineDeadError):
    """Responses are left that no instance can ever run: every instance is gone, or a
    chunk needs more KV than an empty instance has. A configuration error, not a bug.
    A server's engine stops on it (an ``EngineDeadError``): its callers get 503."""


class InstanceDied(RuntimeError):
    """An instance's process (or actor) is gone; its chunks go back to the buffer."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(f"engine instance {index} died: {why}")
        self.index = index
