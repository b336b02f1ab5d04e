"""``seer_engine simulate`` on small and odd inputs: a clear error naming the problem
(exit 2, no traceback) or a correct run, never a crash or a silently wrong figure."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from seer_engine.entrypoints.cli import main
from seer_engine.workloads.paths import default_tokenizer_path

REPEATED = ["--iterations", "2", "--repeat-prompts"]
SMALL = ["simulate", "--prompts", "2", "--samples", "2", "--instances", "2", "--max-tokens", "500"]
GROUPS = [
    "simulate",
    "--samples",
    "2",
    "--instances",
    "2",
    "--max-tokens",
    "500",
]  # --groups picks the prompts
STEP = {"a_s": 0.01, "b_s_per_token": 1e-5, "c_s_per_kv_token": 1e-9}
PROFILE = {"name": "p", "step": STEP, "kv_capacity_tokens": 4096, "max_num_seqs": 8,
           "max_num_batched_tokens": 1024, "kv_bytes_per_token": 1000, "pool_bytes_per_s": 1e9}  # fmt: skip

needs_tokenizer = pytest.mark.skipif(
    not default_tokenizer_path().is_file(), reason="the trace tokenizer is not in the shared traces folder"
)


def _error(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--policy", ""], "--policy names no policy"),
        (["--policy", " , "], "--policy names no policy"),
        (["--policy", "seer+history,oracle,seer+history"], "--policy names seer+history more than once"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--starvation-s", "-5"], "--starvation-s must be >= 0"),
        (["--starvation-s", "nan"], "--starvation-s must be >= 0, got nan"),
        (["--setup", ""], "--setup names no setup"),
        (["--setup", " , "], "--setup names no setup"),
        (["--setup", "kimi-k2,moonlight, kimi-k2"], "--setup names kimi-k2 more than once"),
        (
            ["--drift", "nan", "--repeat-prompts", "--iterations", "2"],
            "--drift must be a finite number >= 0, got nan",
        ),
        (["--drift", "inf", *REPEATED], "--drift must be a finite number >= 0, got inf"),
        (["--repeat-prompts"], "samples the same prompts in later iterations: pass --iterations N > 1"),
        (["--migration-spread", "-1"], "--migration-spread must be >= 0, got -1"),
        (["--pool-pull-tokens", "-5"], "--pool-pull-tokens must be >= 0, got -5"),
        (
            ["--admission", "known"],
            "choose from reserve, reserve-per-response, peak, peak:TOKENS, peak-known",
        ),
        (["--across-sigma", "-0.5"], "--across-sigma must be >= 0, got -0.5"),
        (["--across-sigma", "nan"], "--across-sigma must be >= 0, got nan"),
        (["--across-sigma", "inf"], "--across-sigma must be at most 4, got inf"),
        (["--across-sigma", "1e6"], "--across-sigma must be at most 4, got 1000000.0"),
        (["--speculative-config", "{budget}"], "--speculative-config is not valid JSON"),
        (["--speculative-config", "[1]"], "--speculative-config must be a JSON object, got [1]"),
        (["--speculative-config", '{"drafts": 4}'], "unknown --speculative-config keys ['drafts']"),
        (["--speculative-config", '{"budget": "greedy"}'], "budget must be one of ['adaptive', 'fixed']"),
        (["--speculative-config", '{"num_speculative_tokens": 99}'], "num_speculative_tokens must be"),
        (["--speculative-config", '{"method": "ngram"}'], "models grouped multi-path drafts (seer) only"),
        (["--policy", "baseline,context", "--speculative-config", "{}"], "none of the policies"),
        # the Context Manager's flags where no policy runs one
        (["--policy", "baseline,divided,oracle", "--starvation-s", "5"], "--starvation-s sets the Context"),
        (["--policy", "baseline", "--context-order", "wait"], "--context-order sets the Context Manager's"),
        # acceptance models that no policy of the run would draft with
        (
            ["--policy", "baseline,context+history", "--acceptance", "a.json"],
            "--acceptance models speculation",
        ),
        (["--policy", "seer", *REPEATED, "--history-acceptance", "a.json"], "--history-acceptance models"),
        (["--policy", "seer+history", "--history-acceptance", "a.json"], "from the second iteration on"),
        (
            ["--policy", "seer+history", "--iterations", "2", "--history-acceptance", "a.json"],
            "--history-acceptance is used once the history store knows the prompts: pass --repeat-prompts",
        ),
        # a trace's lengths are its own: both were ignored while the report's meta recorded them
        ([*REPEATED, "--trace", "t.jsonl.gz", "--drift", "0.5"], "--drift shapes the synthetic"),
        (["--trace", "t.jsonl.gz", "--across-sigma", "0"], "--across-sigma shapes the synthetic"),
    ],
)
def test_simulate_names_bad_arguments(args, message, capsys):
    assert message in _error([*SMALL, *args], capsys)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p: [1, 2], "expected a JSON object, got list"),
        (lambda p: {**p, "step": {**STEP, "a_s": float("nan")}}, "a_s must be a finite number >= 0, got nan"),
        (lambda p: {**p, "step": {**STEP, "b_s_per_token": "fast"}}, "b_s_per_token must be a finite number"),
        (lambda p: {**p, "pool_bytes_per_s": -1e9}, "pool_bytes_per_s must be a finite number >= 0"),
        (lambda p: {**p, "kv_bytes_per_token": -1}, "kv_bytes_per_token must be a finite number >= 0"),
        (lambda p: {**p, "max_num_seqs": True}, "max_num_seqs must be a positive integer, got True"),
        (lambda p: {**p, "kv_capacity_tokens": 10}, "holds no KV block of block_size 16"),
    ],
)
def test_simulate_names_a_bad_profile_field(tmp_path, capsys, change, message):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(change(PROFILE)))  # NaN is written as the JSON extension NaN
    err = _error([*SMALL, "--profile", str(path)], capsys)
    assert f"instance profile {str(path)!r} is not valid" in err and message in err


@pytest.mark.parametrize("policy", ["baseline", "context"])
def test_an_instance_too_small_for_a_response_is_a_clear_error(tmp_path, capsys, policy):
    """Named before anything runs, with the remedy that helps: no chunk size lets a
    response whose context outgrows an instance finish."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps({**PROFILE, "kv_capacity_tokens": 512}))
    err = _error([*SMALL, "--profile", str(path), "--policy", policy], capsys)
    assert "tokens but an instance holds 512 (kv_capacity_tokens): raise it or lower max_tokens" in err


