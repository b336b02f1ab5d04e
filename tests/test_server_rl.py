"""The RL trainer endpoints: abort, pause modes, weight updates, sleep / wake-up, metrics."""

from __future__ import annotations

import importlib.metadata
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

pytest_plugins = ["server_harness"]

LONG = 400  # tokens: seconds of work on the tiny model, always cut short by the tests


@pytest.fixture(autouse=True)
def _running_afterwards(http):
    """A failed test must not leave the shared server paused or asleep."""
    yield
    http.post("/resume_generation")
    http.post("/wake_up")


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as ex:
        yield ex


def _long_completion(client, model, request_id=None, max_tokens=LONG):
    extra = {"ignore_eos": True, "return_token_ids": True}
    if request_id:
        extra["request_id"] = request_id
    return client.completions.create(model=model, prompt="Tell me", max_tokens=max_tokens, extra_body=extra)


def _wait_running(server, what="a running request"):
    server.wait_until(
        lambda: server.metrics()["num_requests_running"] >= 1 and server.metrics()["generation_tokens_total"],
        what=what,
    )


def test_abort_by_id_returns_partial_tokens(server, client, http, model, pool):
    before = server.metrics()["generation_tokens_total"]
    fut = pool.submit(_long_completion, client, model, "rl-abort-1")
    server.wait_until(lambda: server.metrics()["generation_tokens_total"] > before + 5, what="progress")
    resp = http.post("/abort_requests", json={"request_ids": ["rl-abort-1"]})
    assert resp.status_code == 200 and resp.json()["num_aborted"] == 1
    choice = fut.result(timeout=30).choices[0]
    assert choice.finish_reason == "abort"
    assert 0 < len(choice.token_ids) < LONG
    assert http.post("/abort_requests", json={}).status_code == 400  # neither ids nor all


