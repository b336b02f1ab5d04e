"""Rollout mode behind the engine surface the server drives.

``RolloutEngine`` offers what ``AsyncEngine`` calls on an ``LLMEngine`` (add, step,
abort, sleep, weight updates, a snapshot) over an engine pool and a ``Rollout``, so
the server has one code path for both modes. User requests become responses in the
Request Buffer: requests that share a prompt (or name the same ``group_id``) while
their group is live join that group, so the Context Manager learns a group's length
from siblings that arrived as separate requests (veRL and slime send n=1 requests).
A finished group is forgotten: the next iteration's identical prompt, on new
weights, starts a new group.

Per-response seeds follow the plain engine's rule (request seed + index), so seeded
requests give the same tokens with or without rollout mode.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from seer_engine.core.policies import make_rollout_policy
from seer_engine.core.request import Group, RolloutSample
from seer_engine.core.seeds import child_seed
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.llm_engine import EngineSnapshot
from seer_engine.outputs import CompletionOutput, RequestOutput
from seer_engine.rollout.config import RolloutConfig
from seer_engine.rollout.rollout import Rollout
from seer_engine.sampling_params import InvalidRequestError, SamplingParams


@dataclass(eq=False)
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[RolloutSample]
    stream: bool

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_completion(i, s) for i, s in enumerate(self.samples)],
            finished=self.finished,
        )


def _completion(index: int, sample: RolloutSample) -> CompletionOutput:
    want_logprobs = sample.params.logprobs is not None
    return CompletionOutput(
        index=index,
        text=sample.text,
        token_ids=list(sample.output_token_ids),
        cumulative_logprob=sample.cumulative_logprob if want_logprobs else None,
        logprobs=sample.logprobs + sample.chunk_logprobs if want_logprobs else None,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
    )


class RolloutEngine:
    def __init__(self, config: EngineConfig, rollout: RolloutConfig) -> None:
        policy = make_rollout_policy(rollout.policy, starvation_s=rollout.starvation_s)
        self.pool = rollout.make_pool(config, policy)
        self.config = self.pool.config
        self.rollout = Rollout(self.pool, policy, rollout.chunk_tokens, placement=rollout.placement())
        front = self.pool.front
        self.max_model_len = front.max_model_len
        self.vocab_size = front.vocab_size
        self.detokenizer: Detokenizer = front.detokenizer
        self._sleeping = False
        self._requests: dict[str, _UserRequest] = {}
        self._owner: dict[str, _UserRequest] = {}  # sample key -> its user request
        self._groups: dict[tuple, Group] = {}  # live groups by prompt (or by the caller's group_id)
        self._group_keys: dict[str, tuple] = {}  # group id -> its key in _groups
        self._group_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)

    # -- requests ------------------------------------------------------------------------

    def validate_request(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        return self.pool.front.validate_request(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        group_id: str | None = None,
        stream: bool = False,
    ) -> list[RolloutSample]:
        """Queue a request's n responses in the Request Buffer (``priority`` is the
        rollout policy's business here, so it is not used)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids, _, max_tokens = self.pool.front.check_request(prompt, params)
        group = self._group_for(ids, text, params, group_id)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        samples = [
            RolloutSample(
                group, group.n + i, child_seed(base_seed, i), max_tokens, params=params, stream=stream
            )
            for i in range(params.n)
        ]
        group.n += params.n
        self.rollout.add_samples(samples)
        request = _UserRequest(request_id, text, ids, samples, stream)
        self._requests[request_id] = request
        for s in samples:
            self._owner[s.key] = request
        return samples

    def _group_for(
        self, ids: list[int], text: str | None, params: SamplingParams, group_id: str | None
    ) -> Group:
        key = ("group_id", group_id) if group_id is not None else ("prompt", tuple(ids))
        group = self._groups.get(key)
        if group is not None and self.rollout.is_group_live(group.group_id):
            if group.prompt_token_ids != ids:
                raise InvalidRequestError(
                    f"group_id {group_id!r} is already used by a request with a different prompt"
                )
            return group
        n = next(self._group_ids)
        group = Group(f"grp{n}", ids, params, n=0, prompt=text, order=n)
        self._groups[key] = group
        self._group_keys[group.group_id] = key
        return group

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort user requests; unfinished responses keep their tokens, finish_reason "abort"."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            request = self._requests.get(rid)
            if request is None:
                continue
            self.rollout.abort([s.key for s in request.samples if not s.finished])
            outputs.append(self._retire(request))
        self._forget_finished_groups()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of the instance whose clock is earliest; returns finished user
        requests and the progress of streaming ones."""
        touched: dict[str, _UserRequest] = {}
        for sample in self.rollout.step():
            request = self._owner[sample.key]
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.finished:
                outputs.append(self._retire(request))
            elif request.stream:
                outputs.append(request.output())
        self._forget_finished_groups()
        return outputs

    def _retire(self, request: _UserRequest) -> RequestOutput:
        del self._requests[request.request_id]
        for s in request.samples:
            self._owner.pop(s.key, None)
        return request.output()

    def _forget_finished_groups(self) -> None:
        for gid in self.rollout.forget_finished_groups():
            key = self._group_keys.pop(gid, None)
            if key is not None and self._groups.get(key) is not None and self._groups[key].group_id == gid:
                del self._groups[key]

    # -- serving primitives, on every instance -----------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def sleep(self) -> None:
        if self.has_unfinished_requests():
            raise InvalidRequestError(
                f"cannot sleep with {self.num_unfinished_requests} requests in flight; abort them "
                "or wait for them to finish first"
            )
        self.pool.call_all("sleep")
        self._sleeping = True

    def wake_up(self) -> None:
        self.pool.call_all("wake_up")
        self._sleeping = False

    def update_weights(self, path: str | Path) -> None:
        self.pool.call_all("update_weights", str(path))

    def reset_prefix_cache(self) -> None:
        self.pool.call_all("reset_prefix_cache")

    def close(self) -> None:
        """Stop the instances (processes) and release the KV pool."""
        self.pool.close()

    def snapshot(self) -> EngineSnapshot:
        """The sum over instances; responses waiting in the Request Buffer count as waiting."""
        total = EngineSnapshot()
        for snap in self.pool.call_all("snapshot"):
            total = total + snap
        total.waiting += len(self.rollout.buffer)
        return total
