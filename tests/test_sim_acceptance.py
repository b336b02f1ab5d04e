"""The simulator's acceptance model: replay on hand-made groups with known answers (real C++
tree), the table's interpolation and binning, and its file format."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest

from seer_engine.core.draft import DraftTree
from seer_engine.sim.acceptance import (
    DEFAULT_ACCEPTANCE_PATH,
    AcceptanceModel,
    default_acceptance,
    lead_share,
)
from seer_engine.sim.acceptance_replay import (
    ReplayStep,
    accepted_len,
    fit_acceptance,
    probe_starts,
    replay_group,
)
from seer_engine.sim.acceptance_replay import main as replay_main

PROMPT = list(range(1000, 1020))
X = list(range(3000, 3200))  # 200 distinct tokens


@dataclass
class Group:
    group_id: str
    response_token_ids: list[list[int]]
    prompt_token_ids: list[int] = field(default_factory=lambda: list(PROMPT))


def late_copy() -> Group:
    """Sibling 0 writes X and finishes at step 200; sibling 1 writes 250 unrelated tokens, then X:
    from its second X token on it can accept all of X from sibling 0's finished sequence."""
    return Group("late", [list(X), list(range(5000, 5250)) + X])


def totals(records: list[ReplayStep], lo: float = 0.0, hi: float = 1.0) -> tuple[int, int]:
    """(steps, accepted tokens) over the records with lo <= stage < hi."""
    inside = [r.accepted for r in records if lo <= r.stage < hi]
    return len(inside), sum(inside)


@pytest.mark.parametrize("budget, x_steps", [(1, 101), (4, 41), (16, 13)])
def test_late_sibling_accepts_what_a_finished_sibling_wrote(budget, x_steps):
    # Longest-match drafts (no backoff): a copied passage is drafted budget-deep at once.
    records = replay_group(late_copy(), budget, multi_path=True, backoff=0.0)
    # Both siblings alone: 400 steps at stage 0, nothing in common, nothing accepted.
    assert totals(records, 0.0, 0.5) == (400, 0)
    # Sibling 1 after sibling 0 finished: 50 more unrelated tokens, then X: its first token
    # has no match, every later step accepts min(budget, tokens left) of X: all of X but the
    # bonus tokens, the last of which falls past the end.
    steps, accepted = totals(records, 0.5, 1.0)
    assert steps == 50 + x_steps
    assert accepted == 201 - x_steps


@pytest.mark.parametrize("multi_path", [True, False])
def test_catching_up_with_a_sibling_ahead(multi_path):
    """Identical text, sibling 1 starting 60 tokens later: it catches up on sibling 0's
    frontier and then both finish together, so it accepts exactly those 60 tokens."""
    group = Group("behind", [list(X), list(range(2000, 2060)) + X])
    for budget in (1, 16):
        records = replay_group(group, budget, multi_path)
        assert totals(records) == (400, 60)
        assert {r.stage for r in records} == {0.0}


def test_a_late_start_drafts_from_the_sibling_ahead_and_coverage_says_so():
    """Identical responses, sibling 1 starting 50 steps late: while sibling 0 is ahead,
    sibling 1's coverage is 1 (a whole draft written past it) and it accepts the 50
    tokens of the gap; sibling 0, never behind, has coverage 0 and accepts nothing."""
    group = Group("late start", [list(X), list(X)])
    records = replay_group(group, 16, starts=[0, 50])
    assert sum(r.accepted for r in records) == 50
    assert all(r.coverage > 0 for r in records if r.accepted)
    assert sum(1 for r in records if r.coverage == 1.0) >= 50 // 17  # drafts of 16 + 1 bonus close the gap
    lone = records[:50]  # sibling 0 alone before sibling 1 starts
    assert all(r.coverage == 0.0 and r.accepted == 0 and r.response == 0 for r in lone)
    assert replay_group(group, 16) == replay_group(group, 16, starts=[0, 0])
    with pytest.raises(ValueError, match="1 starts for 2 responses"):
        replay_group(group, 16, starts=[0])


