"""What counts as a number in configs and files: JSON and argparse hand over bools,
NaN and Infinity too, and each of them passes a plain ``x >= 0`` or ``isinstance(x,
int)`` check."""

from __future__ import annotations

import math


def is_int(x: object) -> bool:
    """An integer, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A finite number, not a bool, NaN or Infinity."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
