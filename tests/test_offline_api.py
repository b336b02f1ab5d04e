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


def test_prompts_of_the_wrong_kind_are_refused_not_read_as_something_else(llm):
    """``b"hi"`` ran as the token ids [104, 105] (its bytes), ``{"prompt_token_ids": "abc"}``
    as the text "abc", and a bare int failed as "'int' object is not iterable"."""
    params = SamplingParams(max_tokens=1)
    kinds = "prompts must be text, token ids, a prompt dict or a list of them"
    with pytest.raises(TypeError, match=f"{kinds}, got bytes"):
        llm.generate(b"hi", params)
    with pytest.raises(TypeError, match="got int"):
        llm.generate(5, params)
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of token ids, got 'abc'"):
        llm.generate({"prompt_token_ids": "abc"}, params)
    assert [o.prompt_token_ids for o in llm.generate({"prompt_token_ids": (5, 6)}, params)] == [[5, 6]]


def test_generate_waits_for_its_own_requests_not_for_as_many_of_any(llm):
    """A request already in the engine (added through ``llm.engine``) finishing first counted
    as one of the call's: it returned early with a KeyError and left its own request running."""
    llm.engine.add_request("elsewhere", "hi", SamplingParams(max_tokens=1))
    outs = llm.generate(["a longer one"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12]
    assert not llm.engine.has_unfinished_requests()
