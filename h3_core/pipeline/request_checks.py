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
from .layout import LatentShape, frames_for_seconds

# The longest generation H3 makes (the CLI's --seconds, the nodes' seconds / frames widgets): 15 s, 362 frames.
MAX_SECONDS = 15.0
MAX_FRAMES = frames_for_seconds(MAX_SECONDS)
# The largest canvas side accepted anywhere (CLI --size, the nodes' width / height widgets).
MAX_CANVAS = 4096
# torch.Generator.manual_seed takes -2**63 to 2**64 - 1 and wraps negative seeds (-1 is 2**64 - 1): seeds are the
# unsigned 64-bit range, as in ComfyUI's seed widget, so that two spellings never name the same noise.
SEED_MAX = 2**64 - 1
# What `save_generation` and the CLI's --out write: an mp4 (H.264 + AAC) through PyAV; without PyAV, `<stem>_frames/`
# PNGs and `<stem>.wav` next to it.
OUTPUT_SUFFIXES = (".mp4",)

# Large-request thresholds: past any of them the CLI prints the estimate and runs only with --yes-large.
LARGE_CANVAS_PIXELS = 1920 * 1088  # 1080p on the 32-pixel grid; the released model works at 1344x768
LARGE_STEPS = 200  # the sampler widget's maximum; the released model uses 50
# The throughput the time estimate assumes: a fast GPU sustaining 100 TFLOP/s in bf16.
ASSUMED_FLOPS = 100e12


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


def check_memory_budget_gib(value, name: str = "memory budget") -> float:
    if not _finite_positive(value):
        raise H3Error(f"{name} {value!r}: must be a finite number of GiB above 0, e.g. 24.")
    return float(value)


def check_image_file(path, name: str) -> Path:
    """The file exists and PIL can open it (its header; the keyframe code decodes it later)."""
    from PIL import Image

    path = Path(path)
    if not path.is_file():
        raise H3Error(f"{name} {path}: no such image file.")
    try:
        with Image.open(path) as image:
            image.size  # noqa: B018  (opening reads the header; a decompression bomb is refused here)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise H3Error(f"{name} {path}: PIL cannot open it as an image ({exc}).") from None
    return path


def output_problem(path) -> str | None:
    """Why the generation cannot be written at `path` (checked by creating and removing a file in its folder), or
    None. A missing folder is fine: it is created when the output is written."""
    text = os.fspath(path)
    if not text:
        return "is empty; give a file name ending in .mp4, e.g. out.mp4"
    path = Path(text).expanduser()
    if path.is_dir():
        return f"is a folder; give a file name inside it, e.g. {path / 'out.mp4'}"
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        return (f"h3-stream writes {' / '.join(OUTPUT_SUFFIXES)} files (H.264 + AAC; without PyAV, {path.stem}_frames/ "
                f"PNGs and {path.stem}.wav beside it), not {path.suffix or 'files without a suffix'!r}; name it "
                f"{path.with_suffix('.mp4').name}")
    if path.exists() and not path.is_file():
        return "exists and is not a regular file (a device or a pipe); give a file name"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        handle, probe = tempfile.mkstemp(prefix=".h3-write-check-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write in {folder} ({exc.strerror or exc})"
    return None


def check_output_path(path, name: str = "output path") -> Path:
    problem = output_problem(path)
    if problem:
        raise H3Error(f"{name} {os.fspath(path)!r}: {problem}.")
    return Path(os.fspath(path)).expanduser()


# ---- the large-request preflight -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestEstimate:
    """What a request costs, estimated from the checkpoint headers before anything loads."""

    peak_bytes: int  # the largest phase's memory (`plan_for_budget` with an unlimited budget)
    peak_phase: str
    shared_memory: bool  # the peak is host and device together (CPU, MPS), not device memory alone
    transformer_flops: float  # every model call's matmuls and attention, the rest of the pipeline left out
    model_calls: int

    @property
    def seconds_at_assumed_flops(self) -> float:
        return self.transformer_flops / ASSUMED_FLOPS


def estimate_request(sources, *, device, width: int, height: int, num_frames: int, steps: int, dtype=None,
                     chunk_size=None, loras=(), keep=(), keyframes: bool = False,
                     residency: str | None = None, references=None) -> RequestEstimate:
    """Memory from the planner's estimates (`planning.plan_for_budget`, weights exact from the headers, activations
    counted per phase) and transformer work from its parameter count and the packed rows: 2 x parameters x rows per
    call for the matmuls plus 4 x rows^2 x attention width per block for attention."""
    from ..checkpoints.dit_loader import resolve_dit_checkpoint
    from .planning import packed_rows_estimate, plan_for_budget, reference_rows_estimate

    plan = plan_for_budget(sources, device=device, budget_bytes=1 << 62, width=width, height=height,
                           num_frames=num_frames, dtype=dtype, chunk_size=chunk_size, loras=loras, keep=keep,
                           keyframes=keyframes, steps=steps, residency=residency, references=references)
    ckpt = resolve_dit_checkpoint(sources.transformer)
    c = ckpt.config
    shape = LatentShape.for_request(width, height, num_frames)
    rows = packed_rows_estimate(shape, reference_rows_estimate(references) if references else 0)
    params = sum(ckpt.numel(spec) for spec in ckpt.specs)
    calls = steps - 1
    flops = calls * (2.0 * params * rows + 4.0 * rows * rows * c.inner_dim * c.num_layers)
    peak = plan.peak_phase
    return RequestEstimate(plan.peak_bytes, peak.name if peak else "", plan.shared_memory, flops, calls)


def large_request_reasons(width: int, height: int, steps: int, estimate: RequestEstimate,
                          memory_bytes: int | None, *, size_name: str = "size", steps_name: str = "steps") -> list[str]:
    """Which large-request thresholds the request passes: canvas area, steps, and (where host and device share one
    memory and `memory_bytes`, the machine's, is known) an estimated peak beyond the machine's memory."""
    from ..runtime.memory_plan import format_bytes

    reasons = []
    if width * height > LARGE_CANVAS_PIXELS:
        reasons.append(f"{size_name} {width}x{height} is {width * height / 1e6:.1f} megapixels, past the "
                       f"{LARGE_CANVAS_PIXELS / 1e6:.1f}-megapixel (1920x1088) threshold")
    if steps > LARGE_STEPS:
        reasons.append(f"{steps_name} {steps} is past the {LARGE_STEPS}-step threshold")
    if estimate.shared_memory and memory_bytes and estimate.peak_bytes > memory_bytes:
        reasons.append(f"the estimated peak memory {format_bytes(estimate.peak_bytes)} is more than this machine's "
                       f"{format_bytes(memory_bytes)}")
    return reasons


def describe_estimate(estimate: RequestEstimate) -> str:
    from ..runtime.memory_plan import format_bytes

    where = "" if estimate.shared_memory else " of device memory"
    return (f"Estimated peak memory {format_bytes(estimate.peak_bytes)}{where} ({estimate.peak_phase} phase) and "
            f"{format_flops(estimate.transformer_flops)} of transformer work over {estimate.model_calls} model "
            f"calls, about {format_duration(estimate.seconds_at_assumed_flops)} at a sustained "
            f"{ASSUMED_FLOPS / 1e12:.0f} TFLOP/s (a fast GPU; a CPU is 100 to 1000 times slower). Both are rough "
            "estimates")


def format_flops(flops: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12)):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops / 1e9:,.1f} GFLOP"


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.0f} days"

