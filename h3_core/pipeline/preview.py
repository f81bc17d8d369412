"""Live previews of a sampling run: the sampler's x0 estimate after each model call, and two ways to see it.

* `latent_to_rgb`: one latent frame through a 24 -> 3 linear map, the "latent2rgb" preview. The factors and bias are
  ComfyUI core's for H3's video latent (`comfy/latent_formats.py`, class `MiniMaxH3Video`, `latent_rgb_factors` and
  `latent_rgb_factors_bias`, kat3ri/ComfyUI commit 0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a), and the pixel mapping
  is core's (`latent_preview.py`: `Latent2RGBPreviewer` and `preview_to_image`: `(x + 1) / 2`, clamped, times 255,
  truncated to uint8), so the picture is the one core's samplers show for the same latent.
* `frame_to_rgb`: a decoded frame in [0, 1] (the TAEH3 tiny decoder's, `models/taeh3.py`) to the same uint8 layout.

Both read the normalised latent the transformer samples (what core's sampler calls x0 and what TAEHV decoders take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import rows_to_audio, unpatchify

# ComfyUI core, comfy/latent_formats.py, MiniMaxH3Video (commit above): one row per latent channel, columns R, G, B.
VIDEO_RGB_FACTORS = (
    (-0.018555, 0.024344, -0.017536),
    (0.150164, 0.137244, 0.129221),
    (0.027367, -0.050369, -0.208606),
    (-0.000793, -0.164622, -0.323161),
    (-0.048556, 0.013970, -0.074286),
    (0.011740, 0.014172, -0.006906),
    (0.061517, 0.061212, 0.110025),
    (0.035321, 0.086879, 0.110059),
    (-0.017426, 0.002997, 0.035356),
    (0.531539, 0.548819, 0.624404),
    (-0.024968, -0.040234, -0.034302),
    (-0.032549, -0.029096, -0.017221),
    (0.022609, 0.020286, 0.050661),
    (-0.084001, -0.038131, -0.020805),
    (-0.018830, 0.010412, 0.061120),
    (0.020777, 0.011196, -0.030994),
    (-0.008390, -0.012201, -0.025687),
    (-0.013281, -0.002924, 0.006331),
    (0.000260, 0.001833, -0.011038),
    (0.105471, 0.100482, 0.132106),
    (0.016529, 0.015213, 0.009999),
    (-0.014015, -0.017438, -0.019134),
    (-0.033787, -0.009984, -0.019725),
    (0.004224, 0.017284, 0.027196),
)
VIDEO_RGB_BIAS = (0.057426, -0.022078, -0.071449)


@dataclass(frozen=True)
class StepEstimate:
    """The sampler's x0 estimate after model call `step` of `total`, as the sampling loop holds it: the target rows
    (packed, float32, on the sampling device). Read it through `video_latent` / `audio_latent`, which copy; the rows
    themselves are the sampler's and must not be changed."""

    step: int
    total: int
    video_rows: torch.Tensor  # [Tv * h/ph * w/pw, C * pt * ph * pw]
    audio_rows: torch.Tensor  # [2 * Ta, C_a]
    video_shape: tuple[int, int, int, int]  # (C, T, h, w) of the video latent
    patch_size: tuple[int, int, int]

    def video_latent(self, frames: int | None = None) -> torch.Tensor:
        """The first `frames` latent frames (None: all) as `[1, C, frames, h, w]`: only their rows are read (rows
        are frame-major), so a preview of the first frame costs one frame's rows, not the clip's."""
        channels, latent_frames, height, width = self.video_shape
        pt, ph, pw = self.patch_size
        frames = latent_frames if frames is None else max(pt, min(int(frames), latent_frames)) // pt * pt
        rows = frames // pt * (height // ph) * (width // pw)
        return unpatchify(self.video_rows[None, :rows].clone(), (channels, frames, height, width), self.patch_size)

    def audio_latent(self) -> torch.Tensor:
        """The audio latent `[1, C_a, 2, Ta]` (a copy)."""
        return rows_to_audio(self.audio_rows[None].clone())