def test_staggered_fit_has_coverage_bins_and_sees_the_gain():
    """Two identical responses replayed in lock-step and staggered: steps with a sibling
    ahead (coverage >= 0.5) accept far more than steps without."""
    group = Group("pair", [list(X), list(X)])
    model = fit_acceptance(
        [group], budgets=(1, 16), stage_edges=(0.0, 1.0), coverage_edges=(0.0, 0.5, 1.0),
        spreads=(0.0, 1.0), progress=False,
    )  # fmt: skip
    low, high = model.accepted[0]
    assert high[1] > 5 * max(low[1], 0.1) and high[0] > 0.5
    assert model.measured["spreads"] == [0.0, 1.0]
    assert model.accepted_per_step(16, 0.0, 0.9) == pytest.approx(high[1])
    assert model.accepted_per_step(16, 0.0, 0.1) == pytest.approx(low[1])
    again = fit_acceptance(
        [group], budgets=(1, 16), stage_edges=(0.0, 1.0), coverage_edges=(0.0, 0.5, 1.0),
        spreads=(0.0, 1.0), progress=False,
    )  # fmt: skip
    assert again.accepted == model.accepted, "the staggered starts are seeded"
    with pytest.raises(ValueError, match="spreads must be >= 0"):
        fit_acceptance([group], spreads=(-1.0,), progress=False)


def test_lead_share_counts_each_sibling_up_to_a_whole_draft():
    assert lead_share(10, [10, 18, 40]) == pytest.approx((0 + 8 / 16 + 1) / 3)
    assert lead_share(10, [0, 5]) == 0.0
    assert lead_share(10, []) == 0.0
    assert lead_share(0, [4], window=4) == 1.0


