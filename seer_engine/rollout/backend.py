"""The server's rollout backend: user requests in, a dispatcher over an instance pool.

``RolloutBackend`` offers what ``AsyncEngine`` drives on an ``LLMEngine`` (add, step,
abort, sleep, weight updates, stats), so the server has one code path for both
modes. User requests become responses in the Request Buffer: requests that share a
prompt (or name the same ``group_id``) while their group is live join that group, so
the Context Manager learns a group's length from siblings that arrived as separate
requests (veRL and slime send n=1 requests). A finished group is forgotten: the next
iteration's identical prompt, on new weights, starts a new group.

With a history store (``--history``), finished responses fill it for the next
iteration (a weight update starts one, and saves the store into its directory, as
``close`` does): grouped drafts are seeded from it, +history policies rank by it.

Per-response seeds follow the plain engine's rule (``child_seed``), so seeded requests
give the same tokens with or without rollout mode.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from seer_engine.core.seeds import child_seed
from seer_engine.engine.client import Health
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.input_processor import CheckedRequest, InputProcessor
from seer_engine.engine.llm_engine import resolve_model_path
from seer_engine.engine.stats import EngineStats, total
from seer_engine.outputs import CompletionOutput, RequestOutput
from seer_engine.rollout.config import HISTORY_FILE, RolloutConfig, bind_history, save_history
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.types import Group, InstanceDied, RolloutSample
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

SERVER_LOG_LIMIT = 10_000  # dispatches and steps per instance kept for inspection


logger = logging.getLogger(__name__)

# Tests only: "<path>" makes close() create <path> and wait until it is removed, before it
# saves the history store, so a test can signal a server at a known point of its shutdown
# (or hold the save as a slow disk would) instead of racing it.
TEST_PAUSE_CLOSING_ENV = "SEER_ENGINE_TEST_PAUSE_CLOSING"


def _pause_for_test() -> None:
    marker = os.environ.get(TEST_PAUSE_CLOSING_ENV)
    if marker:
        logger.warning("shutdown paused for a test (%s)", TEST_PAUSE_CLOSING_ENV)
        Path(marker).touch()
        while Path(marker).exists():
            time.sleep(0.05)


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
            prompt_logprobs=self.samples[0].prompt_logprobs,
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


class RolloutBackend:
    def __init__(self, config: EngineConfig, rollout: RolloutConfig, data_dir: Path | None = None) -> None:
        """``data_dir``: the server's; a +history policy keeps its store under it by default."""
        self.history_spec = rollout.history_spec(data_dir)
        self.history = rollout.open_history(data_dir)
        policy = rollout.make_policy(self.history)
        self.pool = rollout.make_pool(config, policy, timeline_points=SERVER_LOG_LIMIT, history=self.history)
        self.dispatcher = Dispatcher(
            self.pool,
            policy,
            rollout.chunk_tokens,
            placement=rollout.placement(),
            on_group_finished=self._group_finished,
            log_limit=SERVER_LOG_LIMIT,
        )
        self.max_model_len = self.pool.max_model_len
        self.vocab_size = self.pool.instances[0].info.vocab_size
        try:
            bind_history(self.history, self.history_spec, self.pool.make_input_processor())
        except ValueError:
            self.pool.close()
            raise
        self._history_error: str | None = None  # why the last save failed (None: it did not)
        self._saved_at_close = False
        self.closing: str | None = None  # what close() is doing, for the server's shutdown log
        self._sleeping = False
        self._config = config
        self._weights: str | None = None  # the folder of the last weight update (None: the model's)
        self._mixed_weights: str | None = None  # why the instances hold different weights
        self._requests: dict[str, _UserRequest] = {}
        self._owner: dict[str, _UserRequest] = {}  # sample key -> its user request
        self._live_groups: dict[tuple, Group] = {}  # by prompt (or by the caller's group_id)
        self._join_keys: dict[str, tuple] = {}  # live group id -> its key in _live_groups
        self._group_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._processor: InputProcessor | None = None  # for add_request

    def make_input_processor(self) -> InputProcessor:
        return self.pool.make_input_processor()

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        group_id: str | None = None,
        stream: bool = False,
    ) -> list[RolloutSample]:
        """Check and queue a request, as ``LLMEngine.add_request`` does (the server checks
        requests on its intake thread and calls ``add_checked``)."""
        if self._processor is None:
            self._processor = self.make_input_processor()
        return self.add_checked(
            request_id, self._processor.process(prompt, params), group_id=group_id, stream=stream
        )

    def add_checked(
        self,
        request_id: str,
        checked: CheckedRequest,
        priority: int = 0,
        group_id: str | None = None,
        stream: bool = False,
    ) -> list[RolloutSample]:
        """Queue a request's n responses in the Request Buffer. The rollout policy orders
        them, so a ``priority`` is refused (as vLLM's fcfs refuses one), not ignored."""
        if priority:
            raise InvalidRequestError(
                f"priority {priority} is not supported in rollout mode: the rollout policy orders responses",
                param="priority",
            )
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params = checked.params
        group = self._group_for(checked, group_id)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        # The first response scores the prompt (prompt_logprobs); the others need not.
        unscored = params.clone(prompt_logprobs=None) if params.prompt_logprobs is not None else params
        samples = [
            RolloutSample(group, group.n + i, child_seed(base_seed, i), checked.max_tokens, p, stream)
            for i, p in enumerate([params] + [unscored] * (params.n - 1))
        ]
        group.n += params.n
        self.dispatcher.add_samples(samples)
        request = _UserRequest(request_id, checked.prompt, checked.prompt_token_ids, samples, stream)
        self._requests[request_id] = request
        for s in samples:
            self._owner[s.key] = request
        return samples

    def _group_for(self, checked: CheckedRequest, group_id: str | None) -> Group:
        ids = checked.prompt_token_ids
        key = ("group_id", group_id) if group_id is not None else ("prompt", tuple(ids))
        group = self._live_groups.get(key)
        if group is not None:
            if list(group.prompt_token_ids) != ids:
                raise InvalidRequestError(
                    f"group_id {group_id!r} is already used by a request with a different prompt",
                    param="group_id",
                )
            return group
        n = next(self._group_ids)
        group = Group(f"grp{n}", ids, checked.params, 0, checked.max_tokens, prompt=checked.prompt, order=n)
        self._live_groups[key] = group
        self._join_keys[group.group_id] = key
        return group

    def _group_finished(self, group: Group) -> None:
        del self._live_groups[self._join_keys.pop(group.group_id)]

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort user requests; unfinished responses keep their tokens, finish_reason "abort"."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            request = self._requests.get(rid)
            if request is None:
                continue
            self.dispatcher.abort([s.key for s in request.samples if not s.finished])
            outputs.append(self._retire(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One dispatcher step; returns finished user requests and the progress of
        streaming ones."""
        touched: dict[str, _UserRequest] = {}
        for sample in self.dispatcher.step():
            request = self._owner[sample.key]
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.finished:
                outputs.append(self._retire(request))
            elif request.stream:
                outputs.append(request.output())
        return outputs

    def _retire(self, request: _UserRequest) -> RequestOutput:
        del self._requests[request.request_id]
        for s in request.samples:
            self._owner.pop(s.key, None)
        return request.output()

    # -- serving primitives, on every instance -----------------------------------------------

    def _call_all(self, method: str, *args, answers: list | None = None) -> list:
        """``method`` on every live instance; one that turns out dead is dropped (its
        responses finish elsewhere), not an error, unless none is left (``RolloutStalled``:
        the call applied nowhere, and the server stops serving). ``answers``: the list the
        answers go into as they come, so a caller whose call failed sees how far it got."""
        results = [] if answers is None else answers
        for inst in self.pool.alive:
            try:
                results.append(inst.call(method, *args))
            except InstanceDied as died:
                self.dispatcher.lose_instance(inst, str(died))
        self.dispatcher.check_alive()
        return results

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    def sleep(self) -> None:
        if self.has_unfinished_requests():
            raise InvalidRequestError(
                f"cannot sleep with {self.num_unfinished_requests} requests in flight; abort them "
                "or wait for them to finish first"
            )
        try:
            self._call_all("sleep")
        except Exception:  # all or none: a half-asleep rollout would step instances without KV
            self._call_all("wake_up")
            raise
        self._sleeping = True

    def wake_up(self) -> None:
        try:
            self._call_all("wake_up")
        except Exception:  # all or none: the woken ones would hold memory the trainer was promised
            self._call_all("sleep")
            raise
        self._sleeping = False

    def update_weights(self, path: str | Path) -> None:
        """New weights on every instance; the history store starts its next iteration
        (its lengths decay by ``--history-half-life``) and is saved. All or none, as on one
        engine: when an instance fails (out of memory, say), those updated before it load
        the weights they had again, so the rollout never samples from two models."""
        updated: list = []
        try:
            self._call_all("update_weights", str(path), answers=updated)
        except Exception as failed:
            if updated:
                self._roll_back(failed)
            raise
        self._weights, self._mixed_weights = str(path), None
        self.dispatcher.kv_epoch += 1
        self._drop_pooled_kv()
        if self.history is not None:
            self.history.next_iteration()
            self._save_history()

    def _roll_back(self, failed: Exception) -> None:
        """The instances updated before ``failed`` load their previous weights again; when
        that fails too (their folder deleted, say), the update's error says so and
        ``/health`` reports the instances on different weights until an update succeeds."""
        try:
            self._call_all("update_weights", str(self._weights_path()))
        except Exception as back:  # noqa: BLE001 - reported with the update's own error
            self._mixed_weights = (
                "a failed weight update left the instances on different weights (going back to "
                f"the previous weights failed: {back}); update the weights again"
            )
            raise RuntimeError(f"{failed}; and {self._mixed_weights}") from failed

    def _weights_path(self) -> Path | str:
        if self._weights is not None:
            return self._weights
        return resolve_model_path(self._config.model, self._config.dtype)

    def _drop_pooled_kv(self) -> None:
        """The instances dropped their prefix caches with the old weights; the pool holds the
        same KV of the responses between chunks, which a moved response would load where one
        that stays recomputes: it goes too, and every response recomputes its context. A free
        that fails leaves nothing loadable: chunks from now on use the next ``kv_epoch``."""
        if self.dispatcher.pooled:
            for request in self._requests.values():
                for sample in request.samples:
                    if not sample.finished:
                        self.pool.kv_connector.free(sample.key)

    def _save_history(self) -> None:
        """Save the store; a failure (a full or read-only disk, a store of another
        tokenizer in a shared directory) fails neither a weight update, which has already
        happened, nor a shutdown: the store stays in memory, is saved again at the next
        update, and /health says why it is not on disk."""
        try:
            save_history(self.history, self.history_spec)
        except (ValueError, OSError) as e:
            self._history_error = str(e)
            logger.error("%s; the store is kept in memory and saved again at the next update", e)
        else:
            self._history_error = None

    def reset_prefix_cache(self) -> None:
        self._call_all("reset_prefix_cache")

    def close(self) -> None:
        """Save the history store, then stop the instances (processes) and release the KV
        pool; ``closing`` says which step runs, for a shutdown that waits on it."""
        self.closing = "saving the history store" if self.lost_on_exit() else "closing the rollout"
        try:
            _pause_for_test()
            self._save_history()
            self._saved_at_close = self._history_error is None
        finally:
            self.closing = "stopping the engine instances"
            self.pool.close()
            self.closing = None

    def lost_on_exit(self) -> str | None:
        """What a process that exits before ``close`` has saved the store loses."""
        if self.history is None or self.history_spec in ("off", "memory") or self._saved_at_close:
            return None
        path = Path(self.history_spec).expanduser() / HISTORY_FILE
        return f"the history store's records since its last save ({path} keeps that save)"

    def stats(self) -> EngineStats:
        """The sum over instances, as of their last replies (asking them would wait on
        their steps) with their chunks counted as the books hold them now; responses in
        the Request Buffer count as waiting; idle, the pool frees that failed are retried. Raises
        ``RolloutStalled`` once every instance is gone (the engine thread asks often)."""
        for inst in self.pool.alive:
            if not inst.poll_alive():
                self.dispatcher.lose_instance(inst, f"engine instance {inst.index} died")
        self.dispatcher.check_alive()  # none left: the server stops serving (503), paused or idle
        if not self.has_unfinished_requests():
            self.pool.kv_connector.free_left()  # idle: no finishing response would retry them
        stats = total([inst.books.current_stats() for inst in self.pool.alive])
        stats += total([inst.books.stats.counters() for inst in self.pool.instances if not inst.alive])
        stats.waiting += len(self.dispatcher.buffer)
        return stats

    def health(self) -> Health:
        instances = [
            {"index": inst.index, "backend": inst.backend, "pid": inst.info.pid, "alive": inst.alive}
            for inst in self.pool.instances
        ]
        lost = [inst.index for inst in self.pool.instances if not inst.alive]
        connectors = [self.pool.kv_connector.stats, *(inst.books.connector_stats for inst in self.pool.alive)]
        pool_failures = self.pool.kv_connector.stats.failures + sum(
            inst.books.connector_stats.failures for inst in self.pool.instances
        )
        reasons = [f"engine instances {lost} lost"] if lost else []
        down = next((c.down for c in connectors if c.down is not None), None)
        if down is not None:  # a full pool, or one that failed and serves again, is not down
            reasons.append(f"the KV pool is failing ({pool_failures} failed calls so far): {down}")
        if self._history_error is not None:
            reasons.append(f"the history store is not saved: {self._history_error}")
        if self._mixed_weights is not None:
            reasons.append(self._mixed_weights)
        return Health(
            "; ".join(reasons) or None,
            instances,
            instance_failures=self.dispatcher.counters.instance_failures,
            kv_pool_failures=pool_failures,
        )
