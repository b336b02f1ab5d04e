"""Intake: a request is checked and tokenized once, before the engine thread sees it,
in both serving modes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from seer_engine.engine.async_engine import AsyncEngine
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.input_processor import MAX_CHARS_PER_TOKEN, InputProcessor
from seer_engine.entrypoints.openai.api_server import ServerSettings, build_engine_client, create_app
from seer_engine.rollout.config import RolloutConfig
from seer_engine.sampling_params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture
def encode_calls(monkeypatch) -> list[str]:
    """Every text the process tokenizes, whichever tokenizer instance does it."""
    calls: list[str] = []
    real = Detokenizer.encode

    def counting(self, text: str, *args: object) -> list[int]:
        calls.append(text)
        return real(self, text, *args)

    monkeypatch.setattr(Detokenizer, "encode", counting)
    return calls


def _post_all(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return [await client.post(path, json=body) for path, body in requests]

    return asyncio.run(run())


@pytest.mark.parametrize("rollout_mode", [False, True], ids=["engine", "rollout"])
def test_a_request_is_tokenized_once(model, encode_calls, rollout_mode, tmp_path):
    rollout = RolloutConfig(rollout_mode=rollout_mode, instances=2 if rollout_mode else 1,
                            distributed_backend="inproc", chunk_tokens=4)  # fmt: skip
    settings = ServerSettings(served_model_names=["m"], data_dir=tmp_path, rollout=rollout)
    engine = build_engine_client(EngineConfig(model=str(model), num_kv_blocks=64), settings)
    try:
        app = create_app(engine, settings)
        encode_calls.clear()
        completion = {"model": "m", "prompt": "Once upon a time", "max_tokens": 6, "n": 3, "echo": True}
        chat = {"model": "m", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6}
        first, second = _post_all(app, [("/v1/completions", completion), ("/v1/chat/completions", chat)])
        assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
        assert len(first.json()["choices"]) == 3
        assert encode_calls[0] == "Once upon a time" and len(encode_calls) == 2, encode_calls
        assert "Hi there" in encode_calls[1]  # the chat template's text, tokenized once
    finally:
        engine.shutdown()


def test_the_engine_thread_never_tokenizes(model, encode_calls):
    """The intake thread tokenizes; the engine thread only takes checked requests."""
    import threading

    threads: list[str] = []
    real = Detokenizer.encode

    def where(self, text, *args):
        threads.append(threading.current_thread().name)
        return real(self, text, *args)

    Detokenizer.encode = where  # monkeypatch restores the original after the test
    engine = AsyncEngine.for_engine(EngineConfig(model=str(model), num_kv_blocks=64)).start(timeout=60)
    try:

        async def run():
            stream = await engine.generate("a", "Hello world", SamplingParams(max_tokens=3))
            return [o async for o in stream][-1]

        assert asyncio.run(run()).finished
        assert threads and all(name.startswith("seer-intake") for name in threads), threads
    finally:
        engine.shutdown()


def test_prompts_are_bounded_before_they_are_tokenized(model, encode_calls):
    engine_processor = _processor(model)
    limit = engine_processor.max_model_len * MAX_CHARS_PER_TOKEN
    with pytest.raises(InvalidRequestError, match=f"at most {limit}"):
        engine_processor.process("x" * (limit + 1), SamplingParams())
    assert encode_calls == [], "a prompt over the bound is refused without tokenizing it"
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine_processor.process(list(range(5)) * engine_processor.max_model_len, SamplingParams())
    with pytest.raises(InvalidRequestError, match="not valid Unicode.*character 0"):
        engine_processor.process("\ud800abc", SamplingParams())
    checked = engine_processor.process("ok", SamplingParams(max_tokens=None))
    assert checked.max_tokens == engine_processor.max_model_len - len(checked.prompt_token_ids)


def test_a_max_tokens_past_the_context_is_cut_or_refused(model):
    """Offline a max_tokens past the context is cut to what the prompt leaves (vLLM's LLM);
    with ``fit_max_tokens`` off (the server's requests) it is refused, naming the numbers."""
    processor = _processor(model)
    room = processor.max_model_len - 3
    assert processor.process([1, 2, 3], SamplingParams(max_tokens=room + 5)).max_tokens == room
    strict = SamplingParams(max_tokens=room + 5, fit_max_tokens=False)
    with pytest.raises(InvalidRequestError) as refused:
        processor.process([1, 2, 3], strict)
    assert refused.value.param == "max_tokens"
    assert str(refused.value) == (
        f"max_tokens is too large: {room + 5}. This model's maximum context length is "
        f"{processor.max_model_len} tokens and the prompt has 3 tokens "
        f"({room + 5} > {processor.max_model_len} - 3)"
    )
    assert processor.process([1, 2, 3], strict.clone(max_tokens=room)).max_tokens == room


def _processor(model) -> InputProcessor:
    from seer_engine.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=300)).make_input_processor()


