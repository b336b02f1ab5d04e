"""The OpenAI-compatible endpoints, through the official ``openai`` client on a real server."""

from __future__ import annotations

import collections
import json
import re

import httpx
import openai
import pytest

from seer_engine.entrypoints.openai.serving_base import TextDeltas

pytest_plugins = ["server_harness"]


def test_models(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]


def test_completion_n8_logprobs(client, model):
    resp = client.completions.create(
        model=model,
        prompt="The rollout phase",
        n=8,
        max_tokens=12,
        logprobs=3,
        seed=7,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert len(resp.choices) == 8
    assert sorted(c.index for c in resp.choices) == list(range(8))
    assert resp.usage.completion_tokens == 8 * 12
    assert len({tuple(c.token_ids) for c in resp.choices}) > 1  # samples differ
    for c in resp.choices:
        lp = c.logprobs
        assert c.finish_reason == "length" and len(c.token_ids) == 12
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
        assert all(v <= 0 for v in lp.token_logprobs)
        # top-3 (+ the sampled token); tokens that each hold part of a character all read
        # U+FFFD and share one key of the dict, as in vLLM and OpenAI
        assert all(3 <= len(top) <= 4 or ("\ufffd" in top and len(top) <= 4) for top in lp.top_logprobs)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert "".join(lp.tokens) == c.text


def test_completion_token_prompts_echo_and_seed(client, model):
    kwargs = dict(model=model, prompt=[[1, 2, 3], [4, 5, 6, 7]], n=2, max_tokens=6, seed=3)
    resp = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    assert len(resp.choices) == 4
    assert [c.prompt_token_ids for c in resp.choices] == [[1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert resp.usage.prompt_tokens == 7
    again = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in resp.choices]  # seeded
    echo = client.completions.create(model=model, prompt="Hello there", max_tokens=3, echo=True)
    assert echo.choices[0].text.startswith("Hello there")


def test_penalties_reach_the_sampler(client, model):
    """presence/frequency (the OpenAI client's own arguments) and vLLM's repetition_penalty
    change a greedy continuation; the same request twice gives the same tokens."""
    kwargs = dict(model=model, prompt=[5, 6, 7, 8], max_tokens=24, temperature=0)
    body = {"ignore_eos": True, "return_token_ids": True}
    plain = client.completions.create(**kwargs, extra_body=body).choices[0].token_ids
    penalized = [
        client.completions.create(**kwargs, **extra, extra_body={**body, **vllm_extra}).choices[0].token_ids
        for extra, vllm_extra in (
            ({"frequency_penalty": 1.5}, {}),
            ({"presence_penalty": 2.0}, {}),
            ({}, {"repetition_penalty": 3.0}),
        )
    ]
    assert all(len(t) == 24 and t != plain for t in penalized), (plain, penalized)
    again = client.completions.create(**kwargs, frequency_penalty=1.5, extra_body=body).choices[0].token_ids
    assert again == penalized[0]


def test_completion_streaming_matches_non_streaming(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", n=2, max_tokens=20, seed=11, logprobs=1)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    texts, finish, tokens = {0: "", 1: ""}, {}, {0: [], 1: []}
    stream = client.completions.create(
        **kwargs,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.token_ids
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert all(len(t) == 20 for t in tokens.values())
    assert usage is not None and usage.completion_tokens == 40


def test_stop_string_is_never_streamed_past(client, model):
    base = dict(model=model, prompt="A story:", max_tokens=24, temperature=0.0)
    text = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[8:11]
    assert len(stop) == 3, text
    want = text[: text.find(stop)]
    resp = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == want and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(**base, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.text for chunk in stream for c in chunk.choices) == want


def test_text_held_for_a_stop_string_does_not_count_an_unfinished_character():
    """A trailing U+FFFD (a character whose bytes are still coming) may become the start
    of a stop string: the text before it is held back as much as without it."""
    deltas = TextDeltas(["\U0001f600\U0001f600"])
    sent = [deltas.delta(text, False) for text in ("\ufffd", "\U0001f600", "\U0001f600\ufffd")]
    assert sent == ["", "", ""]
    assert deltas.delta("\U0001f600x", False) == "\U0001f600"


def test_streamed_echo_logprobs_match_non_streamed(client, model):
    """With echo, the streamed logprobs start with the prompt's tokens (the first one's
    null, the others scored) and their text offsets count the echoed prompt, as in the
    whole response."""
    kwargs = dict(model=model, prompt=["Hello", "Bye now"], n=2, max_tokens=4, echo=True, logprobs=1, seed=3)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    streamed: dict[int, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for chunk in client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            lp = streamed[c.index]
            lp["text"].append(c.text)
            for key in ("tokens", "token_logprobs", "text_offset"):
                lp[key] += getattr(c.logprobs, key)
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in full.choices:
        lp = streamed[c.index]
        assert "".join(lp["text"]) == c.text == "".join(lp["tokens"])
        assert lp["tokens"] == c.logprobs.tokens and lp["text_offset"] == c.logprobs.text_offset
        # Equal up to float rounding: the two runs may batch their rows differently.
        assert [v is None for v in lp["token_logprobs"]] == [v is None for v in c.logprobs.token_logprobs]
        assert [v for v in lp["token_logprobs"] if v is not None] == pytest.approx(
            [v for v in c.logprobs.token_logprobs if v is not None], abs=1e-4
        )
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.text_offset[0] == 0
        assert None not in c.logprobs.token_logprobs[1:], "every prompt token after the first is scored"


def test_return_tokens_as_token_ids_names_each_logprobs_token_by_its_id(client, model):
    """vLLM's return_tokens_as_token_ids: every token in the logprobs (sampled, top-N,
    echoed prompt; whole and streamed; completions and chat) is "token_id:<id>", the ids
    the response's token_ids give, while text offsets still count the text."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    kwargs = dict(model=model, prompt="Hello there", max_tokens=6, logprobs=2, seed=5, echo=True)
    plain = client.completions.create(**kwargs, extra_body=extra).choices[0]
    as_ids = {**extra, "return_tokens_as_token_ids": True}
    by_id = client.completions.create(**kwargs, extra_body=as_ids).choices[0]
    ids = by_id.prompt_token_ids + by_id.token_ids
    assert by_id.text == plain.text and by_id.token_ids == plain.token_ids
    assert by_id.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert by_id.logprobs.text_offset == plain.logprobs.text_offset
    assert by_id.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    for top in by_id.logprobs.top_logprobs[1:]:
        assert top and all(k.startswith("token_id:") and k[9:].isdigit() for k in top)
    streamed = []
    for chunk in client.completions.create(
        **kwargs, stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
    ):
        for c in chunk.choices:
            streamed += c.logprobs.tokens
    assert streamed == by_id.logprobs.tokens
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True,
        top_logprobs=2, seed=5, extra_body=as_ids,
    )  # fmt: skip
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)


def test_chat_logprobs_bytes_are_each_tokens_own_bytes(client, http, model):
    """A token holding part of a character decodes to U+FFFD; its ``bytes`` are still its
    own (OpenAI's), so the tokens' bytes join into the content, streamed or not."""
    pieces = http.post("/tokenize", json={"model": model, "prompt": "\u00e9", "add_special_tokens": False})
    ids = pieces.json()["tokens"]
    assert len(ids) == 2  # 0xC3 and 0xA9, one byte each
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=7, logprobs=True,
        top_logprobs=2, seed=3, extra_body={"allowed_token_ids": ids, "ignore_eos": True},
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True) for ch in c.choices
                if ch.logprobs for e in ch.logprobs.content]  # fmt: skip
    for entries in (whole.logprobs.content, streamed):
        assert len(entries) == 7
        assert all(e.bytes in ([0xC3], [0xA9]) for e in entries)
        tops = [t for e in entries for t in e.top_logprobs]
        assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in tops)
        joined = bytes(b for e in entries for b in e.bytes)
        assert joined.decode("utf-8", "replace") == whole.message.content


def test_truncate_prompt_tokens_serves_the_prompts_last_tokens(client, http, model):
    """vLLM's truncate_prompt_tokens: the request runs on its prompt's last k tokens, as
    if sent alone (same seeded tokens, usage counts k); echo shows what was kept; chat
    takes it too; a k past the context is refused by name."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    kwargs = dict(model=model, max_tokens=5, seed=9, n=2)
    prompt = "Once upon a time there was a tiny model that wrote a very long story about itself"
    cut = client.completions.create(
        prompt=prompt, echo=True, **kwargs, extra_body={**extra, "truncate_prompt_tokens": 6}
    )
    kept = cut.choices[0].prompt_token_ids
    assert len(kept) == 6 and cut.usage.prompt_tokens == 6
    alone = client.completions.create(prompt=kept, **kwargs, extra_body=extra)
    assert [c.token_ids for c in cut.choices] == [c.token_ids for c in alone.choices]
    shown = http.post("/detokenize", json={"model": model, "tokens": kept}).json()["prompt"]
    assert all(c.text == shown + a.text for c, a in zip(cut.choices, alone.choices))
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=3,
        extra_body={"truncate_prompt_tokens": 4},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 4
    resp = http.post("/v1/completions", json={"model": model, "prompt": "x", "truncate_prompt_tokens": 10**6})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens", resp.text


def test_truncate_prompt_tokens_takes_prompts_longer_than_the_context(client, model):
    """What truncate_prompt_tokens is for (as in vLLM): a prompt past the context, in token
    ids, text or chat messages, is served on its last k tokens, not refused for its length."""
    ids = [5 + i % 400 for i in range(700)]  # the server's context: 512 tokens
    extra = {"truncate_prompt_tokens": 10, "return_token_ids": True}
    out = client.completions.create(model=model, prompt=ids, max_tokens=2, extra_body=extra)
    assert out.choices[0].prompt_token_ids == ids[-10:] and out.usage.prompt_tokens == 10
    text = "many words " * 2000  # more characters than any prompt that fits 512 tokens
    out = client.completions.create(model=model, prompt=text, max_tokens=2, extra_body=extra)
    assert out.usage.prompt_tokens == 10
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=2, extra_body=extra
    )
    assert chat.usage.prompt_tokens == 10


def test_stop_token_text_is_not_in_the_output(client, model):
    """A stop token id ends the output's token ids but not its text (as vLLM), unless
    include_stop_str_in_output; streamed and whole responses agree."""
    base = dict(model=model, prompt="A story:", temperature=0.0)
    free = client.completions.create(**base, max_tokens=24, logprobs=0, extra_body={"ignore_eos": True})
    pieces = free.choices[0].logprobs.tokens
    k = next(
        i
        for i in range(2, len(pieces))
        if pieces[i].strip() and "\ufffd" not in pieces[i] and pieces[i] not in pieces[:i]
    )
    free_ids = client.completions.create(
        **base, max_tokens=k + 1, extra_body={"ignore_eos": True, "return_token_ids": True}
    ).choices[0]
    stop_id = free_ids.token_ids[k]
    before = client.completions.create(**base, max_tokens=k, extra_body={"ignore_eos": True}).choices[0].text
    extra = {"stop_token_ids": [stop_id], "return_token_ids": True, "ignore_eos": True}
    out = client.completions.create(**base, max_tokens=24, extra_body=extra).choices[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free_ids.token_ids and out.text == before
    stream = client.completions.create(**base, max_tokens=24, stream=True, extra_body=extra)
    assert "".join(c.text for chunk in stream for c in chunk.choices) == before
    kept = client.completions.create(
        **base, max_tokens=24, extra_body={**extra, "include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == free_ids.text


def test_null_is_the_default(client, model):
    """OpenAI's optional fields are nullable, and the client sends None as null."""
    resp = client.completions.create(model=model, prompt="x", max_tokens=2, n=None, echo=None, stream=None)
    assert len(resp.choices) == 1 and resp.usage.completion_tokens <= 2
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2, n=None, logprobs=None)
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": None}
        )
    )
    assert all(c.usage is None for c in chunks)  # include_usage: null is false


def test_chat(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    kwargs = dict(model=model, messages=messages, max_tokens=10, seed=5, logprobs=True, top_logprobs=2)
    resp = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == 10 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == choice.message.content
    assert resp.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts_and_n(client, model):
    resp = client.chat.completions.create(
        model=model,
        n=3,
        max_tokens=4,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        extra_body={"return_token_ids": True},
    )
    assert len(resp.choices) == 3
    assert resp.choices[0].prompt_token_ids == resp.choices[2].prompt_token_ids


def _chat_prompt_ids(client, model, messages, **body) -> list[int]:
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, extra_body={"return_token_ids": True, **body}
    )
    return resp.choices[0].prompt_token_ids


def _completion_ids(client, model, text: str, **body) -> list[int]:
    resp = client.completions.create(
        model=model, prompt=text, max_tokens=1, extra_body={"return_token_ids": True, **body}
    )
    return resp.choices[0].prompt_token_ids


@pytest.mark.parametrize("second", ["text", "input_text", "output_text"])
def test_text_parts_are_joined_by_newlines_as_vllm_does(client, model, second):
    """vLLM renders a message's text parts as one string joined by newlines; the Responses
    API's ``input_text`` and ``output_text`` parts are text parts to it too."""
    parts = [{"type": "text", "text": "Hello"}, {"type": second, "text": "World"}]
    ids = _chat_prompt_ids(client, model, [{"role": "user", "content": parts}])
    assert ids == _chat_prompt_ids(client, model, [{"role": "user", "content": "Hello\nWorld"}])


def test_an_assistant_refusal_part_renders_as_its_text_as_vllm_does(client, model):
    """OpenAI's assistant content may hold ``refusal`` parts; vLLM renders their text."""
    parts = [{"type": "text", "text": "Well"}, {"type": "refusal", "refusal": "I can't help with that."}]
    said = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": parts}]
    as_text = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Well\nI can't help with that."},
    ]
    assert _chat_prompt_ids(client, model, said) == _chat_prompt_ids(client, model, as_text)


def test_chat_template_options_render_as_vllm_does(client, model):
    """A request's own chat_template, the variables in chat_template_kwargs, message fields
    the template reads (name, tool_call_id) and continue_final_message all reach the prompt."""
    template = (
        "{% for m in messages %}<{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}>{{ m.content }}"
        "{% if not (continue_final_message and loop.last) %}</{{ m.role }}>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{% if flag %} FLAG{% endif %}"
    )
    messages = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    ids = _chat_prompt_ids(
        client, model, messages, chat_template=template, chat_template_kwargs={"flag": True}
    )
    assert ids == _completion_ids(client, model, "<user:ann>Hi</user><tool#c1>42</tool><assistant> FLAG")
    partial = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    ids = _chat_prompt_ids(
        client,
        model,
        partial,
        chat_template=template,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert ids == _completion_ids(client, model, "<user>Hi</user><assistant>The answer is")


def test_an_assistants_reasoning_reaches_the_template_under_both_names(client, model):
    """An assistant's earlier reasoning, sent as ``reasoning`` (vLLM's name for it now) or
    ``reasoning_content`` (its earlier name, which Qwen3's template reads), reaches the
    template under both, as vLLM hands ``reasoning`` over."""
    each = "[{{ m.reasoning_content }}|{{ m.reasoning }}]{{ m.content }}"
    template = "{% for m in messages %}" + each + "{% endfor %}"
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "A", "reasoning": "R1"},
        {"role": "user", "content": "So?"},
        {"role": "assistant", "content": "B", "reasoning_content": "R2"},
    ]
    ids = _chat_prompt_ids(client, model, messages, chat_template=template, add_generation_prompt=False)
    assert ids == _completion_ids(client, model, "[|]Hi[R1|R1]A[|]So?[R2|R2]B", add_special_tokens=False)


def test_documents_reach_the_chat_template_as_vllm_hands_them_over(client, model):
    """vLLM's ``documents`` (retrieval-augmented templates) are rendered, not dropped."""
    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[0].content }}"
    documents = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    messages = [{"role": "user", "content": "Hi"}]
    ids = _chat_prompt_ids(client, model, messages, chat_template=template, documents=documents)
    assert ids == _completion_ids(client, model, "[a: one][b: two]Hi")


def test_reasoning_effort_reaches_the_template_unless_its_kwargs_name_it(client, model):
    template = "[{{ reasoning_effort }}]{{ messages[0].content }}"
    messages = [{"role": "user", "content": "Hi"}]
    ids = _chat_prompt_ids(client, model, messages, chat_template=template, reasoning_effort="low")
    assert ids == _completion_ids(client, model, "[low]Hi", add_special_tokens=False)
    kwargs = {"reasoning_effort": "high"}
    ids = _chat_prompt_ids(
        client, model, messages, chat_template=template, reasoning_effort="low", chat_template_kwargs=kwargs
    )
    assert ids == _completion_ids(client, model, "[high]Hi", add_special_tokens=False)


def test_chat_echo_writes_the_continued_message_before_each_answer(client, model):
    """vLLM's chat ``echo``: the final message, when the answer continues it (or follows an
    assistant message), comes before each choice's content, whole and streamed; after a
    user message with a generation prompt there is nothing to echo."""
    messages = [{"role": "user", "content": "Tell"}, {"role": "assistant", "content": "Once upon"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    kwargs = dict(model=model, messages=messages, max_tokens=5, n=2, seed=4)
    plain = client.chat.completions.create(**kwargs, extra_body=body)
    echoed = client.chat.completions.create(**kwargs, extra_body={**body, "echo": True})
    answers = [c.message.content for c in plain.choices]
    assert [c.message.content for c in echoed.choices] == ["Once upon" + a for a in answers]
    assert echoed.usage == plain.usage
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kwargs, stream=True, extra_body={**body, "echo": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == ["Once upon" + a for a in answers]
    after_user = dict(kwargs, messages=messages[:1])
    fresh = client.chat.completions.create(**after_user, extra_body={"echo": True})
    assert [c.message.content for c in fresh.choices] == [
        c.message.content for c in client.chat.completions.create(**after_user).choices
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template": "{% for %}"}, "chat_template"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_bad_chat_template_options_are_refused_by_name(http, body, param):
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


# ----------------------------------------------------------------------- bad input


BAD_COMPLETIONS = [
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "priority": 1}, 400, "priority"),  # fcfs and rollout policies: refused, as in vLLM
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x " * 600}, 400, "max_model_len"),
    ({"prompt": [1, 2, 100000]}, 400, "vocabulary"),
    ({"prompt": [[1, 2], [-3]]}, 400, "vocabulary"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": "x", "stop_token_ids": [99999]}, 400, "vocabulary"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty must be in [-2, 2]"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty must be in (0, 10]"),
    ({"prompt": "x", "seed": 2**64 + 5}, 400, "seed must be a 64-bit signed integer"),
    (
        {"prompt": "x", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs is not available when stream",
    ),
    ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs must be an integer in [0, 20]"),
    ({"prompt": "x", "use_beam_search": True}, 400, "use_beam_search is not supported"),
    ({"prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json is not supported"),
    ({"prompt": "x", "length_penalty": 0.5}, 400, "length_penalty is not supported"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "model": "gpt-nope"}, 404, "does not exist"),
    ({"prompt": "x", "n": "two"}, 400, "n"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": 12}, 400, "prompt"),
    ({"prompt": [1.5, 2]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_COMPLETIONS)
def test_bad_completion_requests(http, model, body, status, needle):
    resp = http.post("/v1/completions", json={"model": model, **body} if "model" not in body else body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"] or needle == error["param"], error


HI = [{"role": "user", "content": "hi"}]
OUT_OF_VOCABULARY = "stop token id 99999 is out of the vocabulary"


@pytest.mark.parametrize(
    ("route", "body", "message", "param"),
    [
        ("/v1/completions", {"prompt": [1, 2, -1]}, "prompt token id -1 is out of the vocabulary", "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt is empty", "prompt"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt.1 is empty", "prompt.1"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt.1 is empty", "prompt.1"),
        ("/v1/completions", {"prompt": [[1], [2, -3]]}, "prompt.1 token id -3 is out of the", "prompt.1"),
        ("/v1/completions", {"prompt": "x " * 600}, "prompt has", "prompt"),
        ("/v1/completions", {"prompt": ["a", "x " * 600]}, "prompt.1 has", "prompt.1"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, OUT_OF_VOCABULARY, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": HI, "stop_token_ids": [99999]},
         OUT_OF_VOCABULARY, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]},
         "the prompt rendered from messages has", "messages"),
        ("/v1/chat/completions", {"messages": HI, "chat_template": "{{ '' }}"},
         "the prompt rendered from messages is empty", "messages"),
        # A max_tokens past the context is refused, as vLLM's server does (offline, it is cut).
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 510},
         "max_tokens is too large: 510. This model's maximum context length is 512 tokens and "
         "the prompt has 3 tokens (510 > 512 - 3)", "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 512},
         "max_completion_tokens is too large: 512. This model's maximum context length",
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 10**6},
         "max_tokens is too large", "max_tokens"),
    ],
)  # fmt: skip
def test_intake_refusals_name_their_param(http, model, route, body, message, param):
    resp = http.post(route, json={"model": model, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": []}, 400),
        ({"messages": [{"role": "user"}], "top_logprobs": 2}, 400),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
        ({"messages": [{"content": "hi"}]}, 400),
        ({"messages": "hi"}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400),
    ],
)
def test_bad_chat_requests(http, body, status):
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == status, resp.text
    assert "message" in resp.json()["error"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 11}, "repetition_penalty"),
    ],
)
def test_chat_errors_name_the_chat_field(http, body, param):
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param} "), error


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("functions", [{"name": "get_weather", "parameters": {"type": "object"}}]),  # tools, before tools
        ("function_call", {"name": "get_weather"}),
    ],
)
def test_deprecated_function_calls_are_refused(client, model, param, value):
    """A chat that asks for a function call the deprecated way (``functions`` /
    ``function_call``) is refused, never answered in free text as if it had not asked;
    their neutral values are served. (``tools`` and ``tool_choice``: test_server_tools.py.)"""
    chat = {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**chat, extra_body={param: value})
    assert refused.value.body["param"] == param
    assert refused.value.body["message"] == f"{param} is not supported"
    for neutral in ({"tool_choice": "none", "functions": [], "function_call": "none"},
                    {"tool_choice": "none", "function_call": "auto"}):  # fmt: skip
        resp = client.chat.completions.create(**chat, extra_body=neutral)
        assert resp.choices[0].finish_reason in ("length", "stop")


