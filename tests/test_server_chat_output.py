"""A chat response's parts: reasoning (vLLM's ``--reasoning-parser qwen3``) and tool
calls (``--enable-auto-tool-choice --tool-call-parser hermes``) read back from its text,
streamed and whole alike; tools reach the chat template; tool_choice follows vLLM's rules.

The end-to-end tests serve a tiny model whose greedy output is scripted: its layers add
nothing to the residual stream, so each next token depends on the current one alone,
and its embeddings and output rows chain the tokens of a known response."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seer_engine.entrypoints.openai.chat_output import ChatOutputSplitter, ThinkReasoningParser
from seer_engine.entrypoints.openai.tool_parsers import HermesToolParser

pytest_plugins = ["server_harness"]

CALL = '{"name":"get_weather","arguments":{"city":"Paris","days":2}}'
THOUGHT = "Paris is in France."
SCRIPT = ["<think>", THOUGHT, "</think>", "Let me check.", "<tool_call>", CALL, "</tool_call>"]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters | tojson }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
# Answered to a prompt that ends in its first token (a template that writes it): two calls.
ROME, OSLO = (f'{{"name":"get_weather","arguments":{{"city":"{city}"}}}}' for city in ("Rome", "Oslo"))
TWO_CALLS = ["<two_calls>", "<tool_call>\n", ROME, "\n</tool_call>", "\n<tool_call>", OSLO, "</tool_call>\n"]


def _scripted_model(base: Path, out: Path, special_tags: bool = False) -> Path:
    """``base`` (a tiny model) made to answer every chat with ``SCRIPT`` then its EOS;
    ``special_tags``: its tool call tags are special tokens (as in Hermes-2-Pro)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tags = [HermesToolParser.start, HermesToolParser.end] if special_tags else []
    tok.add_tokens([t for t in SCRIPT + TWO_CALLS if t not in tags])
    tok.add_tokens(tags, special_tokens=True)
    tok.chat_template = TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    prompt = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    last = tok(prompt, add_special_tokens=False)["input_ids"][-1]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    chains = [[last, *tok.convert_tokens_to_ids(SCRIPT), eos], [*tok.convert_tokens_to_ids(TWO_CALLS), eos]]
    steps = [step for chain in chains for step in zip(chain, chain[1:])]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for token, successor in steps:  # the EOS ends both chains: cleared once
            embed[token] = 0.0
            head[successor] = 0.0
        for k, (token, successor) in enumerate(steps):
            embed[token, k] = 10.0
            head[successor, k] = 100.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_server(tiny_model, tmp_path_factory):
    from server_harness import API_KEY, MODEL_NAME, ServerProcess

    root = tmp_path_factory.mktemp("tools")
    path = _scripted_model(tiny_model("qwen3"), root / "model")
    args = ["--model", str(path), "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
            "--data-dir", str(root / "data"), "--max-model-len", "256", "--num-kv-blocks", "128",
            "--num-threads", "1", "--log-level", "warning",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3"]  # fmt: skip
    proc = ServerProcess(args, root / "server.log").start(timeout=240)
    yield proc
    proc.stop()


def test_tool_calls_are_read_back_whole_and_streamed(tool_server):
    with tool_server.openai() as client:
        kwargs = dict(model=tool_server.model, messages=HI, tools=[WEATHER], temperature=0, max_tokens=12)
        whole = client.chat.completions.create(**kwargs, n=2)
        for choice in whole.choices:
            message = choice.message
            assert choice.finish_reason == "tool_calls" and message.content == "Let me check."
            assert message.reasoning_content == THOUGHT
            (call,) = message.tool_calls
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

        content, reasoning, calls, finish = "", "", [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                assert "<tool" not in (choice.delta.content or ""), "a call is never streamed as content"
                assert "think>" not in (choice.delta.content or "") + (
                    getattr(choice.delta, "reasoning_content", "") or ""
                )
                content += choice.delta.content or ""
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
        assert (reasoning, content, finish) == (THOUGHT, "Let me check.", "tool_calls")
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (0, "get_weather", {"city": "Paris", "days": 2})
        ]

        plain = client.chat.completions.create(**kwargs, tool_choice="none")
        assert (
            plain.choices[0].message.content == "".join(SCRIPT[3:])
            and not plain.choices[0].message.tool_calls
        )
        assert plain.choices[0].message.reasoning_content == THOUGHT
        assert plain.choices[0].finish_reason == "stop"


def test_tool_calls_are_read_back_where_the_tags_are_special_tokens(tiny_model, tmp_path, start_server):
    """A model whose tool call tags are special tokens (Hermes-2-Pro) still has its calls
    read back: a request parsed for tool calls keeps special tokens in its text, as vLLM's
    hermes parser has it."""
    path = _scripted_model(tiny_model("qwen3"), tmp_path / "model", special_tags=True)
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    server = start_server("--model", str(path), "--max-model-len", "256", "--num-kv-blocks", "64", *tools)
    with server.openai() as client:
        kwargs = dict(model=server.model, messages=HI, tools=[WEATHER], temperature=0, max_tokens=12)
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        whole = choice.message.tool_calls
        assert [json.loads(c.function.arguments) for c in whole] == [{"city": "Paris", "days": 2}]
        calls = [
            call
            for chunk in client.chat.completions.create(**kwargs, stream=True)
            for c in chunk.choices
            for call in c.delta.tool_calls or []
        ]
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris", "days": 2}]


@pytest.mark.parametrize(
    "parallel, cities", [(None, ["Rome", "Oslo"]), (True, ["Rome", "Oslo"]), (False, ["Rome"])]
)
def test_parallel_tool_calls_false_returns_only_the_first_call(tool_server, parallel, cities):
    """OpenAI's ``parallel_tool_calls: false`` (as vLLM honours it): at most one call comes
    back, whole and streamed, however many the model wrote."""
    template = TEMPLATE.replace("assistant\n{% endif %}", "assistant\n" + TWO_CALLS[0] + "{% endif %}")
    extra = {"chat_template": template} | ({} if parallel is None else {"parallel_tool_calls": parallel})
    with tool_server.openai() as client:
        kwargs = dict(model=tool_server.model, messages=HI, tools=[WEATHER], temperature=0, max_tokens=12,
                      extra_body=extra)  # fmt: skip
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls] == cities
        streamed = [
            call
            for chunk in client.chat.completions.create(**kwargs, stream=True)
            for c in chunk.choices
            for call in c.delta.tool_calls or []
        ]
        assert [(c.index, json.loads(c.function.arguments)["city"]) for c in streamed] == list(
            enumerate(cities)
        )


