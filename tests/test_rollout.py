"""Rollout mode: every sample exactly once, no preemption when divided, same greedy
outputs whatever the policy, chunk size or instance count, Context Manager order."""

from __future__ import annotations

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.rollout.report import REPORT_KEYS
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import SamplingParams
from seer_engine.workloads.replay import TraceReplay


def _groups(max_tokens: int = 40, temperature: float = 0.0) -> list[Group]:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=11)
    prompts = [list(range(10, 10 + n)) for n in (7, 23, 40)]
    return [Group(f"g{i}", p, params, 4, max_tokens) for i, p in enumerate(prompts)]


def _run(model, policy: str, instances: int, chunk: int, kv_blocks: int = 64, **kw):
    cfg = EngineConfig(model=str(model), num_kv_blocks=kv_blocks, max_num_seqs=8)
    pool = EnginePool.start(cfg, instances)
    true = {f"g{i}/{j}": 40 for i in range(3) for j in range(4)}
    admission = {"admission": kw["admission"]} if "admission" in kw else {}
    rollout = Dispatcher(
        pool, make_rollout_policy(policy, true_lengths=true), chunk_tokens=chunk, **admission
    )
    return rollout, rollout.run(kw.get("groups") or _groups())


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def reference(model):
    _, result = _run(model, "baseline", 1, 10_000, kv_blocks=256)
    return {k: [s.output_token_ids for s in v] for k, v in result.samples.items()}


@pytest.mark.parametrize(
    "policy,instances,chunk",
    [
        ("baseline", 2, 10_000),
        ("divided", 1, 8),
        ("divided", 2, 16),
        ("context", 2, 8),
        ("context", 1, 10_000),
        ("oracle", 2, 12),
    ],
)
def test_every_sample_once_and_same_greedy_outputs(model, reference, policy, instances, chunk):
    rollout, result = _run(model, policy, instances, chunk)
    assert set(result.samples) == {"g0", "g1", "g2"}
    for gid, samples in result.samples.items():
        assert [s.sample_index for s in samples] == [0, 1, 2, 3]
        assert all(s.finished and s.finish_reason == "length" for s in samples)
        assert [s.output_token_ids for s in samples] == reference[gid]
    # each response's last chunk ends exactly once
    finished_keys = [k for k, _ in rollout.dispatch_log]
    assert sorted(set(finished_keys)) == sorted(f"g{i}/{j}" for i in range(3) for j in range(4))
    if policy != "baseline":
        assert result.metrics.preemptions == 0
        if chunk < 40:
            assert max(s.chunks for v in result.samples.values() for s in v) > 1
    for inst in rollout.pool:
        kv = inst.engine.kv_manager
        assert kv.num_free_blocks == kv.pool.num_blocks
        assert inst.books.reserved_blocks == 0


def test_baseline_preempts_where_divided_does_not(model):
    _, base = _run(model, "baseline", 1, 10_000, kv_blocks=14)
    _, divided = _run(model, "divided", 1, 8, kv_blocks=14)
    assert base.metrics.preemptions > 0 and base.metrics.recomputed_tokens > 0
    assert divided.metrics.preemptions == 0
    outs = lambda r: {k: [s.output_token_ids for s in v] for k, v in r.samples.items()}
    assert outs(base) == outs(divided)


def test_sampled_outputs_do_not_depend_on_chunking(model):
    groups = _groups(temperature=1.0)
    _, whole = _run(model, "baseline", 1, 10_000, kv_blocks=256, groups=groups)
    _, chunked = _run(model, "context", 2, 8, groups=_groups(temperature=1.0))
    a = {k: [s.output_token_ids for s in v] for k, v in whole.samples.items()}
    b = {k: [s.output_token_ids for s in v] for k, v in chunked.samples.items()}
    assert a == b
    assert len({tuple(x) for x in a["g0"]}) > 1, "samples of a group must differ"


