"""What one generation gives back, locally or from a server."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .grid import AUDIO_SAMPLE_RATE, FPS


@dataclass
class GenerationResult:
    frames: torch.Tensor  # [F, H, W, 3] float in [0, 1]
    waveform: torch.Tensor  # [2, N] float at 32 kHz, trimmed to the video length
    fps: int = FPS
    sample_rate: int = AUDIO_SAMPLE_RATE
    timings: dict = field(default_factory=dict)
    step_cache: object = None  # the sampler's `StepCacheStats` (None: the step cache was off, or a remote engine)
    # The audio health check's warnings (`request.audio_health.AudioFinding`s): audio that may still be usable.
    # Its errors never make a result: they raise `AudioHealthError` before anything is saved.
    audio_warnings: tuple = ()
