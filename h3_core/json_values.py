"""What a number read from a checkpoint's JSON (config.json, a safetensors header) may be: one rule for every
loader. Python's bool is an int, and JSON `true`, `2.0` or `"2"` is never a count."""

from __future__ import annotations

import math


def is_whole(value, minimum: int = 1) -> bool:
    """An integer (not a bool, not a float such as 2.0) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_positive_real(value) -> bool:
    """A finite number above 0 (an int or a float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