def test_min_tokens_holds_across_chunks(model):
    """min_tokens bounds the whole response: every chunk bans the stop ids until the
    response (not the chunk) has min_tokens tokens, so chunking changes no output."""
    params = SamplingParams(
        temperature=1.0, max_tokens=40, min_tokens=40, seed=5, stop_token_ids=list(range(0, 1000, 2))
    )
    groups = lambda: [Group(f"g{i}", g.prompt_token_ids, params, 4, 40) for i, g in enumerate(_groups())]
    _, whole = _run(model, "baseline", 1, 10_000, kv_blocks=256, groups=groups())
    _, chunked = _run(model, "context", 2, 8, groups=groups())
    for result in (whole, chunked):
        assert all(s.num_generated == 40 for v in result.samples.values() for s in v)
    outs = lambda r: {k: [s.output_token_ids for s in v] for k, v in r.samples.items()}
    assert outs(whole) == outs(chunked)


def test_a_stop_string_at_a_chunk_end_before_min_tokens_does_not_stop(model):
    """A chunk shorter than min_tokens ends at its limit; a stop string its last token
    completes comes before min_tokens in the response, so it must not stop it."""
    prompt = _groups()[0].prompt_token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, plain = _run(model, "baseline", 1, 10_000, groups=[Group("g0", prompt, greedy, 1, 40)])
    tokens = plain.samples["g0"][0].output_token_ids
    detok = Detokenizer.from_pretrained(model)
    stop = detok.decode(tokens[:8])[len(detok.decode(tokens[:7])) :]
    assert stop.strip() and "\ufffd" not in stop
    params = greedy.clone(min_tokens=40, stop=[stop])
    _, whole = _run(model, "baseline", 1, 10_000, groups=[Group("g0", prompt, params, 1, 40)])
    _, chunked = _run(model, "context", 2, 8, groups=[Group("g0", prompt, params, 1, 40)])
    want, got = whole.samples["g0"][0], chunked.samples["g0"][0]
    assert want.output_token_ids == tokens
    assert (got.output_token_ids, got.finish_reason) == (tokens, want.finish_reason)


def test_allowed_stop_tokens_stop_no_chunk_short_of_min_tokens(model):
    """Allowed tokens that are all stop ids are sampled before min_tokens (the sampler
    has nothing else); they stop the response only once it has min_tokens tokens, not
    at the end of an earlier chunk."""
    params = SamplingParams(
        temperature=0.0, max_tokens=12, min_tokens=10, stop_token_ids=[5, 6], allowed_token_ids=[5, 6]
    )
    groups = lambda: [Group("g0", [3, 4, 7, 8], params, 1, 12)]
    _, whole = _run(model, "baseline", 1, 10_000, groups=groups())
    _, chunked = _run(model, "context", 2, 4, groups=groups())
    want, got = whole.samples["g0"][0], chunked.samples["g0"][0]
    assert want.num_generated == 10 and want.finish_reason == "stop"
    assert (got.output_token_ids, got.finish_reason) == (want.output_token_ids, "stop")


def test_peak_admission_keeps_seeded_outputs_and_never_preempts(model):
    """Tight KV, so the admission rule decides what runs together: every policy returns
    every sample once with the same seeded tokens, and the divided ones never preempt."""
    outs = {}
    for policy in ("baseline", "divided", "context"):
        _, r = _run(model, policy, 2, 8, kv_blocks=20, groups=_groups(temperature=1.0), admission="peak")
        assert sorted(s.key for v in r.samples.values() for s in v) == sorted(
            f"g{i}/{j}" for i in range(3) for j in range(4)
        )
        if policy != "baseline":
            assert r.metrics.preemptions == 0
        outs[policy] = {k: [s.output_token_ids for s in v] for k, v in r.samples.items()}
    assert all(o == outs["baseline"] for o in outs.values())


