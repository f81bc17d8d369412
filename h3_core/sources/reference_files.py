"""Reading Ref2VA reference files (the CLI's --ref-video / --ref-audio): a video's frames, frame rate and soundtrack,
an audio file's waveform and sample rate, through PyAV. Decoded at the rates the file carries; `references`
resamples them onto 24 fps and 32 kHz. Every failure is one `H3Error` naming the flag and the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import H3Error


def _av(flag: str, path: Path):
    try:
        import av
    except ImportError:
        raise H3Error(f"{flag} {path}: reading video and audio files needs PyAV (pip install 'h3-stream[video]' or "
                      "pip install av).") from None
    return av


def _soundtrack(av, container, stream) -> tuple[torch.Tensor, int]:
    """An audio stream as float32 [channels, samples] at its own rate (planar float conversion only)."""
    rate = int(stream.codec_context.sample_rate)
    resampler = av.audio.resampler.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
    chunks = []
    for frame in container.decode(stream):
        chunks += [f.to_ndarray() for f in resampler.resample(frame)]
    chunks += [f.to_ndarray() for f in resampler.resample(None)]
    if not chunks:
        return torch.zeros(stream.codec_context.channels or 1, 0), rate
    return torch.from_numpy(np.concatenate(chunks, axis=-1).astype(np.float32)), rate


def read_video_file(path, flag: str = "--ref-video") -> tuple[np.ndarray, float, torch.Tensor | None, int | None]:
    """uint8 frames [F, H, W, 3] (display rotation applied), the frame rate, and the soundtrack with its sample rate
    (None, None without an audio stream)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise H3Error(f"{flag} {path}: no such video file.")
    av = _av(flag, path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise H3Error(f"{flag} {path}: the file has no video stream; give a video (an audio file goes to "
                              "--ref-audio).")
            stream = container.streams.video[0]
            frames, rotation = [], 0.0
            for frame in container.decode(stream):
                rotation = getattr(frame, "rotation", 0) or 0
                frames.append(frame.to_ndarray(format="rgb24"))
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            soundtrack = None
            if container.streams.audio:
                container.seek(0)
                soundtrack = _soundtrack(av, container, container.streams.audio[0])
    except H3Error:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise H3Error(f"{flag} {path}: cannot read the video ({exc}); it is not a video file PyAV can decode, or it "
                      "is truncated.") from None
    if not frames:
        raise H3Error(f"{flag} {path}: the video has no frames.")
    if not rate > 0:
        raise H3Error(f"{flag} {path}: the video does not say its frame rate.")
    frames = np.stack(frames)
    turns = round(rotation / 90.0) % 4
    if turns:  # shown upright, as a player undoes the stream's display rotation
        frames = np.ascontiguousarray(np.rot90(frames, k=-turns, axes=(1, 2)))
    if soundtrack is not None and soundtrack[0].shape[-1] == 0:
        soundtrack = None
    waveform, sample_rate = soundtrack if soundtrack is not None else (None, None)
    return frames, rate, waveform, sample_rate


def read_audio_file(path, flag: str = "--ref-audio") -> tuple[torch.Tensor, int]:
    """float32 [channels, samples] and the sample rate of an audio file (or of a video file's soundtrack)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise H3Error(f"{flag} {path}: no such audio file.")
    av = _av(flag, path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise H3Error(f"{flag} {path}: the file has no audio stream.")
            waveform, rate = _soundtrack(av, container, container.streams.audio[0])
    except H3Error:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise H3Error(f"{flag} {path}: cannot read the audio ({exc}); it is not an audio file PyAV can decode, or "
                      "it is truncated.") from None
    if waveform.shape[-1] == 0:
        raise H3Error(f"{flag} {path}: the audio has no samples.")
    return waveform, rate
