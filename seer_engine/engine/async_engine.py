"""An asyncio face for one ``LLMEngine``: the server's view of an engine.

``LLMEngine`` is not thread-safe and its ``step()`` blocks for a whole forward pass,
so it lives on one background thread that does every engine call. Callers on an
event loop hand requests and control commands over through a thread-safe queue and
get results back on their loop (``call_soon_threadsafe``). The thread blocks on the
queue when there is nothing to step, so an idle server costs nothing.

``EngineClient`` is the interface the server codes against. The thread drives a
``StepEngine``: one ``LLMEngine``, or in rollout mode a ``RolloutEngine`` (several
instances behind the Request Buffer), so both modes share this one code path.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.llm_engine import EngineSnapshot, LLMEngine, resolve_model_path
from seer_engine.outputs import CompletionOutput, RequestOutput
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from seer_engine.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no request can be served."""


class EngineBusyError(RuntimeError):
    """The command conflicts with the engine's state (e.g. sleep with requests in flight)."""


@dataclass
class EngineStats:
    """A snapshot for /metrics and load tests; requests are counted per sample."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_held: int = 0  # accepted while paused or asleep, admitted on resume/wake-up
    kv_cache_usage: float = 0.0  # fraction of blocks referenced by requests
    kv_cache_free_blocks: int = 0
    kv_cache_total_blocks: int = 0
    num_preemptions: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    tokens_per_second: float = 0.0  # over the last few seconds
    accepted_tokens_per_step: float = 0.0  # draft tokens accepted per request-step
    draft_tokens_verified: int = 0
    draft_tokens_accepted: int = 0
    paused: str | None = None  # the pause mode, None when running
    sleeping: bool = False
    weight_version: str = "default"


@runtime_checkable
class EngineClient(Protocol):
    """What the OpenAI server needs from a backend (one engine or a rollout pool)."""

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
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; raises ``InvalidRequestError`` at once if refused.

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

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None: ...

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def stats(self) -> EngineStats: ...

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` when the backend can no longer serve."""
        ...

    def shutdown(self) -> None: ...


