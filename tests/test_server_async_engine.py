"""AsyncEngine in-process: failures reach every waiting caller, and nothing hangs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from seer_engine.engine.async_engine import AsyncEngine
from seer_engine.engine.client import EngineClient, EngineDeadError
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.engine.streams import RequestStream, Sink
from seer_engine.entrypoints.openai.admin import render_metrics
from seer_engine.entrypoints.openai.serving_base import final_output, merge_outputs
from seer_engine.outputs import CompletionOutput, RequestOutput
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def _start(model, **overrides) -> AsyncEngine:
    config = EngineConfig(model=str(model), num_kv_blocks=16, max_model_len=320, num_threads=1, **overrides)
    return AsyncEngine.for_engine(config, model_name="m").start(timeout=60)


def test_protocol_and_basic_generation(tiny_model):
    engine = _start(tiny_model())
    try:
        assert isinstance(engine, EngineClient)
        assert engine.max_model_len == 320 and engine.vocab_size > 0 and engine.model_name == "m"

        async def run():
            stream = await engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=5, n=2), stream=True)
            outs = [o async for o in stream]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert [len(s.token_ids) for s in outs[-1].outputs] == [5, 5]
            with pytest.raises(InvalidRequestError, match="KV blocks"):
                await engine.generate("b", [1], SamplingParams(max_tokens=300, ignore_eos=True))
            with pytest.raises(InvalidRequestError, match="already in use"):
                first = await engine.generate("dup", [1], LONG)
                await engine.generate("dup", [1], LONG)
            await first.aclose()  # closing the stream aborts the request
            stats = await engine.stats()
            assert stats.engine.running + stats.engine.waiting == 0

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_priority_reaches_the_scheduler(tiny_model, monkeypatch):
    """vLLM's request ``priority`` reaches the engine (``--scheduling-policy priority``
    orders by it); under fcfs a non-zero one is refused, as vLLM refuses it."""
    seen = {}
    real_add = LLMEngine.add_checked

    def spy(self, request_id, checked, priority=0, *args, **kw):
        seen[request_id] = priority
        return real_add(self, request_id, checked, priority, *args, **kw)

    monkeypatch.setattr(LLMEngine, "add_checked", spy)
    by_priority, fcfs = _start(tiny_model(), scheduling_policy="priority"), _start(tiny_model())
    try:

        async def run():
            short = SamplingParams(max_tokens=2)
            await final_output(await by_priority.generate("p", [1, 2], short, priority=-3))
            assert seen["p"] == -3
            with pytest.raises(InvalidRequestError, match="priority") as refused:
                await fcfs.generate("q", [1, 2], short, priority=1)
            assert refused.value.param == "priority"
            await final_output(await fcfs.generate("r", [1, 2], short, priority=0))

        asyncio.run(run())
    finally:
        by_priority.shutdown()
        fcfs.shutdown()


def test_engine_failure_reaches_waiting_callers(tiny_model, monkeypatch):
    engine = _start(tiny_model())
    device_lost = threading.Event()
    real_step = LLMEngine.step

    def failing_step(self):
        if device_lost.is_set():
            raise RuntimeError("device lost")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", failing_step)

    async def run():
        await engine.pause("keep")  # the requests are held, none can finish before the failure
        streams = [await engine.generate(f"r{i}", [1, 2, 3], LONG) for i in range(3)]
        device_lost.set()
        await engine.resume()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="device lost"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.generate("late", [1], LONG)
        with pytest.raises(EngineDeadError):
            await engine.pause("keep")
        assert (await engine.stats()).engine.kv_total_blocks == 16  # last snapshot still readable
        assert 'instances_alive{model_name="m"} 0.0' in render_metrics(await engine.stats(), "m")

    asyncio.run(asyncio.wait_for(run(), 30))
    engine.shutdown()


def test_shutdown_releases_waiters(tiny_model):
    engine = _start(tiny_model())

    async def run():
        await engine.pause("keep")
        stream = await engine.generate("held", [1, 2], LONG)
        waiter = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            await waiter

    asyncio.run(asyncio.wait_for(run(), 30))


def test_start_reports_a_bad_model(tmp_path):
    engine = AsyncEngine.for_engine(EngineConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match="config.json"):
        engine.start(timeout=60)
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_engine_primitives_sleep_and_weights(tiny_model):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model()), num_kv_blocks=16, max_model_len=128, num_threads=1)
    )
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(rid: str) -> list[int]:
        engine.add_request(rid, [5, 6, 7], greedy)
        while engine.has_unfinished_requests():
            outs = engine.step()
        return outs[0].outputs[0].token_ids

    before = run("a")
    engine.add_request("busy", [1, 2], greedy)
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.sleep()
    engine.abort_request("busy")
    engine.sleep()
    assert engine.is_sleeping and engine.runner.kv_caches == []
    engine.wake_up()
    assert run("b") == before  # fresh KV cache, same weights
    with pytest.raises(InvalidRequestError, match="num_layers"):
        engine.update_weights(tiny_model(num_layers=1))
    engine.update_weights(tiny_model(seed=1))
    assert run("c") != before
    engine.update_weights(tiny_model())
    assert run("d") == before


def _progress(rid: str, n: int, finished: bool = False) -> RequestOutput:
    sample = CompletionOutput(0, "x" * n, list(range(n)), None, None, "length" if finished else None)
    return RequestOutput(rid, None, [1], [sample], finished)


def test_a_reader_that_falls_behind_holds_one_progress_output_per_request():
    """A streaming client that stops reading: each step's output of its requests (every
    sample's output so far) replaces the one it has not read, instead of queueing behind
    it (memory quadratic in the output length, for a client that reads nothing); one of
    several prompts' requests too, whose merged stream waits for the client. It then
    reads the latest output and the final one."""

    async def run() -> tuple[list[int], list[tuple[int, int, bool]]]:
        loop = asyncio.get_running_loop()
        sinks = [Sink(loop), Sink(loop)]
        streams = [RequestStream(f"r{i}", sink, lambda _: None) for i, sink in enumerate(sinks)]
        merged = merge_outputs(streams)
        sinks[0].queue.put_nowait(_progress("r0", 1))
        first = await anext(merged)  # the client reads one output, then falls behind
        for n in range(2, 300):
            for i, sink in enumerate(sinks):
                sink.queue.put_nowait(_progress(f"r{i}", n))
        waiting = [sink.queue.qsize() for sink in sinks]
        for i, sink in enumerate(sinks):
            sink.queue.put_nowait(_progress(f"r{i}", 300, finished=True))
        read = [first] + [item async for item in merged]
        return waiting, [(i, len(out.outputs[0].token_ids), out.finished) for i, out in read]

    waiting, read = asyncio.run(run())
    assert all(w <= 1 for w in waiting), waiting
    assert len(read) <= 8, f"{len(read)} outputs read"
    assert sorted(r for r in read if r[2]) == [(0, 300, True), (1, 300, True)]
