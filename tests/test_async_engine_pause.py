"""AsyncEngine pause sequences: a ``wait`` pause that a later command overrides must not hang."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from seer_engine.engine.async_engine import AsyncEngine
from seer_engine.engine.client import EngineBusyError
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture
def stalled_engine(tiny_model, monkeypatch):
    """An engine whose steps make no progress while ``stalled`` is set: a request in
    flight stays in flight for as long as the test needs."""
    stalled = threading.Event()
    real_step = LLMEngine.step

    def step(self):
        if stalled.is_set():
            time.sleep(0.001)
            return []
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    config = EngineConfig(model=str(tiny_model()), num_kv_blocks=16, max_model_len=320, num_threads=1)
    engine = AsyncEngine.for_engine(config, model_name="m").start(timeout=60)
    stalled.set()
    yield engine, stalled
    stalled.clear()
    engine.shutdown()


@pytest.mark.parametrize("then", ["keep", "resume"])
def test_a_wait_pause_overridden_before_its_requests_finish_is_refused(stalled_engine, then):
    engine, stalled = stalled_engine

    async def run():
        stream = await engine.generate("r", [1, 2, 3], LONG)
        waiting = asyncio.ensure_future(engine.pause("wait"))
        await asyncio.sleep(0)  # posted before the next command: the thread takes them in order
        await (engine.pause("keep") if then == "keep" else engine.resume())
        with pytest.raises(EngineBusyError, match="before the requests in flight finished"):
            await asyncio.wait_for(waiting, 10)
        stalled.clear()
        await engine.resume()
        assert [o async for o in stream][-1].finished
        await engine.pause("wait")  # nothing in flight: returns at once
        await engine.resume()

    asyncio.run(asyncio.wait_for(run(), 60))


def test_an_abort_pause_completes_a_pending_wait_pause(stalled_engine):
    engine, _ = stalled_engine

    async def run():
        stream = await engine.generate("r", [1, 2, 3], LONG)
        waiting = asyncio.ensure_future(engine.pause("wait"))
        await asyncio.sleep(0)
        await engine.pause("abort")
        await asyncio.wait_for(waiting, 10)  # the abort drained the engine
        assert [o async for o in stream][-1].outputs[0].finish_reason == "abort"
        await engine.resume()

    asyncio.run(asyncio.wait_for(run(), 60))