class StepEngine(Protocol):
    """What ``AsyncEngine`` drives on its thread: an ``LLMEngine``, or a
    ``RolloutEngine`` (an engine pool behind the Request Buffer)."""

    max_model_len: int
    vocab_size: int
    detokenizer: Detokenizer

    def validate_request(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
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

    def snapshot(self) -> EngineSnapshot: ...


# ------------------------------------------------------------------------- plumbing


class _Sink:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


def _deliver(items: list[tuple[_Sink, RequestOutput | BaseException]]) -> None:
    """Hand outputs to their loops, one wake-up per loop and batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, Any]]] = {}
    for sink, item in items:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is waiting any more


def _put_all(batch: list[tuple[_Sink, Any]]) -> None:
    for sink, item in batch:
        sink.queue.put_nowait(item)


def _resolve(fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


@dataclass
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    stream: bool
    group_id: str | None
    sink: _Sink
    future: concurrent.futures.Future
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Call:
    """Run ``fn(future)`` on the engine thread; ``fn`` resolves the future itself."""

    fn: Callable[[concurrent.futures.Future], None]
    future: concurrent.futures.Future


_STOP = object()


class RequestStream:
    """The outputs of one request, as an async iterator.

    Ends after the finished output. Closing it, dropping it, or cancelling a read
    before the end aborts the request, so a caller that goes away never leaves work
    behind in the engine.
    """

    def __init__(self, request_id: str, sink: _Sink, on_abandon: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._sink = sink
        self._on_abandon = on_abandon
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._sink.queue.get()
        except asyncio.CancelledError:
            self._abandon()
            raise
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        self._finished = item.finished
        return item

    async def aclose(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        if not self._finished:
            self._finished = True
            self._on_abandon(self.request_id)

    def __del__(self) -> None:
        self._abandon()


class _TokenRate:
    """Generated tokens per second over a sliding window, readable from any thread."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._points: collections.deque[tuple[float, int]] = collections.deque(maxlen=8192)
        self._lock = threading.Lock()

    def record(self, total_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._points.append((now, total_tokens))
            while self._points and self._points[0][0] < now - 2 * self.window_s:
                self._points.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [p for p in self._points if p[0] >= now - self.window_s]
        if len(recent) < 2:
            return 0.0
        (t0, g0), (_, g1) = recent[0], recent[-1]
        return (g1 - g0) / max(now - t0, 1e-6)


# ------------------------------------------------------------------------- the engine


class AsyncEngine:
    """One ``LLMEngine`` on its own thread, driven from asyncio. Implements EngineClient.

    Pause modes: ``abort`` aborts what is in flight (callers get partial tokens with
    finish_reason "abort"); ``wait`` lets in-flight requests finish and returns
    then; ``keep`` freezes them with their KV and continues them on resume. While
    paused or asleep, new requests are checked at once (bad ones are refused) and
    held, then admitted in arrival order on resume / wake-up.

    Sleep refuses while requests are in flight (``EngineBusyError``): pause with
    ``abort`` or ``wait`` first. A weight update runs between two steps; requests
    in flight continue on the new weights.
    """

    def __init__(
        self,
        engine_factory: Callable[[], StepEngine],
        model_name: str,
        tokenizer_path: str | None = None,
        weight_version: str = "default",
    ) -> None:
        self._factory = engine_factory
        self._model_name = model_name
        self._tokenizer_path = tokenizer_path
        self._weight_version = weight_version
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._closed = False  # set by the thread before it fails what is left in the queue
        self._fatal: BaseException | None = None
        self._rate = _TokenRate()
        self._stats = EngineStats(weight_version=weight_version)
        self._thread = threading.Thread(target=self._run, name="seer-engine", daemon=True)
        # Engine-thread state: touched only by the engine thread.
        self._engine: StepEngine | None = None
        self._sinks: dict[str, _Sink] = {}
        self._held: list[_Add] = []
        self._paused: str | None = None
        self._drain_waiters: list[concurrent.futures.Future] = []
        # Read-only after start().
        self._max_model_len = 0
        self._vocab_size = 0
        self._client_detokenizer: Detokenizer | None = None

    @classmethod
    def from_config(
        cls, config: EngineConfig, model_name: str | None = None, rollout: RolloutConfig | None = None
    ) -> AsyncEngine:
        """One plain engine, or (``rollout`` that needs a pool) the rollout backend:
        an engine pool behind the Request Buffer, driven through the same surface."""
        path = str(config.tokenizer or resolve_model_path(config.model))
        if rollout is not None and rollout.needs_pool:
            from seer_engine.rollout.rollout_engine import RolloutEngine

            factory: Callable[[], StepEngine] = lambda: RolloutEngine(config, rollout)  # noqa: E731
        else:
            factory = lambda: LLMEngine(config)  # noqa: E731
        return cls(factory, model_name or config.model, tokenizer_path=path)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> AsyncEngine:
        """Build the engine on its thread; raises what building it raised."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not start in time")
        if self._fatal is not None:
            raise self._fatal
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; waiting callers get ``EngineDeadError``."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    def check_health(self) -> None:
        if self._fatal is not None:
            raise EngineDeadError(f"the engine failed: {self._fatal!r}")
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    # -- read-only facts ----------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def detokenizer(self) -> Detokenizer:
        """A tokenizer of the callers' own: HF fast tokenizers must not be shared
        between threads, and the engine thread uses its own."""
        assert self._client_detokenizer is not None, "start() the engine first"
        return self._client_detokenizer

    @property
    def weight_version(self) -> str:
        return self._weight_version

    # -- requests -----------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        stream: bool = False,
        group_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        sink = _Sink(asyncio.get_running_loop())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Add(request_id, prompt, params, stream, group_id, sink, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self._abandon(request_id)
            raise
        return RequestStream(request_id, sink, self._abandon)

    def _abandon(self, request_id: str) -> None:
        """The caller stopped reading (disconnect, cancelled batch): free the engine slot."""
        self._post_quietly(_Call(lambda f: self._do_abort([request_id], f), _new_future()))

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        ids = None if request_ids is None else list(request_ids)
        return await self._call(lambda f: self._do_abort(ids, f))

    # -- control ------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self._call(lambda f: self._do_pause(mode, f))

    async def resume(self) -> None:
        await self._call(self._do_resume)

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        def do(f: concurrent.futures.Future) -> None:
            self._engine.update_weights(path)
            self._weight_version = weight_version if weight_version is not None else self._bump_version()
            _resolve(f)

        await self._call(do)

    async def sleep(self) -> None:
        def do(f: concurrent.futures.Future) -> None:
            if self._engine.has_unfinished_requests():
                raise EngineBusyError(
                    f"cannot sleep with {self._engine.num_unfinished_requests} requests in flight; "
                    "pause with mode 'abort' or 'wait' first"
                )
            self._engine.sleep()
            _resolve(f)

        await self._call(do)

    async def wake_up(self) -> None:
        def do(f: concurrent.futures.Future) -> None:
            self._engine.wake_up()
            self._admit_held()
            _resolve(f)

        await self._call(do)

    async def flush_cache(self) -> None:
        def do(f: concurrent.futures.Future) -> None:
            self._engine.reset_prefix_cache()
            _resolve(f)

        await self._call(do)

    async def stats(self) -> EngineStats:
        """A consistent snapshot, taken on the engine thread between two steps (the last
        one published when the engine is gone, so /metrics keeps answering)."""

        def do(f: concurrent.futures.Future) -> None:
            self._publish_stats()
            _resolve(f)

        try:
            await self._call(do)
        except EngineDeadError:
            pass
        return EngineStats(**{**vars(self._stats), "tokens_per_second": self._rate.rate()})

    # -- handing work to the thread --------------------------------------------------------

    async def _call(self, fn: Callable[[concurrent.futures.Future], None]) -> Any:
        fut = _new_future()
        self._post(_Call(fn, fut))
        return await asyncio.wrap_future(fut)

    def _post(self, cmd: _Add | _Call) -> None:
        self.check_health()
        self._commands.put(cmd)
        if self._closed:  # the thread may have drained the queue before our put
            self._fail_queued()

    def _post_quietly(self, cmd: _Call) -> None:
        try:
            self._post(cmd)
        except EngineDeadError:
            pass

    def _fail_queued(self) -> None:
        error = EngineDeadError("the engine is shut down" if self._fatal is None else repr(self._fatal))
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)):
                _resolve(cmd.future, error=error)

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = self._factory()
            self._max_model_len = self._engine.max_model_len
            self._vocab_size = self._engine.vocab_size
            self._client_detokenizer = (
                Detokenizer.from_pretrained(self._tokenizer_path)
                if self._tokenizer_path
                else self._engine.detokenizer
            )
            self._publish_stats()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._fatal = e
            self._closed = True
            self._ready.set()
            return
        self._ready.set()
        reason: BaseException = EngineDeadError("the engine is shut down")
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a crashed step must not hang callers
            logger.exception("engine thread failed")
            self._fatal = e
            reason = EngineDeadError(f"the engine failed: {e!r}")
        finally:
            self._closed = True
            self._fail_everyone(reason)
            close = getattr(self._engine, "close", None)  # instance processes, KV pool
            if close is not None:
                close()

    def _loop(self) -> None:
        engine = self._engine
        while True:
            # Idle: sleep on the queue. Busy: take whatever arrived, then step.
            cmd = self._commands.get() if not self._can_step() else self._next_command()
            while cmd is not None:
                if cmd is _STOP:
                    return
                self._handle(cmd)
                cmd = self._next_command()
            if self._can_step():
                outputs = engine.step()
                if outputs:
                    self._dispatch(outputs)
            self._check_drained()
            self._publish_stats()

    def _next_command(self) -> Any:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _can_step(self) -> bool:
        engine = self._engine
        return engine.has_unfinished_requests() and self._paused != "keep" and not engine.is_sleeping

    def _handle(self, cmd: _Add | _Call) -> None:
        try:
            if isinstance(cmd, _Add):
                self._do_add(cmd)
            else:
                cmd.fn(cmd.future)
        except (InvalidRequestError, EngineBusyError, ValueError) as e:
            _resolve(cmd.future, error=e)
        except Exception as e:  # noqa: BLE001 - the caller learns why; the engine is unharmed
            logger.exception("engine command failed")
            _resolve(cmd.future, error=e)

    def _do_add(self, cmd: _Add) -> None:
        if cmd.request_id in self._sinks:
            raise InvalidRequestError(f"request id {cmd.request_id!r} is already in use")
        cmd.prompt_token_ids = self._engine.validate_request(cmd.prompt, cmd.params)
        self._sinks[cmd.request_id] = cmd.sink
        if self._paused is not None or self._engine.is_sleeping:
            self._held.append(cmd)
        else:
            self._admit(cmd)
        _resolve(cmd.future)

    def _admit(self, cmd: _Add) -> None:
        try:
            self._engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params, group_id=cmd.group_id, stream=cmd.stream
            )
        except Exception as e:
            del self._sinks[cmd.request_id]
            raise e

    def _admit_held(self) -> None:
        if self._paused is not None or self._engine.is_sleeping:
            return
        held, self._held = self._held, []
        for cmd in held:
            try:
                self._admit(cmd)
            except Exception as e:  # noqa: BLE001 - validated already; report rather than hang
                _deliver([(cmd.sink, e)])

    def _do_abort(self, ids: list[str] | None, fut: concurrent.futures.Future) -> None:
        """Abort user ids (or sample ids, which the engine also knows); unknown ids are ignored."""
        wanted = set(self._sinks) if ids is None else set(ids)
        held = [c for c in self._held if c.request_id in wanted]
        self._held = [c for c in self._held if c.request_id not in wanted]
        in_engine = sorted(wanted - {c.request_id for c in held})
        outputs = self._engine.abort_request(in_engine) if in_engine else []
        outputs += [_aborted_output(c) for c in held]
        self._dispatch(outputs)
        self._check_drained()
        _resolve(fut, len(outputs))

    def _do_pause(self, mode: str, fut: concurrent.futures.Future) -> None:
        self._paused = mode
        if mode == "abort":
            in_engine = [rid for rid in self._sinks if rid not in {c.request_id for c in self._held}]
            self._dispatch(self._engine.abort_request(in_engine))
        if mode == "wait":
            self._drain_waiters.append(fut)
            self._check_drained()
        else:
            _resolve(fut)

    def _do_resume(self, fut: concurrent.futures.Future) -> None:
        self._paused = None
        self._admit_held()
        _resolve(fut)

    def _check_drained(self) -> None:
        if self._drain_waiters and not self._engine.has_unfinished_requests():
            waiters, self._drain_waiters = self._drain_waiters, []
            for f in waiters:
                _resolve(f)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        items: list[tuple[_Sink, RequestOutput | BaseException]] = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            items.append((sink, out))
        _deliver(items)

    def _fail_everyone(self, error: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        self._held = []
        _deliver([(s, error) for s in sinks.values()])
        waiters, self._drain_waiters = self._drain_waiters, []
        for f in waiters:
            _resolve(f, error=error)
        self._fail_queued()

    def _publish_stats(self) -> None:
        engine = self._engine
        snap = engine.snapshot()
        self._rate.record(snap.generated_tokens)
        total = snap.kv_total_blocks
        self._stats = EngineStats(
            num_requests_running=snap.running,
            num_requests_waiting=snap.waiting,
            num_requests_held=sum(c.params.n for c in self._held),
            kv_cache_usage=snap.kv_used_blocks / total if total else 0.0,
            kv_cache_free_blocks=total - snap.kv_used_blocks,
            kv_cache_total_blocks=total,
            num_preemptions=snap.preemptions,
            generated_tokens=snap.generated_tokens,
            num_steps=snap.steps,
            accepted_tokens_per_step=snap.draft_tokens_accepted / snap.sampled_rows
            if snap.sampled_rows
            else 0.0,
            draft_tokens_verified=snap.draft_tokens_verified,
            draft_tokens_accepted=snap.draft_tokens_accepted,
            paused=self._paused,
            sleeping=engine.is_sleeping,
            weight_version=self._weight_version,
        )

    def _bump_version(self) -> str:
        try:
            return str(int(self._weight_version) + 1)
        except ValueError:
            return "1"


def _new_future() -> concurrent.futures.Future:
    return concurrent.futures.Future()


def _aborted_output(cmd: _Add) -> RequestOutput:
    """The final output of a request aborted before it reached the engine: no tokens."""
    samples = [
        CompletionOutput(
            index=i,
            text="",
            token_ids=[],
            cumulative_logprob=None,
            logprobs=[] if cmd.params.logprobs is not None else None,
            finish_reason="abort",
        )
        for i in range(cmd.params.n)
    ]
    prompt = cmd.prompt if isinstance(cmd.prompt, str) else None
    return RequestOutput(cmd.request_id, prompt, cmd.prompt_token_ids, samples, finished=True)
