"""Checks of one generation request that need no model, run before anything loads, and the large-request preflight.

Each check takes `name`, the setting as the user wrote it (`--seed` in the CLI, `seed` in the Python API or a
ComfyUI widget), and raises one `H3Error` that starts with it, names the value and says what is accepted.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import H3Error
from .grid import LatentShape, frames_for_seconds

# The longest generation H3 makes (the CLI's --seconds, the nodes' seconds / frames widgets): 15 s, 362 frames.
MAX_SECONDS = 15.0
MAX_FRAMES = frames_for_seconds(MAX_SECONDS)
# The largest canvas side accepted anywhere (CLI --size, the nodes' width / height widgets).
MAX_CANVAS = 4096
# torch.Generator.manual_seed takes -2**63 to 2**64 - 1 and wraps negative seeds (-1 is 2**64 - 1): seeds are the
# unsigned 64-bit range, as in ComfyUI's seed widget, so that two spellings never name the same noise.
SEED_MAX = 2**64 - 1


def _whole(value) -> int | None:
    """`value` as an int when it is a whole number (int, numpy integer; not a bool or a float), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _finite_positive(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
            and value > 0)


def check_seed(seed, name: str = "seed") -> int:
    whole = _whole(seed)
    if whole is None or not 0 <= whole <= SEED_MAX:
        raise H3Error(f"{name} {seed!r}: must be a whole number from 0 to 2**64 - 1 ({SEED_MAX}).")
    return whole


def check_steps(steps, name: str = "steps") -> int:
    whole = _whole(steps)
    if whole is None or whole < 2:
        raise H3Error(f"{name} {steps!r}: must be at least 2, a whole number (sigma grid points including the final "
                      "0: steps - 1 model calls).")
    return whole


def check_shift(value, name: str) -> float:
    """A sigma shift: a finite number above 0 (1 leaves the schedule unshifted)."""
    if not _finite_positive(value):
        raise H3Error(f"{name} {value!r}: must be a finite number above 0 (the released model uses 12 for video "
                      "and 3 for audio).")
    return float(value)


def check_prompt(prompt, name: str = "prompt") -> str:
    """Text only: a str that encodes as UTF-8 (no lone surrogates, which is how undecodable command-line bytes
    arrive in Python)."""
    if not isinstance(prompt, str):
        raise H3Error(f"{name} must be a string, got {type(prompt).__name__}.")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = prompt[exc.start]
        if 0xDC80 <= ord(char) <= 0xDCFF:  # surrogateescape: a byte that was not UTF-8
            what = f"byte 0x{ord(char) - 0xDC00:02x}, which is not UTF-8"
        else:
            what = f"a lone surrogate U+{ord(char):04X}, which is not a character"
        raise H3Error(f"{name}: character {exc.start} is {what}; give the prompt as UTF-8 text.") from None
    return prompt


def check_canvas_limit(width: int, height: int, name: str = "width / height") -> None:
    for side, value in (("width", width), ("height", height)):
        if value > MAX_CANVAS:
            raise H3Error(f"{name}: {side} {value} is past the {MAX_CANVAS}-pixel limit (H3 was trained at "
                          "1344x768).")


# ---- the large-request preflight -------------------------------------------------------------------------------------


VIDEO_SHIFT = 12.0


AUDIO_SHIFT = 3.0