def latent_rgb_weights(dtype=torch.float32, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The factors as a linear layer's weight `[3, 24]` and bias `[3]`."""
    weight = torch.tensor(VIDEO_RGB_FACTORS, dtype=dtype, device=device).t()
    return weight, torch.tensor(VIDEO_RGB_BIAS, dtype=dtype, device=device)


def latent_to_rgb(frame: torch.Tensor) -> torch.Tensor:
    """One latent frame `[24, h, w]` -> uint8 `[h, w, 3]` on the CPU, core's latent2rgb preview of it."""
    if frame.ndim != 3 or frame.shape[0] != len(VIDEO_RGB_FACTORS):
        raise ValueError(f"latent2rgb needs one latent frame [{len(VIDEO_RGB_FACTORS)}, h, w], got "
                         f"{list(frame.shape)}.")
    weight, bias = latent_rgb_weights(frame.dtype, frame.device)
    rgb = torch.nn.functional.linear(frame.movedim(0, -1), weight, bias)
    return _to_uint8((rgb + 1.0) / 2.0)


def frame_to_rgb(frame: torch.Tensor) -> torch.Tensor:
    """A decoded frame `[3, H, W]` in [0, 1] -> uint8 `[H, W, 3]` on the CPU."""
    if frame.ndim != 3 or frame.shape[0] != 3:
        raise ValueError(f"a decoded frame is [3, H, W], got {list(frame.shape)}.")
    return _to_uint8(frame.movedim(0, -1))


def _to_uint8(unit: torch.Tensor) -> torch.Tensor:
    # core: clamp to [0, 1], times 255, then a truncating cast (not rounding), on the CPU
    return unit.clamp(0, 1).mul(0xFF).to(device="cpu", dtype=torch.uint8)


class Latent2RGBPreviewer:
    """Each step's picture: the first latent frame of the x0 estimate through `latent_to_rgb` (latent size)."""

    method = "latent2rgb"

    def render(self, estimate: StepEstimate) -> torch.Tensor:
        return latent_to_rgb(estimate.video_latent(1)[0, :, 0])


class TAEH3Previewer:
    """Each step's picture: the clip's first frame, decoded from latent frame 0 of the x0 estimate by the TAEH3
    decoder on the estimate's device, with just enough of its 2x spatial stages for the frame's long side to reach
    `max_size` (the size ComfyUI shows previews at), so a preview costs about its own size, not the clip's."""

    method = "taeh3"

    def __init__(self, decoder, max_size: int | None = None):
        self.decoder = decoder
        self.max_size = max_size

    def stages(self, latent_height: int, latent_width: int) -> tuple[bool, bool, bool]:
        """The spatial stages to run: all of them without a size limit, else the first few that reach it."""
        from ..models.taeh3 import PATCH_SIZE

        if self.max_size is None:
            return (True, True, True)
        side, kept = max(latent_height, latent_width) * PATCH_SIZE, 0
        while kept < 3 and side < self.max_size:
            side, kept = side * 2, kept + 1
        return tuple(stage < kept for stage in range(3))

    def render(self, estimate: StepEstimate) -> torch.Tensor:
        latent = estimate.video_latent(1)
        parameter = next(self.decoder.parameters())
        with torch.no_grad():
            frame = self.decoder.first_frame(latent.to(parameter.device, parameter.dtype),
                                             self.stages(*latent.shape[-2:]))
        return frame_to_rgb(frame)


def taeh3_previewer(path, *, device="cpu", max_size: int | None = None) -> TAEH3Previewer:
    """A `TAEH3Previewer` of the `.safetensors` at `path` (loaded once per file version and device: a run's steps and
    the runs after it share it)."""
    import os

    stat = os.stat(path)
    return TAEH3Previewer(_cached_decoder(str(path), stat.st_mtime_ns, stat.st_size, str(device)), max_size)


def _cached_decoder(path: str, mtime_ns: int, size: int, device: str):
    from ..checkpoints.taeh3_loader import load_taeh3

    key = (path, mtime_ns, size, device)
    if _DECODER_CACHE.get("key") != key:
        _DECODER_CACHE.clear()  # one decoder at most: a changed file or device replaces it
        _DECODER_CACHE.update(key=key, decoder=load_taeh3(path, device=device))
    return _DECODER_CACHE["decoder"]


_DECODER_CACHE: dict = {}
