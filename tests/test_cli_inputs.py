"""``seer_engine generate`` and the engine flags every model command shares, on bad
input: exit 2 with one line naming the flag and the problem, before any model loads;
never a traceback or a run on something other than what was asked."""

from __future__ import annotations

import json

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.entrypoints.cli import main


def _error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("device", "gpu0", "device must be auto, cpu or cuda[:N], got 'gpu0'"),
        ("kv_cache_memory_gb", -1.0, "kv_cache_memory_gb must be a finite number > 0, got -1.0"),
        ("kv_cache_memory_gb", 0.0, "kv_cache_memory_gb must be a finite number > 0, got 0.0"),
        ("kv_cache_memory_gb", float("nan"), "kv_cache_memory_gb must be a finite number > 0, got nan"),
        ("kv_cache_memory_gb", float("inf"), "kv_cache_memory_gb must be a finite number > 0, got inf"),
    ],
)
def test_engine_flags_are_checked_before_the_model_loads(field, value, message, capsys):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{field: value})
    assert message in str(info.value)
    flag = "--" + field.replace("_", "-")
    args = ["generate", "--model", "/nonexistent-model", "--prompt", "hi", flag, str(value)]
    assert message in _error(args, capsys)


def test_a_prompts_file_that_cannot_be_read_is_named(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    err = _error(["generate", "--model", "/nonexistent-model", "--prompts-file", str(missing)], capsys)
    assert f"cannot read --prompts-file {str(missing)!r}: No such file or directory" in err
    err = _error(["generate", "--model", "/nonexistent-model", "--prompts-file", str(tmp_path)], capsys)
    assert f"cannot read --prompts-file {str(tmp_path)!r}: Is a directory" in err


def test_an_empty_prompts_file_is_an_error_not_the_demo_prompts(tmp_path, capsys):
    """The demo prompts are for a bare ``generate``; a file with no prompts is a mistake."""
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    err = _error(["generate", "--model", "/nonexistent-model", "--prompts-file", str(empty)], capsys)
    assert f"--prompts-file {str(empty)!r} holds no prompts" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "70000"], "--port must be in 0..65535 (0: a free one), got 70000"),
        (["--port", "-1"], "--port must be in 0..65535 (0: a free one), got -1"),
        (["--timeout-keep-alive", "-1"], "--timeout-keep-alive must be >= 0, got -1"),
        (["--drain-timeout", "-1"], "--drain-timeout must be a number of seconds >= 0, got -1.0"),
        (["--drain-timeout", "nan"], "--drain-timeout must be a number of seconds >= 0, got nan"),
        (["--drain-timeout", "inf"], "--drain-timeout must be a number of seconds >= 0, got inf"),
        (["--served-model-name", "m", " "], "--served-model-name must not be blank, got ['m', ' ']"),
        # `--api-key "$KEY"` with KEY unset served every route without a key
        (["--api-key", ""], "--api-key must not be blank"),
        (["--api-key", "  "], "--api-key must not be blank"),
        # rollout-backend flags on a server of one engine: accepted, then never used
        (["--chunk-tokens", "512"], "--chunk-tokens applies to the rollout backend"),
        (["--kv-connector", "mooncake"], "--kv-connector applies to the rollout backend"),
        (
            ["--distributed-backend", "mp", "--instance-timeout", "9"],
            "--distributed-backend, --instance-timeout",
        ),
        (["--context-order", "estimate"], "--context-order applies to the rollout backend"),
        (["--instance-load-timeout", "60"], "--instance-load-timeout applies to the rollout backend"),
    ],
)
def test_serve_flags_are_checked_before_the_model_loads(args, message, capsys):
    assert message in _error(["serve", "--model", "/nonexistent-model", *args], capsys)


def test_a_data_dir_that_cannot_be_written_is_named_before_the_model_loads(tmp_path, capsys):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    err = _error(["serve", "--model", "/nonexistent-model", "--port", "0", "--data-dir", str(a_file)], capsys)
    assert f"--data-dir {str(a_file)!r} is not a directory this run can write to" in err


