"""SGLang's native /generate on a real server (both serving modes): the same tokens,
logprobs and refusals as /v1/completions, in SGLang's names and shapes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest_plugins = ["server_harness"]

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _generate(http, body: dict, status: int = 200):
    resp = http.post("/generate", json=body)
    assert resp.status_code == status, resp.text
    return resp.json()


def test_generate_gives_the_tokens_and_logprobs_completions_give(http, client, model):
    sampling = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    out = _generate(http, {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True,
                           "top_logprobs_num": 2, "return_text_in_logprobs": True})  # fmt: skip
    ref = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=9, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    meta = out["meta_info"]
    assert out["output_ids"] == ref.token_ids and out["text"] == ref.text
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 9)
    assert [e[1] for e in meta["output_token_logprobs"]] == ref.token_ids
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        ref.logprobs.token_logprobs, abs=1e-4
    )
    assert [e[2] for e in meta["output_token_logprobs"]] == ref.logprobs.tokens
    for tops, ref_tops in zip(meta["output_top_logprobs"], ref.logprobs.top_logprobs):
        assert len(tops) == 2 and tops[0][0] >= tops[1][0]
        shown = {e[2] for e in tops}
        assert {e[2]: e[0] for e in tops} == pytest.approx({k: v for k, v in ref_tops.items() if k in shown})
    plain = _generate(http, {"text": "Once upon", "sampling_params": {"max_new_tokens": 3}})
    assert (
        set(plain) == {"text", "output_ids", "meta_info"}
        and "output_token_logprobs" not in plain["meta_info"]
    )


def test_generate_scores_the_prompt_from_logprob_start_len(http, client, model):
    """logprob_start_len 0 with max_new_tokens 0 scores a prompt alone (no token shown),
    with the logprobs vLLM's prompt_logprobs gives; a later start gives the tail."""
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    out = _generate(http, body)
    assert out["text"] == "" and out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in scored] == PROMPT and scored[0][0] is None
    ref = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    ).choices[0].prompt_logprobs  # fmt: skip
    assert [e[0] for e in scored[1:]] == pytest.approx(
        [step[str(t)]["logprob"] for t, step in zip(PROMPT[1:], ref[1:])], abs=1e-4
    )
    tail = _generate(http, {**body, "logprob_start_len": 4})["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in tail] == PROMPT[4:] and [e[0] for e in tail] == pytest.approx(
        [e[0] for e in scored[4:]]
    )


def test_generate_batches_samples_and_stops_as_sglang_does(http, client, model):
    """A batch of prompts with n samples each comes back prompt-major, seeded as
    /v1/completions seeds them; stops report what matched."""
    sampling = {"max_new_tokens": 6, "n": 2, "sampling_seed": 13, "ignore_eos": True}
    outs = _generate(http, {"text": ["Hello there", "A story"], "sampling_params": sampling})
    assert isinstance(outs, list) and len(outs) == 4
    for p, prompt in enumerate(["Hello there", "A story"]):
        ref = client.completions.create(
            model=model, prompt=prompt, n=2, seed=13, max_tokens=6,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert [o["output_ids"] for o in outs[2 * p : 2 * p + 2]] == [c.token_ids for c in ref.choices]
    first = outs[0]["output_ids"]
    one = {**sampling, "n": 1}
    stopped = _generate(
        http, {"text": "Hello there", "sampling_params": {**one, "stop_token_ids": [first[2]]}}
    )
    want = first[: first.index(first[2]) + 1]
    assert stopped["output_ids"] == want
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2]}
    to_eos = {"logit_bias": {"0": 100.0}, "max_new_tokens": 4}  # token 0: the tiny model's EOS
    eos = _generate(http, {"text": "Hello", "sampling_params": to_eos})
    assert eos["output_ids"] == [0] and eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 0}
    text = outs[0]["text"]
    if len(text) > 4:
        by_text = _generate(http, {"text": "Hello there", "sampling_params": {**one, "stop": text[2:4]}})
        assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": text[2:4]}
        assert text[2:4] not in by_text["text"]


def test_generate_streams_its_answer_so_far(http):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 7, "sampling_seed": 3, "ignore_eos": True},
    }
    whole = _generate(http, body)
    events = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    ids = [c["output_ids"] for c in chunks]
    assert all(a == b[: len(a)] for a, b in zip(ids, ids[1:])), "cumulative, as SGLang streams"
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_generate_streams_a_text_that_only_grows(http):
    """A streamed answer's text never shows a character whose bytes are still coming (as
    SGLang holds it back) nor text a stop string may still cut: each event's text is a
    prefix of the final one. Byte tokens 130 and 105 spell "é" in the tiny tokenizer (the
    stop string matches at the start)."""
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logit_bias": {"130": 100, "105": 100}}  # fmt: skip
    for stop in ([], ["\u00e9\u00e9\u00e9"]):
        body = {"input_ids": PROMPT, "sampling_params": {**sampling, "stop": stop}}
        whole = _generate(http, body)
        with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        texts = [e["text"] for e in events]
        assert texts[-1] == whole["text"] == ("" if stop else "\u00e9" * 4)
        assert all(whole["text"].startswith(t) for t in texts), texts


