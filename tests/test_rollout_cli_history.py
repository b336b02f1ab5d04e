"""``seer_engine rollout`` with ``--history DIR`` and ``--output`` that cannot be used: a
clear error before the rollout runs, never a traceback after it (its outputs lost)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seer_engine.entrypoints.cli import main
from seer_engine.rollout.config import HISTORY_FILE
from seer_engine.rollout.history import HistoryStore

PROMPT = [10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def _args(model, tmp_path, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "max_tokens": 8}) + "\n")
    return ["rollout", "--model", str(model), "--input", str(prompts), "--n", "2", "--rollout-mode",
            "--temperature", "0", "--num-threads", "1", "--output", str(tmp_path / "out.jsonl"),
            *extra]  # fmt: skip


def _error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_output_that_cannot_be_written_is_refused_first(model, tmp_path, capsys):
    for output in (tmp_path / "missing" / "out.jsonl", tmp_path):
        args = _args(model, tmp_path)
        err = _error([*args[:-1], str(output)], capsys)
        assert f"cannot write --output '{output}'" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no one may create a file")
def test_output_in_a_folder_that_cannot_be_written_is_refused_first(model, tmp_path, capsys):
    """Not after the rollout ran, with a traceback and its responses lost."""
    args = _args(model, tmp_path)
    err = _error([*args[:-1], "/proc/out.jsonl"], capsys)
    assert "--output '/proc/out.jsonl': its folder '/proc' is not a directory this run can write to" in err


def test_history_dir_that_cannot_be_written_is_refused_before_the_rollout(model, tmp_path, capsys):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    err = _error(_args(model, tmp_path, "--history", str(in_the_way)), capsys)
    assert f"--history '{in_the_way}' is not a directory this run can write to" in err
    assert not (tmp_path / "out.jsonl").exists(), "refused before the rollout"
    (tmp_path / "hist" / HISTORY_FILE).mkdir(parents=True)
    err = _error(_args(model, tmp_path, "--history", str(tmp_path / "hist")), capsys)
    assert f"cannot save the history store to '{tmp_path / 'hist' / HISTORY_FILE}'" in err


def test_damaged_history_file_is_a_clear_error(model, tmp_path, capsys):
    (tmp_path / "hist").mkdir()
    store = HistoryStore()
    store.record(PROMPT, 8, token_ids=[1, 2, 3])
    store.save(tmp_path / "hist" / HISTORY_FILE)
    data = json.loads((tmp_path / "hist" / HISTORY_FILE).read_text())
    (tmp_path / "hist" / HISTORY_FILE).write_text(json.dumps({**data, "prompts": list(data["prompts"])}))
    err = _error(_args(model, tmp_path, "--history", str(tmp_path / "hist")), capsys)
    assert "is not valid" in err


def test_history_of_another_model_is_refused(model, tmp_path, capsys):
    """The same token-id prompt under another model: its stored responses would seed grouped
    drafts with tokens this model does not have (an IndexError in the forward pass)."""
    hist = tmp_path / "hist"
    hist.mkdir()
    foreign = HistoryStore()
    for _ in range(2):
        foreign.record(PROMPT, 8, token_ids=[40_000 + i for i in range(8)])
    foreign.next_iteration()
    foreign.save(hist / HISTORY_FILE)
    err = _error(_args(model, tmp_path, "--history", str(hist)), capsys)
    assert "holds token id 40007, beyond this model's vocabulary" in err

    (hist / HISTORY_FILE).unlink()
    assert main(_args(model, tmp_path, "--history", str(hist))) == 0
    saved = HistoryStore.load(hist / HISTORY_FILE)
    assert saved.tokenizer is not None and saved.iteration == 1 and PROMPT in saved
    data = json.loads((hist / HISTORY_FILE).read_text())
    (hist / HISTORY_FILE).write_text(json.dumps({**data, "tokenizer": "49152:0123456789abcdef"}))
    err = _error(_args(model, tmp_path, "--history", str(hist)), capsys)
    assert "written under another tokenizer (49152:0123456789abcdef" in err


def test_a_server_refuses_history_of_another_model_at_startup(model, tmp_path):
    """The server's rollout backend binds its store as ``rollout`` does: a store holding ids
    beyond the model's vocabulary is refused when the backend starts, not at the first
    drafted step; a fresh one is bound to the model's tokenizer and saved at once."""
    from seer_engine.engine.config import EngineConfig
    from seer_engine.rollout.backend import RolloutBackend
    from seer_engine.rollout.config import RolloutConfig

    hist = tmp_path / "hist"
    hist.mkdir()
    foreign = HistoryStore()
    foreign.record(PROMPT, 8, token_ids=[40_000 + i for i in range(8)])
    foreign.save(hist / HISTORY_FILE)
    config = EngineConfig(model=str(model), num_threads=1)
    rollout = RolloutConfig(
        rollout_mode=True, policy="seer+history", history=str(hist), distributed_backend="inproc"
    )
    with pytest.raises(ValueError, match="holds token id 40007, beyond this model's vocabulary"):
        RolloutBackend(config, rollout)

    (hist / HISTORY_FILE).unlink()
    backend = RolloutBackend(config, rollout)
    try:
        assert HistoryStore.load(hist / HISTORY_FILE).tokenizer == backend.history.tokenizer is not None
    finally:
        backend.close()


