"""Small media for the remote engine's conformance tests: keyframe and reference pictures, a stereo tone."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """Random RGB noise: every pixel differs, so a resize or a crop shows."""
    generator = np.random.default_rng(seed)
    return Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8))


def tone(seconds: float, rate: int = 32000) -> torch.Tensor:
    """[2, N]: 440 Hz on the left, 660 Hz on the right."""
    t = torch.arange(int(seconds * rate)) / rate
    return torch.stack([0.3 * torch.sin(2 * torch.pi * 440 * t), 0.3 * torch.sin(2 * torch.pi * 660 * t)])
