"""SmolLM2-135M-Instruct (``--model smollm2-135m``), where the cache holds it.

These tests never fetch: CI runs on tiny models, and a machine that has run
``make run`` (or resolved the alias once) runs these too. They check that the
engine computes what transformers computes on a real model, and that the server
answers a chat request with real English.
"""

from __future__ import annotations

import pytest
import torch
from references import transformers_greedy

from seer_engine import LLM, SamplingParams
from seer_engine.model_executor.model_source import cached_alias_dir

pytest_plugins = ["server_harness"]

FOLDER = cached_alias_dir("smollm2-135m")  # float32 first: what transformers is compared at
pytestmark = pytest.mark.skipif(
    FOLDER is None or FOLDER.name != "smollm2-135m",
    reason="smollm2-135m (float32) is not in the seer_engine cache; fetch it once with "
    "`seer_engine generate --model smollm2-135m --prompt hi` (or `make run`)",
)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 7 times 8?",
    "Give me three tips for sleeping better.",
    "Explain what a prime number is.",
    "Translate 'good morning' into Spanish.",
    "Name three primary colors.",
    "Write one sentence about a cat.",
]
NEW_TOKENS = 64


def test_greedy_equals_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FOLDER)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in CHAT_PROMPTS
    ]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    llm = LLM(model="smollm2-135m", max_model_len=1024, num_kv_blocks=256, num_threads=1)
    assert llm.engine.model_config.path == FOLDER
    assert [llm.engine.detokenizer.encode(p) for p in prompts] == ids
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in outs]

    hf = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    theirs = [transformers_greedy(hf, p, NEW_TOKENS) for p in ids]
    for question, a in zip(CHAT_PROMPTS, ours):
        answer = tok.decode(a, skip_special_tokens=False).split("<|im_end|>")[0]
        print(f"{question!r} -> {answer!r}")
    mismatched = [q for q, a, b in zip(CHAT_PROMPTS, ours, theirs) if a != b]
    assert not mismatched, f"greedy differs from transformers on {mismatched}"
    assert "Paris" in tok.decode(ours[0])


def test_repetition_penalty_greedy_equals_transformers():
    """vLLM's repetition penalty on the real model: token for token what transformers'
    ``generate(repetition_penalty=...)`` gives, and it changes the continuations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FOLDER)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in CHAT_PROMPTS[:4]
    ]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    llm = LLM(model="smollm2-135m", max_model_len=1024, num_kv_blocks=256, num_threads=1)
    # min_tokens bans EOS as transformers' min_new_tokens does
    params = SamplingParams(temperature=0, max_tokens=48, min_tokens=48, repetition_penalty=1.3)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(ids, params)]
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(ids, params.clone(repetition_penalty=1.0))]
    hf = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = [
            hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=48,
                min_new_tokens=48, do_sample=False, repetition_penalty=1.3, pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in ids
        ]  # fmt: skip
    assert ours == theirs
    assert ours != plain


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from server_harness import ServerProcess

    root = tmp_path_factory.mktemp("real-server")
    args = [
        "--model", str(FOLDER), "--served-model-name", "smollm2-135m",
        "--api-key", "test-key", "--data-dir", str(root / "data"),
        "--max-model-len", "1024", "--num-kv-blocks", "256", "--num-threads", "1", "--log-level", "warning",
    ]  # fmt: skip
    proc = ServerProcess(args, root / "server.log").start(timeout=300)
    yield proc
    proc.stop()


def test_chat_completions_answer_in_english(real_server):
    with real_server.openai() as client:
        reply = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
        )
    text = reply.choices[0].message.content
    print(f"server: {text!r}")
    assert "Paris" in text and reply.choices[0].finish_reason == "stop"
