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


def test_a_weight_update_while_asleep_builds_the_new_weights_on_the_host(tiny_model, monkeypatch):
    """An update during sleep built the new model on the accelerator (a whole model of the
    memory the trainer was promised free) and only then moved it to the host. The meta
    device stands in for the accelerator here: nothing may be built on it while asleep."""
    import torch

    import seer_engine.model_executor.model_runner as model_runner
    from seer_engine.engine.llm_engine import LLMEngine
    from seer_engine.sampling_params import SamplingParams

    def engine_on(model) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=16, max_model_len=128, num_threads=1))

    def run(engine: LLMEngine, rid: str) -> list[int]:
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            outs = engine.step()
        return outs[0].outputs[0].token_ids

    expected = run(engine_on(tiny_model(seed=1)), "fresh")
    engine = engine_on(tiny_model())
    engine.sleep()
    built_on = []
    real_load = model_runner.load_model

    def load_model(cfg, dtype, device):
        built_on.append(torch.device(device).type)
        return real_load(cfg, dtype, device)

    monkeypatch.setattr(model_runner, "load_model", load_model)
    engine.device = engine.runner.device = torch.device("meta")  # "the accelerator"
    engine.update_weights(tiny_model(seed=1))
    assert built_on == ["cpu"]
    assert {p.device.type for p in engine.runner.model.parameters()} == {"cpu"}
    engine.device = engine.runner.device = torch.device("cpu")
    engine.wake_up()
    assert run(engine, "after") == expected  # as a fresh engine on the new weights
