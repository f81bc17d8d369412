"""Guides: media that anchor a generation at a pixel frame of the target (issue 30).

A guide is an image (one frame), a clip (17k + 5 frames; longer or odd clips are cropped to that grid with a note),
an audio waveform, or a clip with its soundtrack, placed at `frame` of the target video: 0 is the first frame,
negative values count from the end (-1 is the last frame). Several guides may anchor one request; FL2VA's
`first_frame` / `last_frame` are the two common cases (frame 0 and frame -1, one image each).

This module holds the record the front ends build (the CLI's `--guide FILE[@FRAME]`, the H3 Guide node, the
long-video windows) and its per-guide checks; where guides lower to packed rows is `pipeline/layout.py`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from ..errors import H3Error

GUIDE_SAMPLE_RATE = 32_000


@dataclass(frozen=True, eq=False)
class Guide:
    """One guide. `frames`: [F, H, W, 3] float in [0, 1] (F = 1: an image), or None for audio alone.
    `audio`: [C, N] float waveform at `sample_rate`, or None. `frame`: the target pixel frame the guide starts at
    (negative: from the end). `label`: how the user named it, for messages (a file and its @FRAME, a node)."""

    frame: int = 0
    frames: torch.Tensor | None = field(default=None, repr=False)
    audio: torch.Tensor | None = field(default=None, repr=False)
    sample_rate: int = GUIDE_SAMPLE_RATE
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
