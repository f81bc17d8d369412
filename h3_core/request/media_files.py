"""Writing a generation to disk: an mp4 (H.264 + AAC 32 kHz stereo) through PyAV when it is installed, otherwise
PNG frames plus a WAV file (soundfile).

Every output is written under a hidden staging name in its own folder (`.NAME.PID.partial`) and renamed into place
(`os.replace`) once complete: an interrupted or failed write leaves no partial file and never touches a file already
at the path; a complete one replaces it in one step. Staging leftovers of killed processes are removed by the next
write to the same path.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import H3Error
from ..staged_files import remove, remove_dead_staging, staging_path, write_failure
from .grid import AUDIO_SAMPLE_RATE, FPS, audio_samples_for_frames


def have_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def _frames_uint8(frames: torch.Tensor) -> np.ndarray:
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise H3Error(f"frames must be [F, H, W, 3] in [0, 1], got shape {tuple(frames.shape)}.")
    return (frames.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu().numpy())


def _trimmed_audio(waveform: torch.Tensor, num_frames: int, fps: int, sample_rate: int) -> np.ndarray:
    if waveform.ndim != 2 or waveform.shape[0] != 2:
        raise H3Error(f"waveform must be stereo [2, N], got shape {tuple(waveform.shape)}.")
    n = min(waveform.shape[1], audio_samples_for_frames(num_frames, fps, sample_rate))
    return waveform[:, :n].detach().float().clamp(-1, 1).cpu().numpy()


def _write_error(path: Path, exc: BaseException) -> H3Error:
    reason = write_failure(exc, path.parent)
    kept = "; the file already there is unchanged" if path.exists() else ""
    return H3Error(f"{path}: could not write the output: {reason}. Nothing was written{kept}.")


def _write_staged(path: Path, write) -> Path:
    """Run `write(staging_path)`, then rename the staging file or folder to `path`; on any failure or interrupt the
    staging copy is removed and `path` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(path)
    staging = staging_path(path)
    try:
        write(staging)
        if staging.is_dir() and path.is_dir():  # a folder cannot replace a folder in one rename: move the old aside
            old = path.with_name(f".{path.name}.{os.getpid()}.old.partial")
            os.replace(path, old)
            os.replace(staging, path)
            remove(old)
        else:
            os.replace(staging, path)
    except BaseException as exc:
        remove(staging)
        if isinstance(exc, OSError) or _is_av_error(exc):
            raise _write_error(path, exc) from None
        raise
    return path


def _is_av_error(exc: BaseException) -> bool:
    try:
        import av
    except ImportError:
        return False
    return isinstance(exc, getattr(av, "FFmpegError", ()))


def write_mp4(path: Path, frames: torch.Tensor, waveform: torch.Tensor, fps: int = FPS,
              sample_rate: int = AUDIO_SAMPLE_RATE) -> Path:
    pixels = _frames_uint8(frames)
    audio = np.ascontiguousarray(_trimmed_audio(waveform, len(pixels), fps, sample_rate))
    return _write_staged(Path(path), lambda staging: _encode_mp4(staging, pixels, audio, fps, sample_rate))


def _encode_mp4(path: Path, pixels: np.ndarray, audio: np.ndarray, fps: int, sample_rate: int) -> None:
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "h264"
    with av.open(str(path), "w", format="mp4") as container:
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


def write_frames_and_wav(path: Path, frames: torch.Tensor, waveform: torch.Tensor, fps: int = FPS,
                         sample_rate: int = AUDIO_SAMPLE_RATE) -> list[Path]:
    """`out.mp4` -> `out_frames/frame_00000.png ...` and `out.wav` (each staged and renamed into place)."""
    import soundfile
    from PIL import Image

    path = Path(path)
    pixels = _frames_uint8(frames)
    audio = _trimmed_audio(waveform, len(pixels), fps, sample_rate)

    def write_frames(folder: Path) -> None:
        folder.mkdir()
        for i, image in enumerate(pixels):
            Image.fromarray(image).save(folder / f"frame_{i:05d}.png", format="PNG")

    wav = _write_staged(path.with_suffix(".wav"), lambda staging: soundfile.write(
        str(staging), audio.T, sample_rate, subtype="FLOAT", format="WAV"))
    folder = _write_staged(path.with_name(path.stem + "_frames"), write_frames)
    return [folder, wav]


