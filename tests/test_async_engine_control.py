"""AsyncEngine control calls that race each other: each caller learns what its own call did."""

from __future__ import annotations

import asyncio
import time

from seer_engine.engine.async_engine import AsyncEngine
from seer_engine.engine.config import EngineConfig


def _wait_blocking(predicate, timeout: float = 30.0) -> None:
    """Wait without yielding to the event loop (so no awaiting caller runs meanwhile)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_weight_update_reports_its_own_version_when_another_follows_at_once(tiny_model):
    """Two updates in a row: the first caller's reply named the version of whichever update
    had run by the time it read ``weight_version`` (the second's), not its own."""
    config = EngineConfig(model=str(tiny_model()), num_kv_blocks=16, max_model_len=320, num_threads=1)
    engine = AsyncEngine.for_engine(config, model_name="m").start(timeout=60)
    other = str(tiny_model(seed=1))

    async def run():
        first = asyncio.ensure_future(engine.update_weights_from_disk(other, "v-first"))
        second = asyncio.ensure_future(engine.update_weights_from_disk(str(tiny_model()), "v-second"))
        await asyncio.sleep(0)  # both posted; the engine thread runs them in order
        _wait_blocking(lambda: engine.weight_version == "v-second")  # both ran before either caller resumes
        assert await first == "v-first"
        assert await second == "v-second"
        assert await engine.update_weights_from_disk(other) == engine.weight_version

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        engine.shutdown()
