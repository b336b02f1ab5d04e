"""An engine instance in a process of its own (``--distributed-backend mp``).

The worker process runs an ``InstanceWorker`` and answers messages in order: submit,
abort, step, call. The dispatcher never waits on a step: it sends ``step`` to every
busy instance and takes whichever reply comes first, so instances compute in
parallel. A call that needs an answer (abort, a serving primitive) reads the replies
queued before it and keeps any step reply among them for the next poll. A process
that dies surfaces as ``InstanceDied`` on the next message, and its chunks go back to
the Request Buffer; so does one that answers no step or abort in ``reply_timeout_s``
(hung, or stopped): it is killed first, so it cannot come back with chunks that have
been handed out again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from seer_engine.engine.config import EngineConfig
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.instances.worker import build_worker
from seer_engine.rollout.types import ChunkRequest, InstanceDied, StepReply

READY_TIMEOUT_S = 600.0  # loading a large model may take minutes


def worker_threads(num_instances: int) -> int:
    """Torch threads per instance process: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // num_instances)


def _worker_main(conn: Connection, config: EngineConfig, token_source, kv_spec, replica_spec) -> None:
    # Ctrl-C reaches the whole process group: the server drains, then closes its instances.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if config.num_threads:
            import torch

            torch.set_num_threads(config.num_threads)
        replica = replica_spec.open() if replica_spec is not None else None
        worker = build_worker(config, token_source, kv_spec.open(), replica)
        conn.send(("ready", worker.info))
    except BaseException as e:
        conn.send(("error", (_portable(e) if isinstance(e, Exception) else None, traceback.format_exc())))
        return
    try:
        while True:
            try:
                op, args = conn.recv()
            except EOFError:  # the rollout's process is gone
                break
            if op == "close":
                conn.send(("ok", None))
                break
            try:
                conn.send(("ok", getattr(worker, op)(*args)))
            except Exception as e:
                conn.send(("error", (_portable(e), traceback.format_exc())))
    finally:
        worker.connector.close()


def _portable(error: Exception) -> Exception | None:
    """The exception itself if it survives pickling (the caller re-raises it), else None."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return None
    return error


class ProcessInstance(InstanceHandle):
    backend = "mp"

    def __init__(
        self, index: int, config: EngineConfig, token_source=None, kv_spec=None, replica_spec=None
    ) -> None:
        super().__init__(index)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch threads or locks
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main,
            args=(child, config, token_source, kv_spec, replica_spec),
            name=f"seer-instance-{index}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self._pending: deque[str] = deque()  # ops sent whose replies are not read yet
        self._replies: deque[StepReply] = deque()
        self._step_deadline: float | None = None  # by when the step in flight must answer
        self._step_failure: RuntimeError | None = None  # a step or submit failed, read by a call or abort

    def wait_ready(self) -> None:
        """Block until the worker has built its engine (raises with its traceback if not)."""
        if not self._conn.poll(READY_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"engine instance {self.index} did not start in {READY_TIMEOUT_S:.0f} s")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(
                f"engine instance {self.index} exited while starting (exit code {self.process.exitcode})"
            ) from None
        if status != "ready":
            self.close()
            error, trace = value
            if isinstance(error, ValueError):
                raise error  # a configuration error (max_model_len, the KV budget): the caller's
            raise RuntimeError(f"engine instance {self.index} failed to start:\n{trace}")
        self.info = value

    # -- messages ----------------------------------------------------------------------

    def _died(self, why: str) -> InstanceDied:
        self.alive = False
        self.stepping = False
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        return InstanceDied(self.index, f"{why} (exit code {code})")

    def _hung(self, what: str, method: str | None = None) -> InstanceDied:
        """No answer in time: kill the process (a stopped one too) and report it lost."""
        self.process.kill()
        return self._died(f"no {what} reply in {self.timeout_s(method):g} s, taken as hung and killed")

    def _send(self, op: str, *args: Any) -> None:
        if not self.alive:
            raise InstanceDied(self.index, "already gone")
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise self._died(f"sending {op}: {e}") from None
        self._pending.append(op)

    def _read_one(self, deadline: float | None = None, method: str | None = None) -> tuple[str, Any]:
        """The next reply; past ``deadline`` (monotonic; set for a call of ``method``)
        without one, the instance is hung."""
        try:
            if deadline is not None and not self._conn.poll(max(0.0, deadline - time.monotonic())):
                raise self._hung(self._pending[0], method)
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise self._died("its process exited") from None
        op = self._pending.popleft()
        if status == "error":
            error, trace = value
            if op == "call" and isinstance(error, (ValueError, OSError)):
                raise error  # a refused serving call (a bad checkpoint path): the caller's error
            failure = RuntimeError(f"engine instance {self.index} failed in {op}:\n{trace}")
            if op not in ("step", "submit"):
                raise failure
            # Kept for poll_reply, where a step's reply is read: a call or abort reading it
            # on its way gets its own answer (raising here left the instance "stepping" with
            # no step pending, never stepped again, and blamed the serving call).
            self.stepping = self.stepping and op != "step"
            self._step_failure = failure
            return op, None
        if op == "step":
            self.stepping = False
            self._replies.append(value)
        return op, value

    def _answer(self, op: str, deadline: float | None = None, method: str | None = None) -> Any:
        """Read replies up to ``op``'s (the last one sent), each by ``deadline``."""
        while True:
            got, value = self._read_one(deadline, method)
            if got == op and not self._pending:
                return value

    def submit(self, chunk: ChunkRequest) -> None:
        self._send("submit", chunk)  # its reply is read (and dropped) with the next ones

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        self._send("abort", request_ids)
        outputs, self.books.stats = self._answer("abort", self.reply_deadline())
        return outputs

    def call(self, method: str, *args: Any) -> Any:
        self._send("call", method, *args)
        return self._answer("call", self.reply_deadline(method), method)

    def start_step(self, draft_updates: list | None = None, finished_groups: list[str] | None = None) -> None:
        if not self.stepping:
            self._send("step", draft_updates, finished_groups)
            self.stepping = True
            self._step_deadline = self.reply_deadline()

    def poll_reply(self) -> StepReply | None:
        """A step reply if one has arrived (never blocks); raises a step's failure."""
        while not self._replies and self._pending and self._step_failure is None:
            try:
                ready = self._conn.poll()
            except (EOFError, OSError):
                raise self._died("its pipe broke") from None
            if not ready:
                if not self.process.is_alive():
                    raise self._died("its process exited")
                deadline = self._step_deadline
                if self.stepping and deadline is not None and time.monotonic() > deadline:
                    raise self._hung("step")
                break
            self._read_one()
        if self._step_failure is not None:
            raise self._step_failure
        return self._replies.popleft() if self._replies else None

    @staticmethod
    def wait_any(handles: Sequence[ProcessInstance], timeout: float) -> None:
        wait([i._conn for i in handles], timeout=timeout)

    def poll_alive(self) -> bool:
        return self.alive and self.process.is_alive()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("close", ()))
                self.process.join(timeout=10.0)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
        self.alive = False
        self._conn.close()