def test_engines_cut_chunks_instead_of_preempting(model):
    """A short admission horizon overfills the engines: they end chunks early for KV
    (kept in the prefix cache), nothing is preempted, and the seeded tokens are the same."""
    groups = _groups(temperature=1.0)
    _, base = _run(model, "baseline", 1, 10_000, kv_blocks=256, groups=groups)
    _, cut = _run(model, "divided", 2, 40, kv_blocks=8, groups=_groups(temperature=1.0), admission="peak:4")
    assert cut.metrics.chunk_cuts > 0 and cut.metrics.preemptions == 0
    outs = lambda r: {k: [s.output_token_ids for s in v] for k, v in r.samples.items()}
    assert outs(cut) == outs(base)


def test_policies_cannot_see_trace_lengths(model):
    """Before any response finishes, the context policy's dispatch order is the same
    for two traces with different lengths: only the replay holds them."""
    logs = []
    for lengths in ((5, 30, 12, 40), (40, 3, 33, 8)):
        groups = _groups(max_tokens=48)
        for g in groups:
            g.sampling_params = g.sampling_params.clone(ignore_eos=False)
        responses = {
            f"g{g}/{j}": list(range(100, 100 + lengths[(g + j) % 4])) for g in range(3) for j in range(4)
        }
        cfg = EngineConfig(model=str(model), num_kv_blocks=24, max_num_seqs=8)
        pool = EnginePool.start(cfg, 2, token_source=TraceReplay(responses, eos_token_id=0))
        rollout = Dispatcher(pool, make_rollout_policy("context"), chunk_tokens=8)
        first_finish = []
        rollout.on_sample_finished = lambda s, log=first_finish, r=rollout: log.append(len(r.dispatch_log))
        result = rollout.run(groups)
        for samples in result.samples.values():
            for s in samples:
                assert s.output_token_ids == responses[s.key] + [0], "replay emits the trace then EOS"
                assert s.finish_reason == "stop"
        logs.append(list(rollout.dispatch_log)[: first_finish[0]])
    n = min(len(logs[0]), len(logs[1]))
    assert n >= 4 and logs[0][:n] == logs[1][:n]
    policy = make_rollout_policy("context")
    assert not any(isinstance(v, TraceReplay) for v in vars(policy).values())
    with pytest.raises(ValueError, match="true lengths"):
        make_rollout_policy("oracle")