@pytest.mark.parametrize("store", ["files", "batches"])
def test_a_file_in_the_way_of_a_data_dir_store_is_named_before_the_model_loads(store, tmp_path, capsys):
    """A file where the Files or Batch store's folder goes used to pass the check of the
    data dir and stop the server after the model had loaded, with a FileExistsError traceback."""
    (tmp_path / store).write_text("")
    args = ["serve", "--model", "/nonexistent-model", "--port", "0", "--data-dir", str(tmp_path)]
    err = _error(args, capsys)
    assert f"--data-dir {str(tmp_path / store)!r} is not a directory this run can write to" in err


def test_the_default_data_dir_follows_seer_engine_cache(tmp_path, capsys, monkeypatch):
    """The server's files and batches go where the run's cache is (a file there is named)."""
    monkeypatch.setenv("SEER_ENGINE_CACHE", str(tmp_path))
    (tmp_path / "server").write_text("")
    err = _error(["serve", "--model", "/nonexistent-model", "--port", "0"], capsys)
    assert f"--data-dir {str(tmp_path / 'server')!r} is not a directory this run can write to" in err


def test_a_kv_budget_that_holds_no_block_is_an_error_not_an_oversized_cache(tiny_model, capsys):
    """One block of 2^30 tokens is far over the 1 GiB CPU budget: it was allocated anyway
    (at least one block), a torch out-of-memory traceback."""
    args = ["generate", "--model", str(tiny_model()), "--prompt", "hi", "--block-size", str(1 << 30)]
    err = _error(args, capsys)
    assert "KV cache budget (1073741824 bytes) holds no block of 1073741824 tokens" in err
    assert "lower --block-size or raise --kv-cache-memory-gb" in err


def test_a_kv_cache_too_large_to_allocate_names_the_flags(tiny_model, capsys, monkeypatch):
    """``--num-kv-blocks 1000000000`` asks for terabytes: torch's allocation failure (out of
    memory) is stood in for here, since a real one depends on the machine's overcommit."""
    from seer_engine.model_executor.model_runner import ModelRunner

    def out_of_memory(self):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(ModelRunner, "_allocate_kv_cache", out_of_memory)
    args = ["generate", "--model", str(tiny_model()), "--prompt", "hi", "--num-kv-blocks", "1000000000"]
    err = _error(args, capsys)
    assert "cannot allocate the KV cache of 1000000000 blocks of 16 tokens" in err
    assert "--num-kv-blocks" in err and "can't allocate memory" in err


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"prompt": null}', "prompt must be text or a list of token ids, got None"),
        ('{"prompt": 5}', "prompt must be text or a list of token ids, got 5"),
        ('{"prompt": "x", "stop": 5}', "stop must be a list of non-empty strings, got 5"),
        ('{"prompt": "x", "stop": {"a": 1}}', "stop must be a list of non-empty strings, got {'a': 1}"),
        ('{"prompt": "x", "stop_token_ids": 5}', "stop_token_ids must be non-negative integers, got 5"),
        ('{"prompt": "x", "ignore_eos": "false"}', "ignore_eos must be a boolean, got 'false'"),
        ('{"prompt": "x", "skip_special_tokens": 0}', "unknown fields ['skip_special_tokens']"),
    ],
)
def test_a_rollout_input_line_of_the_wrong_type_is_named(line, message, tiny_model, tmp_path, capsys):
    """A prompt or field of the wrong JSON type was a TypeError traceback (``list(None)``,
    ``list(5)``), a mapping's keys taken as stop strings, or a truthy string as a flag."""
    src = tmp_path / "in.jsonl"
    src.write_text(line + "\n")
    out = tmp_path / "out.jsonl"
    args = ["rollout", "--model", str(tiny_model()), "--input", str(src), "--output", str(out), "--n", "1"]
    assert f"{src}:1: {message}" in _error([*args, "--max-tokens", "2"], capsys)
    assert not out.exists()


