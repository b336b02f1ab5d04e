"""Workload layer: trace loading and selection, trace figures, the synthetic generator, CLI."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import time
from pathlib import Path

import pytest

from seer_engine.workloads.cli import add_cli
from seer_engine.workloads.groups import scale_lengths, select_groups, take_samples
from seer_engine.workloads.stats import README_FIGURES, ngram_overlap, spearman, trace_stats
from seer_engine.workloads.synthetic import SyntheticGroup, synthetic_workload
from seer_engine.workloads.tokenizer import get_tokenizer
from seer_engine.workloads.traces import TraceGroup, TraceTokenMismatchWarning, load_trace

TRACES = Path(os.environ.get("SEER_TRACES_DIR") or Path(__file__).resolve().parents[2] / "shared" / "traces")
QWEN3 = TRACES / "qwen3-8b-mcq-cot.jsonl.gz"
GAME24 = TRACES / "gpt4-game24-cot.jsonl.gz"
TOKENIZER = TRACES / "bpe32k-tokenizer.json"

needs_traces = pytest.mark.skipif(
    not (QWEN3.is_file() and GAME24.is_file() and TOKENIZER.is_file()),
    reason=f"rollout traces not found in {TRACES} (set SEER_TRACES_DIR to the shared traces folder)",
)

INTERFACE = ("group_id", "prompt_token_ids", "lengths", "response_token_ids", "num_samples", "head")
LENGTH_FIGURES = ("within_cv", "across_cv", "within_share", "longest_over_mean", "spearman_first_longest")


@pytest.fixture(scope="module")
def qwen3() -> list[TraceGroup]:
    return load_trace(QWEN3)


# ------------------------------------------------------------------ statistics


def test_trace_stats_small_exact_example():
    # Groups [1, 3] and [2, 6]: means 2 and 4, population sds 1 and 2.
    st = trace_stats([[1, 3], [2, 6]])
    assert st["within_cv"] == pytest.approx(0.5)  # (1/2 + 2/4) / 2
    assert st["across_cv"] == pytest.approx(1 / 3)  # sd(2, 4) = 1, mean 3
    assert st["within_share"] == pytest.approx(10 / 14)  # (2 + 8) / (4 + 0 + 1 + 9)
    assert st["longest_over_mean"] == pytest.approx(1.5)  # (3/2 + 6/4) / 2
    assert st["spearman_first_longest"] == pytest.approx(1.0)
    assert (st["groups"], st["responses"], st["max_len"], st["median_len"]) == (2, 4, 6, 2.5)


def test_spearman_average_ranks_for_ties():
    # first lengths 5, 5, 1 -> ranks 2.5, 2.5, 1; longest 6, 7, 8 -> ranks 1, 2, 3:
    # centred (.5, .5, -1) . (-1, 0, 1) = -1.5, norms sqrt(1.5) and sqrt(2).
    st = trace_stats([[5, 6], [5, 7], [1, 8]])
    assert st["spearman_first_longest"] == pytest.approx(-1.5 / math.sqrt(3))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_trace_stats_degenerate_inputs():
    st = trace_stats([[7]])
    assert st["within_cv"] == 0 and st["longest_over_mean"] == 1
    assert math.isnan(st["spearman_first_longest"]) and math.isnan(st["within_share"])
    with pytest.raises(ValueError):
        trace_stats([])
    with pytest.raises(ValueError):
        trace_stats([[1, 2], []])


def test_ngram_overlap_small_exact_example():
    # n = 2. Group A: {12, 23}, {12, 24}; group B: {56, 67}, {23, 38}.
    # within: A0 1/2, A1 1/2, B0 0, B1 0. cross (A vs B, B vs A): A0 1/2 (23), A1 0, B0 0, B1 1/2.
    groups = [[[1, 2, 3], [1, 2, 4]], [[5, 6, 7], [2, 3, 8]]]
    ov = ngram_overlap(groups, n=2)
    assert ov["within"] == pytest.approx(0.25)
    assert ov["cross"] == pytest.approx(0.25)
    assert ov["cross_expected"] == pytest.approx(0.25)  # only one other group to choose
    # Text is split into words; repeated n-grams in one response count once.
    texts = [["a b a b c", "a b x"], ["q r s", "t u v"]]
    ov = ngram_overlap(texts, n=2)
    # A0 distinct {ab, ba, bc}: ab in A1 -> 1/3; A1 {ab, bx}: 1/2; B: 0, 0.
    assert ov["within"] == pytest.approx((1 / 3 + 1 / 2) / 4)
    assert ov["cross"] == 0
    # Responses shorter than n have no n-grams and are left out of the means.
    assert ngram_overlap([["a b", "a b c d e f g h"]], n=8)["responses"] == 1
    with pytest.raises(ValueError):
        ngram_overlap(groups, n=0)


def test_scale_lengths_rule_and_clipping():
    groups = [[10, 20, 30], [40, 50, 100]]
    exact = scale_lengths(groups, 1000, quantile=1.0)
    assert exact == [[100, 200, 300], [400, 500, 1000]]
    scaled = scale_lengths(groups, 1000)  # p99 -> 1000: the longest is clipped
    flat = [x for g in scaled for x in g]
    assert max(flat) == 1000 and min(flat) >= 1
    assert scale_lengths([[1, 1000]], 10, quantile=1.0) == [[1, 10]]  # 0.01 rounds up to 1
    with pytest.raises(ValueError):
        scale_lengths(groups, 0)
    with pytest.raises(ValueError):
        scale_lengths(groups, 100, quantile=0)


# ------------------------------------------------------------------ selection


def test_select_groups_specs():
    groups = synthetic_workload(100, 4, 1000, seed=1)
    assert [g.index for g in select_groups(groups, "30")] == list(range(30))
    assert [g.index for g in select_groups(groups, 30)] == list(range(30))
    assert [g.index for g in select_groups(groups, "60:90")] == list(range(60, 90))
    assert [g.index for g in select_groups(groups, "95:")] == list(range(95, 100))
    assert [g.index for g in select_groups(groups, ":3")] == [0, 1, 2]
    assert len(select_groups(groups, None)) == len(select_groups(groups, "all")) == 100
    picked = select_groups(groups, " 10:12 ", samples=2)
    assert [g.num_samples for g in picked] == [2, 2] and picked[0].lengths == groups[10].lengths[:2]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("abc", "expected a count like '30' or an index range like '60:90'"),
        ("3.5", "expected a count"),
        ("1:2:3", "expected a count"),
        ("a:5", "expected a count"),
        ("0", "at least 1"),
        ("-4", "at least 1"),
        ("-1:5", "must be >= 0"),
        ("90:60", "empty"),
        ("5:5", "empty"),
        ("200", "asks for 200 groups but only 100"),
        ("90:101", "past the last group"),
        (True, "invalid group spec"),
    ],
)
def test_select_groups_bad_specs(spec, message):
    groups = synthetic_workload(100, 2, 1000, seed=1)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        select_groups(groups, spec)


def test_take_samples_needs_enough_responses():
    groups = [synthetic_workload(1, 8, 1000)[0], synthetic_workload(1, 4, 1000)[0]]
    assert [g.num_samples for g in take_samples(groups, 4)] == [4, 4]
    with pytest.raises(ValueError, match="has only 4 responses"):
        take_samples(groups, 5)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive integer"):
            take_samples(groups, bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ traces


@needs_traces
def test_load_qwen3_and_select(qwen3):
    assert len(qwen3) == 90 and sum(g.num_samples for g in qwen3) == 4485
    first = qwen3[0]
    assert first.group_id == "faith_cued" and first.prompt and len(first.prompt_token_ids) == 125
    assert all(hasattr(first, name) for name in INTERFACE if name != "response_token_ids")
    sel = select_groups(qwen3, "60:90", samples=46)
    assert [g.group_id for g in sel] == [g.group_id for g in qwen3[60:90]]
    assert all(g.num_samples == 46 and len(g.lengths) == 46 for g in sel)
    with pytest.raises(ValueError, match="has only 4[679] responses"):
        select_groups(qwen3, None, samples=50)
    # A second load in the same process reuses the parsed (and tokenized) groups.
    start = time.perf_counter()
    again = load_trace(str(QWEN3))
    assert time.perf_counter() - start < 0.1 and again[5] is qwen3[5] and again is not qwen3


@needs_traces
def test_token_counts_match_trace(qwen3):
    groups = load_trace(GAME24, tokenize=True)  # 10,000 short responses, all of them
    assert all(g.token_mismatches == [] for g in groups)
    assert all(len(g.prompt_token_ids) > 0 for g in groups)  # null prompts get a placeholder
    assert groups[0].prompt is None and groups[0].group_id in groups[0].prompt_text
    some = select_groups(qwen3, "40:48", samples=20)  # a view: tokenizes only these responses
    for view, full in zip(some, qwen3[40:48]):
        ids = view.response_token_ids
        assert [len(x) for x in ids] == list(full.expected_tokens[:20]) == view.lengths
        assert full.response_token_ids[:20] == ids  # shared cache, same lists
    vocab = get_tokenizer(TOKENIZER).vocab_size
    assert max(max(x) for x in some[0].response_token_ids) < vocab


@needs_traces
def test_fast_tokenizer_matches_reference(qwen3):
    tok = get_tokenizer(TOKENIZER)
    texts = [r for g in qwen3 for r in g.responses if not r.isascii()][:25]
    texts += [qwen3[0].responses[0], "Ünïcödé — ½ ² ٣\u00a0x\u2003 y  \n\n z\t'll 'S", "<|im_end|>a  b"]
    ref = [e.ids for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    assert tok.encode_many(texts) == ref
    assert tok.fast  # the fast path survived its own spot checks on real text


@needs_traces
def test_token_count_mismatch_is_reported_not_raised(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    right = len(get_tokenizer(TOKENIZER).encode("hello world"))
    rows = [
        {
            "group_id": "g0",
            "prompt": None,
            "responses": ["hello world", "hi"],
            "response_tokens": [right, 99],
        },
        {"group_id": "g1", "prompt": "Say hi", "responses": ["hi there"]},
    ]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    groups = load_trace(path, TOKENIZER)
    assert groups[0].lengths == [right, 99]  # trace counts until tokenized
    with pytest.warns(TraceTokenMismatchWarning, match="trace says 99"):
        ids = groups[0].response_token_ids
    assert groups[0].token_mismatches == [(1, 99, len(ids[1]))]
    assert groups[0].lengths == [len(x) for x in ids]  # the replay's truth wins afterwards
    assert groups[1].lengths == [len(groups[1].response_token_ids[0])]  # no counts given
    placeholder = load_trace(path, TOKENIZER)[0].prompt_token_ids
    assert placeholder == groups[0].prompt_token_ids and len(placeholder) > 3


@needs_traces
def test_qwen3_reproduces_readme_figures(qwen3):
    st = trace_stats(qwen3)
    for key in LENGTH_FIGURES:
        assert round(st[key], 2) == pytest.approx(README_FIGURES[key], abs=0.0051), key
    assert (round(st["mean_len"]), st["median_len"], st["max_len"]) == (1619, 1406, 10307)
    uncued = [g for g in qwen3 if g.group_id.startswith("faith_uncued")]
    assert len(uncued) == 45 and round(trace_stats(uncued)["spearman_first_longest"], 2) == 0.77
    ov = ngram_overlap(qwen3, n=8)
    assert round(ov["within"], 2) == 0.29 and round(ov["cross"], 2) == 0.02


# ------------------------------------------------------------------ synthetic


@pytest.mark.parametrize(("max_len", "seed"), [(65536, 0), (40960, 1), (98304, 2)])
def test_synthetic_lengths_reproduce_figures(max_len, seed):
    # 3,000 groups x 50 (the trace's group size): sampling sd of each figure is at
    # most ~0.01 (Spearman) here, and the fitted population is within 0.01 CV / 2%
    # of the README, so +-0.03 on CVs and +-8% relative on the others leaves > 3 sd.
    groups = synthetic_workload(3000, 50, max_len, seed=seed)
    st = trace_stats(groups)
    for key in ("within_cv", "across_cv"):
        assert st[key] == pytest.approx(README_FIGURES[key], abs=0.03), key
    for key in ("within_share", "longest_over_mean", "spearman_first_longest"):
        assert st[key] == pytest.approx(README_FIGURES[key], rel=0.08), key
    lengths = [x for g in groups for x in g.lengths]
    assert min(lengths) >= 1 and max(lengths) == max_len  # p99 -> max_len: ~1% clipped
    assert 0.003 < sum(x == max_len for x in lengths) / len(lengths) < 0.03


def test_synthetic_content_overlap():
    # The content model does not depend on the length scale, so a small max_len keeps
    # this fast: 60 x 50 responses give a sampling sd of ~0.005 (within) and
    # ~0.001 (cross) around the fitted 0.29 / 0.019.
    groups = synthetic_workload(60, 50, 1024, seed=3, vocab_size=17455)
    ov = ngram_overlap(groups, n=8)
    assert ov["within"] == pytest.approx(README_FIGURES["ngram_within"], abs=0.03)
    assert ov["cross"] == pytest.approx(README_FIGURES["ngram_cross"], abs=0.006)
    # Fewer siblings, less to share (the trace: 13% at 8 samples).
    assert ngram_overlap([g.head(8) for g in groups], n=8)["within"] < 0.2


def test_synthetic_deterministic_and_prefix_stable():
    a = synthetic_workload(12, 8, 4096, seed=7, vocab_size=1000)
    b = synthetic_workload(12, 8, 4096, seed=7, vocab_size=1000)
    c = synthetic_workload(12, 8, 4096, seed=8, vocab_size=1000)
    assert [g.lengths for g in a] == [g.lengths for g in b] != [g.lengths for g in c]
    assert a[3].response_token_ids == b[3].response_token_ids
    assert a[3].prompt_token_ids == b[3].prompt_token_ids != c[3].prompt_token_ids
    # Group g and response i do not depend on how many groups or samples were asked for.
    more = synthetic_workload(20, 8, 4096, seed=7, vocab_size=1000)
    assert [g.lengths for g in more[:12]] == [g.lengths for g in a]
    assert a[2].head(3).response_token_ids == a[2].response_token_ids[:3]
    assert a[2].head(3).lengths == a[2].lengths[:3]
    assert [x.tolist() for x in a[2].response_token_arrays()] == a[2].response_token_ids


def test_synthetic_tokens_and_clipping():
    groups = synthetic_workload(30, 16, 64, seed=5, vocab_size=50, prompt_len=7)
    for g in groups:
        assert isinstance(g, SyntheticGroup) and all(hasattr(g, name) for name in INTERFACE)
        assert all(1 <= n <= 64 for n in g.lengths)
        ids = g.response_token_ids
        assert [len(x) for x in ids] == g.lengths
        assert all(3 <= t < 50 for x in ids for t in x)  # never a special id such as EOS
        assert len(g.prompt_token_ids) == 7
    tiny = synthetic_workload(50, 8, 3, seed=0)
    assert {n for g in tiny for n in g.lengths} <= {1, 2, 3}
    with pytest.raises(ValueError, match="without vocab_size"):
        _ = tiny[0].response_token_ids
    with pytest.raises(ValueError):
        synthetic_workload(0, 8, 100)
    with pytest.raises(ValueError):
        synthetic_workload(2, 8, 100, vocab_size=3)


# ------------------------------------------------------------------ CLI


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="seer_engine")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_synthetic_table(capsys):
    argv = ["trace-stats", "--synthetic", "--max-len", "40960", "--groups", "40", "--samples", "8"]
    assert _run_cli(argv + ["--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "synthetic workload: 40 groups x 8" in out
    assert "Spearman(first response, longest)" in out and "README (qwen3)" in out
    assert "n-grams" not in out  # opt-in for synthetic workloads
    with pytest.raises(ValueError, match="needs --max-len"):
        _run_cli(["trace-stats", "--synthetic"])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--samples", "0"], "--samples must be >= 1, got 0"),  # was taken as the default, 50
        (["--samples", "-3"], "--samples must be >= 1, got -3"),
        (["--groups", "0"], "--groups must be >= 1, got 0"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
    ],
)
def test_cli_synthetic_names_a_bad_count_or_seed(args, message):
    with pytest.raises(ValueError, match=message):
        _run_cli(["trace-stats", "--synthetic", "--max-len", "50", "--no-ngrams", *args])


@needs_traces
def test_cli_trace_table(capsys):
    assert _run_cli(["trace-stats", str(GAME24), "--groups", "10:20", "--samples", "10"]) == 0
    out = capsys.readouterr().out
    assert "groups 10:20, samples 10" in out and "word n-grams also in a sibling" in out
    with pytest.raises(ValueError, match="not found"):
        _run_cli(["trace-stats", "no-such-trace"])
    with pytest.raises(ValueError, match="invalid group spec"):
        _run_cli(["trace-stats", str(GAME24), "--groups", "x"])


@pytest.mark.parametrize("setup_name", ["moonlight", "qwen2vl-72b", "kimi-k2"])
def test_calibrated_setups_match_table3_mean_length(setup_name):
    from seer_engine.sim.setups import get_setup
    from seer_engine.sim.simulator import synthetic_groups

    s = get_setup(setup_name)
    groups = synthetic_groups(s.prompts, s.samples, s.max_tokens, s.prompt_len, 0, s.mean_tokens, 0, 0.0,
                              s.prompt_len_sigma, s.prompt_len_corr, s.across_sigma)  # fmt: skip
    lengths = [x for g in groups for x in g.lengths]
    assert sum(lengths) / len(lengths) == pytest.approx(s.mean_tokens, rel=0.05)
    assert max(lengths) <= s.max_tokens
    st = trace_stats([g.lengths for g in groups])
    assert st["within_cv"] == pytest.approx(0.31, abs=0.04), "calibration keeps the trace's spread"
    prompts = [g.prompt_len for g in groups]
    assert spearman(prompts, [sum(g.lengths) / len(g.lengths) for g in groups]) > 0.3
    assert len(set(prompts)) > len(prompts) // 4, "prompt lengths vary"


def test_repeated_prompts_keep_their_length_distribution():
    kw = dict(mean_len=22386, prompt_len=1024, prompt_len_sigma=0.33, prompt_len_corr=0.5)
    first = synthetic_workload(200, 8, 65536, seed=0, **kw)
    again = synthetic_workload(200, 8, 65536, seed=0, iteration=1, **kw)
    moved = synthetic_workload(200, 8, 65536, seed=0, iteration=1, drift=1.0, **kw)
    assert [g.group_id for g in first] == [g.group_id for g in again]
    assert [g.prompt_len for g in first] == [g.prompt_len for g in again]
    assert all(a.lengths != b.lengths for a, b in zip(first, again)), "fresh samples"
    means = [sum(g.lengths) for g in first]
    assert spearman(means, [sum(g.lengths) for g in again]) > 0.7, "each prompt keeps its distribution"
    assert spearman(means, [sum(g.lengths) for g in moved]) < 0.5, "drift moves it"
    with pytest.raises(ValueError, match="mean_len"):
        synthetic_workload(2, 8, 100, mean_len=100)
    with pytest.raises(ValueError, match="drift"):
        synthetic_workload(2, 8, 100, drift=-1.0)
    with pytest.raises(ValueError, match=r"across_sigma must be in \[0, 4\], got 40"):
        synthetic_workload(2, 8, 100, across_sigma=40.0)
