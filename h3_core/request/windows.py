"""Long videos as windows: any duration split into windows of at most 15 s (`MAX_FRAMES`), each after the first
guided at its frame 0 by the previous window's last `OVERLAP_FRAMES` frames and their soundtrack; the overlap is
cross-faded, never repeated. This module is the arithmetic (which frames each window makes, its seed and prompt, the
cross-fade weights); `pipeline.long_video` runs the windows and streams them into one mp4.

Why 22 overlap frames: a guide clip must sit on the video VAE's 17k + 5 grid (5, 22, 39, ...), and 22 = 17 + 5 is
the smallest guide that spans more than one latent chunk (5 frames is a single latent frame of motion); it is also
what core ComfyUI's documented continuation uses (the previous clip's 22 frames + audio). With it every window after
the first adds 17k new frames, so the whole clip is itself on the 17n + 5 grid: the frame count asked for is
rounded up to that grid exactly as a clip of 15 s or less is.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import H3Error
from .generation_request import SEED_MAX
from .grid import (AUDIO_SAMPLE_RATE, FPS, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK, MAX_FRAMES, align_num_frames,
                   is_aligned_num_frames)

OVERLAP_FRAMES = FRAMES_PER_CHUNK + LATENTS_PER_CHUNK  # 22
# The longest video the surfaces accept: 10 minutes (41 windows). Nothing in the method limits it (memory does not
# grow with the length); the bound keeps a typo (6000 for 60) from starting a two-day job.
MAX_LONG_SECONDS = 600.0
# Window i > 0 draws its noise from seed + i x this odd 64-bit constant (the golden-ratio increment of SplitMix64):
# deterministic, different for every window, and window 0 keeps the seed itself (a clip of 15 s or less is the
# one-window case, with the noise it always had).
_SEED_STEP = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Window:
    """One window: `num_frames` frames (17k + 5) starting at frame `start` of the whole clip; its first
    `overlap` frames (0 for an unguided first window) repeat the previous window's last ones and are cross-faded
    with them."""

    index: int
    start: int
    num_frames: int
    overlap: int

    @property
    def end(self) -> int:
        return self.start + self.num_frames


def plan_windows(total_frames: int, *, guided_first: bool = False, overlap: int = OVERLAP_FRAMES,
                 max_frames: int = MAX_FRAMES) -> tuple[Window, ...]:
    """Windows covering `total_frames` (17n + 5, or with `guided_first` a multiple of 17: the new frames after a
    clip being extended). As few windows as fit: all of the longest length but the last two, which share the rest
    (each then at least about 8 s: a last window of a second or two would be far outside the 4-15 s H3 was trained
    on). So a long video's largest window, and its memory plan, is a 15 s request's whatever its length. With `guided_first` every window, the first too, is guided by the
    `overlap` frames before it (the extended clip's last ones), which it makes again; they are not counted in
    `total_frames`."""
    if not is_aligned_num_frames(overlap):
        raise H3Error(f"overlap {overlap} is off the 17n + 5 frame grid a guide clip needs (5, 22, 39, ...).")
    if guided_first:
        # the new frames and the 5 that end the clip are on the grid: a multiple of 17 new frames
        if total_frames < FRAMES_PER_CHUNK or not is_aligned_num_frames(total_frames + LATENTS_PER_CHUNK):
            raise H3Error(f"{total_frames} new frames: an extension adds a multiple of {FRAMES_PER_CHUNK} frames.")
        units = total_frames // FRAMES_PER_CHUNK
    else:
        if not is_aligned_num_frames(total_frames):
            raise H3Error(f"{total_frames} frames is off the 17n + 5 grid; use {align_num_frames(total_frames)}.")
        units = (total_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK
    # A window is `size` chunks of 17 (+ 5 frames); a guided one spends (overlap - 5) / 17 of them on the overlap.
    max_units = (max_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK
    guide_units = (overlap - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK
    if max_units <= guide_units:
        raise H3Error(f"windows of {max_frames} frames leave no room after a {overlap}-frame overlap.")
    count = 1
    while _capacity(count, max_units, guide_units, guided_first) < units:
        count += 1
    sizes_total = units + guide_units * (count - (0 if guided_first else 1))
    if count == 1:
        sizes = [sizes_total]
    else:  # full windows, the last two sharing the rest: each at least about 8 s (the rest is over 22 chunks)
        rest = sizes_total - max_units * (count - 2)
        sizes = [max_units] * (count - 2) + [rest - rest // 2, rest // 2]
    windows, start = [], (-overlap if guided_first else 0)
    for i, size in enumerate(sizes):
        frames = FRAMES_PER_CHUNK * size + LATENTS_PER_CHUNK
        guided = guided_first or i > 0
        windows.append(Window(i, start, frames, overlap if guided else 0))
        start += frames - overlap
    return tuple(windows)


def _capacity(count: int, max_units: int, guide_units: int, guided_first: bool) -> int:
    """New chunks of 17 that `count` windows of at most `max_units` chunks make."""
    guided = count if guided_first else count - 1
    return count * max_units - guided * guide_units


def window_seed(seed: int, index: int) -> int:
    """Window `index`'s seed: the seed itself for the first, a fixed odd stride apart for the others."""
    return (int(seed) + index * _SEED_STEP) % (SEED_MAX + 1)


def audio_sample(frame: int, fps: int = FPS, sample_rate: int = AUDIO_SAMPLE_RATE) -> int:
    """The audio sample at which pixel frame `frame` starts (32 kHz at 24 fps: 1333.3 samples a frame, rounded)."""
    return int(round(frame * sample_rate / fps))


def crossfade(previous: torch.Tensor, following: torch.Tensor, dim: int) -> torch.Tensor:
    """`previous` fading out while `following` fades in along `dim` (same shapes): the weight of `following` rises
    linearly from 1/2n to 1 - 1/2n over the n steps, so neither end repeats the other and the sum of the weights is
    1 everywhere (a signal the two windows agree on passes unchanged)."""
    if previous.shape != following.shape:
        raise H3Error(f"cross-fade of {tuple(previous.shape)} and {tuple(following.shape)}: the shapes differ.")
    n = previous.shape[dim]
    shape = [1] * previous.dim()
    shape[dim] = n
    weight = ((torch.arange(n, dtype=torch.float32) + 0.5) / n).view(shape)
    return previous * (1 - weight) + following * weight


# ---- durations and prompt schedules ---------------------------------------------------------------------------------


def long_frame_count(seconds, name: str = "seconds") -> int:
    """A long video's duration -> its frame count: round(seconds x 24) rounded up to the 17n + 5 grid."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
        raise H3Error(f"{name} {seconds!r}: must be a number of seconds.")
    if not 0 < seconds <= MAX_LONG_SECONDS:
        raise H3Error(f"{name} {seconds:g}: must be more than 0 and at most {MAX_LONG_SECONDS:g} (10 minutes; longer "
                      "videos are windows too, but ask for them in parts with an extension of the clip).")
    return align_num_frames(max(1, round(seconds * FPS)))


def extension_frame_count(seconds, name: str = "seconds") -> int:
    """The new frames an extension of `seconds` adds: round(seconds x 24) rounded up to a multiple of 17."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
        raise H3Error(f"{name} {seconds!r}: must be a number of seconds.")
    if not 0 < seconds <= MAX_LONG_SECONDS:
        raise H3Error(f"{name} {seconds:g}: an extension adds more than 0 and at most {MAX_LONG_SECONDS:g} s.")
    return FRAMES_PER_CHUNK * max(1, math.ceil(round(seconds * FPS) / FRAMES_PER_CHUNK))


@dataclass(frozen=True)
class PromptSchedule:
    """Prompts from given times on: ((seconds, prompt), ...), the first at 0 s, times increasing."""

    entries: tuple[tuple[float, str], ...]

    def prompt_at(self, seconds: float) -> str:
        chosen = self.entries[0][1]
        for start, prompt in self.entries:
            if start <= seconds + 1e-9:
                chosen = prompt
        return chosen


def parse_prompt_schedule(text: str, total_seconds: float, name: str = "--prompt-schedule") -> PromptSchedule:
    """`"0: a beach; 15: the same beach at night"` (entries separated by `;` or new lines) -> a `PromptSchedule`.
    Each window takes the prompt in force at its first new frame. Times are seconds from the start of the new
    video, the first 0, increasing, and before its end."""
    entries: list[tuple[float, str]] = []
    parts = [part.strip() for line in str(text).splitlines() for part in line.split(";")]
    for part in parts:
        if not part:
            continue
        head, colon, prompt = part.partition(":")
        if not colon:
            raise H3Error(f"{name}: {part!r} has no time; write SECONDS: PROMPT entries separated by ';', e.g. "
                          "\"0: a beach at dawn; 15: the same beach at noon\".")
        try:
            start = float(head.strip().rstrip("s"))
        except ValueError:
            raise H3Error(f"{name}: {head.strip()!r} is not a time in seconds (in {part!r}); write SECONDS: PROMPT, "
                          "e.g. 15: the same beach at noon.") from None
        if not math.isfinite(start) or start < 0:
            raise H3Error(f"{name}: time {head.strip()!r} must be a number of seconds, 0 or more.")
        if entries and start <= entries[-1][0]:
            raise H3Error(f"{name}: time {start:g} s comes after {entries[-1][0]:g} s; give the times in increasing "
                          "order, each once.")
        if start >= total_seconds:
            raise H3Error(f"{name}: time {start:g} s is at or past the end of the video ({total_seconds:.2f} s).")
        entries.append((start, prompt.strip()))
    if not entries:
        raise H3Error(f"{name}: is empty; write SECONDS: PROMPT entries separated by ';', e.g. "
                      "\"0: a beach at dawn; 15: the same beach at noon\".")
    if entries[0][0] != 0:
        raise H3Error(f"{name}: the first entry is at {entries[0][0]:g} s; start it at 0 (the prompt of the first "
                      "window).")
    return PromptSchedule(tuple(entries))