def test_sigterm_mid_rollout_closes_the_instance_processes(tiny_model, tmp_path, monkeypatch):
    """SIGTERM ended the process on the spot: its instance processes died on broken pipes
    with tracebacks and its shared memory was left to the resource tracker. It now
    unwinds as Ctrl-C does (exit 143), and the caller's handler is put back."""
    import multiprocessing
    import os
    import signal

    from seer_engine.rollout.dispatcher import Dispatcher

    def terminated_mid_run(self, groups):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the rollout")

    monkeypatch.setattr(Dispatcher, "run", terminated_mid_run)
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        src = tmp_path / "in.jsonl"
        src.write_text('{"prompt": "hi"}\n')
        out = tmp_path / "o.jsonl"
        args = ["rollout", "--model", str(tiny_model()), "--input", str(src), "--output", str(out),
                "--n", "2", "--max-tokens", "2", "--instances", "2", "--distributed-backend", "mp",
                "--kv-connector", "none", "--num-threads", "1"]  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 143 and not received
        assert multiprocessing.active_children() == []
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert callable(restored) and restored.__name__ == "<lambda>"


def test_generate_prints_the_logprobs_it_is_asked_for(tiny_model, capsys):
    """``--logprobs N`` was computed and dropped: the lines held no logprobs."""
    base = ["generate", "--model", str(tiny_model()), "--prompt", "hi", "--max-tokens", "3", "--n", "2"]
    assert main([*base, "--logprobs", "1"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    for sample in line["outputs"]:
        assert len(sample["logprobs"]) == len(sample["token_ids"]) == 3
        for token, step in zip(sample["token_ids"], sample["logprobs"]):
            assert str(token) in step and 1 <= len(step) <= 2 and all(lp <= 0 for lp in step.values())
    assert main(base) == 0
    assert all("logprobs" not in s for s in json.loads(capsys.readouterr().out.splitlines()[0])["outputs"])


def test_a_rollout_input_file_is_read_as_utf8_naming_the_line_that_is_not(tiny_model, tmp_path, capsys):
    """A byte that is not UTF-8 was a bare "'utf-8' codec can't decode byte 0xff" naming
    neither file nor line; a BOM (Windows editors) made line 1 "not valid JSON"."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = ["rollout", "--model", str(tiny_model()), "--input", str(src), "--output", str(out),
            "--n", "1", "--max-tokens", "2"]  # fmt: skip
    src.write_bytes(b'{"prompt": "a"}\n{"prompt": "b\xff"}\n')
    assert f"{src}:2: not UTF-8 text (invalid start byte at byte 13)" in _error(args, capsys)
    src.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert main(args) == 0
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["a", "b"]


def test_a_bom_is_not_part_of_the_first_prompt(tiny_model, tmp_path, capsys):
    """A prompts file saved with a BOM (Windows editors) sent '\\ufeffhello' as the first prompt."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\xef\xbb\xbfhello\r\nworld\r\n")
    args = ["generate", "--model", str(tiny_model()), "--prompts-file", str(prompts), "--max-tokens", "1"]
    assert main(args) == 0
    assert [json.loads(line)["prompt"] for line in capsys.readouterr().out.splitlines()] == ["hello", "world"]


@pytest.mark.parametrize("source", [["--input", "in.jsonl"], ["--task", "arith"]])
@pytest.mark.parametrize(
    "flag,message",
    [
        (["--temperature", "-1"], "--temperature: temperature must be a finite number >= 0, got -1.0"),
        (["--max-tokens", "0"], "--max-tokens: max_tokens must be an integer >= 1, got 0"),
    ],
)
def test_rollout_sampling_flags_are_checked_before_the_model_loads(source, flag, message, tmp_path, capsys):
    """They were checked once the model had loaded, and blamed on the input's first line
    ("in.jsonl:1: temperature must be ...")."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    if source[0] == "--input":
        source = ["--input", str(tmp_path / "in.jsonl")]
    args = ["rollout", "--model", "/nonexistent-model", *source, "--output", str(tmp_path / "o.jsonl"), *flag]
    assert message in _error(args, capsys)


def test_a_bad_prompt_among_several_is_named_by_its_index(tiny_model, capsys):
    """Of several prompts, the one refused was not named: a bare "prompt is empty"."""
    args = ["generate", "--model", str(tiny_model()), "--prompt", "hi", "--prompt", "", "--max-tokens", "1"]
    assert "error: prompts[1]: prompt is empty" in _error(args, capsys)


def test_a_rollout_logged_to_a_file_shows_its_progress(tiny_model, tmp_path, capsys):
    """Its progress bar is off where stderr is no terminal (a job's log): a long rollout said
    nothing until it ended. There it writes a line every ~10% of responses, as bench does."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    args = ["rollout", "--model", str(tiny_model()), "--input", str(src), "--output", str(out),
            "--n", "2", "--max-tokens", "2"]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[rollout (baseline)] 4/4 responses" in err


@pytest.mark.parametrize("command", ["serve", "rollout"])
def test_a_history_dir_that_cannot_be_written_is_named_before_the_model_loads(command, tmp_path, capsys):
    """It was named only when the store was first saved, after every instance had loaded."""
    a_file, prompts = tmp_path / "not-a-dir", tmp_path / "in.jsonl"
    a_file.write_text("")
    prompts.write_text('{"prompt": "a"}\n')
    args = {
        "serve": ["serve", "--rollout-mode", "--data-dir", str(tmp_path)],
        "rollout": ["rollout", "--input", str(prompts), "--output", str(tmp_path / "out.jsonl")],
    }[command]
    err = _error([*args, "--model", "/nonexistent-model", "--history", str(a_file)], capsys)
    assert f"--history {str(a_file)!r} is not a directory this run can write to" in err


@pytest.mark.parametrize(
    "line,message",
    [
        ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deeply)"),
        ('{"prompt": "x"', "not valid JSON"),
        ('["x"]', 'expected an object with a "prompt"'),
        ('{"prompt": "x", "foo": 1}', "unknown fields ['foo']"),
        ('{"prompt": "x", "n": 0}', "n must be an integer >= 1, got 0"),
        ('{"prompt": "x", "temperature": -1}', "temperature must be a finite number >= 0, got -1"),
    ],
)
def test_a_bad_rollout_input_line_is_named_before_the_model_loads(line, message, tmp_path, capsys):
    """The input was read only once every instance had loaded the model, so a bad line was
    named minutes late; JSON nested past Python's recursion limit was a RecursionError traceback."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "fine"}\n' + line + "\n")
    out = str(tmp_path / "o.jsonl")
    args = ["rollout", "--model", "/nonexistent-model", "--input", str(src), "--output", out]
    assert f"{src}:2: {message}" in _error(args, capsys)


def test_an_output_that_cannot_be_written_in_full_keeps_the_earlier_file(tiny_model, tmp_path):
    """The output was written in place: a write that failed part way (a full disk; here a
    file size limit) was an OSError traceback and left a file cut mid-line in place of the
    earlier one. It is written beside it and renamed, the failure named in one line."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": [5, 6]}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    args = ["rollout", "--model", str(tiny_model()), "--input", str(src), "--output", str(out),
            "--n", "2", "--max-tokens", "8", "--num-threads", "1"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "seer_engine.entrypoints.cli", *args],
        capture_output=True, text=True, preexec_fn=limit_file_size, env=os.environ,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: cannot write --output {str(out)!r}: File too large" in proc.stderr
    assert out.read_text() == "earlier\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_an_output_through_a_link_or_to_a_stream_is_written_there(tiny_model, tmp_path, capsys):
    """``--output`` may be a link to the file (written through, not replaced; its target's
    folder is the one checked), a file with its own mode (kept), or ``/dev/stdout`` (a
    stream: written in place)."""
    import os
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    real = tmp_path / "data" / "real.jsonl"
    real.parent.mkdir()
    real.write_text("earlier\n")
    real.chmod(0o640)
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    args = ["rollout", "--model", str(tiny_model()), "--input", str(src), "--n", "1", "--max-tokens", "2"]
    assert main([*args, "--output", str(link)]) == 0
    assert link.is_symlink() and json.loads(real.read_text())["prompt"] == "a"
    assert real.stat().st_mode & 0o777 == 0o640
    cli = [sys.executable, "-m", "seer_engine.entrypoints.cli", *args, "--output", "/dev/stdout"]
    proc = subprocess.run(cli, capture_output=True, text=True, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt"] == "a"
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "missing" / "out.jsonl")
    refused = ["rollout", "--model", "/nonexistent-model", "--input", str(src), "--output", str(dangling)]
    assert "not a file in an existing directory" in _error(refused, capsys)


