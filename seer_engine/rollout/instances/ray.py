"""An engine instance in a Ray actor (``--distributed-backend ray``).

The actor runs an ``InstanceWorker``, like an ``mp`` worker process, and Ray carries the
messages: calls on one actor handle from this process run in the order they were made,
so a chunk submitted before a step is in that step, as on the ``mp`` pipe. The Request
Buffer never waits on a step: ``start_step`` keeps the step's object ref and
``poll_reply`` looks at it without blocking. Submits are not waited on either; their
refs are kept and checked on later polls, so a failed submit still surfaces as an error.
An actor that is gone (killed, its worker or node lost) surfaces as ``InstanceDied`` and
its chunks go back to the Request Buffer.

Where the actors run: Ray connects to the cluster that ``RAY_ADDRESS`` names, or else
starts a local one on this machine, and spreads the instances across the cluster's
nodes (one CPU per actor, or ``--num-threads`` CPUs; one GPU when the engine runs on
CUDA). Each node must be able to read the model path, and this process reads it too
(for the tokenizer). The ``local`` KV pool is shared memory on one host, so with it all
actors must run on this machine; a pool across hosts needs ``--kv-connector mooncake``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.stats import EngineStats
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.instances.process import READY_TIMEOUT_S
from seer_engine.rollout.instances.worker import build_worker
from seer_engine.rollout.types import ChunkRequest, InstanceDied, InstanceInfo, StepReply

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0  # a graceful close waits for the actor's queued calls, then it is killed
PING_S = 1.0  # how often ``poll_alive`` asks an actor that is not stepping whether it is there
NO_RAY = "--distributed-backend ray needs the ray package: pip install 'seer_engine[ray]'"


def import_ray() -> Any:
    """The ``ray`` module; imported only when the backend is used (ray is optional)."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(NO_RAY) from e
    return ray


def ensure_ray() -> Any:
    """Connect to Ray if this process is not connected yet: the cluster at ``RAY_ADDRESS``
    when it is set, else a new local cluster with this machine's cores."""
    ray = import_ray()
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False, ignore_reinit_error=True)
        else:
            # "local": never attach to a cluster left over from an earlier `ray start`.
            _on_a_lasting_thread(
                lambda: ray.init(
                    address="local",
                    num_cpus=os.cpu_count(),
                    include_dashboard=False,
                    log_to_driver=False,
                    ignore_reinit_error=True,
                )
            )
    return ray


def _on_a_lasting_thread(start_cluster: Any) -> None:
    """Run ``start_cluster`` on a thread kept until the process exits. Ray ties the GCS
    and raylet it starts to the thread that ran ``ray.init`` (Linux's parent-death signal
    follows the thread): started on an engine thread, they were SIGKILLed as that thread
    ended, before Ray's shutdown at exit could stop them, and the raylet's agents were
    left running for a minute."""
    started = threading.Event()
    error: list[BaseException] = []

    def own() -> None:
        try:
            start_cluster()
        except BaseException as e:
            error.append(e)
        finally:
            started.set()
        if not error:
            threading.Event().wait()  # the cluster lives as long as this thread

    threading.Thread(target=own, name="seer-ray-cluster", daemon=True).start()
    started.wait()
    if error:
        raise error[0]


