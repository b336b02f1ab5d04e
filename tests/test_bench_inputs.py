"""``seer_engine bench rollout --trace`` on odd inputs: a clear error naming the problem
before any model is made, the trace read as ``simulate`` reads it, and a report that
names what it replayed."""

from __future__ import annotations

import json
import shlex

import pytest

import seer_engine.workloads.traces as traces
from seer_engine.entrypoints.cli import main

BENCH = ["bench", "rollout", "--groups", "1", "--samples", "1", "--max-tokens", "2", "--instances", "1",
         "--distributed-backend", "inproc", "--kv-connector", "none", "--clock", "moonlight"]  # fmt: skip


def _error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


class _Stop(ValueError):
    """Raised by a stand-in for ``load_trace``: what it was called with is all a test needs."""


@pytest.fixture
def loads(monkeypatch) -> list[tuple]:
    """The calls ``bench rollout`` makes to ``load_trace``, each stopping the command there."""
    calls = []

    def stand_in(path, tokenizer=None, **kw):
        calls.append((str(path), tokenizer))
        raise _Stop("stopped after load_trace")

    monkeypatch.setattr(traces, "load_trace", stand_in)
    return calls


@pytest.mark.parametrize(
    "args,message",
    [
        (["--samples", "0"], "--samples must be >= 1, got 0"),
        (["--starvation-s", "-1"], "--starvation-s must be >= 0"),
        (["--starvation-s", "nan"], "--starvation-s must be >= 0, got nan"),
        (["--context-order", "longest"], "--context-order: invalid choice: 'longest'"),
        (["--policy", "seer+history,baseline,seer+history"], "--policy names seer+history more than once"),
        (["--tokenizer", "/nonexistent/tok.json"], "tokenizer '/nonexistent/tok.json' not found"),
        (["--report", "/dev/null"], "--report '/dev/null' is not a directory this run can write to"),
        (["--history", "/dev/null"], "--history '/dev/null' is not a directory this run can write to"),
        (["--seed", "3"], "--seed and --temperature go with --task: a trace replay emits the trace's tokens"),
        (["--policy", "baseline,oracle", "--context-order", "estimate"], "--context-order sets the Context"),
        (["--policy", "divided", "--starvation-s", "9"], "--starvation-s sets the Context Manager's"),
        (["--temperature", "1.0"], "--seed and --temperature go with --task"),
        (
            ["--model", "tiny", "--layers", "4"],
            "--layers and --hidden shape the replay model made without --model",
        ),
        (["--model", "tiny", "--hidden", "32"], "--layers and --hidden shape the replay model made without"),
        # named only after the trace was read and a replay model made for it
        (["--chunk-tokens", "0"], "--chunk-tokens must be >= 1, got 0"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--instances", "0"], "--instances must be >= 1, got 0"),
        (["--kv-pool-gib", "0"], "--kv-pool-gib must be a finite number > 0, got 0.0"),
        (["--migration-spread", "-1"], "--migration-spread and --pool-pull-tokens must be >= 0"),
        (["--kv-blocks", "0"], "num_kv_blocks must be a positive integer, got 0"),
        (["--block-size", "3"], "block_size must be a power of two, got 3"),
        (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer, got 0"),
        (["--num-threads", "0"], "num_threads must be a positive integer, got 0"),
    ],
)
def test_bench_names_bad_arguments_before_loading(args, message, tmp_path, capsys, loads):
    trace = tmp_path / "t.jsonl.gz"
    trace.write_bytes(b"")
    assert message in _error([*BENCH, "--trace", str(trace), *args], capsys)
    assert loads == []


def test_the_trace_is_tokenized_with_the_given_tokenizer(tmp_path, capsys, loads):
    trace, tokenizer = tmp_path / "t.jsonl.gz", tmp_path / "other-tokenizer.json"
    trace.write_bytes(b"")
    tokenizer.write_text("{}")
    assert "stopped after load_trace" in _error(
        [*BENCH, "--trace", str(trace), "--tokenizer", str(tokenizer)], capsys
    )
    assert loads == [(str(trace), str(tokenizer))]  # the tokenizer the replay model is made with


def test_a_trace_name_is_found_in_the_traces_folder(tmp_path, monkeypatch, capsys, loads):
    """As ``simulate --trace NAME`` finds it."""
    monkeypatch.setenv("SEER_TRACES_DIR", str(tmp_path))
    (tmp_path / "t.jsonl.gz").write_bytes(b"")
    (tmp_path / "bpe32k-tokenizer.json").write_text("{}")
    assert "stopped after load_trace" in _error([*BENCH, "--trace", "t"], capsys)
    assert loads == [(str(tmp_path / "t.jsonl.gz"), str(tmp_path / "bpe32k-tokenizer.json"))]


def test_a_file_that_is_not_a_gzip_trace_is_named(tmp_path, capsys, game24_trace):
    notes = tmp_path / "notes.md"
    notes.write_text("# not a trace\n")
    tokenizer = game24_trace.parent / "bpe32k-tokenizer.json"
    err = _error([*BENCH, "--trace", str(notes), "--tokenizer", str(tokenizer)], capsys)
    assert f"{notes}: not a gzip JSON-lines trace" in err


def test_the_report_names_the_trace_it_replayed(tmp_path, game24_trace):
    args = [*BENCH, "--trace", str(game24_trace), "--policy", "baseline", "--layers", "1", "--hidden", "32"]
    (tmp_path / "lengths.png").write_bytes(b"a --task run's")  # stood beside a report of the trace
    assert main([*args, "--report", str(tmp_path)]) == 0
    assert not (tmp_path / "lengths.png").exists()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["trace"] == str(game24_trace) and report["meta"]["groups"] == 1
    assert report["meta"]["command"] == shlex.join(["seer_engine", *args, "--report", str(tmp_path)])
    assert report["policies"]["baseline"]["output_tokens"] == 2


def test_the_replay_model_made_for_the_run_is_removed_after_it(tmp_path, monkeypatch, game24_trace):
    """Without --model a tiny random model is written for the run: it was left in the
    temporary folder (megabytes per run, for ever), and the report named its path."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    args = [*BENCH, "--trace", str(game24_trace), "--policy", "baseline", "--layers", "1", "--hidden", "32"]
    assert main([*args, "--report", str(tmp_path / "report")]) == 0
    assert list(scratch.iterdir()) == []
    meta = json.loads((tmp_path / "report" / "report.json").read_text())["meta"]
    assert meta["model"] == "tiny random qwen3 (1 layers, hidden 32, the trace tokenizer)"


@pytest.mark.parametrize("policy", ["baseline", "context"])
def test_a_response_no_instance_can_hold_is_named_not_run_forever(policy, capsys, game24_trace):
    """A trace response whose prompt and tokens outgrow an instance's whole KV cache can
    never finish (the baseline's engine preempted and re-admitted it forever): refused
    before any model is made, naming --kv-blocks."""
    args = [*BENCH, "--trace", str(game24_trace), "--policy", policy, "--kv-blocks", "1"]
    err = _error(args, capsys)
    assert "--kv-blocks 1 (16 tokens per instance) cannot hold response t" in err
    assert "27-token prompt and 2 tokens need KV for 28; raise --kv-blocks" in err
    assert "Traceback" not in err


def test_a_tokenizer_that_is_not_a_tokenizer_json_is_named(tmp_path, capsys, game24_trace):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("")
    err = _error([*BENCH, "--trace", str(game24_trace), "--tokenizer", str(tokenizer)], capsys)
    assert f"{tokenizer} is not a tokenizer.json file" in err and "Traceback" not in err


def test_a_history_dir_written_under_another_tokenizer_is_refused(tmp_path, capsys, game24_trace):
    """As rollout and serve refuse it: its keys are other prompts' token ids. It was
    loaded, used and saved back mixed with the trace tokenizer's prompts."""
    from seer_engine.rollout.config import HISTORY_FILE
    from seer_engine.rollout.history import HistoryStore

    store = HistoryStore()
    store.bind_tokenizer("1024:another-tokenizer", 1024)
    (tmp_path / "context+history").mkdir()
    store.save(tmp_path / "context+history" / HISTORY_FILE)
    args = [*BENCH, "--trace", str(game24_trace), "--policy", "context+history", "--history", str(tmp_path)]
    err = _error(args, capsys)
    assert "the history store was written under another tokenizer (1024:another-tokenizer" in err


def test_a_model_that_names_no_eos_is_refused_by_name(tmp_path, capsys, game24_trace):
    """A trace replay ends each response with the model's EOS id: a model whose configs name
    none in its vocabulary gets an error naming the folder, not min()'s empty sequence."""
    from seer_engine.model_executor.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m", tokenizer=game24_trace.parent / "bpe32k-tokenizer.json",
                            num_layers=1, hidden_size=32)  # fmt: skip
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": config["vocab_size"] + 1}))
    (model / "generation_config.json").unlink(missing_ok=True)
    args = [*BENCH, "--trace", str(game24_trace), "--policy", "baseline", "--model", str(model)]
    err = _error(args, capsys)
    assert f"{model}: neither config.json nor generation_config.json names an EOS token id" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag,value", [("--block-size", "0"), ("--kv-blocks", "0")])
def test_task_bench_names_a_bad_cache_shape(flag, value, tiny_model, capsys):
    """``--task`` built its request checker from these before any engine checked them:
    ``--block-size 0`` was a ZeroDivisionError traceback."""
    no_groups = [*BENCH[:2], *BENCH[4:]]  # --groups goes with --trace
    args = [*no_groups, "--task", "arith", "--prompts", "1", "--model", str(tiny_model()), flag, value]
    name = {"--block-size": "block_size", "--kv-blocks": "num_kv_blocks"}[flag]
    assert f"{name} must be a positive integer, got 0" in _error(args, capsys)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--layers", "4"], "--layers, --hidden and --tokenizer shape the --trace replay model"),
        (["--hidden", "32"], "--layers, --hidden and --tokenizer shape the --trace replay model"),
        (["--tokenizer", "/tmp/tok.json"], "--layers, --hidden and --tokenizer shape the --trace replay"),
    ],
)
def test_task_bench_refuses_the_replay_models_flags(args, message, capsys):
    """They were accepted and ignored: a --task run samples with --model as it is."""
    no_groups = [*BENCH[:2], *BENCH[4:]]
    err = _error(
        [*no_groups, "--task", "arith", "--prompts", "1", "--model", "/nonexistent-model", *args], capsys
    )
    assert message in err


def test_a_model_whose_vocabulary_the_trace_tokens_exceed_is_named(tiny_model, capsys, game24_trace):
    """The trace is tokenized with the trace tokenizer (32k ids); a --model with a smaller
    vocabulary (the tiny model's 1,024) was an IndexError traceback from its embedding."""
    model = tiny_model()
    err = _error(
        [*BENCH, "--trace", str(game24_trace), "--policy", "baseline", "--model", str(model)], capsys
    )
    assert f"beyond the vocabulary of --model {model} (1024 ids)" in err and "Traceback" not in err
