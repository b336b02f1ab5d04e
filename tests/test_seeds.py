"""The one seed rule (core/seeds.py): values pinned, so that a refactor that changes a
single bit of any seed (and with it every sampled token of every recorded run) fails."""

from __future__ import annotations

import pytest

from seer_engine.core.seeds import SEED_MASK, child_seed, group_seed, position_seed, sample_seed


@pytest.mark.parametrize(
    "base,index,want",
    [
        (0, 0, 0),
        (0, 1, -7046029254386353131),
        (12345, 3, -2691343689449495432),
        (SEED_MASK, 2, -4868686471917930455),
        (-1, 1, -7046029254386353132),
    ],
)
def test_child_seed_pinned(base: int, index: int, want: int) -> None:
    assert child_seed(base, index) == want


@pytest.mark.parametrize(
    "group_seed,order,index,want",
    [
        (7, 3, 0, 7),
        (7, 3, 2, 4354685564936845361),
        (None, 3, 0, 3),  # no seed: the group's submission order stands in
        (None, 3, 1, -7046029254386353128),
    ],
)
def test_sample_seed_pinned(group_seed: int | None, order: int, index: int, want: int) -> None:
    assert sample_seed(group_seed, order, index) == want


@pytest.mark.parametrize(
    "seed,index,want",
    [
        (0, 0, 132297946315314195),
        (5, 2, -4294776846441306174),
        (-1, 1, -4811710646387659195),
        (SEED_MASK, 3, 1191370250360723344),
    ],
)
def test_group_seed_pinned(seed: int, index: int, want: int) -> None:
    assert group_seed(seed, index) == want


def test_groups_of_one_seed_share_no_sample_seed() -> None:
    """Every sample of every group seeded from one --seed has a seed of its own: a
    prompt on two lines (or run again in a later iteration) draws other responses."""
    for seed in (0, 5, -1):
        seeds = [child_seed(group_seed(seed, k), i) for k in range(64) for i in range(16)]
        assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize(
    "seed,position,want",
    [
        (0, 0, 6238072747940578789),
        (1, 7, 2186024489510581814),
        (child_seed(42, 1), 100, 2915661842384456482),
        (-1, 5, 5539363832064604964),
        (SEED_MASK, 4095, 7420444713869386369),
    ],
)
def test_position_seed_pinned(seed: int, position: int, want: int) -> None:
    assert position_seed(seed, position) == want


def test_seeds_fit_their_uses() -> None:
    """A sample's seed is a signed int64 (what a request's seed may be) and a position's
    seed a non-negative one (what torch.Generator takes), whatever the inputs."""
    huge = (1 << 70) + 5
    for value in (
        child_seed(huge, 9),
        sample_seed(huge, 0, 9),
        child_seed(-huge, 3),
        group_seed(-huge, huge),
    ):
        assert -(1 << 63) <= value < 1 << 63
    assert 0 <= position_seed(huge, huge) <= SEED_MASK == (1 << 63) - 1


@pytest.mark.parametrize("seed", [0, 1, -1, SEED_MASK, -(1 << 63), 12345])
def test_sample_zero_keeps_the_request_seed(seed: int) -> None:
    """Distinct request seeds never share sample 0's seed (-1 and 2**63-1 once did)."""
    assert child_seed(seed, 0) == seed
    assert sample_seed(seed, 99, 0) == seed


def test_offline_rollout_seeds_are_the_servers() -> None:
    """A seeded group's responses take the seeds the server gives a request's samples."""
    assert [sample_seed(7, 5, i) for i in range(8)] == [child_seed(7, i) for i in range(8)]
