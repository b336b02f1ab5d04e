"""The one seed rule (core/seeds.py): values pinned, so that a refactor that changes a
single bit of any seed (and with it every sampled token of every recorded run) fails."""

from __future__ import annotations

import pytest

from seer_engine.core.seeds import SEED_MASK, child_seed, position_seed, sample_seed


@pytest.mark.parametrize(
    "base,index,want",
    [
        (0, 0, 0),
        (0, 1, 2177342782468422677),
        (12345, 3, 6532028347405280376),
        (SEED_MASK, 2, 4354685564936845353),
    ],
)
def test_child_seed_pinned(base: int, index: int, want: int) -> None:
    assert child_seed(base, index) == want


@pytest.mark.parametrize(
    "group_seed,order,index,want",
    [
        (7, 3, 0, 7000021),
        (7, 3, 2, 4354685564943845375),
        (None, 3, 0, 3000009),  # no seed: the group's submission order stands in
        (None, 3, 1, 2177342782471422686),
    ],
)
def test_sample_seed_pinned(group_seed: int | None, order: int, index: int, want: int) -> None:
    assert sample_seed(group_seed, order, index) == want


@pytest.mark.parametrize(
    "seed,position,want",
    [
        (0, 0, 6238072747940578789),
        (1, 7, 2186024489510581814),
        (child_seed(42, 1), 100, 5177493636192384784),
        (SEED_MASK, 4095, 7420444713869386369),
    ],
)
def test_position_seed_pinned(seed: int, position: int, want: int) -> None:
    assert position_seed(seed, position) == want


def test_seeds_fit_a_torch_generator() -> None:
    """Every derived seed is a non-negative int64, whatever the inputs."""
    huge = (1 << 70) + 5
    for value in (child_seed(huge, 9), sample_seed(huge, 0, 9), position_seed(huge, huge)):
        assert 0 <= value <= SEED_MASK == (1 << 63) - 1