def test_context_order_reaches_the_context_manager_of_serve_and_rollout(model, tmp_path, capsys):
    """``--context-order`` is the simulator's option on the real commands too: ``serve``
    and ``rollout`` build their Context Manager with it, a bad value is refused by name,
    and ``estimate`` (which reorders groups the history store knows) changes no greedy
    output and loses no sample."""
    from seer_engine.entrypoints.cli import build_parser
    from seer_engine.rollout.config import RolloutConfig

    for command in (["serve", "--model", str(model)], _args(model, tmp_path)):
        args = build_parser().parse_args([*command, "--context-order", "estimate"])
        assert RolloutConfig.from_cli_args(args).make_policy().context.order == "estimate"
        args = build_parser().parse_args(command)
        assert RolloutConfig.from_cli_args(args).make_policy().context.order == "auto"
    err = _error(_args(model, tmp_path, "--context-order", "longest"), capsys)
    assert "--context-order: invalid choice: 'longest'" in err

    prompts = tmp_path / "three-prompts.jsonl"  # _args writes prompts.jsonl
    prompts.write_text(
        "".join(json.dumps({"prompt": [10 + i, 11, 12, 13], "max_tokens": 8}) + "\n" for i in range(3))
    )
    outputs = {}
    for order in ("wait", "estimate", "estimate"):  # the second estimate run finds every prompt known
        out = tmp_path / f"out-{order}.jsonl"
        hist = tmp_path / f"hist-{order}"
        args = [*_args(model, tmp_path, "--rollout-policy", "context+history", "--history", str(hist),
                       "--context-order", order)]  # fmt: skip
        args[args.index("--input") + 1] = str(prompts)
        args[args.index("--output") + 1] = str(out)
        assert main(args) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        outputs.setdefault(order, []).append(sorted(json.dumps(r["outputs"]) for r in rows))
        assert len(rows) == 3 and all(len(r["outputs"]) == 2 for r in rows)
    assert HistoryStore.load(tmp_path / "hist-estimate" / HISTORY_FILE).iteration == 2
    assert outputs["estimate"][0] == outputs["estimate"][1] == outputs["wait"][0]


def test_an_engine_config_error_in_an_instance_process_is_named_not_a_traceback(model, tmp_path, capsys):
    """With --instances N > 1 each engine starts in a process of its own: a configuration
    error it raises there is the command's error (exit 2), as with one in-process engine
    (Ray actors: ``tests/test_ray_backend.py``)."""
    extra = ["--instances", "2", "--distributed-backend", "mp", "--max-model-len", "100000"]
    args = _args(model, tmp_path, *extra)
    err = _error(args, capsys)
    assert "max_model_len 100000 exceeds what the model supports (4096)" in err
    assert "Traceback" not in err
