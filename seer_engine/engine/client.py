"""What the OpenAI server codes against: ``EngineClient``, its errors and its stats.

One implementation, ``AsyncEngine``, drives a ``ServingBackend`` (a plain ``LLMEngine``
or the rollout backend: several instances behind the Request Buffer) on a thread of
its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.input_processor import CheckedRequest, InputProcessor
from seer_engine.engine.stats import EngineStats
from seer_engine.outputs import RequestOutput
from seer_engine.sampling_params import SamplingParams

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no request can be served. A
    backend raises it (from any call) when it can serve nothing any more, e.g. every
    rollout instance is gone: the engine thread then stops and fails every caller."""


class EngineBusyError(RuntimeError):
    """The command conflicts with the engine's state (e.g. sleep with requests in flight)."""


@dataclass
class Health:
    """Whether the backend serves with all it started with, and what it runs on."""

    degraded: str | None = None  # why it serves with less than it started with
    instances: list[dict] = field(default_factory=list)  # index, backend, pid, alive
    instance_failures: int = 0  # instances lost (their responses finished elsewhere)
    kv_pool_failures: int = 0  # KV pool calls that failed (those responses recomputed)


@dataclass
class ServerStats:
    """What /metrics shows: the engine's stats and the server's own state."""

    engine: EngineStats = field(default_factory=EngineStats)
    num_requests_held: int = 0  # samples accepted while paused or asleep, admitted on resume/wake-up
    tokens_per_second: float = 0.0  # over the last few seconds
    paused: str | None = None  # the pause mode, None when running
    sleeping: bool = False
    weight_version: str = "default"
    health: Health = field(default_factory=Health)
    engine_stopped: bool = False  # the engine thread ended (failed, or shut down)

    def stopped(self, backend: ServingBackend) -> ServerStats:
        """The figures once the engine thread has stopped and failed every request: nothing
        runs, waits, is held or holds KV, the counters keep their last values, and the health
        is the backend's last word (every instance lost), not that of the last snapshot."""
        try:
            health = backend.health()
        except Exception:  # noqa: BLE001 - a crashed backend: the last snapshot's
            health = self.health
        idle = replace(self.engine, running=0, waiting=0, kv_used_blocks=0)
        return replace(self, engine=idle, num_requests_held=0, health=health, engine_stopped=True)


@runtime_checkable
class EngineClient(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def detokenizer(self) -> Detokenizer:
        """A tokenizer for the caller's thread (chat templates, echo)."""
        ...

    @property
    def weight_version(self) -> str: ...

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        stream: bool = False,
        group_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; raises ``InvalidRequestError`` at once if refused.
        ``priority``: lower runs first where the engine schedules by priority.

        The returned iterator yields progress outputs (``finished=False``) when
        ``stream`` and always ends with the finished output. Closing it early
        aborts the request.
        """
        ...

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Abort requests (all when None); their callers get partial outputs with
        finish_reason "abort". Returns how many requests were aborted."""
        ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> str:
        """Returns the version the update set."""
        ...

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def stats(self) -> ServerStats: ...

    def check_health(self) -> Health:
        """How the backend serves, as of its last step; raises ``EngineDeadError`` when
        it can no longer serve."""
        ...

    def stop(self) -> None:
        """Stop serving at once (callers get ``EngineDeadError``); the backend closes after."""
        ...

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop and wait for the backend's close (at most ``timeout``); whether it ended."""
        ...

    def shutdown_status(self) -> str:
        """What the shutdown is still doing, and what exiting now would lose."""
        ...


class ServingBackend(Protocol):
    """What ``AsyncEngine`` drives on its thread: an ``LLMEngine``, or the rollout
    backend (an engine pool behind the Request Buffer)."""

    max_model_len: int
    vocab_size: int

    def make_input_processor(self) -> InputProcessor:
        """Checks and a tokenizer of its own, for the intake thread."""
        ...

    def add_checked(
        self,
        request_id: str,
        checked: CheckedRequest,
        priority: int = 0,
        group_id: str | None = None,
        stream: bool = False,
    ) -> Any: ...

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def step(self) -> list[RequestOutput]: ...

    @property
    def is_sleeping(self) -> bool: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def update_weights(self, path: str) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> Health: ...