@pytest.mark.parametrize(
    "prompt_ends, reasoning, content",
    [
        ("<think>", THOUGHT, "".join(SCRIPT[3:])),  # the template opened the block (Qwen3-2507, R1)
        ("</think>", None, "".join(SCRIPT[3:])),  # thinking off: the block closed in the prompt
    ],
)
def test_reasoning_is_split_where_the_prompt_left_the_block(tool_server, prompt_ends, reasoning, content):
    """A response is reasoning up to </think> when its prompt left a <think> block open,
    and all content when the prompt closed it; streamed as whole."""
    template = TEMPLATE.replace("assistant\n{% endif %}", "assistant\n" + prompt_ends + "{% endif %}")
    with tool_server.openai() as client:
        kwargs = dict(model=tool_server.model, messages=HI, temperature=0, max_tokens=12,
                      extra_body={"chat_template": template})  # fmt: skip
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert (getattr(message, "reasoning_content", None), message.content) == (reasoning, content)
        assert getattr(message, "reasoning", None) == reasoning  # vLLM's name for it now
        streamed = dict.fromkeys(["reasoning_content", "reasoning", "content"], "")
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                for key in streamed:
                    streamed[key] += getattr(choice.delta, key, None) or ""
        thought = reasoning or ""
        assert streamed == {"reasoning_content": thought, "reasoning": thought, "content": content}


def test_include_reasoning_false_leaves_the_reasoning_out(tool_server):
    """vLLM's ``include_reasoning: false``: the response, whole or streamed, has no
    reasoning, and its content is what it would be with it."""
    with tool_server.openai() as client:
        kwargs = dict(model=tool_server.model, messages=HI, temperature=0, max_tokens=12,
                      extra_body={"include_reasoning": False})  # fmt: skip
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.content == "".join(SCRIPT[3:])
        assert getattr(message, "reasoning", None) is getattr(message, "reasoning_content", None) is None
        stream = client.chat.completions.create(**kwargs, stream=True)
        deltas = [c.delta for chunk in stream for c in chunk.choices]
        assert "".join(d.content or "" for d in deltas) == message.content
        assert not any(getattr(d, "reasoning", None) or getattr(d, "reasoning_content", None) for d in deltas)