def test_followers_of_a_probe_get_a_coverage_bin_of_their_own():
    """Seer's start pattern: one of eight identical responses starts half a response
    ahead, the seven others together. A follower has one sibling in seven a whole draft
    ahead (lead share 1/7) and copies it; under the plain mean that bins with rows that
    have nothing ahead, under the root mean (the default) it does not."""
    group = Group("probe", [list(X) for _ in range(8)])
    assert probe_starts(group, 0.5) == [0] + [100] * 7
    fits = {
        statistic: fit_acceptance(
            [group],
            budgets=(16,),
            stage_edges=(0.0, 1.0),
            coverage_edges=(0.0, 0.2, 1.0),
            spreads=(0.0,),
            probe_leads=(0.5,),
            coverage_statistic=statistic,
            progress=False,
            backoff=0.0,  # longest-match drafts: a follower copies the probe budget-deep
        )  # fmt: skip
        for statistic in ("mean", "root_mean")
    }
    nothing_ahead, probe_ahead = fits["root_mean"].accepted[0]
    assert probe_ahead[0] > 10 and nothing_ahead[0] < 0.5
    assert fits["root_mean"].coverage(1 / 7) == pytest.approx((1 / 7) ** 0.5)
    assert fits["root_mean"].measured["probe_leads"] == [0.5]
    mean_bins = fits["mean"].measured["steps"][0]
    assert mean_bins[1] == [0], "no follower reaches the mean's second bin"
    blended = fits["mean"].accepted[0][0][0]  # followers and rows with nothing ahead, averaged
    assert nothing_ahead[0] + 0.1 < blended < probe_ahead[0] / 10
    with pytest.raises(ValueError, match="probe leads must be > 0"):
        fit_acceptance([group], probe_leads=(0.0,), progress=False)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--probe-leads", "-1", "probe leads must be > 0"),
        ("--probe-leads", "x", "'x' is not a comma-separated"),
        ("--spreads", "-2", "spreads must be >= 0"),
        ("--coverage-statistic", "max", "invalid choice: 'max'"),
    ],
)
def test_the_fit_cli_names_bad_start_patterns(game24_trace, tmp_path, capsys, flag, value, message):
    out = tmp_path / "fit.json"
    with pytest.raises(SystemExit) as exit_info:
        replay_main(["--trace", str(game24_trace), "--groups", "1", flag, value, "--output", str(out)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_model_says_which_coverage_statistic_it_was_fitted_with():
    data = json.loads(table().to_json())
    assert data["coverage_statistic"] == "mean"
    del data["coverage_statistic"]  # files from before the field was written
    assert AcceptanceModel.from_dict(data).coverage(0.25) == 0.25
    with pytest.raises(ValueError, match="coverage_statistic must be one of"):
        AcceptanceModel.from_dict({**data, "coverage_statistic": "max"})


def test_distinct_random_responses_accept_almost_nothing():
    rng = random.Random(0)
    group = Group("random", [[rng.randrange(50_000) for _ in range(300)] for _ in range(4)])
    model = fit_acceptance([group], budgets=(1, 16), stage_edges=(0.0, 1.0), progress=False)
    assert model.accepted[0][0] < 0.02 and model.accepted[0][1] < 0.05
    assert sum(model.measured["steps"][0]) >= 2 * 4 * 299


def test_fit_is_monotone_in_budget_and_fills_empty_bins(capsys):
    model = fit_acceptance(
        [late_copy()], budgets=(1, 2, 4, 16), stage_edges=(0.0, 0.25, 0.5, 1.0), progress=True
    )
    assert "[acceptance] 1/1 groups" in capsys.readouterr().out
    late = model.accepted[2]
    assert list(late) == sorted(late) and late[-1] > 2 * late[0]
    assert late[0] == pytest.approx(100 / 151)  # budget 1: see the test above
    assert model.accepted[0] == (0.0, 0.0, 0.0, 0.0)
    # Stage 0.25..0.5 never happens with two siblings: copied from the nearest bin (0).
    assert model.measured["steps"][1] == [0, 0, 0, 0]
    assert model.measured["filled_bins"] == {"1": "no steps; copied from bin 0"}
    assert model.measured["overall_accepted_per_step"][0] == pytest.approx(100 / 551)


def test_accepted_len_follows_the_matching_branch():
    # root -> 5 -> 6 -> 7 and root -> 9 -> 8
    tree = DraftTree([5, 9, 6, 8, 7], [-1, -1, 0, 1, 2], [0.5] * 5)
    assert accepted_len(tree, [5, 6, 7, 1]) == 3
    assert accepted_len(tree, [9, 8, 8]) == 2
    assert accepted_len(tree, [9, 6]) == 1
    assert accepted_len(tree, [1]) == 0
    assert accepted_len(DraftTree(), [5]) == 0


def table() -> AcceptanceModel:
    return AcceptanceModel(
        budgets=(1, 2, 4),
        stage_edges=(0.0, 0.5, 1.0),
        accepted=((0.4, 0.6, 1.0), (0.8, 1.2, 2.0)),
    )


def test_accepted_per_step_interpolates_and_clamps():
    m = table()
    assert m.accepted_per_step(0, 0.1) == 0.0
    assert m.accepted_per_step(-3, 0.1) == 0.0
    assert m.accepted_per_step(0.5, 0.1) == pytest.approx(0.2)  # from (0, 0) to the first point
    assert m.accepted_per_step(1, 0.1) == pytest.approx(0.4)
    assert m.accepted_per_step(3, 0.1) == pytest.approx(0.8)
    assert m.accepted_per_step(4, 0.1) == pytest.approx(1.0)
    assert m.accepted_per_step(64, 0.1) == pytest.approx(1.0)
    # Stage bins: [0, 0.5) and [0.5, 1.0]; outside [0, 1] clamps.
    assert m.accepted_per_step(2, 0.49) == pytest.approx(0.6)
    assert m.accepted_per_step(2, 0.5) == pytest.approx(1.2)
    assert m.accepted_per_step(2, 1.0) == pytest.approx(1.2)
    assert m.accepted_per_step(2, 7.0) == pytest.approx(1.2)
    assert m.accepted_per_step(2, -1.0) == pytest.approx(0.6)
    assert [m.stage_bin(s) for s in (-1, 0, 0.3, 0.5, 0.99, 1, 2)] == [0, 0, 0, 1, 1, 1, 1]


def test_a_table_with_coverage_bins_reads_the_coverage_row(tmp_path):
    m = AcceptanceModel(
        (1, 2), (0.0, 0.5, 1.0),
        (((0.1, 0.2), (0.5, 1.0)), ((0.3, 0.4), (0.7, 1.4))),
        coverage_edges=(0.0, 0.5, 1.0),
    )  # fmt: skip
    assert m.accepted_per_step(2, 0.1, 0.2) == pytest.approx(0.2)
    assert m.accepted_per_step(2, 0.1, 0.7) == pytest.approx(1.0)
    assert m.accepted_per_step(1, 0.9, 0.7) == pytest.approx(0.7)
    assert m.accepted_per_step(2, 0.9) == pytest.approx(0.4)  # coverage defaults to 0
    assert m.drafted_per_step(5, 0.0, 1.0) == 5  # no drafted table: every budget in full
    assert AcceptanceModel.load(m.save(tmp_path / "c.json")) == m
    with pytest.raises(ValueError, match="2 stage rows of 2 coverage rows of 2 budgets"):
        AcceptanceModel((1, 2), (0.0, 0.5, 1.0), ((0.1, 0.2), (0.3, 0.4)), coverage_edges=(0.0, 0.5, 1.0))
    with pytest.raises(ValueError, match="coverage_edges must increase"):
        AcceptanceModel((1, 2), (0.0, 1.0), ((0.1, 0.2),), coverage_edges=(0.0, 0.7))


def test_save_load_round_trip(tmp_path):
    m = AcceptanceModel(
        (1, 2, 4),
        (0.0, 0.5, 1.0),
        ((0.4, 0.6, 1.0), (0.8, 1.2, 2.0)),
        ((1, 2, 3), (1, 2, 4)),
        "by hand",
        {"x": 1},
    )
    path = m.save(tmp_path / "sub" / "acc.json")
    back = AcceptanceModel.load(path)
    assert back == m
    assert back.accepted_per_step(3, 0.7) == pytest.approx(1.6)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"budgets": [2, 1, 4]}, "budgets must increase"),
        ({"budgets": [0, 1, 2]}, "positive integers"),
        ({"stage_edges": [0.0, 1.0]}, "1 stage rows of 3 budgets"),
        ({"stage_edges": [0.1, 0.5, 1.0]}, "from 0.0 to 1.0"),
        ({"accepted": [[0.4, 0.6], [0.8, 1.2]]}, "2 stage rows of 3 budgets"),
        ({"accepted": [[0.4, -0.6, 1.0], [0.8, 1.2, 2.0]]}, "finite and >= 0"),
        ({"accepted": 3}, "number lists"),
        ({"bogus": 1}, "unknown keys ['bogus']"),
        ({"budgets": None}, "missing keys ['budgets']"),
    ],
)
def test_bad_files_say_what_is_wrong(tmp_path, change, message):
    data = json.loads(table().to_json())
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="acceptance model") as err:
        AcceptanceModel.load(path)
    assert message in str(err.value)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        AcceptanceModel.load(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid"):
        AcceptanceModel.load(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        AcceptanceModel.load(tmp_path / "list.json")


def test_committed_fit_loads_and_is_sane():
    m = default_acceptance()
    assert m is default_acceptance()
    assert DEFAULT_ACCEPTANCE_PATH.is_file() and m.derivation
    assert len(m.coverage_edges) > 2, "the committed fit reads coverage"
    for stage in m.accepted:
        assert len(stage) == len(m.coverage_edges) - 1
        for row in stage:
            assert list(row) == sorted(row)  # more budget never accepts less, on average
            assert 0.0 < row[0] < 1.0
    # Late in a group the stragglers draft from finished siblings: acceptance goes up;
    # so it does early for a row whose siblings have written ahead of it.
    assert m.accepted_per_step(16, 0.9) > m.accepted_per_step(16, 0.0)
    assert m.accepted_per_step(16, 0.0, 1.0) > m.accepted_per_step(16, 0.0, 0.0)


def test_a_fit_records_the_command_that_made_it(game24_trace, tmp_path, capsys):
    import importlib.util
    import shlex

    from seer_engine.sim.acceptance_replay import main

    out = tmp_path / "fit.json"
    argv = [
        "--trace",
        str(game24_trace),
        "--groups",
        "2",
        "--samples",
        "4",
        "--budgets",
        "1,2",
        "--spreads",
        "0",
    ]
    assert main([*argv, "--output", str(out)]) == 0
    model = AcceptanceModel.load(out)
    words = shlex.split(model.measured["command"])
    assert words[:3] == ["python", "-m", "seer_engine.sim.acceptance_replay"] and words[3:] == [
        *argv,
        "--output",
        str(out),
    ]
    assert importlib.util.find_spec(words[2]) is not None, "the recorded command runs"
    assert model.derivation.startswith(f"`{model.measured['command']}`")