def test_refusals_name_their_field(model):
    """Each refusal names the request field at fault as the OpenAI API calls it, and keeps
    it when pickled (rollout instances may run in other processes)."""
    import pickle

    processor = _processor(model)
    for prompt, params, param in [
        ([1, -1], SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        (list(range(5)) * processor.max_model_len, SamplingParams(), "prompt"),
        ([1], SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as refused:
            processor.process(prompt, params)
        assert refused.value.param == param, refused.value
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(temperature=-1)
    assert refused.value.param == "temperature"
    copy = pickle.loads(pickle.dumps(refused.value))
    assert (str(copy), copy.param) == (str(refused.value), "temperature")


@pytest.mark.parametrize("add_bos", [False, True], ids=["plain", "bos"])
def test_truncate_prompt_tokens_keeps_the_last_tokens_as_a_left_truncating_tokenizer(tiny_model, add_bos):
    """vLLM's truncate_prompt_tokens: a text prompt keeps what transformers' tokenizer
    truncating on the left keeps (the BOS stays first), token ids their last k; -1 is
    max_model_len, and sizes it cannot honour are refused by name."""
    from transformers import AutoTokenizer

    path = tiny_model("llama", add_bos=add_bos)
    processor = _processor(path)
    reference = AutoTokenizer.from_pretrained(path, truncation_side="left")
    text = "Once upon a time there was a tiny model that wrote a very long story"
    full = reference(text)["input_ids"]
    assert (full[0] == reference.bos_token_id) == add_bos
    for k in (len(full) + 3, len(full), 5, 2):
        checked = processor.process(text, SamplingParams(truncate_prompt_tokens=k))
        want = reference(text, truncation=True, max_length=k)["input_ids"]
        assert checked.prompt_token_ids == want and len(want) == min(k, len(full)), (k, want)
        kept_text = text if k >= len(full) else reference.decode(want, skip_special_tokens=True)
        assert checked.prompt == kept_text
    ids = list(range(3, 40))
    assert processor.process(ids, SamplingParams(truncate_prompt_tokens=7)).prompt_token_ids == ids[-7:]
    long = list(range(3, 40)) * processor.max_model_len
    with pytest.raises(InvalidRequestError, match="maximum context length") as refused:
        processor.process(long, SamplingParams(truncate_prompt_tokens=-1))  # max_model_len: no room left
    assert refused.value.param == "prompt"
    kept = processor.process(long, SamplingParams(truncate_prompt_tokens=processor.max_model_len - 1))
    assert kept.prompt_token_ids == long[-(processor.max_model_len - 1) :] and kept.max_tokens == 1
    with pytest.raises(InvalidRequestError, match="greater than the model's maximum context") as refused:
        processor.process(ids, SamplingParams(truncate_prompt_tokens=processor.max_model_len + 1))
    assert refused.value.param == "truncate_prompt_tokens"
    for bad in (0, -2, 1.5):
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=bad)
    if add_bos:
        with pytest.raises(InvalidRequestError, match="no room for the prompt's text") as refused:
            processor.process(text, SamplingParams(truncate_prompt_tokens=1))
        assert refused.value.param == "truncate_prompt_tokens"