def test_malformed_json_and_routes(http):
    no_name = "Expecting property name enclosed in double quotes"
    for raw, message in [
        (b"{", f"the body is not valid JSON: {no_name} at line 1 column 2"),
        (b"not json", "the body is not valid JSON: Expecting value at line 1 column 1"),
        (b'{"prompt": "x",}', f"the body is not valid JSON: {no_name} at line 1 column 16"),
        (b"\xff\xfe", "the body is not valid UTF-8 (byte 0xff at position 0)"),
    ]:
        resp = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"].startswith(message), resp.text
    resp = http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert http.get("/v1/nothing-here").status_code == 404
    assert http.get("/v1/nothing-here").json()["error"]["type"] == "not_found_error"
    assert http.delete("/v1/completions").status_code == 405


def test_prompt_logprobs_equal_transformers_through_the_server(server, client, http, model):
    """vLLM's prompt_logprobs (each choice; a chat's beside the choices) and an echo's
    prompt logprobs are the model's: transformers' log-softmax at every prompt position."""
    import torch
    from transformers import AutoModelForCausalLM

    path = server.args[server.args.index("--model") + 1]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = [3, 17, 9, 41, 8, 25, 60, 2, 33, 12]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "n": 2, "seed": 1, "prompt_logprobs": 2}
    resp = http.post("/v1/completions", json=body).json()
    for choice in resp["choices"]:
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(prompt) and scored[0] is None
        for i, entry in enumerate(scored[1:], start=1):
            row = ref[i - 1]
            assert entry[str(prompt[i])]["logprob"] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
            assert entry[str(prompt[i])]["rank"] == int((row > row[prompt[i]]).sum()) + 1
            assert {str(t) for t in torch.topk(row, 2).indices.tolist()} <= set(entry)
    echo = client.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True, logprobs=1, seed=1)
    echoed = echo.choices[0].logprobs.token_logprobs[: len(prompt)]
    assert echoed[0] is None
    assert echoed[1:] == pytest.approx(
        [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4
    )
    chat = http.post(
        "/v1/chat/completions", json={"model": model, "messages": HI, "max_tokens": 1, "prompt_logprobs": 0}
    ).json()
    assert (
        len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    )
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:]), "0: only the prompt token itself"


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-nope"}, 404, "model"),
        ("/tokenize", {"prompt": "x " * 20_000}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         400, "messages.0"),
        ("/tokenize", {"messages": "hi"}, 400, "messages"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ],
)  # fmt: skip
def test_tokenize_refusals(http, route, body, status, param):
    resp = http.post(route, json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk carries
    the usage so far, and the last one the totals; completions and chat alike."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, extra in (
        (client.completions.create, {"prompt": "Once upon", "n": 2}),
        (client.chat.completions.create, {"messages": HI}),
    ):
        chunks = list(create(model=model, max_tokens=5, stream=True, stream_options=options, seed=1, **extra))
        used = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and used == sorted(used)
        total = chunks[-1].usage
        assert chunks[-1].choices == [] and total.completion_tokens == used[-1] > 0
        assert total.total_tokens == total.prompt_tokens + total.completion_tokens
        usage_at_end = {"include_usage": True}
        plain = list(create(model=model, max_tokens=5, stream=True, stream_options=usage_at_end, **extra))
        assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_echo_with_max_tokens_0_scores_the_prompt(client, model):
    """echo with max_tokens 0 (how evaluation harnesses score text, as vLLM serves it):
    the prompt and its logprobs come back, nothing is generated or charged, streamed or not."""
    prompt = [3, 17, 9, 41, 8, 25]
    kwargs = dict(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    whole = client.completions.create(**kwargs)
    generated = client.completions.create(**{**kwargs, "max_tokens": 2}).choices[0]
    scored = generated.logprobs
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 0
    assert choice.text and generated.text.startswith(choice.text) and len(scored.tokens) == len(prompt) + 2
    assert choice.logprobs.tokens == scored.tokens[: len(prompt)]
    assert choice.logprobs.token_logprobs == pytest.approx(scored.token_logprobs[: len(prompt)], abs=1e-4)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == choice.text
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=prompt, max_tokens=0)  # nothing to return


