"""Long videos and extensions, window by window (`request.windows`), streamed into one mp4 (`request.streamed_mp4`).

Each window is an ordinary request of at most 15 s: its seed derived from the request's (`window_seed`), its prompt
from the schedule, and, after the first, one guide at its frame 0 — the previous window's last 22 frames and their
soundtrack. A window is decoded as soon as it is sampled and written at once, except its last 22 frames and their
samples: that overlap is the only thing carried to the next window, which makes those frames again (guided by
them) and is cross-faded with them, so the overlap is neither repeated nor cut. Memory is that of one window
whatever the length.

An extension starts from a clip (`ClipToExtend`): its frames are copied into the result untouched, its last 22
frames and soundtrack guide the first new window, whose own first 22 frames are dropped (the clip's stay) while its
audio is cross-faded into the clip's last 22 frames' soundtrack.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import H3Error
from ..request.generation_request import GenerationRequest
from ..request.grid import FPS, audio_samples_for_frames
from ..request.guides import Guide
from ..request.streamed_mp4 import ClipToExtend, StreamedMp4
from ..request.windows import (OVERLAP_FRAMES, PromptSchedule, Window, audio_sample, crossfade, plan_windows,
                               window_seed)


@dataclass
class LongVideoResult:
    """What a long video or an extension wrote: the mp4, its frames (the clip's included) and seconds, the windows
    made, the timings and the audio health warnings of every window."""

    path: Path
    num_frames: int
    windows: tuple[Window, ...]
    timings: dict = field(default_factory=dict)
    audio_warnings: tuple = ()

    @property
    def seconds(self) -> float:
        return self.num_frames / FPS


def window_requests(request: GenerationRequest, windows, schedule: PromptSchedule | None = None):
    """Each window's request without its guide: the window's frame count, seed and prompt (the schedule's prompt at
    the window's first new frame), the request's first frame on the first window and last frame on the last."""
    if request.guides:
        raise H3Error(f"{request.names.guides}: guides are not placed across the windows of a long video yet; give "
                      "a clip of at most 15 s, or drop the guides (the windows guide one another).")
    requests = []
    for window in windows:
        seconds = max(0, window.start + window.overlap) / FPS
        prompt = schedule.prompt_at(seconds) if schedule is not None else request.prompt
        requests.append(request.replace(
            prompt=prompt, num_frames=window.num_frames, seed=window_seed(request.seed, window.index),
            first_frame=request.first_frame if window.index == 0 and not window.overlap else None,
            last_frame=request.last_frame if window.index == len(windows) - 1 else None))
    return requests


def planned_guides(request: GenerationRequest, windows) -> tuple:
    """The placed guides a long video's memory plan and preflight count: one overlap guide (its frames and their
    soundtrack) on the longest window when any window is guided, so every window's plan is within it; () when none
    is. Stand-in pixels: a plan reads only a guide's length."""
    overlap = max((window.overlap for window in windows), default=0)
    if not overlap:
        return ()
    stand_in = Guide(frame=0, frames=torch.zeros(overlap, 32, 32, 3),
                     audio=torch.zeros(2, audio_samples_for_frames(overlap)), label="the overlap guide")
    return request.replace(num_frames=max(window.num_frames for window in windows), first_frame=None,
                           last_frame=None, guides=(stand_in,)).placed_guides


def overlap_guide(frames: torch.Tensor, audio: torch.Tensor | None, window: Window, count: int) -> Guide:
    """The guide of `window`: the frames before it (and their soundtrack) at its frame 0."""
    if audio is not None:
        audio = audio[:, :audio_samples_for_frames(frames.shape[0])].contiguous()
    return Guide(frame=0, frames=frames.contiguous(), audio=audio,
                 label=f"window {window.index + 1} of {count}: the {frames.shape[0]} frames before it")


def generate_long_video(pipeline, request: GenerationRequest, out, *, total_frames: int | None = None,
                        extend: ClipToExtend | None = None, new_frames: int | None = None,
                        schedule: PromptSchedule | None = None, overlap: int = OVERLAP_FRAMES,
                        progress: Callable[[int, int], None] | None = None,
                        on_window: Callable[[Window, int], None] | None = None,
                        check_interrupt: Callable[[], None] | None = None, step_report=None,
                        log: Callable[[str], None] | None = None) -> LongVideoResult:
    """Make `total_frames` frames (17n + 5) from `request` (its prompt, canvas, steps, seed, LoRAs; its own
    `num_frames` is not used), or, with `extend`, `new_frames` (a multiple of 17) after that clip, and write them to
    `out` (an mp4, staged: nothing appears there unless every window finished). `pipeline.generate(request, ...)`
    makes each window. `on_window(window, count)` runs before each window, `progress(done, total)` during its
    sampling; `check_interrupt()` between windows and inside each (and may raise to stop: the staging file is
    removed)."""
    log = log or (lambda message: None)
    if extend is not None:
        if new_frames is None:
            raise H3Error("an extension needs the number of new frames.")
        windows = plan_windows(new_frames, guided_first=True, overlap=overlap)
        request = request.replace(width=extend.width, height=extend.height) \
            if (request.width, request.height) != (extend.width, extend.height) else request
        start_frame = extend.num_frames - overlap
        total = extend.num_frames + new_frames
    else:
        if total_frames is None:
            raise H3Error("a long video needs its frame count.")
        windows = plan_windows(total_frames, overlap=overlap)
        start_frame, total = 0, total_frames
    requests = window_requests(request, windows, schedule)
    timings: dict = {"windows": 0.0, "writing": 0.0}
    warnings: list = []
    carry_frames = carry_audio = None
    frames_already_written = False  # an extended clip's last frames are in the file already (copied)
    if extend is not None:
        carry_frames, frames_already_written = extend.last_frames, True
        carry_audio = extend.last_audio if extend.has_audio else torch.zeros(
            2, audio_sample(extend.num_frames) - audio_sample(start_frame))
    total_samples = audio_samples_for_frames(total)
    hold_back = 0 if extend is None else audio_sample(extend.num_frames) - audio_sample(start_frame)
    with StreamedMp4(out, request.width, request.height, source=extend, hold_back_samples=hold_back) as mp4:
        position = start_frame  # the global frame each window starts at
        for window, window_request in zip(windows, requests):
            if check_interrupt is not None:
                check_interrupt()
            if on_window is not None:
                on_window(window, len(windows))
            if carry_frames is not None:
                guide_audio = carry_audio if (extend is None or extend.has_audio or window.index > 0) else None
                window_request = window_request.replace(
                    guides=(overlap_guide(carry_frames, guide_audio, window, len(windows)),))
            started = time.perf_counter()
            result = pipeline.generate(window_request, progress=progress, check_interrupt=check_interrupt,
                                       step_report=step_report)
            timings["windows"] += time.perf_counter() - started
            warnings.extend(result.audio_warnings)
            frames, audio = result.frames, result.waveform
            if frames.shape[0] != window.num_frames:
                raise H3Error(f"window {window.index + 1} came back with {frames.shape[0]} frames, not "
                              f"{window.num_frames}.")
            started = time.perf_counter()
            if carry_frames is not None:
                # In place (the window's tensors are this call's own): no second copy of a window.
                if not frames_already_written:
                    frames[:overlap] = crossfade(carry_frames, frames[:overlap], dim=0)
                else:
                    frames = frames[overlap:]  # the clip's own frames stay
                length = min(carry_audio.shape[1], audio.shape[1])
                audio[:, :length] = crossfade(carry_audio[:, :length], audio[:, :length], dim=1)
                frames_already_written = False
            last = window.index == len(windows) - 1
            if last:
                mp4.add_video(frames)
                rest = total_samples - mp4.samples_written
                audio = audio[:, :rest]
                if audio.shape[1] < rest:  # the decoder's last samples fall short of the video: silence
                    audio = torch.cat([audio, audio.new_zeros(2, rest - audio.shape[1])], dim=1)
                mp4.add_audio(audio)
            else:
                keep = frames.shape[0] - overlap
                next_start = position + window.num_frames - overlap
                cut = audio_sample(next_start) - audio_sample(position)
                mp4.add_video(frames[:keep])
                mp4.add_audio(audio[:, :cut])
                carry_frames = frames[keep:].clone()
                carry_audio = audio[:, cut:].clone()
                position = next_start
            del frames, audio, result
            timings["writing"] += time.perf_counter() - started
        if check_interrupt is not None:
            check_interrupt()
        if mp4.frames_written != total:  # before the rename: a wrong file is never put in place
            raise H3Error(f"made {mp4.frames_written} frames, not {total}: the windows do not add up.")
        started = time.perf_counter()
        mp4.finish()
        timings["writing"] += time.perf_counter() - started
    log(f"wrote {out}: {total} frames ({total / FPS:.2f} s) from {len(windows)} window(s)")
    return LongVideoResult(Path(out).expanduser(), total, windows, timings, tuple(warnings))
