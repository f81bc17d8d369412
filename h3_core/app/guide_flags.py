"""The CLI's `--guide FILE[@FRAME]` flag: an image, a video (with or without its soundtrack) or an audio file anchored
at a frame of the video (0 when no @FRAME; negative counts from the end). Files are read with the safe readers the
keyframe and reference flags use (PIL for images, PyAV for video and audio); each guide is labelled `--guide TEXT`
in messages."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ..errors import H3Error
from ..request.grid import FPS
from ..request.guides import Guide, guide_clip_frames

GUIDE_HELP = ("anchor a file at a frame of the video: an image, a video (its soundtrack too, when it has one; "
              "clips keep 17k+5 frames: 5, 22, 39, ...) or an audio file; @FRAME is the pixel frame it starts at "
              "(default 0; negative counts from the end: @-1 is the last frame). Repeat for several guides "
              "(FL2VA; they may not overlap)")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"}
AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".aac"}
_AT_FRAME = re.compile(r"^(?P<file>.+)@(?P<frame>[+-]?\d+)$")


def parse_guide(text: str) -> tuple[Path, int]:
    """`FILE[@FRAME]` -> (file, frame). A file whose name itself contains "@" is taken whole unless it ends in
    @ and a whole number."""
    found = _AT_FRAME.match(text)
    if found:
        return Path(found.group("file")).expanduser(), int(found.group("frame"))
    if re.search(r"@[^/\\]*$", text) and not Path(text).expanduser().exists():
        raise H3Error(f"--guide {text}: the frame after @ must be a whole number (e.g. clip.mp4@40, last.png@-1).")
    return Path(text).expanduser(), 0


def _to_24_fps(frames: torch.Tensor, rate: float) -> torch.Tensor:
    """A clip at `rate` frames per second as the 24 fps frames H3 generates: each 1/24 s slot holds the frame shown
    then."""
    count = max(1, math.floor(frames.shape[0] * FPS / rate + 1e-9))
    index = torch.tensor([min(frames.shape[0] - 1, math.floor(k * rate / FPS + 1e-9)) for k in range(count)])
    return frames[index]


def read_guide(text: str, num_frames: int, say=print) -> Guide:
    """One `--guide` value as a `Guide`, its file decoded (a video only as long as the video generated, its
    soundtrack as long as the clip frames kept). Errors start `--guide FILE@FRAME:`."""
    path, frame = parse_guide(text)
    label = f"--guide {text}"
    try:
        return _read(path, frame, label, num_frames, say)
    except H3Error as exc:
        message = str(exc)
        for prefix in (f"--guide {path}", str(path)):
            if message.startswith(prefix) and not message.startswith(label + ":"):
                message = label + message[len(prefix):]
                break
        raise H3Error(message) from None


def _read(path: Path, frame: int, label: str, num_frames: int, say) -> Guide:
    from ..request.keyframes import open_keyframe
    from ..sources.reference_files import read_audio_file, read_video_file

    if path.is_dir():
        raise H3Error(f"{label}: is a folder; give an image, video or audio file.")
    if not path.is_file():
        raise H3Error(f"{label}: no such file.")
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        import numpy as np

        image = open_keyframe(path, "guide image")
        frames = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None]
        return Guide(frame=frame, frames=frames, label=label)
    if suffix in AUDIO_SUFFIXES:
        waveform, rate = read_audio_file(path, flag="--guide")
        return Guide(frame=frame, audio=waveform, sample_rate=rate, label=label)
    frames, rate, soundtrack, sample_rate = read_video_file(path, flag="--guide", max_seconds=num_frames / FPS)
    frames = torch.from_numpy(frames).float().div_(255.0)
    if rate and abs(rate - FPS) > 1e-3:
        say(f"note: {label}: the clip is {rate:g} fps; taken at {FPS} fps (the frame shown at each 1/{FPS} s).")
        frames = _to_24_fps(frames, rate)
    if soundtrack is not None:
        kept = guide_clip_frames(frames.shape[0])
        soundtrack = soundtrack[:, :math.ceil(kept / FPS * sample_rate)]  # the soundtrack of the frames kept
    return Guide(frame=frame, frames=frames, audio=soundtrack, sample_rate=sample_rate or 32000, label=label)


def read_guide_files(values, num_frames: int, say=print) -> tuple[Guide, ...]:
    """Every `--guide` value, in command-line order."""
    return tuple(read_guide(text, num_frames, say) for text in values or ())