def test_generate_streams_a_batch_of_unequal_n_under_its_answers_indices(http):
    """Each streamed output's index is its place in the whole answer's list, also when the
    batch's prompts ask for different n (no two outputs share one, none is skipped)."""
    each = [{"max_new_tokens": 3, "n": n, "sampling_seed": 5, "ignore_eos": True} for n in (3, 1)]
    body = {"text": ["Hello there", "A story"], "sampling_params": each}
    whole = _generate(http, body)
    last: dict[int, dict] = {}
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                before = last.get(chunk["index"])
                assert before is None or before["meta_info"]["finish_reason"] is None, "one output per index"
                last[chunk["index"]] = chunk
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["output_ids"] for i in range(4)] == [w["output_ids"] for w in whole]


def test_generate_answers_a_batch_of_one_as_a_batch(http):
    """A prompt sent as a list is a batch, as SGLang reads it: a list of answers back (and
    stream events with an index) even when it holds one prompt; an empty one is refused."""
    one = {"max_new_tokens": 2, "ignore_eos": True}
    for prompt in ({"text": ["Hello"]}, {"input_ids": [PROMPT]}):
        outs = _generate(http, {**prompt, "sampling_params": one})
        assert isinstance(outs, list) and len(outs) == 1 and len(outs[0]["output_ids"]) == 2
    with http.stream(
        "POST", "/generate", json={"text": ["Hello"], "sampling_params": one, "stream": True}
    ) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks and all(c["index"] == 0 for c in chunks)
    assert _generate(http, {"text": []}, 400)["error"]["param"] == "text"


def test_generate_fits_its_default_max_new_tokens_into_the_context(http):
    """Left unset, max_new_tokens (SGLang's 128) stops where the context ends, as SGLang's
    scheduler clamps it; set, it is refused when it cannot fit, as SGLang refuses it."""
    long = list(range(5, 5 + 450))  # 62 tokens of room in the 512-token context
    body = {"input_ids": long, "sampling_params": {"ignore_eos": True}}
    out = _generate(http, body)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 62}
    assert len(out["output_ids"]) == 62
    error = _generate(http, {**body, "sampling_params": {"max_new_tokens": 128}}, 400)["error"]
    assert error["param"] == "sampling_params.max_new_tokens"


def test_generate_batch_is_aborted_by_its_rid(server, http):
    """A batch sent with one rid is aborted by it: /abort_requests reaches every prompt's
    request (``<rid>-<i>``), as a completion's several prompts are reached by its id."""
    body = {"text": ["Tell me", "A story"], "rid": "gen-batch-abort",
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
    before = server.metrics()["generation_tokens_total"]
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_generate, server.http(), body)
        server.wait_until(lambda: server.metrics()["generation_tokens_total"] > before + 5, what="progress")
        resp = http.post("/abort_requests", json={"request_ids": ["gen-batch-abort"]})
        outs = fut.result(timeout=30)
    assert resp.json()["num_aborted"] == 2
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert [o["meta_info"]["id"] for o in outs] == ["gen-batch-abort-0", "gen-batch-abort-1"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "x", "input_ids": [1]}, "text"),
        ({"sampling_params": {}}, "text"),
        ({"text": "x", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
        ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
        ({"text": "x", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "x", "image_data": "cat.png"}, "image_data"),
        ({"text": ["x", "y"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["x", "y"], "rid": ["a"]}, "rid"),
        ({"text": ["x", "y"], "rid": ["a", "a"]}, "rid"),  # one id for two requests
        ({"input_ids": [1, -4]}, "input_ids"),
        ({"text": "x", "top_logprobs_num": 50, "return_logprob": True}, "top_logprobs_num"),
        ({"text": "x", "stream": True, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
        ({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 8}, "logprob_start_len"),
        ({"text": "x", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ([1, 2], "body"),
    ],
)
def test_generate_refuses_bad_input_by_name(http, body, param):
    error = _generate(http, body, 400)["error"]
    assert error["param"] == param or error["param"].startswith(param), error
    assert _generate(http, {"text": "still serving", "sampling_params": {"max_new_tokens": 2}})["output_ids"]