def test_rollout_cli_writes_groups_in_input_order(model, tmp_path):
    import json

    from seer_engine.entrypoints.cli import main

    src = tmp_path / "prompts.jsonl"
    first = {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    second = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "logprobs": 2}
    src.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["rollout", "--model", str(model), "--input", str(src), "--output", str(out), "--n", "3"]
    assert main(args + ["--rollout-mode", "--chunk-tokens", "4", "--instances", "2"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["Once upon a time", [5, 6, 7, 8]]
    assert [len(x["outputs"]) for x in lines] == [3, 3]
    assert all(len(o["token_ids"]) == 9 and o["finish_reason"] == "length" for o in lines[0]["outputs"])
    assert len({tuple(o["token_ids"]) for o in lines[0]["outputs"]}) == 1, "greedy samples agree"
    second = lines[1]["outputs"][0]
    assert len(second["logprobs"]) == len(second["token_ids"]) and second["text"] is not None
    assert main(args) == 0  # baseline (no rollout mode) gives the same greedy group
    assert json.loads(out.read_text().splitlines()[0])["outputs"] == lines[0]["outputs"]

    bad = tmp_path / "bad.jsonl"
    for line in ('{"prompt": "x", "temperature": -1}', '{"prompt": "x", "n": 0}', "not json"):
        bad.write_text(line + "\n")
        with pytest.raises(SystemExit) as err:
            main(["rollout", "--model", str(model), "--input", str(bad), "--output", str(out)])
        assert err.value.code == 2


def test_bench_rollout_report(tmp_path, game24_trace):
    import json

    from seer_engine.entrypoints.cli import main

    trace = game24_trace
    args = ["bench", "rollout", "--trace", str(trace), "--groups", "2:4", "--samples", "3",
            "--instances", "2", "--kv-blocks", "24", "--chunk-tokens", "32", "--max-tokens", "96",
            "--report", str(tmp_path), "--distributed-backend", "inproc",
            "--policy", "baseline,divided,context,seer,oracle,context+group_tree"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["policies"]) == {*args[-1].split(",")}
    for name, figures in report["policies"].items():
        for key in REPORT_KEYS:
            assert key in figures, (name, key)
        assert len(figures["accepted_tokens_per_step_thirds"]) == 3
        assert figures["output_tokens"] == report["policies"]["baseline"]["output_tokens"]
        if name != "baseline":
            assert figures["preemptions"] == 0
    assert (tmp_path / "report.png").stat().st_size > 10_000
    # Seer's adaptive budget drafts only where its profile of this machine says it pays
    # (tested with a pinned cost in test_spec_decode); a fixed budget always drafts.
    tree = report["policies"]["context+group_tree"]
    assert tree["draft_tokens_verified"] > 0 and tree["accepted_tokens_per_step"] > 0
    assert report["policies"]["seer"]["draft_tokens_verified"] >= 0
    assert report["policies"]["context"]["draft_tokens_verified"] == 0
    assert set(report["vs_context"]) == set(report["policies"])
    assert (tmp_path / "acceptance.png").stat().st_size > 5_000
    with pytest.raises(SystemExit):
        main(args[:-1] + ["context+eagle"])


def test_bench_rollout_names_a_chunk_no_instance_can_hold(tmp_path, capsys, game24_trace):
    from seer_engine.entrypoints.cli import main

    trace = game24_trace
    args = ["bench", "rollout", "--trace", str(trace), "--groups", "2", "--samples", "4", "--instances", "1",
            "--kv-blocks", "6", "--chunk-tokens", "64", "--max-tokens", "200", "--policy", "divided",
            "--distributed-backend", "inproc", "--report", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2
    assert "a chunk needs more KV blocks than an instance has" in capsys.readouterr().err


def test_bench_rollout_with_instance_processes_and_a_kv_pool(tmp_path, game24_trace):
    """Two instance processes and the local shared-memory KV pool (chunk ends saved
    to it): the replayed tokens are the same as in-process."""
    import json

    from seer_engine.entrypoints.cli import main

    trace = game24_trace
    args = ["bench", "rollout", "--trace", str(trace), "--groups", "2", "--samples", "3",
            "--instances", "2", "--kv-blocks", "24", "--chunk-tokens", "32", "--max-tokens", "96",
            "--policy", "context,seer",
            "--report", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["distributed_backend"] == "mp" and report["meta"]["kv_connector"] == "local"
    for figures in report["policies"].values():
        assert figures["backend"] == "mp" and figures["kv_connector"] == "local"
        assert figures["pool_saved_blocks"] > 0 and figures["pool_failures"] == 0
    assert main(args[:-2] + ["--distributed-backend", "inproc", "--report", str(tmp_path / "inproc")]) == 0
    inproc = json.loads((tmp_path / "inproc" / "report.json").read_text())
    for name, figures in report["policies"].items():
        assert figures["output_tokens"] == inproc["policies"][name]["output_tokens"]


def _task_rollout_args(model, out) -> list[str]:
    return ["rollout", "--model", str(model), "--task", "arith", "--prompts", "3", "--n", "4",
            "--max-tokens", "12", "--knob", "steps=1", "--knob", "ops=add,sub", "--seed", "5",
            "--output", str(out), "--num-threads", "1"]  # fmt: skip


def test_rollout_cli_task_grades_every_response(model, tmp_path, capsys):
    import json

    from seer_engine.engine.detokenizer import Detokenizer
    from seer_engine.entrypoints.cli import main
    from seer_engine.tasks import TaskPrompt, get_task, task_prompts

    out = tmp_path / "out.jsonl"
    args = _task_rollout_args(model, out)
    assert main(args + ["--rollout-mode", "--chunk-tokens", "4"]) == 0
    err = capsys.readouterr().err
    for words in ("accuracy (mean reward)", "groups with mixed rewards", "spread within groups", "arith-5-2"):
        assert words in err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    tok = Detokenizer.from_pretrained(model)
    expected = task_prompts(
        "arith", 3, seed=5, chat_template=tok.apply_chat_template, steps=1, ops=("add", "sub")
    )
    task = get_task("arith", steps=1, ops=("add", "sub"))
    assert [x["id"] for x in lines] == [p.id for p in expected]
    for line, p in zip(lines, expected):
        assert line["prompt"] == p.text and line["answer"] == p.answer and line["messages"] == p.messages
        assert line["prompt_token_ids"] == tok.encode(p.text)
        assert len(line["outputs"]) == 4
        back = TaskPrompt(line["id"], line["task"], line["messages"], line["answer"], line["data"])
        for o in line["outputs"]:
            assert 1 <= len(o["token_ids"]) <= 12 and o["finish_reason"] in ("stop", "length")
            grade = task.grade(back, o["text"])
            assert (o["reward"], o["parsed"], o["verdict"]) == (grade.reward, grade.parsed, grade.verdict)
    assert main(args) == 0  # baseline scheduling: the same seeded responses
    assert [json.loads(x) for x in out.read_text().splitlines()] == lines


@pytest.mark.parametrize(
    "change,message",
    [
        (["--input", "x.jsonl"], "exactly one of --input and --task"),
        (["--knob", "digits=3"], "has no knob digits"),
        (["--knob", "steps=two"], "knob steps wants int, got 'two'"),
        (["--knob", "steps"], "is not KEY=VALUE"),
        (["--prompts", "0"], "--prompts must be >= 1"),
        (["--n", "0"], "--n must be >= 1"),
    ],
)
def test_rollout_cli_task_errors(model, tmp_path, capsys, change, message):
    from seer_engine.entrypoints.cli import main

    with pytest.raises(SystemExit) as err:
        main(_task_rollout_args(model, tmp_path / "out.jsonl") + change)
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_rollout_cli_needs_input_or_task(model, tmp_path, capsys):
    from seer_engine.entrypoints.cli import main

    base = ["rollout", "--model", str(model), "--output", str(tmp_path / "o.jsonl")]
    cases = [([], "exactly one of --input and --task"),
             (["--input", "x", "--knob", "steps=1"], "--prompts and --knob go with --task")]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(SystemExit):
            main(base + extra)
        assert message in capsys.readouterr().err


def test_bench_rollout_task_samples_the_same_responses_under_every_policy(model, tmp_path):
    """Real outputs of the model (no trace): seeded sampling gives every policy the
    same responses, so rewards and lengths agree and oracle gets true lengths."""
    import json

    from seer_engine.entrypoints.cli import main

    args = ["bench", "rollout", "--model", str(model), "--task", "arith", "--prompts", "3", "--n", "3",
            "--max-tokens", "16", "--temperature", "1.0", "--instances", "2", "--kv-blocks", "24",
            "--chunk-tokens", "8", "--distributed-backend", "inproc", "--num-threads", "1",
            "--report", str(tmp_path), "--policy", "oracle,baseline,divided,context,seer"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["policies"]) == ["baseline", "divided", "context", "seer", "oracle"]
    assert report["meta"]["reference_policy"] == "baseline" and report["meta"]["task"] == "arith"
    workload = report["meta"]["workload"]
    assert workload["responses"] == 9 and len(workload["per_group"]) == 3
    for key in ("within_cv", "across_cv", "within_share", "mean_len", "max_len"):
        assert key in workload["length"]
    tokens = report["policies"]["baseline"]["output_tokens"]
    for name, figures in report["policies"].items():
        assert figures["identical_responses"] == 9, name
        assert figures["mean_reward"] == workload["mean_reward"]
        assert figures["output_tokens"] == tokens
        for key in REPORT_KEYS:
            assert key in figures, (name, key)
    assert (tmp_path / "lengths.png").stat().st_size > 5_000
    # on a modeled clock the same responses take the same modeled time in every run
    modeled = [*args[:-2], "--policy", "divided", "--clock", "moonlight", "--report"]
    makespans = []
    for run in ("a", "b"):
        assert main([*modeled, str(tmp_path / run)]) == 0
        again = json.loads((tmp_path / run / "report.json").read_text())
        assert again["meta"]["clock"] == "moonlight" and again["meta"]["admission"] == "peak"
        assert again["policies"]["divided"]["identical_responses"] == 9
        makespans.append(again["policies"]["divided"]["makespan_s"])
    assert makespans[0] == makespans[1] > 0


@pytest.mark.parametrize(
    "change,message",
    [
        (["--trace", "t.jsonl.gz"], "exactly one of --trace and --task"),
        (["--groups", "4"], "--groups goes with --trace"),
        (["--policy", "oracle"], "oracle takes its lengths from another policy's run"),
        (["--model", None], "--task needs --model"),
        (["--admission", "peak:x"], "peak:TOKENS needs a positive number of tokens, got 'x'"),
        (["--backfill", "some"], "backfill must be one of none, claim, any"),
    ],
)
def test_bench_rollout_task_errors(model, capsys, change, message):
    from seer_engine.entrypoints.cli import main

    args = ["bench", "rollout", "--model", str(model), "--task", "arith", "--prompts", "2"]
    if change[1] is None:
        args = args[:2] + args[4:]
    else:
        args += change
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_rollout_cli_task_needs_a_chat_template(model, tmp_path, capsys):
    import json
    import shutil

    from seer_engine.entrypoints.cli import main

    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        main(_task_rollout_args(plain, tmp_path / "out.jsonl"))
    assert "needs a chat model: the model's tokenizer has no chat template" in capsys.readouterr().err


def test_a_modeled_clock_times_the_work_not_the_machine(model):
    """On a modeled clock each step costs what the step-time model says its shape costs:
    the same rollout takes the same modeled time every run and on either backend,
    whatever the machine was doing."""
    from seer_engine.sim.profile import StepTimeModel

    timer = StepTimeModel(a_s=0.02, b_s_per_token=1e-4, c_s_per_kv_token=1e-6, d_s_per_logit=1e-5)

    def run(backend: str):
        cfg = EngineConfig(model=str(model), num_kv_blocks=64, max_num_seqs=8, num_threads=1)
        policy = make_rollout_policy("context")
        with EnginePool.start(cfg, 2, backend=backend, policy=policy, step_timer=timer) as pool:
            return Dispatcher(pool, policy, chunk_tokens=8).run(_groups()).metrics

    first, again, processes = run("inproc"), run("inproc"), run("mp")
    assert first.makespan_s > 0 and first.makespan_s == again.makespan_s == processes.makespan_s
    assert first.instance_busy_s == processes.instance_busy_s and first.steps == processes.steps
    # every step costs at least the fixed term, so the busy time bounds the step count
    assert sum(first.instance_busy_s) >= first.steps * timer.a_s


def test_step_shapes_count_what_the_rows_compute():
    from seer_engine.engine.stats import StepShape

    # a decode row (20 computed, 1 new) with a 3-node draft, and a prompt span of 8 tokens
    shape = StepShape.of([(20, 4, 10, 21, 0), (0, 8, 30, 30, 0)])
    assert shape.scheduled_tokens == 12 and shape.kv_tokens == 24 + 8
    assert shape.kv_pairs == (4 * 20 + 10) + (0 + 36)
    assert shape.logit_tokens == 4 and shape.kind == "mixed"
    assert StepShape.of([(29, 1, 10, 30, 0)]).kind == "decode"
    assert StepShape.of([(4, 8, 30, 30, 8)]).logit_tokens == 8  # prompt positions scored for prompt_logprobs


def test_bench_rollout_on_a_modeled_clock(tmp_path, game24_trace):
    import json

    from seer_engine.entrypoints.cli import main

    trace = game24_trace
    args = ["bench", "rollout", "--trace", str(trace), "--groups", "2", "--samples", "2",
            "--instances", "2", "--kv-blocks", "24", "--chunk-tokens", "32", "--max-tokens", "64",
            "--distributed-backend", "inproc", "--policy", "divided,context"]  # fmt: skip
    with pytest.raises(SystemExit) as bad:
        main([*args, "--clock", "no-such-setup"])
    assert bad.value.code == 2
    reports = []
    for run in ("a", "b"):
        assert main([*args, "--clock", "moonlight", "--report", str(tmp_path / run)]) == 0
        reports.append(json.loads((tmp_path / run / "report.json").read_text()))
    assert reports[0]["meta"]["clock"] == "moonlight"
    for name in ("divided", "context"):
        assert reports[0]["policies"][name]["makespan_s"] == reports[1]["policies"][name]["makespan_s"]


def test_rollout_cli_times_the_rollout_not_its_setup(model, tmp_path, capsys, monkeypatch):
    """Instance processes run on the wall clock from the pool's start: the rollout's
    time (and tokens/s) counted the reading and tokenizing of the input after it."""
    import json
    import re
    from types import SimpleNamespace

    import seer_engine.entrypoints.rollout_cli as rollout_cli
    import seer_engine.rollout.pool as pool_module
    from seer_engine.entrypoints.cli import main

    setup_s = 1000.0  # what reading the input takes, on the pool's clock
    skipped = [0.0]
    real = pool_module.time.perf_counter
    monkeypatch.setattr(pool_module, "time", SimpleNamespace(perf_counter=lambda: real() + skipped[0]))
    read_groups = rollout_cli.read_groups

    def slow_read(*args, **kw):
        skipped[0] += setup_s
        return read_groups(*args, **kw)

    monkeypatch.setattr(rollout_cli, "read_groups", slow_read)
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 6}) + "\n")
    args = ["rollout", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "out.jsonl"),
            "--n", "2", "--instances", "2", "--rollout-mode", "--num-threads", "1"]  # fmt: skip
    assert main(args) == 0
    seconds = float(re.search(r"12 tokens in ([0-9.]+)s", capsys.readouterr().err).group(1))
    assert 0 < seconds < setup_s


