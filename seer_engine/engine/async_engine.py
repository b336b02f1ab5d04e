"""An asyncio face for one engine: the server's ``EngineClient``.

An engine is not thread-safe and its ``step()`` blocks for a whole forward pass, so
it lives on one background thread that does every engine call. Prompts are checked
and tokenized before they get there, on an intake thread with a tokenizer of its
own, so a long prompt never holds up a step. Callers hand requests and control
commands to the engine thread through a queue and get results back on their loop.
The thread blocks on the queue when there is nothing to step, so an idle server
costs nothing.

The thread drives a ``ServingBackend``: one ``LLMEngine``, or in rollout mode the rollout
backend (several instances behind the Request Buffer), so both modes share this one
code path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from seer_engine.engine.client import (
    PAUSE_MODES,
    EngineBusyError,
    EngineDeadError,
    Health,
    PauseMode,
    ServerStats,
    ServingBackend,
)
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.engine_commands import STOP as _STOP
from seer_engine.engine.engine_commands import Add as _Add
from seer_engine.engine.engine_commands import Call as _Call
from seer_engine.engine.engine_shutdown import describe, join_engine_thread
from seer_engine.engine.input_processor import InputProcessor
from seer_engine.engine.streams import RequestStream, Sink, TokenRate, deliver, resolve
from seer_engine.outputs import RequestOutput
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

IDLE_CHECK_S = 1.0  # how often an idle engine thread refreshes stats and health


class AsyncEngine:
    """One engine on its own thread, driven from asyncio. Implements EngineClient.

    Pause modes: ``abort`` aborts what is in flight (callers get partial tokens with
    finish_reason "abort"); ``wait`` lets in-flight requests finish and returns
    then (or fails with ``EngineBusyError`` if a ``keep`` pause or a resume comes
    first); ``keep`` freezes them with their KV and continues them on resume. While
    paused or asleep, new requests are checked at once (bad ones are refused) and
    held, then admitted in arrival order on resume / wake-up.

    Sleep refuses while requests are in flight (``EngineBusyError``): pause with
    ``abort`` or ``wait`` first. A weight update runs between two steps; requests
    in flight continue on the new weights.
    """

    def __init__(
        self,
        engine_factory: Callable[[], ServingBackend],
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
        self._rate = TokenRate()
        self._stats = ServerStats(weight_version=weight_version)
        self._thread = threading.Thread(target=self._run, name="seer-engine", daemon=True)
        # Prompts are checked and tokenized here, one at a time, off the engine thread.
        self._intake = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="seer-intake")
        # Engine-thread state: touched only by the engine thread.
        self._engine: ServingBackend | None = None
        self._sinks: dict[str, Sink] = {}
        self._held: list[_Add] = []
        self._paused: str | None = None
        self._drain_waiters: list[concurrent.futures.Future] = []
        self._doing: str | None = None  # a long call under way, for shutdown's log
        self._stop_at: float | None = None  # when a stop was first asked for
        # Read-only after start().
        self._processor: InputProcessor | None = None  # used by the intake thread only
        self._client_detokenizer: Detokenizer | None = None

    @classmethod
    def for_engine(cls, config, model_name: str | None = None) -> AsyncEngine:
        """One plain ``LLMEngine`` of ``config`` (an EngineConfig)."""
        from seer_engine.engine.llm_engine import LLMEngine, resolve_model_path

        path = str(config.tokenizer or resolve_model_path(config.model, config.dtype))
        return cls(lambda: LLMEngine(config), model_name or config.model, tokenizer_path=path)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> AsyncEngine:
        """Build the engine on its thread; raises what building it raised."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not start in time")
        if self._fatal is not None:
            raise self._fatal
        return self

    def stop(self) -> None:
        """Ask the thread to stop, not waiting: callers get ``EngineDeadError``, then the backend closes."""
        self._stop_at = self._stop_at or time.monotonic()
        if self._thread.is_alive():
            self._commands.put(_STOP)

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop the thread and wait until its backend has closed (the history store saved, the
        instances stopped; an exit before loses them), logging the wait every 10 s. ``timeout``
        bounds it, with a warning naming what is left undone. Whether the thread ended."""
        self.stop()
        ended = not self._thread.is_alive() or join_engine_thread(self._thread, self.shutdown_status, timeout)
        self._intake.shutdown(wait=False, cancel_futures=True)
        return ended

    def shutdown_status(self) -> str:
        """What the engine thread is busy with since the stop, and what exiting now would lose."""
        doing = getattr(self._engine, "closing", None) or self._doing or "finishing an engine step"
        return describe(doing, self._stop_at, getattr(self._engine, "lost_on_exit", None))

    def check_health(self) -> Health:
        if self._fatal is not None:
            raise self._death()
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")
        return self._stats.health

    # -- read-only facts ----------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._processor.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._processor.vocab_size

    @property
    def detokenizer(self) -> Detokenizer:
        """A tokenizer of the callers' own: HF fast tokenizers must not be shared
        between threads, and the engine and intake threads use their own."""
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
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        self.check_health()
        loop = asyncio.get_running_loop()
        checked = await loop.run_in_executor(self._intake, self._processor.process, prompt, params)
        sink = Sink(loop)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Add(request_id, checked, stream, group_id, sink, fut, priority))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self._abandon(request_id)
            raise
        return RequestStream(request_id, sink, self._abandon)

    def _abandon(self, request_id: str) -> None:
        """The caller stopped reading (disconnect, cancelled batch): free the engine slot."""
        self._post_quietly(_Call(lambda f: self._do_abort([request_id], f), concurrent.futures.Future()))

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        ids = None if request_ids is None else list(request_ids)
        return await self._call(lambda f: self._do_abort(ids, f))

    # -- control ------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(
                f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}", param="mode"
            )
        await self._call(lambda f: self._do_pause(mode, f))

    async def resume(self) -> None:
        await self._call(self._do_resume)

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> str:
        """The version this update set (``weight_version`` read later may be a later update's)."""

        def do(f: concurrent.futures.Future) -> None:
            self._engine.update_weights(path)
            self._weight_version = weight_version if weight_version is not None else self._bump_version()
            resolve(f, self._weight_version)

        return await self._call(do, "running a weight update")

    async def sleep(self) -> None:
        def do(f: concurrent.futures.Future) -> None:
            if self._engine.has_unfinished_requests():
                raise EngineBusyError(
                    f"cannot sleep with {self._engine.num_unfinished_requests} requests in flight; "
                    "pause with mode 'abort' or 'wait' first"
                )
            self._engine.sleep()
            resolve(f)

        await self._call(do)

    async def wake_up(self) -> None:
        def do(f: concurrent.futures.Future) -> None:
            self._engine.wake_up()
            self._admit_held()
            resolve(f)

        await self._call(do)

    async def flush_cache(self) -> None:
        def do(f: concurrent.futures.Future) -> None:
            self._engine.reset_prefix_cache()
            resolve(f)

        await self._call(do)

    async def stats(self) -> ServerStats:
        """A consistent snapshot, taken on the engine thread between two steps (the last
        one published when the engine is gone, so /metrics keeps answering)."""

        def do(f: concurrent.futures.Future) -> None:
            self._publish_stats()
            resolve(f)

        try:
            await self._call(do)
        except EngineDeadError:
            pass
        stats = self._stats
        return ServerStats(**{**vars(stats), "tokens_per_second": self._rate.rate()})

    # -- handing work to the thread --------------------------------------------------------

    async def _call(self, fn: Callable[[concurrent.futures.Future], None], what: str | None = None) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Call(fn, fut, what))
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
        error = self._death()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)):
                resolve(cmd.future, error=error)

    def _death(self) -> EngineDeadError:
        """What callers learn once the thread has stopped: a backend's EngineDeadError in
        its own words, any other failure named with its type."""
        if self._fatal is None:
            return EngineDeadError("the engine is shut down")
        if isinstance(self._fatal, EngineDeadError):
            return EngineDeadError(str(self._fatal))
        return EngineDeadError(f"the engine failed: {self._fatal!r}")

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = self._factory()
            self._processor = self._engine.make_input_processor()
            self._client_detokenizer = (
                Detokenizer.from_pretrained(self._tokenizer_path)
                if self._tokenizer_path
                else self._engine.make_input_processor().tokenizer
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
        except EngineDeadError as e:  # the backend can serve nothing more; it says why
            logger.error("engine stopped: %s", e)
            self._fatal = e
            reason = self._death()
        except BaseException as e:  # noqa: BLE001 - a crashed step must not hang callers
            logger.exception("engine thread failed")
            self._fatal = e
            reason = self._death()
        finally:
            self._closed = True
            self._fail_everyone(reason)
            close = getattr(self._engine, "close", None)  # history store, instance processes, KV pool
            if close is not None:
                close()

    def _loop(self) -> None:
        engine = self._engine
        while True:
            # Idle: sleep on the queue, waking now and then to look at the backend (an
            # instance process may die while nothing runs). Busy: take what arrived, step.
            cmd = self._idle_wait() if not self._can_step() else self._next_command()
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

    def _idle_wait(self) -> Any:
        try:
            return self._commands.get(timeout=IDLE_CHECK_S)
        except queue.Empty:
            return None

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
                self._doing = cmd.what
                cmd.fn(cmd.future)
        except (InvalidRequestError, EngineBusyError, ValueError, EngineDeadError) as e:
            resolve(cmd.future, error=e)
            if isinstance(e, EngineDeadError):  # the backend can serve nothing more: stop
                raise
        except Exception as e:  # noqa: BLE001 - the caller learns why; the engine is unharmed
            logger.exception("engine command failed")
            resolve(cmd.future, error=e)
        finally:
            self._doing = None

    def _do_add(self, cmd: _Add) -> None:
        if cmd.request_id in self._sinks:
            raise InvalidRequestError(f"request id {cmd.request_id!r} is already in use", param="request_id")
        self._sinks[cmd.request_id] = cmd.sink
        if self._paused is not None or self._engine.is_sleeping:
            self._held.append(cmd)
        else:
            self._admit(cmd)
        resolve(cmd.future)

    def _admit(self, cmd: _Add) -> None:
        try:
            self._engine.add_checked(cmd.request_id, cmd.checked, cmd.priority, cmd.group_id, cmd.stream)
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
            except Exception as e:  # noqa: BLE001 - checked already; report rather than hang
                deliver([(cmd.sink, e)])

    def _do_abort(self, ids: list[str] | None, fut: concurrent.futures.Future) -> None:
        """Abort user ids (or sample ids, which the engine also knows); unknown ids are ignored."""
        wanted = set(self._sinks) if ids is None else set(ids)
        held = [c for c in self._held if c.request_id in wanted]
        self._held = [c for c in self._held if c.request_id not in wanted]
        in_engine = sorted(wanted - {c.request_id for c in held})
        outputs = self._engine.abort_request(in_engine) if in_engine else []
        outputs += [c.checked.aborted_output(c.request_id) for c in held]
        self._dispatch(outputs)
        self._check_drained()
        resolve(fut, len(outputs))

    def _do_pause(self, mode: str, fut: concurrent.futures.Future) -> None:
        self._paused = mode
        if mode == "abort":
            in_engine = [rid for rid in self._sinks if rid not in {c.request_id for c in self._held}]
            self._dispatch(self._engine.abort_request(in_engine))
        if mode == "wait":
            self._drain_waiters.append(fut)
            self._check_drained()
        else:
            self._check_drained()
            self._refuse_drain_waiters(f"generation was paused with mode {mode!r}")
            resolve(fut)

    def _do_resume(self, fut: concurrent.futures.Future) -> None:
        self._paused = None
        self._refuse_drain_waiters("generation was resumed")
        self._admit_held()
        resolve(fut)

    def _refuse_drain_waiters(self, why: str) -> None:
        """End the ``wait`` pauses still waiting, which a later command overrode: frozen
        requests never finish, and after a resume new ones keep coming, so they would hang."""
        waiters, self._drain_waiters = self._drain_waiters, []
        error = EngineBusyError(f"{why} before the requests in flight finished")
        for f in waiters:
            resolve(f, error=error)

    def _check_drained(self) -> None:
        if self._drain_waiters and not self._engine.has_unfinished_requests():
            waiters, self._drain_waiters = self._drain_waiters, []
            for f in waiters:
                resolve(f)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        items: list[tuple[Sink, RequestOutput | BaseException]] = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            items.append((sink, out))
        deliver(items)

    def _fail_everyone(self, error: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        self._held = []
        self._stats = self._stats.stopped(self._engine)  # /metrics: none run, every instance lost
        deliver([(s, error) for s in sinks.values()])
        waiters, self._drain_waiters = self._drain_waiters, []
        for f in waiters:
            resolve(f, error=error)
        self._fail_queued()

    def _publish_stats(self) -> None:
        engine = self._engine
        stats = engine.stats()
        self._rate.record(stats.generated_tokens)
        self._stats = ServerStats(
            engine=stats,
            health=engine.health(),
            num_requests_held=sum(c.checked.params.n for c in self._held),
            paused=self._paused,
            sleeping=engine.is_sleeping,
            weight_version=self._weight_version,
        )

    def _bump_version(self) -> str:
        try:
            return str(int(self._weight_version) + 1)
        except ValueError:
            return "1"