def actor_threads(num_instances: int) -> int:
    """Torch threads (and Ray CPUs) per actor when ``--num-threads`` is unset: the most
    that lets every instance fit on the cluster's live nodes, whole actors per node."""
    ray = ensure_ray()
    cpus = [int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")]
    for threads in range(max(cpus, default=1), 1, -1):
        if sum(c // threads for c in cpus) >= num_instances:
            return threads
    return 1


def _wants_gpu(config: EngineConfig, ray: Any) -> bool:
    if config.device.startswith("cuda"):
        return True
    return config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the task names in its error text


def _text(error: BaseException) -> str:
    return _ANSI.sub("", str(error))


def _first_line(error: BaseException) -> str:
    text = _text(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _InstanceActor:
    """The actor's body (``ray.remote`` is applied when an instance starts, so importing
    this module does not need ray). Methods run one at a time, in call order."""

    def __init__(self, config: EngineConfig, token_source, kv_spec, replica_spec) -> None:
        import ray
        import torch

        if config.device.startswith("cuda"):
            config = dataclasses.replace(config, device="cuda")  # Ray shows the actor only its GPU
        threads = config.num_threads or int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))
        torch.set_num_threads(max(1, threads))
        self.worker = None
        self.config_error: ValueError | None = None
        try:
            replica = replica_spec.open() if replica_spec is not None else None
            self.worker = build_worker(config, token_source, kv_spec.open(), replica)
        except ValueError as e:  # the caller's configuration: Ray would pass it on only as text
            self.config_error = e

    def info(self) -> InstanceInfo | ValueError:
        return self.worker.info if self.worker is not None else self.config_error

    def ping(self) -> None:
        pass

    def submit(self, chunk: ChunkRequest) -> None:
        self.worker.submit(chunk)

    def abort(self, request_ids: list[str]) -> tuple[list[RequestOutput], EngineStats]:
        return self.worker.abort(request_ids)

    def step(self, draft_updates: list | None, finished_groups: list[str] | None) -> StepReply:
        return self.worker.step(draft_updates, finished_groups)

    def call(self, method: str, *args: Any) -> Any:
        return self.worker.call(method, *args)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.connector.close()


class RayInstance(InstanceHandle):
    backend = "ray"

    def __init__(
        self, index: int, config: EngineConfig, token_source=None, kv_spec=None, replica_spec=None
    ) -> None:
        super().__init__(index)
        ray = ensure_ray()
        self._ray = ray
        self._step_ref = None  # the step in flight
        self._step_deadline: float | None = None  # by when it must answer (reply_timeout_s)
        self._submits: list = []  # refs of submits not yet seen to succeed
        self._ping_ref = None  # poll_alive's ping in flight
        self._ping_at = 0.0  # when it was sent (monotonic)
        self._cpus = config.num_threads or 1
        self._gpus = 1 if _wants_gpu(config, ray) else 0
        actor_class = ray.remote(_InstanceActor)
        self.actor = actor_class.options(
            num_cpus=self._cpus,
            num_gpus=self._gpus,
            max_restarts=0,  # a restarted actor would have lost its chunks anyway
            scheduling_strategy="SPREAD",
        ).remote(config, token_source, kv_spec, replica_spec)
        self._ready_ref = self.actor.info.remote()

    def wait_ready(self) -> None:
        """Block until the actor has built its engine (raises with its traceback if not)."""
        ray = self._ray
        try:
            info = ray.get(self._ready_ref, timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise RuntimeError(
                f"engine instance {self.index} did not start in {READY_TIMEOUT_S:.0f} s "
                f"(does a Ray node have {self._cpus} CPUs and {self._gpus} GPUs free?)"
            ) from None
        except ray.exceptions.RayError as e:
            self.close()
            raise RuntimeError(f"engine instance {self.index} failed to start:\n{_text(e)}") from None
        self._ready_ref = None
        if isinstance(info, ValueError):
            self.close()
            raise info  # a configuration error (max_model_len, the KV budget): the caller's
        self.info = info

    # -- calls on the actor --------------------------------------------------------------

    def _died(self, why: str) -> InstanceDied:
        """Mark the instance gone; kill the actor too, in case it is only unreachable, so
        that it cannot go on running chunks that the Request Buffer hands out again."""
        self.alive = False
        self.stepping = False
        self._step_ref = None
        self._submits = []
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:
            pass
        return InstanceDied(self.index, why)

    def _hung(self, what: str, method: str | None = None) -> InstanceDied:
        """No answer in time: kill the actor and report it lost."""
        return self._died(f"no {what} reply in {self.timeout_s(method):g} s, taken as hung and killed")

    def _remote(self, op: str, *args: Any) -> Any:
        if not self.alive:
            raise InstanceDied(self.index, "already gone")
        try:
            return getattr(self.actor, op).remote(*args)
        except self._ray.exceptions.RayActorError as e:
            raise self._died(f"calling {op}: {_first_line(e)}") from None

    def _get(self, ref: Any, op: str, deadline: float | None = None, method: str | None = None) -> Any:
        """The result of a call (of serving ``method``), its errors turned into ours; past
        ``deadline`` (monotonic) without one, the actor is taken as hung and killed."""
        errors = self._ray.exceptions
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._ray.get(ref, timeout=timeout)
        except errors.GetTimeoutError:
            raise self._hung(op, method) from None
        except errors.RayTaskError as e:
            cause = e.cause
            if op == "call" and isinstance(cause, (ValueError, OSError)):
                raise cause from None  # a refused serving call (a bad checkpoint path): the caller's error
            raise RuntimeError(f"engine instance {self.index} failed in {op}:\n{_text(e)}") from None
        except errors.RayError as e:  # the actor, its worker or its node is gone
            raise self._died(f"{op}: {_first_line(e)}") from None

    def _check_submits(self) -> None:
        """Raise the error of any submit that failed (those still running stay kept)."""
        if not self._submits:
            return
        done, self._submits = self._ray.wait(self._submits, num_returns=len(self._submits), timeout=0)
        for ref in done:
            self._get(ref, "submit")

    def submit(self, chunk: ChunkRequest) -> None:
        self._submits.append(self._remote("submit", chunk))

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs, self.books.stats = self._get(
            self._remote("abort", request_ids), "abort", self.reply_deadline()
        )
        self._check_submits()  # all done by now (they ran before the abort)
        return outputs

    def call(self, method: str, *args: Any) -> Any:
        value = self._get(self._remote("call", method, *args), "call", self.reply_deadline(method), method)
        self._check_submits()
        return value

    def start_step(self, draft_updates: list | None = None, finished_groups: list[str] | None = None) -> None:
        if not self.stepping:
            self._step_ref = self._remote("step", draft_updates, finished_groups)
            self.stepping = True
            self._step_deadline = self.reply_deadline()

    def poll_reply(self) -> StepReply | None:
        """A step reply if one has arrived (never blocks)."""
        self._check_submits()
        if self._step_ref is None:
            return None
        ready, _ = self._ray.wait([self._step_ref], timeout=0)
        if not ready:
            if self._step_deadline is not None and time.monotonic() > self._step_deadline:
                raise self._hung("step")
            return None
        ref, self._step_ref = self._step_ref, None
        self.stepping = False
        return self._get(ref, "step")

    def poll_alive(self) -> bool:
        """Never blocks: a ping kept in flight (one per ``PING_S``) fails once the actor
        is gone, so one that dies while idle is noticed (a stepping one by its step)."""
        if not self.alive or self.stepping:
            return self.alive
        try:
            if self._ping_ref is None:
                if time.monotonic() - self._ping_at >= PING_S:
                    self._ping_ref, self._ping_at = self._remote("ping"), time.monotonic()
            elif self._ray.wait([self._ping_ref], timeout=0)[0]:
                ref, self._ping_ref = self._ping_ref, None
                self._get(ref, "ping")
        except InstanceDied:
            return False
        return self.alive

    @staticmethod
    def wait_any(handles: Sequence[RayInstance], timeout: float) -> None:
        refs = [inst._step_ref for inst in handles if inst._step_ref is not None]
        if refs:
            handles[0]._ray.wait(refs, num_returns=1, timeout=timeout)

    def close(self) -> None:
        """Detach the actor from the KV pool, then kill it; never raises (idempotent)."""
        self.alive = False
        self.stepping = False
        self._step_ref = None
        actor, self.actor = self.actor, None
        if actor is None:
            return
        ray = self._ray
        try:
            if not ray.is_initialized():
                return  # Ray is shut down: its actors are gone with it
            try:
                ray.get(actor.close.remote(), timeout=CLOSE_TIMEOUT_S)
            except Exception:
                pass  # dead already, or stuck: the kill below ends it
            ray.kill(actor, no_restart=True)
        except Exception as e:
            logger.debug("closing engine instance %d: %s", self.index, e)