def test_seeded_group_samples_what_the_plain_engine_samples(model):
    """A seeded group in an offline rollout (divided into chunks, on two instances) takes
    the tokens the plain engine gives the same request with the same seed and n."""
    from seer_engine.entrypoints.llm import LLM

    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=-3)
    prompt = list(range(10, 27))
    _, result = _run(model, "divided", 2, 8, groups=[Group("g0", prompt, params, 4, 24)])
    plain = LLM(str(model)).generate([{"prompt_token_ids": prompt}], params.clone(n=4))[0]
    rolled = [s.output_token_ids for s in result.samples["g0"]]
    assert rolled == [o.token_ids for o in plain.outputs]
    assert len({tuple(t) for t in rolled}) == 4  # the samples differ: the seeds did their work


def test_rollout_cli_groups_of_one_prompt_share_no_response(model, tmp_path):
    """Lines without a seed take seeds derived from --seed: a prompt on three lines draws
    3n different responses (group k's sample i once took group k+1's sample i-1 seed,
    and with it the same tokens)."""
    import json

    from seer_engine.entrypoints.cli import main

    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": [5, 6, 7]}\n' * 3)
    args = ["rollout", "--model", str(model), "--input", str(src), "--output", str(out), "--n", "3",
            "--max-tokens", "8", "--temperature", "1.0", "--num-threads", "1"]  # fmt: skip
    assert main(args) == 0
    responses = [
        tuple(o["token_ids"]) for line in out.read_text().splitlines() for o in json.loads(line)["outputs"]
    ]
    assert len(set(responses)) == 9
