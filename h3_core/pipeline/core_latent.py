"""Our `Latents` <-> the two streams of ComfyUI core's MiniMax H3 AV latent.

Core's H3 `LATENT` is `{"samples": NestedTensor((video, audio))}` with video `[B, 24, T, H/16, W/16]` and audio
`[B, 32, 2, Ta]` (comfy_extras/nodes_minimax_h3.py, `_empty_av_latent`). Both streams are normalised by the VAEs'
`latents_mean` / `latents_std`, as ours are (comfy/ldm/minimax/vae.py `MiniMaxH3VideoVAE.encode` / `decode`,
comfy/ldm/minimax/audio_vae.py `MiniMaxH3AudioVAE.encode` / `decode`), and core's latent format leaves them as they are
(comfy/latent_formats.py `MiniMaxH3AV`: scale factor 1, no shift; the sampler's audio scaling is undone by
`MiniMaxH3.process_latent_out` in comfy/model_base.py before a LATENT leaves the sampler). So converting changes the
container only: no arithmetic, and a round trip is bitwise exact. Each side gets its own copy, so a core node that
edits its latent in place never changes ours (ComfyUI caches node outputs) and the reverse.

This module builds and reads the two tensors; the node layer wraps them in core's `NestedTensor`.
"""

from __future__ import annotations

import torch

from ..errors import H3Error
from ..request.grid import (AUDIO_CHANNELS, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK, SPATIAL_COMPRESSION, LatentShape,
                            audio_latent_frames)
from .pipeline import Latents

VIDEO_LATENT_CHANNELS = LatentShape.latent_channels
AUDIO_LATENT_CHANNELS = LatentShape.audio_latent_channels
VIDEO_LAYOUT = f"[1, {VIDEO_LATENT_CHANNELS}, T, H/16, W/16]"
AUDIO_LAYOUT = f"[1, {AUDIO_LATENT_CHANNELS}, {AUDIO_CHANNELS}, Ta]"
MAKE_ONE = ("make it with Empty MiniMax H3 AV Latent, MiniMax H3 Image to Video or a sampler fed by one, or join a "
            "video latent and an audio latent with Concat AV Latent")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')} {list(value.shape)}"
    return type(value).__name__


def _checked_stream(value, stream: str, layout: str, fixed: dict[int, int], ndim: int, source: str) -> None:
    """One clear error for a stream that is not a float tensor of `layout` (`fixed`: dimension -> required size)."""
    if not isinstance(value, torch.Tensor) or value.ndim != ndim or not value.is_floating_point() \
            or min(value.shape) < 1 or any(value.shape[d] != size for d, size in fixed.items()):
        raise H3Error(f"{source}: the {stream} stream must be a float tensor {layout}, got {_describe(value)}.")
    if value.shape[0] != 1:
        raise H3Error(f"{source}: the {stream} stream holds a batch of {value.shape[0]} latents {_describe(value)}; "
                      "H3 Stream decodes one video per latent: make the latent with batch size 1.")


def _num_frames(latent_frames: int, source: str) -> int:
    """Pixel frames of `latent_frames` latent frames on the 17n + 5 grid (5n + 2 latent frames)."""
    if latent_frames < 2 or (latent_frames - 2) % LATENTS_PER_CHUNK:
        raise H3Error(f"{source}: the video stream has {latent_frames} latent frames; H3 latents have 5n + 2 "
                      "(2, 7, 12, ...: 5, 22, 39, ... pixel frames at 24 fps), as core's H3 latent nodes and VAE "
                      "Encode of a 17n + 5-frame clip make them.")
    return (latent_frames - 2) // LATENTS_PER_CHUNK * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK


def latents_from_core(streams, *, source: str = "latent") -> Latents:
    """Core's H3 AV latent streams (`NestedTensor.unbind()`: video, audio) -> our `Latents`, float32 on the CPU.

    `source` names the input in the error messages."""
    streams = tuple(streams)
    if len(streams) != 2:
        got = ", ".join(_describe(s) for s in streams)
        raise H3Error(f"{source}: expected a MiniMax H3 AV latent (video {VIDEO_LAYOUT} and audio {AUDIO_LAYOUT}), "
                      f"got {len(streams)} stream(s): {got}; {MAKE_ONE}.")
    video, audio = streams
    _checked_stream(video, "video", VIDEO_LAYOUT, {1: VIDEO_LATENT_CHANNELS}, 5, source)
    _checked_stream(audio, "audio", AUDIO_LAYOUT, {1: AUDIO_LATENT_CHANNELS, 2: AUDIO_CHANNELS}, 4, source)
    _, _, latent_frames, latent_height, latent_width = video.shape
    num_frames = _num_frames(latent_frames, source)
    audio_latents = audio.shape[-1]
    if audio_latents != audio_latent_frames(num_frames):
        raise H3Error(f"{source}: the audio stream has {audio_latents} latents but the video's {num_frames} frames "
                      f"need {audio_latent_frames(num_frames)} (40 per second at 24 fps); {MAKE_ONE}.")
    for stream, tensor in (("video", video), ("audio", audio)):
        if not torch.isfinite(tensor).all():
            raise H3Error(f"{source}: the {stream} stream holds NaN or Inf values, which decode to noise; sample it "
                          "again (in bfloat16 or float32 if the sampler ran in float16).")
    shape = LatentShape(width=latent_width * SPATIAL_COMPRESSION, height=latent_height * SPATIAL_COMPRESSION,
                        num_frames=num_frames, latent_frames=latent_frames, latent_height=latent_height,
                        latent_width=latent_width, audio_latents=audio_latents)
    return Latents(_own_copy(video), _own_copy(audio), shape)


def latents_to_core(latents: Latents) -> tuple[torch.Tensor, torch.Tensor]:
    """Our `Latents` -> (video, audio) for core's `NestedTensor`, float32 on the CPU, checked as `latents_from_core`
    checks them (so what leaves is what comes back)."""
    if not isinstance(latents, Latents):
        raise H3Error(f"h3_latent: expected the latents of an H3 sampler, got {type(latents).__name__}.")
    checked = latents_from_core((latents.video, latents.audio), source="h3_latent")
    if checked.shape != latents.shape:
        raise H3Error(f"h3_latent: its tensors (video {list(latents.video.shape)}, audio {list(latents.audio.shape)}) "
                      f"do not match its recorded shape {latents.shape}.")
    return checked.video, checked.audio


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 CPU tensor that shares no memory with `tensor` (float32 holds float16 and bfloat16 exactly)."""
    return tensor.detach().to(device="cpu", dtype=torch.float32).clone(memory_format=torch.contiguous_format)