def test_abort_all_streaming(server, client, http, model):
    stream = client.completions.create(
        model=model,
        prompt="Go",
        n=2,
        max_tokens=LONG,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens, finish, aborted = {0: 0, 1: 0}, {}, False
    for chunk in stream:
        for c in chunk.choices:
            tokens[c.index] += len(c.token_ids)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        if sum(tokens.values()) >= 6 and not aborted:
            aborted = True
            assert http.post("/abort_requests", json={"all": True}).json()["num_aborted"] == 1
    assert finish == {0: "abort", 1: "abort"}
    assert all(0 < n < LONG for n in tokens.values())


def test_pause_abort_holds_new_requests_until_resume(server, client, http, model, pool):
    fut = pool.submit(_long_completion, client, model)
    _wait_running(server)
    assert http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    choice = fut.result(timeout=30).choices[0]
    assert choice.finish_reason == "abort" and 0 < len(choice.token_ids) < LONG
    held = pool.submit(_long_completion, client, model, None, 5)
    server.wait_until(lambda: server.metrics()["num_requests_held"] == 1, what="a held request")
    assert not held.done()
    assert http.post("/resume_generation").status_code == 200
    assert held.result(timeout=30).choices[0].finish_reason == "length"


def test_pause_keep_freezes_and_continues(server, client, http, model):
    stream = client.completions.create(
        model=model,
        prompt="Keep",
        max_tokens=60,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens, finish, paused = [], None, False
    for chunk in stream:
        tokens += chunk.choices[0].token_ids
        finish = chunk.choices[0].finish_reason or finish
        if len(tokens) >= 5 and not paused:
            paused = True
            assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
            frozen = server.metrics()
            assert frozen["paused"] == 1
            held = frozen["num_requests_running"] + frozen["num_requests_waiting"]
            if server.mode == "rollout":  # between two chunks it waits in the Request Buffer
                assert held == 1
            else:
                assert frozen["num_requests_running"] == 1 and held == 1
            time.sleep(0.2)
            assert server.metrics()["generation_tokens_total"] == frozen["generation_tokens_total"]
            assert http.post("/resume_generation").status_code == 200
    assert finish == "length" and len(tokens) == 60  # nothing lost, nothing recomputed


def test_pause_wait_lets_requests_finish(server, client, http, model):
    stream = client.completions.create(
        model=model,
        prompt="Wait",
        max_tokens=120,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = iter(stream)
    tokens = list(next(chunks).choices[0].token_ids)  # running now
    assert http.post("/pause_generation", json={"mode": "wait"}).status_code == 200
    assert server.metrics()["num_requests_running"] == 0  # returned once in-flight work finished
    last = None
    for chunk in chunks:
        tokens += chunk.choices[0].token_ids
        last = chunk.choices[0].finish_reason or last
    assert last == "length" and len(tokens) == 120
    assert http.post("/resume_generation").status_code == 200
    assert http.post("/pause_generation", json={"mode": "later"}).status_code == 400


def test_update_weights_changes_outputs_and_version(server, server_models, client, http, model):
    greedy = dict(
        model=model, prompt="Weights", max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    before = client.completions.create(**greedy).choices[0].text
    version = http.get("/get_weight_version").json()["weight_version"]
    resp = http.post(
        "/update_weights_from_disk", json={"model_path": str(server_models[1]), "weight_version": "v2"}
    )
    assert resp.status_code == 200 and resp.json()["weight_version"] == "v2"
    assert http.get("/get_weight_version").json()["weight_version"] == "v2"
    assert client.completions.create(**greedy).choices[0].text != before
    resp = http.post("/update_weights_from_disk", json={"model_path": str(server_models[0])})
    assert resp.status_code == 200 and resp.json()["weight_version"] not in (version, "v2")
    assert client.completions.create(**greedy).choices[0].text == before


def test_update_weights_refuses_wrong_checkpoints(
    server, server_models, tiny_model, client, http, model, tmp_path
):
    version = http.get("/get_weight_version").json()["weight_version"]
    resp = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent/model"})
    assert resp.status_code == 400 and "not a directory" in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "model_path"
    other = tiny_model("qwen3", hidden_size=32, num_layers=1)
    resp = http.post("/update_weights_from_disk", json={"model_path": str(other)})
    assert resp.status_code == 400 and "hidden_size" in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "model_path"
    scaled = tiny_model("qwen3", rope_scaling={"rope_type": "linear", "factor": 2.0})  # same shapes
    resp = http.post("/update_weights_from_disk", json={"model_path": str(scaled)})
    assert resp.status_code == 400 and "rope_scaling" in resp.json()["error"]["message"]
    import shutil

    broken = tmp_path / "broken"  # a damaged checkpoint: a 400 naming the file, not a 500
    shutil.copytree(server_models[0], broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors" * 8)
    resp = http.post("/update_weights_from_disk", json={"model_path": str(broken)})
    assert resp.status_code == 400 and "cannot read weights from" in resp.json()["error"]["message"], (
        resp.text
    )
    (broken / "config.json").write_text("[]")
    resp = http.post("/update_weights_from_disk", json={"model_path": str(broken)})
    assert resp.status_code == 400 and "not an object" in resp.json()["error"]["message"], resp.text
    assert http.get("/get_weight_version").json()["weight_version"] == version
    assert http.post("/update_weights_from_disk", json={"path": "x"}).status_code == 400
    assert client.completions.create(model=model, prompt="ok", max_tokens=2).choices[0].text is not None


def test_sleep_and_wake_up(server, client, http, model, pool):
    fut = pool.submit(_long_completion, client, model, "rl-sleep-1")
    _wait_running(server)
    resp = http.post("/sleep")
    assert resp.status_code == 409 and "in flight" in resp.json()["error"]["message"]
    http.post("/abort_requests", json={"request_ids": ["rl-sleep-1"]})
    assert fut.result(timeout=30).choices[0].finish_reason == "abort"
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep").status_code == 200
    assert server.metrics()["sleeping"] == 1 and http.get("/is_sleeping").json() == {"is_sleeping": True}
    held = pool.submit(_long_completion, client, model, None, 4)  # waits for the wake-up
    server.wait_until(lambda: server.metrics()["num_requests_held"] == 1, what="a held request")
    assert http.post("/wake_up").status_code == 200
    assert held.result(timeout=30).choices[0].finish_reason == "length"
    assert client.completions.create(model=model, prompt="awake", max_tokens=3).usage.completion_tokens == 3


def test_sglangs_names_for_the_rl_endpoints(server, client, http, model, pool):
    """SGLang's /abort_request (rid or abort_all), pause modes in_place / retract (held,
    then continued: nothing lost), /continue_generation, /release_memory_occupation and
    /resume_memory_occupation act as their vLLM-named twins."""
    assert http.post("/abort_request", json={}).json()["num_aborted"] == 0  # SGLang: a no-op
    fut = pool.submit(_long_completion, client, model, "rl-sglang-1")
    _wait_running(server)
    assert http.post("/abort_request", json={"rid": "rl-sglang-1"}).json()["num_aborted"] == 1
    assert fut.result(timeout=30).choices[0].finish_reason == "abort"
    fut = pool.submit(_long_completion, client, model)
    _wait_running(server)
    assert http.post("/abort_request", json={"abort_all": True}).json()["num_aborted"] == 1
    assert fut.result(timeout=30).choices[0].finish_reason == "abort"
    for mode in ("in_place", "retract"):
        assert http.post("/pause_generation", json={"mode": mode}).json() == {"success": True, "mode": mode}
        held = pool.submit(_long_completion, client, model, None, 5)
        server.wait_until(lambda: server.metrics()["num_requests_held"] == 1, what="a held request")
        assert server.metrics()["paused"] == 1 and not held.done()
        assert http.post("/continue_generation").status_code == 200
        choice = held.result(timeout=30).choices[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == 5
    assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/resume_memory_occupation", json={"tags": None}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_a_request_id_that_two_requests_share_aborts_both(server, client, http, model, pool):
    """A completion of several prompts runs as <id>-0, <id>-1, ..., so a one-prompt request
    may carry the same request_id meanwhile (its engine request is <id> itself). Aborting the
    id reaches both, and one of them ending (here: its client hanging up) does not unlink the
    other from it. Everything is held by a keep pause, so no request finishes on its own."""
    rid = "rl-shared-id"
    held = lambda n: lambda: server.metrics()["num_requests_held"] == n  # noqa: E731
    body = {"ignore_eos": True, "request_id": rid}
    assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
    several = pool.submit(
        client.completions.create, model=model, prompt=["a", "b"], max_tokens=LONG, extra_body=body
    )
    server.wait_until(held(2), what="the two-prompt request held")
    stream = {"model": model, "prompt": "c", "max_tokens": LONG, "stream": True, **body}
    with http.stream("POST", "/v1/completions", json=stream) as resp:  # hangs up once held
        assert resp.status_code == 200
        server.wait_until(held(3), what="the streamed request held")
    server.wait_until(held(2), what="the hung-up request dropped")
    one = pool.submit(client.completions.create, model=model, prompt="d", max_tokens=LONG, extra_body=body)
    server.wait_until(held(3), what="the one-prompt request held")
    assert http.post("/abort_requests", json={"request_ids": [rid]}).json()["num_aborted"] == 3
    assert http.post("/resume_generation").status_code == 200
    assert [c.finish_reason for c in several.result(timeout=30).choices] == ["abort", "abort"]
    assert one.result(timeout=30).choices[0].finish_reason == "abort"


def test_an_id_in_use_is_refused_by_name(server, client, http, model, pool):
    """A request_id that a live request carries, or (rollout mode, where the Request Buffer
    groups by it) a group_id that a live request of another prompt names, is refused with
    that param. A keep pause holds everything, so nothing finishes on its own."""
    held = lambda n: lambda: server.metrics()["num_requests_held"] == n  # noqa: E731
    body = {"ignore_eos": True, "request_id": "rl-taken", "group_id": "rl-group"}
    assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
    first = pool.submit(client.completions.create, model=model, prompt="a", max_tokens=LONG, extra_body=body)
    server.wait_until(held(1), what="the first request held")
    with pytest.raises(openai.BadRequestError) as taken:
        client.completions.create(model=model, prompt="a", max_tokens=4, extra_body=body)
    assert taken.value.body["param"] == "request_id", taken.value.body
    assert taken.value.body["message"] == "request id 'rl-taken' is already in use"
    other = {"ignore_eos": True, "request_id": "rl-other", "group_id": "rl-group"}
    second = pool.submit(client.completions.create, model=model, prompt="b", max_tokens=4, extra_body=other)
    server.wait_until(held(2), what="the second request held")
    assert http.post("/resume_generation").status_code == 200  # admitted in order: the first, then it
    if server.mode == "rollout":
        with pytest.raises(openai.BadRequestError) as clash:
            second.result(timeout=30)
        assert clash.value.body["param"] == "group_id", clash.value.body
        assert (
            clash.value.body["message"]
            == "group_id 'rl-group' is already used by a request with a different prompt"
        )
    else:
        assert second.result(timeout=30).choices[0].finish_reason == "length"
    assert http.post("/abort_requests", json={"request_ids": ["rl-taken"]}).json()["num_aborted"] == 1
    assert first.result(timeout=30).choices[0].finish_reason == "abort"


def test_client_disconnect_aborts(server, http, model):
    body = {"model": model, "prompt": "bye", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk
    server.wait_until(lambda: server.metrics()["num_requests_running"] == 0, what="the abort")


def test_metrics_and_flush_cache(server, http, client, model):
    # A repeating prompt: the group's suffix tree matches its tail, so rollout mode drafts.
    client.completions.create(model=model, prompt=[5, 6, 7, 8] * 6, n=4, max_tokens=24, temperature=0)
    assert http.post("/flush_cache").status_code == 200
    assert http.post("/reset_prefix_cache").status_code == 200  # vLLM's name
    assert http.get("/flush_cache").json() == {"success": True}  # SGLang takes GET too
    m = server.wait_until(
        lambda: (m := server.metrics())["num_requests_running"] == 0 and m, what="an idle engine"
    )
    for name in (
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "generation_tokens_per_second",
        "accepted_tokens_per_step",
    ):
        assert name in m
    if server.mode == "plain":  # no speculative decoding there; rollout mode runs seer's
        assert m["accepted_tokens_per_step"] == 0.0 and m["spec_decode_draft_tokens_total"] == 0
    else:
        assert m["spec_decode_draft_tokens_total"] > 0
        assert m["spec_decode_draft_tokens_total"] >= m["spec_decode_accepted_tokens_total"] >= 0
    assert m["kv_cache_free_blocks"] == m["kv_cache_total_blocks"] and m["kv_cache_usage_perc"] == 0.0
    assert m["generation_tokens_total"] > 0
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/version").json() == {"version": importlib.metadata.version("seer_engine")}