def save_generation(path, frames: torch.Tensor, waveform: torch.Tensor, fps: int = FPS,
                    sample_rate: int = AUDIO_SAMPLE_RATE, *, prefer_mp4: bool = True) -> list[Path]:
    """Write the result to `path` (an .mp4 name); returns the paths written. Writes `<stem>_frames/` PNGs and
    `<stem>.wav` instead without PyAV or with `prefer_mp4=False`. Another suffix is refused (`OUTPUT_SUFFIXES`)."""
    from .media_files import check_output_path

    path = check_output_path(path, "path")
    if prefer_mp4 and have_pyav():
        return [write_mp4(path, frames, waveform, fps, sample_rate)]
    return write_frames_and_wav(path, frames, waveform, fps, sample_rate)


def read_mp4(path, sample_rate: int = AUDIO_SAMPLE_RATE, source: str | None = None):
    """An mp4 with a video and an audio track -> (frames [F, H, W, 3] float32 in [0, 1], waveform [2, N] float32 at
    `sample_rate`, frames per second). The audio is resampled to `sample_rate` stereo when it is in another form.
    `source` names the video in errors (default: the path)."""
    try:
        import av
    except ImportError:
        raise H3Error("reading an mp4 needs PyAV: pip install 'h3-stream[video]' (or pip install av).") from None
    source = source or str(path)
    try:
        with av.open(str(path), "r") as container:
            if not container.streams.video:
                raise H3Error(f"{source}: the file has no video track.")
            if not container.streams.audio:
                raise H3Error(f"{source}: the file has no audio track (H3 makes video with stereo audio).")
            video = container.streams.video[0]
            rate = video.average_rate
            images = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
            container.seek(0)
            resampler = av.AudioResampler(format="fltp", layout="stereo", rate=sample_rate)
            blocks = []
            for frame in container.decode(audio=0):
                frame.pts = None  # the resampler keeps its own clock
                blocks.extend(block.to_ndarray() for block in resampler.resample(frame))
            blocks.extend(block.to_ndarray() for block in resampler.resample(None))
    except H3Error:
        raise
    except (OSError, ValueError, getattr(av, "FFmpegError", OSError)) as exc:
        raise H3Error(f"{source}: cannot decode the mp4 ({exc}); it is truncated or not a video file.") from None
    if not images:
        raise H3Error(f"{source}: the video track has no frames.")
    frames = torch.from_numpy(np.stack(images)).float().div_(255.0)
    audio = np.concatenate(blocks, axis=1) if blocks else np.zeros((2, 0), dtype=np.float32)
    fps = float(rate) if rate else float(FPS)
    return frames, torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32)), fps


def write_outputs(out, result, before, say) -> list:
    """Save a run's frames and waveform at `out` (the mp4, or PNG frames and a WAV without PyAV) and say what was
    written, whether it replaced a file (`before`: what was at `out` when the run started) and the phase timings."""
    written = save_generation(out, result.frames, result.waveform, result.fps, result.sample_rate)
    if not have_pyav():
        say("PyAV is not installed (pip install 'h3-stream[video]'), so frames and audio were written separately")
    for path in written:
        replaced = before is not None and path == out
        say(f"wrote {path}" + (" (replaced the file that was there)" if replaced else ""))
    say(", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items()))
    return written


# What `save_generation` and the CLI's --out write: an mp4 (H.264 + AAC) through PyAV; without PyAV, `<stem>_frames/`
# PNGs and `<stem>.wav` next to it.
OUTPUT_SUFFIXES = (".mp4",)


def output_problem(path) -> str | None:
    """Why the generation cannot be written at `path` (checked by creating and removing a file in its folder), or
    None. A missing folder is fine: it is created when the output is written."""
    text = os.fspath(path)
    if not text:
        return "is empty; give a file name ending in .mp4, e.g. out.mp4"
    path = Path(text).expanduser()
    if path.is_dir():
        return f"is a folder; give a file name inside it, e.g. {path / 'out.mp4'}"
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        return (f"h3-stream writes {' / '.join(OUTPUT_SUFFIXES)} files (H.264 + AAC; without PyAV, {path.stem}_frames/ "
                f"PNGs and {path.stem}.wav beside it), not {path.suffix or 'files without a suffix'!r}; name it "
                f"{path.with_suffix('.mp4').name}")
    if path.exists() and not path.is_file():
        return "exists and is not a regular file (a device or a pipe); give a file name"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        handle, probe = tempfile.mkstemp(prefix=".h3-write-check-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write in {folder} ({exc.strerror or exc})"
    return None


def check_output_path(path, name: str = "output path") -> Path:
    problem = output_problem(path)
    if problem:
        raise H3Error(f"{name} {os.fspath(path)!r}: {problem}.")
    return Path(os.fspath(path)).expanduser()
