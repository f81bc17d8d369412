"""Writing a generation to disk: an mp4 (H.264 + AAC 32 kHz stereo) through PyAV when it is installed, otherwise
PNG frames plus a WAV file (soundfile)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..errors import H3Error
from .layout import AUDIO_SAMPLE_RATE, FPS


def have_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def audio_samples_for_frames(num_frames: int, fps: int = FPS, sample_rate: int = AUDIO_SAMPLE_RATE) -> int:
    """Samples per channel covering `num_frames` video frames (the decoder's longer output is trimmed to this)."""
    return math.ceil(sample_rate / fps * num_frames)


def _frames_uint8(frames: torch.Tensor) -> np.ndarray:
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise H3Error(f"frames must be [F, H, W, 3] in [0, 1], got shape {tuple(frames.shape)}.")
    return (frames.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu().numpy())


def _trimmed_audio(waveform: torch.Tensor, num_frames: int, fps: int, sample_rate: int) -> np.ndarray:
    if waveform.ndim != 2 or waveform.shape[0] != 2:
        raise H3Error(f"waveform must be stereo [2, N], got shape {tuple(waveform.shape)}.")
    n = min(waveform.shape[1], audio_samples_for_frames(num_frames, fps, sample_rate))
    return waveform[:, :n].detach().float().clamp(-1, 1).cpu().numpy()


def write_mp4(path: Path, frames: torch.Tensor, waveform: torch.Tensor, fps: int = FPS,
              sample_rate: int = AUDIO_SAMPLE_RATE) -> Path:
    import av

    pixels = _frames_uint8(frames)
    audio = np.ascontiguousarray(_trimmed_audio(waveform, len(pixels), fps, sample_rate))
    codec = "libx264" if "libx264" in av.codecs_available else "h264"
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        video = container.add_stream(codec, rate=fps)
        video.height, video.width = pixels.shape[1], pixels.shape[2]
        video.pix_fmt = "yuv420p"
        sound = container.add_stream("aac", rate=sample_rate)
        sound.layout = "stereo"
        for image in pixels:
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        block = av.AudioFrame.from_ndarray(audio, format="fltp", layout="stereo")
        block.sample_rate = sample_rate
        for packet in sound.encode(block):
            container.mux(packet)
        for packet in sound.encode():
            container.mux(packet)
    return path


def write_frames_and_wav(path: Path, frames: torch.Tensor, waveform: torch.Tensor, fps: int = FPS,
                         sample_rate: int = AUDIO_SAMPLE_RATE) -> list[Path]:
    """`out.mp4` -> `out_frames/frame_00000.png ...` and `out.wav`."""
    import soundfile
    from PIL import Image

    pixels = _frames_uint8(frames)
    audio = _trimmed_audio(waveform, len(pixels), fps, sample_rate)
    folder = path.with_name(path.stem + "_frames")
    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(pixels):
        Image.fromarray(image).save(folder / f"frame_{i:05d}.png")
    wav = path.with_suffix(".wav")
    soundfile.write(str(wav), audio.T, sample_rate, subtype="FLOAT")
    return [folder, wav]


def save_generation(path, frames: torch.Tensor, waveform: torch.Tensor, fps: int = FPS,
                    sample_rate: int = AUDIO_SAMPLE_RATE, *, prefer_mp4: bool = True) -> list[Path]:
    """Write the result; returns the paths written. Falls back to PNG + WAV without PyAV."""
    path = Path(path)
    if prefer_mp4 and path.suffix.lower() == ".mp4" and have_pyav():
        return [write_mp4(path, frames, waveform, fps, sample_rate)]
    return write_frames_and_wav(path, frames, waveform, fps, sample_rate)
