"""Without the C++ CPU kernels the engine still serves, on torch ops, and says why.

CI machines may lack AVX-512, or the optional extension may not have built; these tests
make the kernels unavailable in both ways on any machine (they never need the extension).
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from seer_engine import SamplingParams
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.model_executor import cpu_kernels


@pytest.fixture
def fresh_probe():
    """``cpu_kernels.native()`` probes once per process: clear its answer around the test."""
    cpu_kernels.native.cache_clear()
    yield
    cpu_kernels.native.cache_clear()


def greedy_tokens(path, **config) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=24, **config))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [(5 * i + 3 * j) % 17 + 2 for j in range(20 + 7 * i)], params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert engine.runner.backend.name == "torch"
    return [list(done[f"r{i}"]) for i in range(3)]


@pytest.mark.parametrize("cause", ["no_avx512", "not_importable"])
def test_engine_falls_back_to_torch_ops(tiny_model, fresh_probe, monkeypatch, caplog, cause: str) -> None:
    path = tiny_model("llama")
    expected = greedy_tokens(path, cpu_kernels=False)
    cpu_kernels.native.cache_clear()
    if cause == "no_avx512":
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        message = "need AVX-512 (this CPU: AVX2); running torch ops"
    else:  # an AVX-512 CPU (as reported) whose extension cannot be imported
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        monkeypatch.setitem(sys.modules, "seer_engine._cpu_ops", None)  # import raises ImportError
        message = "C++ CPU kernels unavailable"
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert greedy_tokens(path) == expected  # the default asks for the kernels
    assert cpu_kernels.native() is None
    assert any(message in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(ValueError, match="needs the C.. CPU kernels"):
        LLMEngine(EngineConfig(model=str(path), attention_backend="cpu"))
