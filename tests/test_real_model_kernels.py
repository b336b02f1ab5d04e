"""SmolLM2-135M-Instruct through both kernel paths: greedy equals transformers token for
token, with the C++ CPU kernels and with plain torch ops.

Runs where the converted model is in ``$SEER_ENGINE_CACHE`` (default
``~/.cache/seer_engine/smollm2-135m``); never fetches. Batched rows at different
positions and chunked prefill spans (a 32-token budget) go through the same kernels as
decode rows. Single-threaded: on the shared 2-core machine that is the fastest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from references import transformers_greedy

from seer_engine import LLM, SamplingParams
from seer_engine.model_executor import cpu_kernels

FOLDER = Path(os.environ.get("SEER_ENGINE_CACHE", "~/.cache/seer_engine")).expanduser() / "smollm2-135m"
pytestmark = pytest.mark.skipif(
    not (FOLDER / "config.json").is_file(), reason=f"no converted model in {FOLDER}"
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "Give me three tips for sleeping better.",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def prompts_and_reference() -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FOLDER)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    ids = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in chats]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    return ids, [transformers_greedy(hf, p, NEW_TOKENS) for p in ids]


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_greedy_equals_transformers(prompts_and_reference, kernels: bool) -> None:
    if kernels and cpu_kernels.native() is None:
        pytest.skip("C++ CPU kernels not built or no AVX-512 on this CPU")
    ids, reference = prompts_and_reference
    llm = LLM(
        str(FOLDER), max_model_len=1024, num_kv_blocks=128, max_num_batched_tokens=48, cpu_kernels=kernels
    )
    assert llm.engine.runner.backend.name == ("cpu" if kernels else "torch")
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    mismatched = [p for p, a, b in zip(PROMPTS, ours, reference) if a != b]
    assert not mismatched, f"greedy differs from transformers on {mismatched}"
    stats = llm.engine.scheduler.stats
    assert stats.scheduled_tokens - stats.generated_tokens > 32, "prompts must be split into prefill spans"