def test_rollout_input_from_a_pipe_is_read(tiny_model, tmp_path, capsys):
    """``--input /dev/stdin`` (a pipe, no regular file) was refused as "not found"."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out.jsonl"
    args = ["rollout", "--model", str(tiny_model()), "--input", "/dev/stdin", "--output", str(out),
            "--n", "1", "--max-tokens", "2", "--num-threads", "1"]  # fmt: skip
    cli = [sys.executable, "-m", "seer_engine.entrypoints.cli", *args]
    proc = subprocess.run(cli, input='{"prompt": "a"}\n', capture_output=True, text=True, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["prompt"] == "a"
    refused = ["rollout", "--model", "/nonexistent-model", "--input", str(tmp_path), "--output", str(out)]
    assert f"--input {str(tmp_path)!r} is a directory" in _error(refused, capsys)


def test_rollout_seed_picks_the_samples_of_lines_without_their_own(tiny_model, tmp_path):
    """Lines without a seed were seeded by their position only: ``--seed 1`` and ``--seed 2``
    gave the same responses, so rollouts of one file (an epoch each) repeated themselves.
    ``--seed`` now seeds them, as it does ``--task``'s groups; a line's own seed still wins."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Once upon a time"}\n{"prompt": "Once upon a time", "seed": 5}\n')

    def tokens(seed: int) -> list:
        out = tmp_path / f"out{seed}.jsonl"
        args = ["rollout", "--model", str(tiny_model()), "--input", str(src), "--output", str(out),
                "--n", "2", "--max-tokens", "6", "--seed", str(seed), "--num-threads", "1"]  # fmt: skip
        assert main(args) == 0
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        return [[o["token_ids"] for o in line["outputs"]] for line in lines]

    first, second, again = tokens(1), tokens(2), tokens(1)
    assert first == again
    assert first[0] != second[0]
    assert first[1] == second[1]


