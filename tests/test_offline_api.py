"""The offline ``LLM`` API against vLLM's semantics: what it is given is what it runs, or
it says why not."""

from __future__ import annotations

import pytest

from seer_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("qwen3")), num_threads=1)


def test_an_empty_sampling_params_list_is_a_count_mismatch_not_the_defaults(llm):
    """``[]`` is a list of no SamplingParams: one prompt ran on the defaults (16 tokens)."""
    with pytest.raises(ValueError, match="got 0 SamplingParams for 1 prompts"):
        llm.generate(["hi"], [])
    with pytest.raises(ValueError, match="got 0 SamplingParams for 1 prompts"):
        llm.chat([{"role": "user", "content": "hi"}], [])
    assert llm.generate([], []) == []


def test_a_prompt_dict_key_the_engine_does_not_read_is_refused(llm):
    """vLLM's prompt dicts may carry ``multi_modal_data`` and more; this engine read only the
    text or the ids and ran the prompt without the rest (an image dropped in silence)."""
    params = SamplingParams(max_tokens=1)
    prompt = {"prompt": "hi", "multi_modal_data": {"image": None}}
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*unsupported keys \['multi_modal_data'\]"):
        llm.generate(["hi", prompt], params)
    assert len(llm.generate({"prompt": "hi"}, params)) == 1
