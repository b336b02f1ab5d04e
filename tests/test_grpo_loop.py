"""examples/grpo_loop.py against a real ``seer_engine serve --rollout-mode`` on 127.0.0.1.

A tiny random model never solves a task, so the loop here adds the format bonus (an
answer could be read from the response, which random text sometimes gives): groups
then have mixed rewards, the policy-gradient step has a gradient, and the served
model's greedy output must change once the new weights are loaded.
"""

from __future__ import annotations

import importlib.util
import math
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest_plugins = ["server_harness"]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_loop.py"
API_KEY = "test-key"  # what the harness's start_server sets
SERVED = "tiny-test"


@pytest.fixture(scope="module")
def grpo():
    """The script as `python examples/grpo_loop.py` runs it: its folder first on the path,
    where it finds its parts (``examples/grpo/``)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("grpo_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_loop"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("grpo_loop", None)
    sys.path.remove(str(EXAMPLE.parent))


@pytest.fixture
def served(start_server, tiny_model):
    """A rollout-mode server of the tiny model (weights change, so each test gets its own)."""
    model = tiny_model("qwen3")
    proc = start_server("--model", str(model), "--rollout-mode", "--chunk-tokens", "16", "--max-model-len",
                        "512", "--num-kv-blocks", "256", "--num-threads", "1")  # fmt: skip
    return proc, model


def _greedy(server) -> list[str]:
    with server.http(API_KEY) as http:
        body = {"model": SERVED, "prompt": ["Mia has 3 apples.", "Then"], "max_tokens": 16,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def _version(server) -> int:
    with server.http(API_KEY) as http:
        value = http.get("/get_weight_version").json()["weight_version"]
    return int(value) if value.isdigit() else 0


def _config(grpo, proc, model, out: Path, **changes):
    cfg = grpo.GRPOConfig(
        server=proc.url, api_key=API_KEY, model=str(model), task="arith",
        knobs={"steps": 1, "max_operand": 10}, prompts=6, batch_prompts=4, n=8, iterations=2,
        max_tokens=24, temperature=1.0, lr=1e-3, format_bonus=1.0, out_dir=out, num_threads=1, seed=3,
    )  # fmt: skip
    return replace(cfg, **changes)


def _check_iterations(records, first_version: int, expected_prompts: list[list[str]]) -> None:
    assert [r["iteration"] for r in records] == [1, 2]
    assert [int(r["weight_version"]) for r in records] == [first_version + 1, first_version + 2]
    assert [r["prompts"] for r in records] == expected_prompts
    for r in records:
        assert r["responses"] == 4 * 8  # every prompt x n came back
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert 0 < r["mean_len"] <= r["max_len"] <= 24 and r["tokens"] > 0
        assert r["logp_gap"] < 1e-3  # the trainer's log-probabilities are the server's
    assert any(r["mixed_groups"] > 0 and r["grad_norm"] > 0 for r in records), records


def test_two_iterations_via_batch_then_completions(grpo, served, tmp_path):
    server, model = served
    before, version = _greedy(server), _version(server)
    records = grpo.run_grpo(_config(grpo, server, model, tmp_path / "batch"), log=lambda line: None)
    ids = [f"arith-3-{k}" for k in range(6)]
    _check_iterations(records, version, [ids[:4], ids[4:] + ids[:2]])  # prompts recur: an epoch of 6
    after_batch = _greedy(server)
    assert after_batch != before
    latest = Path(records[-1]["checkpoint"])
    assert (latest / "model.safetensors").is_file() and (latest / "tokenizer.json").is_file()
    assert not (tmp_path / "batch" / "iter-1").exists()  # earlier checkpoints are removed

    # The same loop through /v1/completions, the trainer starting from the served weights,
    # with a KL term to the starting policy and two gradient steps per rollout.
    cfg = _config(grpo, server, latest, tmp_path / "completions", via="completions", kl_coef=0.1, epochs=2)
    records = grpo.run_grpo(cfg, log=lambda line: None)
    _check_iterations(records, version + 2, [ids[:4], ids[4:] + ids[:2]])
    assert any(r["kl"] > 0 for r in records)
    assert _greedy(server) != after_batch


def test_server_errors_are_clear(grpo, served, tmp_path):
    server, model = served
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = [
        ({"server": closed}, "cannot reach the seer_engine server at " + closed),
        ({"api_key": "wrong"}, "HTTP 401"),
        ({"served_model": "nope"}, r"'nope' is not served here; the server serves \['tiny-test'\]"),
        ({"out_dir": in_the_way}, f"cannot make --out-dir '{in_the_way}'"),
    ]
    for changes, message in cases:
        cfg = _config(grpo, server, model, tmp_path / "err", iterations=1, **changes)
        with pytest.raises(grpo.GRPOError, match=message):
            grpo.run_grpo(cfg, log=lambda line: None)
    client = grpo.ServerClient(server.url, API_KEY, 30)
    with pytest.raises(grpo.GRPOError, match="weight update refused: .*HTTP 4"):
        client.update_weights(tmp_path / "missing")
    client.close()
    with pytest.raises(grpo.GRPOError, match="went from '3' to '5', expected '4'"):
        grpo.check_version("3", "5", "5")


def test_command_line_errors(grpo, capsys):
    for argv, message in [
        (["--batch-prompts", "9", "--prompts", "4"], "--batch-prompts (9) must be <= --prompts (4)"),
        (["--n", "1"], "--n must be >= 2"),
        (["--knob", "steps=x"], "knob steps wants int"),
        (["--temperature", "0"], "--temperature must be a finite number > 0"),
        (["--log-json", "/nonexistent-dir/log.json"], "cannot write --log-json '/nonexistent-dir/log.json'"),
    ]:
        assert grpo.main(argv) == 1
        assert message in capsys.readouterr().err
    assert grpo.group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert grpo.group_advantages([0.5, 0.5]) == [0.0, 0.0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--clip", "nan"], "--clip must be a finite number > 0, got nan"),
        (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number > 0, got nan"),
        (["--kl-coef", "nan"], "--kl-coef must be a finite number >= 0, got nan"),
        (["--temperature", "nan"], "--temperature must be a finite number > 0"),
        (["--temperature", "inf"], "--temperature must be a finite number > 0"),
        (["--format-bonus", "nan"], "--format-bonus must be a finite number, got nan"),
        (["--timeout-s", "0"], "--timeout-s must be a finite number > 0, got 0.0"),
        (["--timeout-s", "nan"], "--timeout-s must be a finite number > 0, got nan"),
        (["--num-threads", "0"], "--num-threads must be >= 1, got 0"),
    ],
)
def test_numeric_flags_that_make_no_sense_are_refused(grpo, argv, message, capsys):
    """Refused before the server is asked anything: a nan --lr turned every weight nan in the
    checkpoint the server then loaded, a nan --temperature or --format-bonus failed only
    after a rollout, and --num-threads 0 was taken as no setting."""
    assert grpo.main([*argv, "--server", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert message in err and "cannot reach" not in err


def test_the_server_may_be_given_as_an_openai_base_url(grpo, served, tmp_path):
    """``--server http://host:port/v1`` (the base URL OpenAI clients take) was joined with
    /v1/models and the RL routes: every call a 404 "Not Found" that did not say why."""
    server, _ = served
    client = grpo.ServerClient(server.url + "/v1/", API_KEY, 30)
    try:
        assert client.served_model() == SERVED and client.weight_version()
    finally:
        client.close()


def test_rewards_and_gradients_that_are_not_finite_stop_the_loop(grpo, tiny_model, tmp_path):
    """A reward function that returns nan or inf is named, not a crash deep in statistics;
    a step whose gradient is not finite leaves the weights as they were (they would be
    written to a checkpoint and loaded by the server)."""
    import torch
    from grpo.config import Sample

    for rewards in ([float("nan"), 1.0], [float("inf"), float("inf")], [1.0, -float("inf")]):
        with pytest.raises(grpo.GRPOError, match="rewards must be finite"):
            grpo.group_advantages(rewards)
    assert grpo.group_advantages([1e308, 1e308]) == [0.0, 0.0]
    assert grpo.group_advantages([1e308, -1e308]) == pytest.approx([1.0, -1.0])

    cfg = grpo.GRPOConfig(model=str(tiny_model("qwen3")), lr=1e-3, num_threads=1, out_dir=tmp_path)
    trainer = grpo.Trainer(Path(cfg.model), cfg)
    before = {n: p.detach().clone() for n, p in trainer.trainable.items()}
    sample = Sample([5, 6, 7], [8, 9], "", "length", [0.0, 0.0], advantage=float("inf"))
    with pytest.raises(grpo.GRPOError, match="gradient is not finite"):
        trainer.step([sample])
    assert all(torch.equal(p, before[n]) for n, p in trainer.trainable.items())


def test_the_kl_term_pulls_every_sample_not_only_those_with_an_advantage(grpo, tiny_model, tmp_path):
    """With --kl-coef, a group whose rewards are all equal still has a KL to the reference:
    the step's KL is the token mean of k3 over every sample (checked against a plain
    forward of the model and of its initial weights) and it moves the weights."""
    import torch
    from grpo.config import Sample
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen3")
    cfg = grpo.GRPOConfig(model=str(model), lr=1e-2, kl_coef=0.5, temperature=0.7, num_threads=1,
                          out_dir=tmp_path)  # fmt: skip
    trainer = grpo.Trainer(model, cfg)
    mixed = [
        Sample([5, 6, 7], [8, 9, 10], "", "length", [0.0] * 3, advantage=1.0),
        Sample([5, 6], [11, 12], "", "length", [0.0] * 2, advantage=-1.0),
    ]
    trainer.step(mixed)  # the policy leaves its reference
    equal = [
        Sample([5, 6, 7], [8, 9], "", "length", [0.0] * 2),
        Sample([9, 6], [11, 12, 13, 14], "", "length", [0.0] * 4),
    ]
    initial = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    k3 = []
    with torch.no_grad():
        for s in equal:
            ids = torch.tensor([s.prompt_ids + s.token_ids])
            target = torch.tensor(s.token_ids)[:, None]
            lp, ref = (
                torch.log_softmax(m(ids).logits[0, len(s.prompt_ids) - 1 : -1] / 0.7, -1).gather(1, target)
                for m in (trainer.model, initial)
            )
            k3 += (torch.exp(ref - lp) - (ref - lp) - 1).squeeze(1).tolist()
    before = {n: p.detach().clone() for n, p in trainer.trainable.items()}
    out = trainer.step(equal)
    assert out["kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-4) and out["kl"] > 0
    assert out["loss"] == pytest.approx(0.5 * out["kl"], rel=1e-4)
    assert not all(torch.equal(p, before[n]) for n, p in trainer.trainable.items())


def test_a_resumed_trainer_trains_as_one_that_went_on(grpo, tiny_model, tmp_path):
    """A checkpoint carries the optimizer's moments and the KL reference: a trainer resumed
    from it takes the same next step as the trainer that saved it, and keeps the first
    run's reference, not the checkpoint's weights. A checkpoint without that state, or
    one trained on other layers, is refused by name."""
    import torch
    from grpo.checkpoints import TRAINER_STATE_FILE
    from grpo.config import Sample

    model = str(tiny_model("qwen3"))
    cfg = grpo.GRPOConfig(model=model, lr=1e-2, kl_coef=0.5, num_threads=1, out_dir=tmp_path)
    first = grpo.Trainer(Path(cfg.model), cfg)
    initial = {n: p.detach().clone() for n, p in first.trainable.items()}
    batch = [
        Sample([5, 6, 7], [8, 9, 10], "", "length", [-2.0, -2.0, -2.0], advantage=1.0),
        Sample([5, 6, 7], [11, 12], "", "length", [-2.5, -2.5], advantage=-1.0),
    ]
    first.step(batch)
    checkpoint = first.save(tmp_path / "iter-1", 1)
    resumed = grpo.Trainer(checkpoint, replace(cfg, model=str(checkpoint), resume=True))
    assert all(torch.equal(resumed.reference[n], initial[n]) for n in initial)
    assert not all(torch.equal(p, initial[n]) for n, p in resumed.trainable.items()), "the step moved weights"
    first.step(batch)
    resumed.step(batch)
    for name, p in first.trainable.items():
        torch.testing.assert_close(resumed.trainable[name], p, rtol=0, atol=1e-6)
    fresh = grpo.Trainer(checkpoint, replace(cfg, model=str(checkpoint)))  # without --resume: no state read
    assert not all(torch.equal(fresh.reference[n], initial[n]) for n in initial)

    # The reference outlives runs without a KL term: a later one with it measures from it.
    no_kl = grpo.Trainer(checkpoint, replace(cfg, model=str(checkpoint), resume=True, kl_coef=0.0))
    again = no_kl.save(tmp_path / "iter-2", 2)
    with_kl = grpo.Trainer(again, replace(cfg, model=str(again), resume=True))
    assert all(torch.equal(with_kl.reference[n], initial[n]) for n in initial)
    state = torch.load(again / TRAINER_STATE_FILE, weights_only=True)
    torch.save({**state, "reference": None}, again / TRAINER_STATE_FILE)  # as an older loop saved it
    with pytest.raises(grpo.GRPOError, match="holds no KL reference"):
        grpo.Trainer(again, replace(cfg, model=str(again), resume=True))
    assert grpo.Trainer(again, replace(cfg, model=str(again), resume=True, kl_coef=0.0)).reference is None

    (checkpoint / TRAINER_STATE_FILE).rename(tmp_path / "state.pt")
    with pytest.raises(grpo.GRPOError, match="grpo_trainer_state.pt is missing"):
        grpo.Trainer(checkpoint, replace(cfg, resume=True))
    (tmp_path / "state.pt").rename(checkpoint / TRAINER_STATE_FILE)
    with pytest.raises(grpo.GRPOError, match="the same --train-layers"):
        grpo.Trainer(checkpoint, replace(cfg, resume=True, train_layers=1))


def test_a_loop_whose_server_dies_keeps_its_log_and_says_where_to_resume(
    grpo, served, tmp_path, monkeypatch, capsys
):
    """The server killed during the second weight update: the loop stops with the error,
    names the checkpoint the server last took (what to resume from), and --log-json
    still holds the iterations that were done."""
    import json

    server, model = served
    real_update, calls = grpo.ServerClient.update_weights, []

    def update_then_die(self, path):
        calls.append(path)
        if len(calls) == 2:
            server.kill()
        return real_update(self, path)

    monkeypatch.setattr(grpo.ServerClient, "update_weights", update_then_die)
    log, out = tmp_path / "log.json", tmp_path / "out"
    argv = ["--server", server.url, "--api-key", API_KEY, "--model", str(model), "--knob", "steps=1",
            "--prompts", "2", "--batch-prompts", "2", "--n", "2", "--iterations", "3", "--max-tokens", "8",
            "--out-dir", str(out), "--num-threads", "1", "--log-json", str(log)]  # fmt: skip
    assert grpo.main(argv) == 1
    err = capsys.readouterr().err
    assert "cannot reach the seer_engine server" in err
    assert f"resume with --model {out / 'iter-1'} --resume" in err
    saved = json.loads(log.read_text())
    assert [r["iteration"] for r in saved["iterations"]] == [1]
    assert saved["iterations"][0]["checkpoint"] == str(out / "iter-1") and "cannot reach" in saved["error"]


def test_an_interrupted_loop_stops_its_batch_and_resumes_from_its_checkpoint(
    grpo, served, tmp_path, monkeypatch
):
    """Ctrl-C while the batch runs cancels it on the server (its work would hold up the
    next run); the loop restarted from its latest checkpoint, in the same --out-dir,
    overwrites and removes that folder as it goes and still runs to the end."""
    import shutil

    server, model = served
    client = grpo.ServerClient(server.url, API_KEY, 30)
    body = {"model": SERVED, "prompt": list(range(10, 30)), "n": 8, "max_tokens": 400, "temperature": 1.0,
            "ignore_eos": True, "seed": 1}  # fmt: skip

    real_sleep, slept = grpo.time.sleep, []

    def interrupt(seconds: float) -> None:  # Ctrl-C in the first wait between polls
        slept.append(seconds)
        if len(slept) == 1:
            raise KeyboardInterrupt
        real_sleep(seconds)

    with monkeypatch.context() as patch:
        patch.setattr(grpo.time, "sleep", interrupt)
        with pytest.raises(KeyboardInterrupt):
            client.batch([body, body])
    with server.http(API_KEY) as http:
        batches = http.get("/v1/batches").json()["data"]
        files = http.get("/v1/files").json()["data"]
    assert len(batches) == 1 and batches[0]["status"] == "cancelled"
    # Its files are deleted too: the input file was left (the server refuses to delete it
    # until the batch has ended, and the loop did not wait), and the error file the cancel writes.
    assert files == []
    client.close()

    out = tmp_path / "out"
    shutil.copytree(model, out / "iter-1")  # the checkpoint an earlier run left
    cfg = _config(grpo, server, out / "iter-1", out, iterations=3, batch_prompts=2, n=4, max_tokens=8)
    records = grpo.run_grpo(cfg, log=lambda line: None)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert sorted(p.name for p in out.iterdir()) == ["iter-3"]
    assert (out / "iter-3" / "tokenizer.json").is_file() and (out / "iter-3" / "config.json").is_file()


def test_a_loop_resumed_from_its_checkpoint_goes_on_with_the_next_iteration(grpo, served, tmp_path):
    """A checkpoint records the iteration it ends: the loop resumed from it (--resume) runs
    the iterations left of --iterations (with their prompts), supersedes it in --out-dir;
    one that has nothing left to run, or weights that are no checkpoint, say so."""
    server, model = served
    out = tmp_path / "out"
    first = grpo.run_grpo(_config(grpo, server, model, out, iterations=1), log=lambda line: None)
    assert [r["iteration"] for r in first] == [1] and grpo.iterations_done(out / "iter-1") == 1
    with pytest.raises(grpo.GRPOError, match=r"holds checkpoints of another run \(iter-1\) that this run"):
        grpo.run_grpo(_config(grpo, server, model, out, iterations=1), log=lambda line: None)
    assert grpo.iterations_done(out / "iter-1") == 1  # refused before it wrote anything
    cfg = _config(grpo, server, out / "iter-1", out, iterations=3, resume=True)
    resumed = grpo.run_grpo(cfg, log=lambda line: None)
    assert [r["iteration"] for r in resumed] == [2, 3]
    ids = [f"arith-3-{k}" for k in range(6)]  # an epoch of 6 prompts, 4 per iteration
    assert [r["prompts"] for r in resumed] == [ids[4:] + ids[:2], ids[2:]]
    assert sorted(p.name for p in out.iterdir()) == ["iter-3"] and grpo.iterations_done(out / "iter-3") == 3
    with pytest.raises(grpo.GRPOError, match="ends iteration 3: --iterations 3 .* leaves nothing to run"):
        grpo.run_grpo(replace(cfg, model=str(out / "iter-3")), log=lambda line: None)
    with pytest.raises(grpo.GRPOError, match="it is not a checkpoint of this loop"):
        grpo.run_grpo(replace(cfg, model=str(model)), log=lambda line: None)


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_loop_stopped_by_a_signal_keeps_its_log_and_says_where_to_resume(
    grpo, stop, tmp_path, monkeypatch, capsys
):
    """SIGTERM (what a scheduler or `timeout` sends) killed the loop outright: no --log-json,
    no word of where to resume, its batch left running. It now stops as Ctrl-C does, and
    both say where to resume instead of a traceback."""
    import json
    import os
    import signal
    import time

    def run_then_stop(cfg, records):
        records.append({"iteration": 1, "checkpoint": str(tmp_path / "out" / "iter-1")})
        os.kill(os.getpid(), getattr(signal, stop))
        time.sleep(5)  # the signal lands here
        raise AssertionError("the signal did not stop the loop")

    monkeypatch.setattr(grpo, "run_grpo", run_then_stop)
    log = tmp_path / "log.json"
    before = signal.getsignal(signal.SIGTERM)
    assert grpo.main(["--log-json", str(log), "--out-dir", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert "grpo_loop: interrupted" in err and "Traceback" not in err
    assert f"resume with --model {tmp_path / 'out' / 'iter-1'} --resume" in err
    saved = json.loads(log.read_text())
    assert [r["iteration"] for r in saved["iterations"]] == [1] and saved["error"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is before  # put back as it was


def test_the_resume_a_refused_update_names_is_not_refused(grpo, served, tmp_path, monkeypatch, capsys):
    """A refused weight update left its checkpoint (iter-2) in --out-dir; the loop said
    resume from iter-1, the one the server took, and that resume was then refused as
    "--out-dir holds checkpoints of another run (iter-2)". The checkpoint the server did
    not take is removed, as is the .partial folder of a save that was stopped."""
    server, model = served
    real_update, calls = grpo.ServerClient.update_weights, []

    def refuse_the_second(self, path):
        calls.append(path)
        if len(calls) == 2:
            raise grpo.GRPOError("weight update refused: HTTP 400 from POST /update_weights_from_disk: no")
        return real_update(self, path)

    out = tmp_path / "out"
    argv = ["--server", server.url, "--api-key", API_KEY, "--knob", "steps=1", "--prompts", "2",
            "--batch-prompts", "2", "--n", "2", "--iterations", "3", "--max-tokens", "8",
            "--out-dir", str(out), "--num-threads", "1"]  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(grpo.ServerClient, "update_weights", refuse_the_second)
        assert grpo.main([*argv, "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert "weight update refused" in err and f"resume with --model {out / 'iter-1'} --resume" in err
    assert sorted(p.name for p in out.iterdir()) == ["iter-1"]
    (out / "iter-2.partial").mkdir()
    (out / "iter-2.partial" / grpo.PROGRESS_FILE).write_text('{"iteration": 2}\n')
    assert grpo.main([*argv, "--model", str(out / "iter-1"), "--resume"]) == 0, capsys.readouterr().err
    assert grpo.iterations_done(out / "iter-3") == 3