def _help(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at any width


def test_help_says_what_each_engine_flag_is_and_each_default(capsys):
    """``serve --help`` lists every engine flag with what it means and its default, as
    vLLM's does, and says no default that means nothing (None, an empty list)."""
    import argparse
    import dataclasses

    from seer_engine.engine.config import FIELD_HELP

    text = _help(["serve"], capsys)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    for action in parser._actions[1:]:
        assert action.help and action.help.strip() and not action.help.startswith("("), action.dest
    assert set(FIELD_HELP) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert "most sequences in one step (default: 256)" in text
    assert "--chunk-tokens CHUNK_TOKENS divided rollout: most tokens per dispatch (default: 8192)" in text
    assert "(default: 5.0)" in text  # --drain-timeout
    assert "--enable-prefix-caching, --no-enable-prefix-caching reuse the KV blocks" in text
    assert "--chunk-tokens CHUNK_TOKENS divided rollout: most tokens per dispatch (default: 512)" in _help(
        ["bench", "rollout"], capsys
    )
    for command in ("serve", "rollout", "generate", "simulate", "bench rollout", "trace-stats"):
        text = _help(command.split(), capsys)
        assert "(default: None)" not in text and "(default: [])" not in text, command
        assert "(default: True)" not in text and "(default: False)" not in text, command


def test_every_option_of_every_subcommand_has_help():
    import argparse

    from seer_engine.entrypoints.cli import build_parser

    bare = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, command in action.choices.items():
                    walk(f"{name} {sub}".strip(), command)
            elif action.option_strings and not (action.help or "").strip():
                bare.append(f"{name} {action.option_strings[0]}")

    walk("", build_parser())
    assert not bare, bare