def test_tokenize_counts_what_generation_counts(client, http, model):
    """A conversation's /tokenize count is the prompt a chat completion is charged for,
    and /detokenize gives back the text of a completion's token ids; both are guarded by
    the API key like every route but /health."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    tokenized = http.post("/tokenize", json={"model": model, "messages": messages}).json()
    assert tokenized["count"] == chat.usage.prompt_tokens == len(tokenized["tokens"])
    done = client.completions.create(
        model=model, prompt="Once upon", max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    ).choices[0]
    text = http.post("/detokenize", json={"tokens": done.token_ids}).json()["prompt"]
    assert text == done.text
    with httpx.Client(base_url=str(http.base_url)) as anon:
        assert anon.post("/tokenize", json={"prompt": "x"}).status_code == 401


def test_logit_bias_through_the_openai_client(client, http, model):
    """OpenAI's logit_bias (token ids as strings): +100 all but forces a token, -100 bans
    one; keys that are not token ids, values outside [-100, 100] and ids outside the
    vocabulary are refused by name."""
    base = dict(
        model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    forced = client.completions.create(**base, logit_bias={"42": 100})
    assert forced.choices[0].token_ids == [42] * 6
    plain = client.completions.create(**base).choices[0].token_ids
    banned = client.completions.create(**base, logit_bias={str(plain[0]): -100}).choices[0].token_ids
    assert plain[0] not in banned
    for bias, needle in [
        ({"x": 1}, "logit_bias keys must be token ids"),
        ({"-3": 1}, "logit_bias keys must be token ids"),
        ({"\u00b2": 1}, "logit_bias keys must be token ids"),  # a digit to str.isdigit, not to int()
        ({"\u0663": 1}, "logit_bias keys must be token ids"),  # Arabic-Indic 3, which int() reads
        ({"5": 101}, "numbers in [-100, 100]"),
        ({"99999": 1}, "logit_bias token id 99999 is out of the vocabulary"),
    ]:
        body = {"model": model, "prompt": "x", "max_tokens": 1, "logit_bias": bias}
        for route, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": HI})):
            payload = {k: v for k, v in {**body, **extra}.items() if not (extra and k == "prompt")}
            resp = http.post(route, json=payload)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == "logit_bias" and needle in error["message"], error


def test_allowed_token_ids_through_the_server(client, http, model):
    """vLLM's allowed_token_ids: every sampled token is one of them; an empty list or an
    id outside the vocabulary is refused by name."""
    allowed = [42, 43, 44]
    out = client.completions.create(
        model=model, prompt="x", max_tokens=12, n=2, seed=3,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert all(set(c.token_ids) <= set(allowed) and len(c.token_ids) == 12 for c in out.choices)
    for bad, needle in (([], "non-empty list"), ([5, 99999], "allowed_token_ids token id 99999 is out of")):
        resp = http.post("/v1/completions", json={"model": model, "prompt": "x", "allowed_token_ids": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids", resp.text
        assert needle in resp.json()["error"]["message"]


def test_openai_client_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", top_p=2.0)
    assert "top_p" in e.value.body["message"]
    # A body of the wrong shape is a 400 as well, as OpenAI and vLLM answer it.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", extra_body={"temperature": "hot"})
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=600)
    assert e.value.body["param"] == "max_tokens" and "maximum context length" in e.value.body["message"]
    fits = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=509, temperature=0, stop=None)
    assert fits.usage.prompt_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_api_key_and_body_limit(server, http, model):
    with server.http(api_key=None) as anon:
        assert anon.get("/health").status_code == 200  # open for probes
        for path in ("/v1/models", "/metrics", "/get_weight_version"):
            resp = anon.get(path)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with server.http(api_key="wrong") as bad:
        assert bad.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    big = json.dumps({"model": model, "prompt": "x" * 2_000_000})
    resp = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: caught while reading
        for _ in range(20):
            yield b" " * 100_000

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413


def test_neutral_values_of_unsupported_options_and_unknown_fields_are_served(http, model):
    """Trainers send vLLM's defaults for options this server lacks (prompt_logprobs null,
    use_beam_search false) and OpenAI fields that change nothing here (store): served;
    a chat asking for JSON output is refused rather than answered in free text."""
    body = {"model": model, "prompt": "x", "max_tokens": 2, "prompt_logprobs": None, "use_beam_search": False,
            "length_penalty": 1.0, "bad_words": [], "store": True, "metadata": {"k": "v"},
            "return_tokens_as_token_ids": False, "truncate_prompt_tokens": None}  # fmt: skip
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}})
    assert resp.status_code == 200, resp.text
    resp = http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format", resp.text


def test_top_logprobs_0_without_logprobs_is_served_as_by_vllm(http, model):
    """vLLM refuses top_logprobs > 0 without logprobs; 0 asks for nothing and is served."""
    body = {"model": model, "messages": HI, "max_tokens": 2, "top_logprobs": 0}
    for logprobs in ({}, {"logprobs": False}):
        resp = http.post("/v1/chat/completions", json={**body, **logprobs})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["logprobs"] is None
    resp = http.post("/v1/chat/completions", json={**body, "top_logprobs": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs", resp.text


def test_still_serving_after_bad_input(client, model):
    resp = client.completions.create(
        model=model, prompt="still here", max_tokens=4, extra_body={"repetition_penalty": 1.0}
    )
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_a_model_can_be_retrieved_by_name(client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"


def test_a_response_names_the_model_the_request_named(server_models, start_server):
    """As vLLM: a request may use any served name and its response (each streamed chunk
    too) carries that name; a request that names none (no model, or "") gets the first."""
    server = start_server("--model", str(server_models[0]), "--served-model-name", "main", "alias",
                          "--max-model-len", "256", "--num-threads", "1")  # fmt: skip
    with server.openai() as client:
        for name in ("main", "alias"):
            assert client.completions.create(model=name, prompt="x", max_tokens=1).model == name
            assert client.chat.completions.create(model=name, messages=HI, max_tokens=1).model == name
            chunks = list(client.completions.create(model=name, prompt="x", max_tokens=1, stream=True))
            chunks += list(client.chat.completions.create(model=name, messages=HI, max_tokens=1, stream=True))
            assert {chunk.model for chunk in chunks} == {name}
    with server.http() as http:
        for unnamed in ({}, {"model": ""}, {"model": None}):
            resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **unnamed})
            assert resp.status_code == 200 and resp.json()["model"] == "main", resp.text
            resp = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **unnamed})
            assert resp.status_code == 200 and resp.json()["model"] == "main", resp.text


def test_metrics_escape_the_model_name_as_the_text_format_asks(server_models, start_server):
    """Prometheus' text format escapes a label value's backslashes, double quotes and line
    feeds: a served name holding each still gives one parseable line per sample."""
    name = 'my "model"\\v1\nnext'
    server = start_server("--model", str(server_models[0]), "--served-model-name", name,
                          "--max-model-len", "256", "--num-threads", "1")  # fmt: skip
    with server.http() as http:
        text = http.get("/metrics").text
    sample = re.compile(r'seer_engine_\w+\{model_name="((?:[^"\\\n]|\\[\\"n])*)"\} \S+')
    unescape = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
    comment = re.compile(r"# (HELP seer_engine_\w+ .+|TYPE seer_engine_\w+ (counter|gauge))")
    for line in text.removesuffix("\n").split("\n"):
        if line.startswith("#"):
            assert comment.fullmatch(line), line
        else:
            match = sample.fullmatch(line)
            assert match, line
            assert re.sub(r"\\.", lambda e: unescape[e.group()], match.group(1)) == name


def test_text_prompts_take_the_tokenizers_bos_and_chat_prompts_do_not(tiny_model, start_server):
    """As in transformers and vLLM: a completion's text prompt is tokenized with the
    tokenizer's special tokens (here a Llama-style BOS); a chat's is not, since its
    template writes the BOS itself (else it would be doubled). ``add_special_tokens``
    asks for the other; a value that is not a boolean is refused by name."""
    from transformers import AutoTokenizer

    path = tiny_model("llama", add_bos=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    bos = tok.bos_token_id
    server = start_server(
        "--model", str(path), "--rollout-mode", "--max-model-len", "256", "--num-threads", "1"
    )  # fmt: skip
    text = "Once upon a time"
    messages = [{"role": "user", "content": "Hello"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with server.openai() as client:
        plain = tok(text, add_special_tokens=False).input_ids
        assert _completion_ids(client, server.model, text) == tok(text).input_ids == [bos, *plain]
        assert _completion_ids(client, server.model, text, add_special_tokens=False) == plain
        chat = tok(rendered, add_special_tokens=False).input_ids
        assert chat[0] == bos and chat[1] != bos
        assert _chat_prompt_ids(client, server.model, messages) == chat
        assert _chat_prompt_ids(client, server.model, messages, add_special_tokens=True) == [bos, *chat]
    with server.http() as http:
        body = {"model": server.model, "prompt": text, "add_special_tokens": "yes"}
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "add_special_tokens"
        # /tokenize and /detokenize (vLLM's) tokenize as generation does, by the same rules.
        tokenized = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert tokenized["tokens"] == [bos, *plain] and tokenized["count"] == len(plain) + 1
        assert tokenized["token_strs"] == tok.convert_ids_to_tokens([bos, *plain])
        assert tokenized["max_model_len"] == 256
        body = {"model": server.model, "prompt": text, "add_special_tokens": False}
        resp = http.post("/tokenize", json=body)
        assert resp.json()["tokens"] == plain and resp.json()["token_strs"] is None
        assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == chat
        body = {"messages": messages, "add_special_tokens": True, "add_generation_prompt": False}
        no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        assert http.post("/tokenize", json=body).json()["tokens"] == tok(no_prompt).input_ids
        resp = http.post("/detokenize", json={"model": server.model, "tokens": [bos, *plain]})
        assert resp.json() == {"prompt": tok.decode([bos, *plain])}


def test_echoed_token_prompt_keeps_its_special_tokens(client, http, model):
    """An echoed prompt given as token ids (or a text prompt cut by truncate_prompt_tokens)
    is shown with its special tokens, as /detokenize and the echo's logprobs tokens spell
    it: the logprobs' tokens join into the text and their offsets index it."""
    text = "<|im_start|>user\nHi there<|im_end|>\n"
    ids = http.post("/tokenize", json={"model": model, "prompt": text}).json()["tokens"]
    kwargs = dict(model=model, max_tokens=3, echo=True, logprobs=1, seed=2)
    for prompt, extra in ((ids, {}), (f"Well {text}", {"truncate_prompt_tokens": len(ids)})):
        resp = client.completions.create(prompt=prompt, **kwargs, extra_body={"ignore_eos": True, **extra})
        choice = resp.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(text) and "".join(lp.tokens) == choice.text, (prompt, choice.text)
        assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
        extra_body = {"ignore_eos": True, **extra}
        chunks = client.completions.create(prompt=prompt, **kwargs, stream=True, extra_body=extra_body)
        assert "".join(c.choices[0].text for c in chunks) == choice.text