def test_a_one_token_max_runs_every_response_to_one_token(tmp_path):
    # the setup's calibrated mean scaled to a 1-token max would be 1: no mean below the max
    args = [*SMALL, "--max-tokens", "1", "--policy", "baseline,seer,oracle", "--report", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "moonlight" / "report.json").read_text())
    assert report["meta"]["max_tokens"] == 1
    for name, figures in report["policies"].items():
        assert figures["output_tokens"] == 4, name


def _write_trace(path: Path, lines: list) -> Path:
    with gzip.open(path, "wt") as f:
        f.write("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@needs_tokenizer
@pytest.mark.parametrize(
    "lines,message",
    [
        ([], "the trace holds no groups"),
        ([[1, 2]], ":1: not a trace record (expected an object, got list)"),
        ([{"group_id": "a", "prompt": 5, "responses": ["x"]}], "'prompt' must be a string or null"),
        ([{"group_id": "a", "responses": "abc"}], "'responses' must be a list of strings"),
        ([{"group_id": "a", "responses": ["x y"], "response_tokens": 2}], "'response_tokens' must be a list"),
        ([{"group_id": "a", "responses": ["x", "y"], "response_tokens": ["1", 1]}], "'response_tokens' must"),
        ([{"group_id": "a", "responses": ["x", "y"], "response_tokens": [-3, 1]}], "'response_tokens' must"),
        # two groups of one id: simulate stopped on "response ta/0 is already in the rollout"
        (
            [{"group_id": "a", "responses": ["x", "y"]}, {"group_id": "a", "responses": ["z w", "v"]}],
            "bad.jsonl.gz:2: group_id 'a' repeats line 1",
        ),
    ],
)
def test_simulate_names_a_bad_trace(tmp_path, capsys, lines, message):
    trace = _write_trace(tmp_path / "bad.jsonl.gz", lines)
    for command in (SMALL, [*GROUPS, "--groups", "1"]):
        assert message in _error([*command, "--trace", str(trace)], capsys)


@needs_tokenizer
def test_a_file_that_is_not_a_gzip_trace_is_named(tmp_path, capsys):
    plain = tmp_path / "notes.md"
    plain.write_text("# not a trace\n")
    truncated = tmp_path / "cut.jsonl.gz"
    whole = _write_trace(tmp_path / "whole.jsonl.gz", [{"group_id": "a", "responses": ["x y", "z"]}] * 50)
    truncated.write_bytes(whole.read_bytes()[:30])
    for path in (plain, truncated):
        assert f"{path}: not a gzip JSON-lines trace" in _error([*SMALL, "--trace", str(path)], capsys)


@needs_tokenizer
def test_trace_groups_are_the_prompts_in_the_header_and_the_report(tmp_path, capsys):
    rows = [{"group_id": f"g{k}", "prompt": "Add.", "responses": ["one two three"] * 4} for k in range(5)]
    trace = _write_trace(tmp_path / "t.jsonl.gz", rows)
    args = [*GROUPS, "--trace", str(trace), "--groups", "1:4", "--policy", "baseline"]
    assert main([*args, "--report", str(tmp_path)]) == 0
    assert "3 prompts x 2 responses" in capsys.readouterr().out
    meta = json.loads((tmp_path / "moonlight" / "report.json").read_text())["meta"]
    assert meta["prompts"] == 3
    assert meta["mean_tokens"] is None and meta["across_sigma"] is None, "the trace's, not the setup's"


def test_context_order_reaches_the_context_manager_and_the_report(tmp_path, capsys):
    """``--context-order estimate`` changes the order of a +history policy once the store
    knows the prompts (iteration 2), not before; every response still runs to its length."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**PROFILE, "kv_capacity_tokens": 16384, "max_num_seqs": 16}))
    outputs = {}
    for order in ("wait", "estimate"):
        out = tmp_path / order
        args = ["simulate", "--prompts", "16", "--samples", "4", "--instances", "2", "--max-tokens", "4000",
                "--chunk-tokens", "256", "--iterations", "2", "--repeat-prompts", "--starvation-s", "100000",
                "--profile", str(profile), "--context-order", order, "--policy", "divided,context+history",
                "--report", str(out)]  # fmt: skip
        assert main(args) == 0
        report = json.loads((out / "moonlight" / "report.json").read_text())
        assert report["meta"]["context_order"] == order
        outputs[order] = [it["policies"] for it in report["iterations"]]
    wait, estimate = outputs["wait"], outputs["estimate"]
    assert wait[0] == estimate[0]  # iteration 1: no prompt is known yet
    assert wait[1]["divided"] == estimate[1]["divided"]
    assert wait[1]["context+history"]["makespan_s"] != estimate[1]["context+history"]["makespan_s"]
    assert wait[1]["context+history"]["output_tokens"] == estimate[1]["context+history"]["output_tokens"]
    assert "invalid choice: 'longest'" in _error([*SMALL, "--context-order", "longest"], capsys)


def test_across_sigma_spreads_the_group_lengths_and_is_reported(tmp_path):
    """``--across-sigma`` replaces the setup's spread of group mean lengths: at 0 the
    groups differ only by their prompts and samples, at 1.5 far more; both keep the
    calibrated mean, and the report names the spread it ran."""
    spread = {}
    for sigma in ("0", "1.5"):
        out = tmp_path / sigma
        args = ["simulate", "--prompts", "64", "--samples", "4", "--instances", "2", "--max-tokens", "20000",
                "--policy", "divided", "--across-sigma", sigma, "--report", str(out)]  # fmt: skip
        assert main(args) == 0
        report = json.loads((out / "moonlight" / "report.json").read_text())
        assert report["meta"]["across_sigma"] == float(sigma)
        spread[sigma] = report["policies"]["divided"]["output_tokens"]
    from seer_engine.sim.setups import get_setup
    from seer_engine.sim.simulator import synthetic_groups

    s = get_setup("moonlight")
    mean = round(s.mean_tokens * 20000 / s.max_tokens)
    cv = {}
    for sigma in (0.0, 1.5):
        groups = synthetic_groups(64, 4, 20000, s.prompt_len, 0, mean, across_sigma=sigma)
        means = [sum(g.lengths) / len(g.lengths) for g in groups]
        avg = sum(means) / len(means)
        cv[sigma] = (sum((m - avg) ** 2 for m in means) / len(means)) ** 0.5 / avg
    assert cv[1.5] > 3 * cv[0.0]
    assert spread["0"] != spread["1.5"]  # the same seed, another workload
    assert get_setup("qwen2vl-72b").across_sigma > get_setup("moonlight").across_sigma


def test_simulate_says_which_context_order_auto_chose(tmp_path, capsys):
    """Once the history store knows the prompts, ``simulate`` prints the order ``auto``
    put in force and the spread it measured: groups this unequal get ``estimate``."""
    args = ["simulate", "--prompts", "16", "--samples", "4", "--instances", "2", "--max-tokens", "4000",
            "--chunk-tokens", "256", "--iterations", "2", "--repeat-prompts", "--across-sigma", "3",
            "--policy", "context+history"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "iter 1/2 context+history] context order" not in out, "nothing known in iteration 1"
    assert "iter 2/2 context+history] context order for known prompts: estimate" in out


def test_speculative_config_reaches_the_modeled_drafters(tmp_path):
    """A fixed budget drafts every decoding row the cap, so 16 nodes verify several
    times what 1 does on the same workload."""
    verified = {}
    for nodes in (1, 16):
        out = tmp_path / str(nodes)
        config = json.dumps({"budget": "fixed", "num_speculative_tokens": nodes})
        args = ["simulate", "--prompts", "4", "--samples", "4", "--instances", "2", "--max-tokens", "2000",
                "--policy", "seer", "--speculative-config", config, "--report", str(out)]  # fmt: skip
        assert main(args) == 0
        report = json.loads((out / "moonlight" / "report.json").read_text())
        seer = report["policies"]["seer"]
        verified[nodes] = seer["draft_tokens_verified"]
    assert verified[16] > 4 * verified[1] > 0


def test_the_mean_tail_reduction_skips_iterations_whose_baseline_has_no_tail():
    """As ``vs_baseline`` per iteration: no baseline tail, no reduction to average in."""
    from types import SimpleNamespace

    from seer_engine.entrypoints.simulate import _summary

    def run(tail_s: float) -> SimpleNamespace:
        figures = {"throughput_tokens_per_s": 10.0, "makespan_s": 5.0, "tail_s": tail_s, "preemptions": 0,
                   "chunk_cuts": 0, "idle_fraction": 0.0}  # fmt: skip
        return SimpleNamespace(metrics=SimpleNamespace(**figures))

    runs = [{"baseline": run(0.0), "seer": run(1.0)}, {"baseline": run(4.0), "seer": run(2.0)}]
    assert _summary(runs)["seer"]["tail_reduction_vs_baseline"] == 0.5
    assert _summary(runs[:1])["seer"]["tail_reduction_vs_baseline"] is None


def test_a_step_model_that_takes_no_time_is_named(tmp_path, capsys):
    """Every step at 0 s made a 0 s makespan: a ZeroDivisionError traceback in the summary."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**PROFILE, "step": {"a_s": 0, "b_s_per_token": 0, "c_s_per_kv_token": 0}}))
    err = _error([*SMALL, "--policy", "baseline,seer", "--profile", str(path)], capsys)
    assert f"instance profile {str(path)!r} is not valid: step-time model: every step would take 0 s" in err


def test_fixed_trace_groups_over_iterations_need_repeat_prompts(capsys):
    """``--groups`` without ``--repeat-prompts`` replayed responses 0..N-1 in every
    iteration: N identical runs, not the fresh workload each that --iterations promises."""
    args = [*GROUPS, "--trace", "gpt4-game24-cot.jsonl.gz", "--groups", "2", "--iterations", "2"]
    assert "pass --repeat-prompts to take disjoint sibling sets" in _error(args, capsys)


def test_a_file_where_a_setups_report_folder_goes_is_named_before_the_run(tmp_path, capsys):
    """The root was checked, not ``<root>/<setup>``: a FileExistsError traceback after the run."""
    (tmp_path / "moonlight").write_text("")
    err = _error([*SMALL, "--policy", "divided", "--report", str(tmp_path)], capsys)
    assert f"--report {str(tmp_path / 'moonlight')!r} is not a directory this run can write to" in err


def test_a_report_rewritten_without_speculation_keeps_no_old_acceptance_plot(tmp_path, capsys):
    """acceptance.png of an earlier run in the same folder stayed beside a report.json whose
    policies never drafted; the line that names the files written names it when it is one."""
    report = [*SMALL, "--report", str(tmp_path)]
    assert main([*report, "--policy", "baseline,seer"]) == 0
    assert "report.png and " in capsys.readouterr().out
    assert (tmp_path / "moonlight" / "acceptance.png").is_file()
    assert main([*report, "--policy", "baseline,context"]) == 0
    assert not (tmp_path / "moonlight" / "acceptance.png").exists()
    assert "acceptance.png" not in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--seed", "3"), ("--seed", "0"), ("--prompts", "9")])
def test_trace_groups_refuse_the_flags_that_would_pick_other_groups(flag, value, capsys):
    """``--groups`` names the groups: both were ignored while the report's meta recorded --seed."""
    args = [*GROUPS, "--trace", "t.jsonl.gz", "--groups", "2", flag, value]
    assert "--seed and --prompts pick the groups" in _error(args, capsys)


def test_the_report_records_the_command_it_ran(tmp_path):
    """meta.command was built from sys.argv: a script calling main(argv) (the benchmarks'
    run.py files) recorded its own command line, not the simulate command it ran."""
    import shlex

    args = [*SMALL, "--policy", "baseline", "--report", str(tmp_path)]
    assert main(args) == 0
    meta = json.loads((tmp_path / "moonlight" / "report.json").read_text())["meta"]
    assert meta["command"] == shlex.join(["seer_engine", *args])


@pytest.mark.parametrize("trace", [False, True])
def test_history_policies_without_repeated_prompts_run_as_their_base_policy(tmp_path, trace, game24_trace):
    """Iterations without --repeat-prompts draw fresh prompts: the history store knows none
    of them, so it neither seeds their drafts nor gives them a prior."""
    args = ["simulate", "--prompts", "4", "--samples", "8", "--instances", "2", "--max-tokens", "2000",
            "--iterations", "2", "--policy", "seer,seer+history,context,context+history",
            "--report", str(tmp_path)]  # fmt: skip
    assert main(args + (["--trace", str(game24_trace)] if trace else [])) == 0
    report = json.loads((tmp_path / "moonlight" / "report.json").read_text())
    later = report["iterations"][1]["policies"]
    for base in ("seer", "context"):
        plain, learnt = later[base], later[f"{base}+history"]
        assert {k: v for k, v in learnt.items() if k != "policy"} == {
            k: v for k, v in plain.items() if k != "policy"
        }, base
