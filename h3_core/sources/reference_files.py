"""Reading Ref2VA reference files (the CLI's --ref-video / --ref-audio): a video's frames, frame rate and soundtrack,
an audio file's waveform and sample rate, through PyAV. Decoded at the rates the file carries; `references`
resamples them onto 24 fps and 32 kHz. Every failure is one `H3Error` naming the flag and the file.

Audio is decoded as packed float (one plane): PyAV 18's `AudioFrame.planes` walks `extended_data` until a NULL
pointer, and a planar frame of 8 or more channels has none after its last plane (8: past the 8 `data` pointers;
more: past the end of the allocated array), so `to_ndarray` read bogus planes and the process died (SIGSEGV). Mono and stereo stay as they are; 3+ channels whose speaker positions
the file names (5.1, 7.1, quad, ...) are mixed down to stereo by libswresample's standard matrix (what ffmpeg
-ac 2 and players do); 3+ channels without positions (a WAV without a channel mask) are refused, as no mix of them
is right. With `max_seconds` only what the request uses is decoded (a reference is cut to the generated duration).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..errors import H3Error
from ..request.references import check_sample_rate


def _av(flag: str, path: Path):
    try:
        import av
    except ImportError:
        raise H3Error(f"{flag} {path}: reading video and audio files needs PyAV (pip install 'h3-stream[video]' or "
                      "pip install av).") from None
    return av


def _positions_known(layout) -> bool:
    """Whether each channel names its speaker (FL, FR, FC, LFE, ...): libswresample can mix those to stereo."""
    return all(channel.name != "NONE" and not channel.name.startswith(("USR", "AMBI")) for channel in layout.channels)


def _soundtrack(av, container, stream, label: str, max_seconds: float | None) -> tuple[torch.Tensor, int]:
    """An audio stream as float32 [channels, samples] at its own rate: mono or stereo as it is, more channels mixed
    down to stereo; at most `max_seconds` of it (when given)."""
    rate = check_sample_rate(stream.codec_context.sample_rate, label)
    layout = stream.codec_context.layout
    channels = layout.nb_channels
    if channels < 1:
        raise H3Error(f"{label}: the audio stream has no channels; the file is corrupt.")
    if channels > 2 and not _positions_known(layout):
        raise H3Error(f"{label}: the audio has {channels} channels without speaker positions (the file does not say "
                      "which is left and which right), and H3 takes mono or stereo. Mix it down to stereo first, "
                      "e.g. in an audio editor.")
    out_layout = "stereo" if channels > 2 else layout
    out_channels = min(channels, 2)
    resampler = av.audio.resampler.AudioResampler(format="flt", layout=out_layout, rate=rate)
    wanted = math.ceil(max_seconds * rate) if max_seconds is not None else None
    chunks, got = [], 0
    for frame in container.decode(stream):
        for block in resampler.resample(frame):
            chunks.append(block.to_ndarray().reshape(-1, out_channels))  # packed: samples interleaved
            got += chunks[-1].shape[0]
        if wanted is not None and got >= wanted:
            break
    else:
        chunks += [block.to_ndarray().reshape(-1, out_channels) for block in resampler.resample(None)]
    if not chunks:
        return torch.zeros(out_channels, 0), rate
    waveform = np.concatenate(chunks, axis=0)[:wanted].T
    return torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32)), rate


def _existing_file(path, flag: str, what: str) -> Path:
    path = Path(path).expanduser()
    if path.is_dir():
        raise H3Error(f"{flag} {path}: is a folder; give a file inside it.")
    if not path.is_file():
        raise H3Error(f"{flag} {path}: no such {what} file.")
    return path


def read_video_file(path, flag: str = "--ref-video", max_seconds: float | None = None
                    ) -> tuple[np.ndarray, float, torch.Tensor | None, int | None]:
    """uint8 frames [F, H, W, 3] (display rotation applied), the frame rate, and the soundtrack with its sample rate
    (None, None without an audio stream). With `max_seconds`, the frames that cover that long at 24 fps and as
    much of the soundtrack, not more (a two-hour film as a reference is not decoded whole)."""
    path = _existing_file(path, flag, "video")
    av = _av(flag, path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise H3Error(f"{flag} {path}: the file has no video stream; give a video (an audio file goes to "
                              "--ref-audio).")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            # One frame past the duration: the 24 fps resampling holds each frame until the next one's slot.
            wanted = math.ceil(max_seconds * rate) + 1 if max_seconds is not None and rate > 0 else None
            frames, rotation = [], 0.0
            for frame in container.decode(stream):
                rotation = getattr(frame, "rotation", 0) or 0
                frames.append(frame.to_ndarray(format="rgb24"))
                if wanted is not None and len(frames) >= wanted:
                    break
            soundtrack = None
            if container.streams.audio:
                container.seek(0)
                soundtrack = _soundtrack(av, container, container.streams.audio[0], f"{flag} {path} (soundtrack)",
                                         max_seconds)
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


def read_audio_file(path, flag: str = "--ref-audio", max_seconds: float | None = None) -> tuple[torch.Tensor, int]:
    """float32 [channels, samples] (mono or stereo) and the sample rate of an audio file (or of a video file's
    soundtrack); at most `max_seconds` of it, when given."""
    path = _existing_file(path, flag, "audio")
    av = _av(flag, path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise H3Error(f"{flag} {path}: the file has no audio stream.")
            waveform, rate = _soundtrack(av, container, container.streams.audio[0], f"{flag} {path}", max_seconds)
    except H3Error:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise H3Error(f"{flag} {path}: cannot read the audio ({exc}); it is not an audio file PyAV can decode, or "
                      "it is truncated.") from None
    if waveform.shape[-1] == 0:
        raise H3Error(f"{flag} {path}: the audio has no samples.")
    return waveform, rate