def test_tools_and_earlier_tool_calls_reach_the_template(tool_server):
    """The tools are rendered into the prompt (the chat's prompt tokens are /tokenize's
    with them), and an assistant's earlier call, sent with its arguments as JSON text as
    OpenAI sends them, reaches the template as an object (not as a quoted string)."""
    turn = HI + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    with tool_server.http() as http:
        body = {"model": tool_server.model, "messages": turn, "max_tokens": 12, "temperature": 0}
        with_tools = http.post("/tokenize", json={**body, "tools": [WEATHER]}).json()
        without = http.post("/tokenize", json=body).json()
        assert with_tools["count"] > without["count"]
        rendered = http.post("/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
        assert 'Tools: get_weather({"type": "object", "properties": {"city"' in rendered
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
        resp = http.post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == with_tools["count"]
        assert resp.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    "extra, status, needle",
    [
        ({"tools": [WEATHER]}, 400, "--enable-auto-tool-choice"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, 400, "--enable-auto-tool-choice"),
        ({"tools": [WEATHER], "tool_choice": "none"}, 200, None),
        ({"tools": [WEATHER], "tool_choice": "required"}, 400, "not supported"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "named"),
        ({"tool_choice": "auto"}, 400, "needs tools"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, 400, "tool_choice must be"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, 400, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "none"}, 400, "tools"),
        ({"tools": [], "parallel_tool_calls": False}, 200, None),
    ],
)
def test_tool_choice_follows_vllms_rules_on_a_server_without_a_parser(http, model, extra, status, needle):
    body = {"model": model, "messages": HI, "max_tokens": 2, **extra}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == status, resp.text
    if needle is not None:
        error = resp.json()["error"]
        assert needle in error["message"] and error["param"].startswith("tool"), error


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("plain text", "plain text", []),
        (f"Sure.<tool_call>{CALL}</tool_call>", "Sure.", [("get_weather", {"city": "Paris", "days": 2})]),
        (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{{\"name\": \"f\", \"arguments\": {{}}}}",
         None, [("get_weather", {"city": "Paris", "days": 2}), ("f", {})]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
        ("Sure.<tool_call>{not json}</tool_call>", "Sure.<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ],
)  # fmt: skip
def test_the_hermes_parser_splits_content_from_calls(text, content, calls):
    parsed = HermesToolParser().parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_streamed_content_never_takes_back_text_and_stops_at_a_call():
    parser = HermesToolParser()
    text = f"Hi <tool <tool_call>{CALL}</tool_call>"
    ends = [parser.content_end(text[:n]) for n in range(len(text) + 1)]
    assert ends == sorted(ends), "content only grows"
    assert all(e <= len("Hi <tool ") for e in ends) and ends[-1] == len("Hi <tool ")
    assert parser.content_end("Hi <tool_ca") == len("Hi ")
    assert parser.parse(text).content == text[: ends[-1]]


def test_a_think_tag_a_message_quotes_opens_no_block(tool_server):
    """Only the template opens a reasoning block in the prompt: a user who writes "<think>"
    in a message does not turn the whole answer into reasoning."""
    parser = ThinkReasoningParser()
    asked = "What does <think> do?"
    prompt = f"user: {asked}\nassistant:"
    assert parser.opens(prompt) and not parser.opens(prompt, [asked])
    assert parser.opens(f"{prompt} <think>\n", [asked])  # the template's own tag still opens one
    template = TEMPLATE.replace("assistant\n{% endif %}", "assistant\n" + SCRIPT[3] + "{% endif %}")
    with tool_server.openai() as client:  # the model goes on after "Let me check.": no reasoning
        message = client.chat.completions.create(
            model=tool_server.model, messages=[{"role": "user", "content": asked}], temperature=0,
            max_tokens=12, extra_body={"chat_template": template},
        ).choices[0].message  # fmt: skip
    assert (getattr(message, "reasoning_content", None), message.content) == (None, "".join(SCRIPT[4:]))


@pytest.mark.parametrize(
    "prompt, text",
    [
        ("user: hi\nassistant:", f"<think>{THOUGHT}</think>\n\nSure.<tool_call>{CALL}</tool_call>"),
        ("assistant: <think>\n", f"{THOUGHT}</think>Sure."),
        ("assistant: <think>\n", "cut off while still thi"),
        ("assistant: <think>\n", f"<think>{THOUGHT}</think>Sure."),  # opened again by the response
        ("assistant: <think></think>", "<thinking is not a tag> and </think> is text here"),
        ("assistant:", "<thin"),
        ("assistant:", f"Plain <tool_call>{CALL}"),
        ("assistant:", "<think>a</think>b<tool_call>{broken</tool_call>"),
    ],
)
@pytest.mark.parametrize("reasoning", [False, True])
@pytest.mark.parametrize("tools", [False, True])
def test_streamed_parts_add_up_to_the_whole_responses(prompt, text, reasoning, tools):
    """Fed a response token by token (here: character by character), the splitter's
    deltas never show what the whole response would not, and add up to it."""

    def splitter() -> ChatOutputSplitter:
        think = ThinkReasoningParser() if reasoning else None
        prompt_open = think is not None and think.opens(prompt)
        return ChatOutputSplitter([], think, HermesToolParser() if tools else None, prompt_open)

    whole = splitter().parts(text)
    stream, got_reasoning, got_content, got_calls = splitter(), "", "", []
    for n in range(len(text) + 1):
        r, c, calls = stream.step(text[:n], n == len(text))
        got_reasoning, got_content, got_calls = got_reasoning + r, got_content + c, got_calls + calls
        assert (whole.reasoning or "").startswith(got_reasoning) and (whole.content or "").startswith(
            got_content
        )
    assert (got_reasoning, got_content, got_calls) == (
        whole.reasoning or "",
        whole.content or "",
        whole.tool_calls,
    )
    if not reasoning and not whole.tool_calls:
        assert whole.content == text and whole.reasoning is None
