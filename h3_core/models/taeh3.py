"""TAEH3: the decoder of the Tiny AutoEncoder for MiniMax H3 (madebyollin/taehv's `taeh3` weights), for previews.

TAEHV decoders (github.com/madebyollin/taehv, `taehv.py`) turn the normalised latent the transformer samples straight
into RGB in [0, 1], no latent scale or shift. The `taeh3` member: 24 latent channels, output pixel-shuffled by 2,
time upscaled 4x (stages 2 and 3), and H3's chunking on decode (five latent frames a chunk, each chunk's first three
decoded frames dropped, the clip's last twelve too), so latent frame 0 gives exactly the clip's first frame.

The module is written here from that definition, with its state-dict layout (`decoder.<index>....`, the indices of
taehv's `nn.Sequential`), so a `taeh3.safetensors` in taehv's layout loads as it is. Reading a file is
`checkpoints/taeh3_loader.py`'s (safetensors only; the encoder's tensors in the file are ignored). Blocks with memory see the previous frame's input at their depth (zeros
for the first frame): everything is causal in time, so the first frame needs only latent frame 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


LATENT_CHANNELS = 24
PATCH_SIZE = 2
WIDTHS = (256, 128, 64, 64)
TIME_UPSCALE = (False, True, True)  # taehv's default decoder_time_upscale, which taeh3 keeps
CHUNK_LATENTS = 5  # H3's video VAE decodes five latent frames a chunk
TRAILING_LATENTS = 3  # ... and its last chunk carries three latents of padding


def _conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class _SoftClamp(nn.Module):
    """`3 tanh(x / 3)`: bounds the latent before the first convolution."""

    def forward(self, x):
        return torch.tanh(x / 3) * 3


class _MemoryBlock(nn.Module):
    """Three 3x3 convolutions over (this frame, the previous frame) at this depth, plus the frame itself."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * width, width), nn.ReLU(), _conv(width, width), nn.ReLU(),
                                  _conv(width, width))

    def forward(self, x, past):
        return F.relu(self.conv(torch.cat([x, past], 1)) + x)


class TimeGrow(nn.Module):
    """One frame -> `stride` frames: a 1x1 convolution to `stride * width` channels, split in time."""

    def __init__(self, width: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(width, width * stride, 1, bias=False)

    def forward(self, x):
        frames, width, height, breadth = x.shape
        return self.conv(x).reshape(frames * self.stride, width, height, breadth)


class _Upsample(nn.Module):
    """A 2x nearest-neighbour spatial stage (on or off per call: `TAEH3Decoder._run`)."""


class TAEH3Decoder(nn.Module):
    """The TAEH3 decoder. `space_upscale` turns each of the three 2x spatial stages on or off (off: the same weights
    at half the size per stage, taehv's cheaper preview), so a preview decodes at about the size it is shown."""

    def __init__(self, space_upscale=(True, True, True)):
        super().__init__()
        self.space_upscale = tuple(bool(s) for s in space_upscale)
        w = WIDTHS
        layers: list[nn.Module] = [_SoftClamp(), _conv(LATENT_CHANNELS, w[0]), nn.ReLU()]
        for stage in range(3):
            layers += [_MemoryBlock(w[stage]), _MemoryBlock(w[stage]), _MemoryBlock(w[stage]),
                       _Upsample(),
                       TimeGrow(w[stage], 2 if TIME_UPSCALE[stage] else 1), _conv(w[stage], w[stage + 1], bias=False)]
        layers += [nn.ReLU(), _conv(w[3], 3 * PATCH_SIZE ** 2)]
        self.decoder = nn.Sequential(*layers)
        self.time_upscale = 2 ** sum(TIME_UPSCALE)
        self.frames_to_trim = self.time_upscale - 1  # the first chunk's lead-in frames

    @property
    def spatial_scale(self) -> int:
        return PATCH_SIZE * 2 ** sum(self.space_upscale)

    def _run(self, latent: torch.Tensor, space_upscale=None) -> torch.Tensor:
        """`[N, T, C, h, w]` -> every decoded frame `[N, 4T, 3 * 4, h', w']` before H3's trims. `space_upscale`
        overrides the constructor's stages for this call (the upsampling layers hold no weights)."""
        batch, frames = latent.shape[:2]
        x = latent.reshape(batch * frames, *latent.shape[2:])
        stages = iter(self.space_upscale if space_upscale is None else tuple(bool(s) for s in space_upscale))
        for layer in self.decoder:
            if isinstance(layer, _Upsample):
                x = F.interpolate(x, scale_factor=2, mode="nearest") if next(stages) else x
            elif isinstance(layer, _MemoryBlock):
                per_clip = x.reshape(batch, -1, *x.shape[1:])
                past = torch.cat([torch.zeros_like(per_clip[:, :1]), per_clip[:, :-1]], 1).reshape(x.shape)
                x = layer(x, past)
            else:
                x = layer(x)
        return x.reshape(batch, -1, *x.shape[1:])

    def decode_video(self, latent: torch.Tensor) -> torch.Tensor:
        """A latent `[N, 24, T, h, w]` (normalised, as sampled) -> frames `[N, F, 3, H, W]` in [0, 1], with H3's
        chunk trims (T = 5n + 2 latent frames give 17n + 5 frames)."""
        raw = self._run(latent.movedim(1, 2))
        chunk = CHUNK_LATENTS * self.time_upscale
        pad = -raw.shape[1] % chunk
        if pad:
            raw = torch.cat([raw, raw.new_zeros(raw.shape[0], pad, *raw.shape[2:])], 1)
        raw = raw.unflatten(1, (-1, chunk))[:, :, self.frames_to_trim:].flatten(1, 2)
        raw = raw[:, : raw.shape[1] - TRAILING_LATENTS * self.time_upscale]
        return F.pixel_shuffle(raw, PATCH_SIZE).clamp(0, 1)

    def first_frame(self, latent: torch.Tensor, space_upscale=None) -> torch.Tensor:
        """The clip's first frame `[3, H, W]` in [0, 1] from latent frame 0 of `[1, 24, T, h, w]` alone (its
        size: `space_upscale`'s stages, default the constructor's)."""
        raw = self._run(latent[:1, :, :1].movedim(1, 2), space_upscale)
        return F.pixel_shuffle(raw[0, self.frames_to_trim], PATCH_SIZE).clamp(0, 1)
