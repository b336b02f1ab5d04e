"""The workload the KV-pool tests share: three seeded groups over two instances with a
tight KV budget (a response's last instance is often full when its next chunk is due,
so responses move), its single-instance reference, and greedy decoding on one engine."""

from __future__ import annotations

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import SamplingParams

BLOCK = 16


def pool_groups(temperature: float = 1.0) -> list[Group]:
    """Seeded sampling, so siblings differ: a moved response's blocks past the prompt
    are then in no other instance's prefix cache and must come from the pool (greedy
    siblings would share them by content). Per-response seeds make the tokens
    independent of chunking and placement."""
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=48, ignore_eos=True)
    prompts = [[(3 * i + j) % 30 + 2 for i in range(20 + 9 * j)] for j in range(3)]
    return [Group(f"g{j}", p, params, 4, params.max_tokens) for j, p in enumerate(prompts)]


def pool_config(model, kv_blocks: int, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), num_kv_blocks=kv_blocks, max_num_seqs=3, block_size=BLOCK, **kw)


def outputs_of(samples: dict) -> dict[str, list[list[int]]]:
    """Output tokens per group id, from ``{group id: [RolloutSample]}``."""
    return {gid: [s.output_token_ids for s in v] for gid, v in samples.items()}


def reference_outputs(model, temperature: float = 1.0) -> dict[str, list[list[int]]]:
    """The workload on one in-process instance, whole responses (no chunks, no moves)."""
    with EnginePool.start(pool_config(model, 64), 1) as pool:
        rollout = Dispatcher(pool, make_rollout_policy("context"), chunk_tokens=10_000)
        result = rollout.run(pool_groups(temperature))
    return outputs_of(result.samples)


def greedy(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int, prior: list[int]) -> list[int]:
    """Greedy output of one request run to the end on ``engine`` (prior output included)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(rid, prompt, params, prior_output_token_ids=prior)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens
