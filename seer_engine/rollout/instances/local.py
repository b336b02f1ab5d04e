"""An instance in this process (``--distributed-backend inproc``).

Its step runs when the dispatcher polls for the reply, so in-process instances step
one at a time; the pool's simulated clock gives each its own time line.
"""

from __future__ import annotations

from typing import Any

from seer_engine.outputs import RequestOutput
from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.instances.worker import InstanceWorker
from seer_engine.rollout.types import ChunkRequest, StepReply


class LocalInstance(InstanceHandle):
    backend = "inproc"

    def __init__(self, index: int, worker: InstanceWorker) -> None:
        super().__init__(index)
        self.worker = worker
        self.engine = worker.engine
        self.info = worker.info
        self._step_args: tuple = ()

    def submit(self, chunk: ChunkRequest) -> None:
        self.worker.submit(chunk)

    def start_step(self, draft_updates: list | None = None, finished_groups: list[str] | None = None) -> None:
        self._step_args = (draft_updates, finished_groups)
        self.stepping = True

    def poll_reply(self) -> StepReply | None:
        if not self.stepping:
            return None
        self.stepping = False
        return self.worker.step(*self._step_args)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs, self.books.stats = self.worker.abort(request_ids)
        return outputs

    def call(self, method: str, *args: Any) -> Any:
        return self.worker.call(method, *args)
