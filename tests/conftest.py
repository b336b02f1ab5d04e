"""Shared fixtures: tiny random-weight models made on the fly, and reference outputs."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

# Keep the 2-core CI machine responsive and runs reproducible.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before any
# test imports seer_engine.kernels: without a GPU the kernels run in the interpreter.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A test run started as a background job of a shell without job control (`cmd &` in a
# script) inherits SIGINT ignored, and so would every server it starts: Python then
# installs no KeyboardInterrupt handler, and the tests that send a server SIGINT (Ctrl-C
# in a terminal) would test another process than a user's. Servers start with it handled.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def game24_trace() -> Path:
    """The Game of 24 rollout trace in ``../shared/traces``; skips where it is missing."""
    trace = SHARED / "traces" / "gpt4-game24-cot.jsonl.gz"
    if not trace.is_file():
        pytest.skip(f"traces not found at {trace}")
    return trace


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch="qwen3", **kwargs) -> Path``; each distinct model is built once."""
    from seer_engine.model_executor.tiny_model import make_tiny_model

    cache: dict[str, Path] = {}

    def make(arch: str = "qwen3", **kwargs) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(out, arch=arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture
def sim_instances(monkeypatch) -> list:
    """Every ``SimInstance`` the test's simulations make, in order (to read their peak KV)."""
    from seer_engine.sim.instance import SimInstance

    made: list[SimInstance] = []
    real_init = SimInstance.__init__

    def spy(self, *args, **kw):
        real_init(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(SimInstance, "__init__", spy)
    return made


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(path, dtype) -> transformers model``, cached."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(path: Path, dtype=torch.float32):
        key = (str(path), dtype)
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        return cache[key]

    return load


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """Reference greedy continuation from transformers, EOS banned for all of it (as the
    engine's min_tokens = max_tokens does; ignore_eos may still emit an EOS token);
    ``generate_kwargs`` go to ``generate`` (e.g. ``repetition_penalty``)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )
    return out[0, len(prompt) :].tolist()


def make_engine(model, spec=None, **kw):
    """A real LLMEngine on ``model`` with room for a few groups; ``spec``: its speculative config."""
    from seer_engine.engine.config import EngineConfig
    from seer_engine.engine.llm_engine import LLMEngine

    args = {"num_kv_blocks": 256, "max_num_seqs": 64, **kw}
    return LLMEngine(EngineConfig(model=str(model), speculative_config=spec, **args))


def run_waves(engine, waves, head_start: int = 6) -> dict[str, list[list[int]]]:
    """Add each wave of (request id, prompt, params, group) after the previous one ran
    ``head_start`` steps, so later siblings draft from earlier ones; run to the end."""
    outputs = {}
    for wave in waves:
        for rid, prompt, params, group in wave:
            engine.add_request(rid, prompt, params, group_id=group)
        for _ in range(head_start):
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outputs.items()}
