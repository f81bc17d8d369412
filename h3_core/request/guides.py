"""Guides: media that anchor a generation at a pixel frame of the target (issue 30).

A guide is an image (one frame), a clip (17k + 5 frames; longer or odd clips are cropped to that grid with a note),
an audio waveform, or a clip with its soundtrack, placed at `frame` of the target video: 0 is the first frame,
negative values count from the end (-1 is the last frame). Several guides may anchor one request; FL2VA's
`first_frame` / `last_frame` are the two common cases (frame 0 and frame -1, one image each).

This module holds the record the front ends build (the CLI's `--guide FILE[@FRAME]`, the H3 Guide node, the
long-video windows) and its per-guide checks; where guides lower to packed rows is `pipeline/layout.py`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from ..errors import H3Error
from .grid import AUDIO_LATENTS_PER_SECOND, AUDIO_SAMPLE_RATE, FPS


@dataclass(frozen=True, eq=False)
class Guide:
    """One guide. `frames`: [F, H, W, 3] float in [0, 1] (F = 1: an image), or None for audio alone.
    `audio`: [C, N] float waveform at `sample_rate`, or None. `frame`: the target pixel frame the guide starts at
    (negative: from the end). `label`: how the user named it, for messages (a file and its @FRAME, a node)."""

    frame: int = 0
    frames: torch.Tensor | None = field(default=None, repr=False)
    audio: torch.Tensor | None = field(default=None, repr=False)
    sample_rate: int = AUDIO_SAMPLE_RATE
    label: str = "guide"

    def __post_init__(self):
        if isinstance(self.frame, bool) or not isinstance(self.frame, numbers.Integral):
            raise H3Error(f"{self.label}: the frame {self.frame!r} must be a whole number (negative counts from the "
                          "end: -1 is the last frame).")
        object.__setattr__(self, "frame", int(self.frame))
        if self.frames is None and self.audio is None:
            raise H3Error(f"{self.label}: give an image, a clip or an audio (it has none).")
        if self.frames is not None:
            if not isinstance(self.frames, torch.Tensor) or self.frames.dim() != 4 or self.frames.shape[-1] != 3:
                raise H3Error(f"{self.label}: frames must be a [frames, height, width, 3] RGB tensor in [0, 1], got "
                              f"{getattr(self.frames, 'shape', type(self.frames).__name__)}.")
        if self.audio is not None:
            if not isinstance(self.audio, torch.Tensor) or self.audio.dim() != 2:
                raise H3Error(f"{self.label}: audio must be a [channels, samples] waveform, got "
                              f"{getattr(self.audio, 'shape', type(self.audio).__name__)}.")
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, numbers.Integral) \
                or self.sample_rate <= 0:
            raise H3Error(f"{self.label}: sample rate {self.sample_rate!r} must be a positive whole number of Hz.")

    @property
    def kind(self) -> str:
        """"image", "video", "video_audio" or "audio" (SGLang's condition types)."""
        if self.frames is None:
            return "audio"
        if self.frames.shape[0] == 1 and self.audio is None:
            return "image"
        return "video_audio" if self.audio is not None else "video"


# ---- placing guides on a request's timeline -------------------------------------------------------------------------
#
# The reference is ComfyUI core's MiniMaxH3AddGuide (comfy_extras/nodes_minimax_h3.py) with its PackedLayout
# (comfy/ldm/minimax/model.py): SGLang 0.5.23 admits keyframe conditions only as images at frame 0 and -1 (its
# `MINIMAX_H3_FL2VA_KEYFRAME_SIGNATURES`), which are our first_frame / last_frame, so guides at any other frame, clips
# and audio have core as their only reference. The rules below are core's, except where a silent change of the user's
# media would hide a mistake: core crops audio that runs past the end of the video without a word, and we refuse it
# (beyond one audio latent, 25 ms, which is rounding: that is cropped, as core does).

AUDIO_HOP = AUDIO_SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND  # 800 samples per audio latent
CLIP_FRAMES_PER_CHUNK = 17
CLIP_MIN_FRAMES = 5
FRAME_TIME_UNITS = AUDIO_LATENTS_PER_SECOND / FPS  # 5/3 audio latents (1/40 s) per pixel frame (1/24 s)


def guide_clip_frames(count: int) -> int:
    """Pixel frames of a clip that a guide keeps (core's rule): fewer than 5 -> its first frame only; else the largest
    17k + 5 that is not more than it (5, 22, 39, ...)."""
    if count < CLIP_MIN_FRAMES:
        return 1
    return (count - CLIP_MIN_FRAMES) // CLIP_FRAMES_PER_CHUNK * CLIP_FRAMES_PER_CHUNK + CLIP_MIN_FRAMES


def centre_crop_box(width: int, height: int, canvas_width: int, canvas_height: int) -> tuple[int, int, int, int]:
    """The part of a `width x height` frame that is scaled onto the canvas (core's `common_upscale(crop="center")`):
    `(left, top, right, bottom)`, the centre cut to the canvas' aspect ratio, its margins rounded."""
    old_aspect, new_aspect = width / height, canvas_width / canvas_height
    x = y = 0
    if old_aspect > new_aspect:
        x = round((width - width * (new_aspect / old_aspect)) / 2)
    elif old_aspect < new_aspect:
        y = round((height - height * (old_aspect / new_aspect)) / 2)
    return x, y, width - x, height - y


def prepare_guide_frames(frames: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """A guide's frames `[F, h, w, 3]` in [0, 1] -> `[F, height, width, 3]` float32 on the canvas, as core prepares
    them (`_resize(image, width, height, "center")`): centre-cropped to the canvas' aspect ratio, then each frame
    scaled with PIL's LANCZOS on 8-bit pixels (`clip(255 x)` truncated to uint8, as core's `comfy.utils.lanczos`)."""
    import numpy as np
    from PIL import Image

    left, top, right, bottom = centre_crop_box(frames.shape[2], frames.shape[1], width, height)
    cropped = frames[:, top:bottom, left:right, :3].detach().to("cpu", torch.float32).numpy()
    out = np.empty((cropped.shape[0], height, width, 3), dtype=np.float32)
    for index, frame in enumerate(cropped):
        image = Image.fromarray(np.clip(255.0 * frame, 0, 255).astype(np.uint8))
        out[index] = np.asarray(image.resize((width, height), resample=Image.Resampling.LANCZOS),
                                dtype=np.float32) / 255.0
    return torch.from_numpy(out)


@dataclass(frozen=True, eq=False)
class PlacedGuide:
    """A guide checked against one request: `frame` is the resolved target pixel frame (0 .. num_frames - 1),
    `num_frames` the clip frames it keeps (1: an image; 0: audio alone), `audio` its soundtrack or audio as stereo
    32 kHz [2, N] (None without), `max_audio_latents` how many audio latents fit from `frame` to the end of the
    target's audio track (core's `floor(Ta - 5/3 frame)`: longer encoded audio is cropped to it)."""

    guide: Guide
    frame: int
    num_frames: int
    audio: torch.Tensor | None
    max_audio_latents: int
    label: str = "guide"

    @property
    def kind(self) -> str:
        return self.guide.kind

    @property
    def frames(self) -> torch.Tensor | None:
        """The frames the guide keeps (cropped to the 17k + 5 grid), not yet fitted to the canvas."""
        return None if self.guide.frames is None else self.guide.frames[:self.num_frames]

    @property
    def audio_latents(self) -> int:
        """Audio latents per channel this guide places (its audio at 40 a second, cropped to the track's end)."""
        if self.audio is None:
            return 0
        return min(-(-int(self.audio.shape[1]) // AUDIO_HOP), self.max_audio_latents)


def _seconds(frames: float) -> str:
    return f"{frames / FPS:.2f} s"


def place_guides(guides, *, num_frames: int, width: int, height: int, audio_latents: int, anchors=(),
                 name: str = "guides") -> tuple[tuple[PlacedGuide, ...], tuple[str, ...]]:
    """Check a request's guides against its canvas and duration; returns the placed guides (request order) and the
    notes to show the user (a clip cropped to the 17k + 5 grid, a short batch used as an image). One H3Error, naming
    the guide by its label, for: a frame outside the video, a clip that runs past its end, frames that do not fit
    the canvas, audio longer than the rest of the video, guides that overlap each other or the first / last frame
    (`anchors`: (name, pixel frame) of each keyframe given). A guide left with the default label is named
    `name[i]` (1-based)."""
    from .references import normalise_audio

    placed, notes = [], []
    for index, guide in enumerate(guides):
        if not isinstance(guide, Guide):
            raise H3Error(f"{name}: item {index + 1} is a {type(guide).__name__}; give h3_core.Guide(frame=..., "
                          "frames=... and/or audio=...) records.")
        label = guide.label if guide.label != Guide.label else f"{name}[{index + 1}]"
        count = 0
        if guide.frames is not None:
            given = int(guide.frames.shape[0])
            if given < 1 or min(guide.frames.shape[1:3]) < 1:
                raise H3Error(f"{label}: the clip has no frames (shape {tuple(guide.frames.shape)}).")
            count = guide_clip_frames(given)
            if not torch.isfinite(guide.frames[:count]).all():
                raise H3Error(f"{label}: the frames contain NaN or Inf values.")
            if count == 1 and given > 1:
                notes.append(f"note: {label}: {given} frames is shorter than the shortest clip (5 frames); only its "
                             "first frame is used, as an image.")
            elif count != given:
                notes.append(f"note: {label}: a clip of {given} frames is cropped to its first {count} (clips are "
                             "17k + 5 frames: 5, 22, 39, ...).")
            left, top, right, bottom = centre_crop_box(guide.frames.shape[2], guide.frames.shape[1], width, height)
            if right <= left or bottom <= top:
                raise H3Error(f"{label}: its {guide.frames.shape[2]}x{guide.frames.shape[1]} frames do not fit the "
                              f"{width}x{height} canvas: cut to the canvas' aspect ratio nothing is left. Give frames "
                              "closer to the canvas' shape.")
        resolved = guide.frame if guide.frame >= 0 else num_frames + guide.frame
        if not 0 <= resolved < num_frames:
            raise H3Error(f"{label}: frame {guide.frame} is outside the video's {num_frames} frames (0 to "
                          f"{num_frames - 1}, or -1 to -{num_frames} from the end).")
        if count > 1 and resolved + count > num_frames:
            raise H3Error(f"{label}: a clip of {count} frames at frame {resolved} runs past the end of the video "
                          f"({num_frames} frames: it ends at frame {resolved + count - 1}); start it at frame "
                          f"{num_frames - count} at the latest, or make the video longer.")
        audio = None
        max_latents = math.floor(audio_latents - FRAME_TIME_UNITS * resolved)
        if guide.audio is not None:
            audio = normalise_audio(guide.audio, guide.sample_rate, f"{label} (audio)",
                                    guide.audio.shape[-1] / guide.sample_rate + 1)  # whole: checked below
            latents = -(-int(audio.shape[1]) // AUDIO_HOP)
            if max_latents < 1 or latents > max_latents + 1:  # one latent (25 ms) over is rounding: cropped
                left_s = max(0.0, max_latents / AUDIO_LATENTS_PER_SECOND)
                raise H3Error(f"{label}: its audio is {audio.shape[1] / AUDIO_SAMPLE_RATE:.2f} s but the video has "
                              f"{left_s:.2f} s left from frame {resolved} ({num_frames} frames, "
                              f"{_seconds(num_frames)}); cut the audio to {left_s:.2f} s or start it earlier.")
        placed.append(PlacedGuide(guide, resolved, count, audio, max_latents, label))

    spans = [(anchor, frame, frame + 1, None) for anchor, frame in anchors]
    for guide in placed:
        if guide.num_frames:
            spans.append((guide.label, guide.frame, guide.frame + guide.num_frames, guide))
    _check_overlaps(spans, "frames")
    audio_spans = [(g.label, FRAME_TIME_UNITS * g.frame, FRAME_TIME_UNITS * g.frame + g.audio_latents, g)
                   for g in placed if g.audio is not None]
    _check_overlaps(audio_spans, "audio")
    return tuple(placed), tuple(notes)


def _check_overlaps(spans, what: str) -> None:
    spans = sorted(spans, key=lambda span: (span[1], span[2]))
    for (label_a, start_a, end_a, _), (label_b, start_b, end_b, _) in zip(spans, spans[1:]):
        if start_b < end_a:
            def frames(start, end):
                return f"frame {start}" if end - start == 1 else f"frames {start}-{end - 1}"

            if what == "frames":
                where = f"{label_a} holds {frames(start_a, end_a)}, {label_b} {frames(start_b, end_b)}"
            else:
                per_second = AUDIO_LATENTS_PER_SECOND
                where = (f"their audio overlaps from {start_b / per_second:.2f} s to "
                         f"{min(end_a, end_b) / per_second:.2f} s")
            raise H3Error(f"{label_b} overlaps {label_a}: {where}. Guides anchor different frames; move one of "
                          "them, or shorten it.")
