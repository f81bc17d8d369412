"""The grid every H3 request sits on: 24 fps, 32 kHz stereo, frame counts of the form 17n + 5, canvases in
multiples of 32 pixels, and the latent shape that follows from them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..errors import H3Error

FPS = 24
AUDIO_SAMPLE_RATE = 32000
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2
# The video VAE maps 17 pixel frames to 5 latent frames (the first 5 pixel frames to 2): frame counts are 17n + 5.
FRAMES_PER_CHUNK = 17
LATENTS_PER_CHUNK = 5
SPATIAL_COMPRESSION = 16
CANVAS_MULTIPLE = 32
# The largest canvas side accepted anywhere (the CLI's --size, the nodes' width / height widgets).
MAX_CANVAS = 4096
# The longest generation H3 makes in one window (the CLI's --seconds, the nodes' seconds / frames): 15 s.
MAX_SECONDS = 15.0


def align_num_frames(num_frames: int) -> int:
    """The smallest `17n + 5` frame count >= `num_frames`."""
    if int(num_frames) < 1:
        raise H3Error(f"num_frames must be at least 1, got {num_frames}.")
    n = max(0, -(-(int(num_frames) - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK))
    return FRAMES_PER_CHUNK * n + LATENTS_PER_CHUNK


def frames_for_seconds(seconds: float) -> int:
    """Pixel frames generated for a requested duration: round(seconds * 24), rounded up to the 17n + 5 grid."""
    if not seconds > 0:
        raise H3Error(f"seconds must be positive, got {seconds}.")
    return align_num_frames(max(1, round(seconds * FPS)))


MAX_FRAMES = frames_for_seconds(MAX_SECONDS)  # 362


def is_aligned_num_frames(num_frames: int) -> bool:
    return num_frames >= LATENTS_PER_CHUNK and num_frames % FRAMES_PER_CHUNK == LATENTS_PER_CHUNK


def frame_count_problem(num_frames) -> str | None:
    """Why `num_frames` cannot be a generation's frame count (None: it can): a whole number on the 17n + 5 grid, at
    most `MAX_FRAMES`. The one frame-grid rule; every surface words its message around it."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, numbers.Integral):
        return "is not a whole number of frames"
    if num_frames > MAX_FRAMES:
        return f"is {num_frames / FPS:.1f} s of video; H3 generates at most {MAX_SECONDS:g} s ({MAX_FRAMES} frames)"
    if not is_aligned_num_frames(num_frames):
        return (f"is off the 17n + 5 frame grid the video VAE needs (5, 22, 39, ...); use "
                f"{align_num_frames(max(1, num_frames))}")
    return None


def video_latent_frames(num_frames: int) -> int:
    """Latent frames of an aligned frame count: 2 for the first 5 frames, then 5 per 17."""
    if not is_aligned_num_frames(num_frames):
        raise H3Error(
            f"num_frames must be of the form 17n + 5 (5, 22, 39, ...), got {num_frames}; the nearest valid count "
            f"above it is {align_num_frames(num_frames)}."
        )
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def audio_latent_frames(num_frames: int) -> int:
    """Audio latents per stereo channel covering `num_frames` video frames (40 latents per second)."""
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


def canvas_problem(value) -> str | None:
    """Why `value` cannot be a canvas side (None: it can): a whole number of pixels, a positive multiple of 32, at
    most `MAX_CANVAS`. The one canvas rule; every surface words its message around it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return "is not a whole number of pixels"
    if value < CANVAS_MULTIPLE or value % CANVAS_MULTIPLE:
        lower = max(CANVAS_MULTIPLE, int(value) // CANVAS_MULTIPLE * CANVAS_MULTIPLE)
        return f"is not a positive multiple of {CANVAS_MULTIPLE} pixels; use {lower} or {lower + CANVAS_MULTIPLE}"
    if value > MAX_CANVAS:
        return f"is past the {MAX_CANVAS}-pixel limit (H3 was trained at 1344x768)"
    return None


def check_canvas(width: int, height: int, names: tuple[str, str] = ("width", "height")) -> None:
    for name, value in zip(names, (width, height)):
        problem = canvas_problem(value)
        if problem:
            raise H3Error(f"{name} {value!r} {problem}.")


@dataclass(frozen=True)
class LatentShape:
    """Everything the sampler needs to know about the size of one request."""

    width: int
    height: int
    num_frames: int
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int
    latent_channels: int = 24
    audio_latent_channels: int = 32

    @classmethod
    def for_request(cls, width: int, height: int, num_frames: int, *, latent_channels: int = 24,
                    audio_latent_channels: int = 32) -> "LatentShape":
        check_canvas(width, height)
        return cls(
            width=int(width),
            height=int(height),
            num_frames=int(num_frames),
            latent_frames=video_latent_frames(num_frames),
            latent_height=int(height) // SPATIAL_COMPRESSION,
            latent_width=int(width) // SPATIAL_COMPRESSION,
            audio_latents=audio_latent_frames(num_frames),
            latent_channels=latent_channels,
            audio_latent_channels=audio_latent_channels,
        )

    @property
    def video(self) -> tuple[int, int, int, int, int]:
        return (1, self.latent_channels, self.latent_frames, self.latent_height, self.latent_width)

    @property
    def audio(self) -> tuple[int, int, int, int]:
        """ComfyUI's audio latent layout `[B, C, 2, Ta]`."""
        return (1, self.audio_latent_channels, AUDIO_CHANNELS, self.audio_latents)


def audio_samples_for_frames(num_frames: int, fps: int = FPS, sample_rate: int = AUDIO_SAMPLE_RATE) -> int:
    """Samples per channel covering `num_frames` video frames (the decoder's longer output is trimmed to this)."""
    return math.ceil(sample_rate / fps * num_frames)
