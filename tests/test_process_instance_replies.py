"""ProcessInstance reads its worker's replies in order: a serving call or an abort that
reads a step's reply on its way must leave that reply (even a failure) to the step."""

from __future__ import annotations

import multiprocessing as mp
from collections import deque

import pytest

from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.instances.process import ProcessInstance


class _Alive:
    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        pass


def _instance_on_a_pipe() -> tuple[ProcessInstance, mp.connection.Connection]:
    """A ProcessInstance whose worker is the test, at the other end of the pipe."""
    inst = ProcessInstance.__new__(ProcessInstance)
    InstanceHandle.__init__(inst, 0)
    inst._conn, worker = mp.Pipe()
    inst.process = _Alive()
    inst._pending = deque()
    inst._replies = deque()
    inst._step_deadline = None
    inst._step_failure = None
    return inst, worker


@pytest.mark.parametrize("failed", ["step", "submit"])
def test_a_step_that_fails_under_a_serving_call_fails_the_next_poll_not_the_call(failed):
    """The step (or a chunk's submit) failed in the worker while a flush_cache was on its
    way: the failure went to the flush's caller (a 500), and the instance was left marked
    stepping with no step pending (or with a chunk that never ran), so it was never stepped
    again and its requests hung with /health ok."""
    inst, worker = _instance_on_a_pipe()
    if failed == "step":
        inst.start_step()
    else:
        inst.submit("a chunk")
    worker.send(("error", (None, "Traceback: the device failed")))  # the step's or submit's reply
    worker.send(("ok", "flushed"))  # the call's
    assert inst.call("reset_prefix_cache") == "flushed"  # the call gets its own answer
    assert [worker.recv()[0] for _ in range(2)] == [failed, "call"]
    assert not inst.stepping
    with pytest.raises(RuntimeError, match=f"failed in {failed}"):
        inst.poll_reply()  # the failure surfaces where a step's reply is read: the engine stops
