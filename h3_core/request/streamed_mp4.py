"""An mp4 written a piece at a time (H.264 + AAC 32 kHz stereo, through PyAV): a long video's windows are appended
as each is decoded, so neither the frames nor the samples of the whole clip are ever in memory. Staged like every
output (`staged_files`): written under `.NAME.PID.partial` and renamed into place by `finish()`; an exception or an
interrupt before that removes the staging file and leaves whatever was at the path untouched.

Extending a clip: `ClipToExtend.read` checks it (24 fps, H.264, a canvas on the 32-pixel grid) and keeps only its
last frames and their soundtrack (the guide of the first new window); `StreamedMp4(..., source=clip)` then copies
the clip's video packets as they are (its frames decode bitwise as before) and re-encodes its soundtrack into the one
AAC track; the new frames are encoded after them in the same H.264 track, their own parameter sets sent in-band.
"""

from __future__ import annotations

import collections
import fractions
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import H3Error
from ..staged_files import remove, remove_dead_staging, staging_path, write_failure
from .grid import AUDIO_SAMPLE_RATE, FPS, canvas_problem


def _av():
    try:
        import av
    except ImportError:
        raise H3Error("a long video or an extension is written as an mp4 through PyAV: pip install "
                      "'h3-stream[video]' (or pip install av).") from None
    return av


def _frames_uint8(frames) -> np.ndarray:
    if isinstance(frames, np.ndarray) and frames.dtype == np.uint8:
        return frames
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4 or frames.shape[-1] != 3:
        raise H3Error(f"frames must be [F, H, W, 3] in [0, 1], got {getattr(frames, 'shape', type(frames))}.")
    return frames.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu().numpy()


def _resampled_audio(container, stream_index: int, sample_rate: int):
    """The audio stream's samples as float32 [2, n] blocks at `sample_rate` (stereo), in order."""
    av = _av()
    resampler = av.AudioResampler(format="fltp", layout="stereo", rate=sample_rate)
    for frame in container.decode(audio=stream_index):
        frame.pts = None  # the resampler keeps its own clock
        for block in resampler.resample(frame):
            yield block.to_ndarray()
    for block in resampler.resample(None):
        yield block.to_ndarray()


@dataclass
class ClipToExtend:
    """What an extension needs of its clip, read once through the file: its canvas, frame count, last `overlap`
    decoded frames (float [O, H, W, 3] in [0, 1]) and their soundtrack (float [2, n] at 32 kHz; None when the clip
    has no audio track)."""

    path: Path
    width: int
    height: int
    num_frames: int
    last_frames: torch.Tensor
    last_audio: torch.Tensor | None
    has_audio: bool

    @classmethod
    def read(cls, path, overlap: int, name: str = "--extend", sample_rate: int = AUDIO_SAMPLE_RATE,
             fps: int = FPS) -> "ClipToExtend":
        av = _av()
        path = Path(path).expanduser()
        source = f"{name} {path}"
        if not path.is_file():
            raise H3Error(f"{source}: no such file.")
        try:
            with av.open(str(path), "r") as container:
                if not container.streams.video:
                    raise H3Error(f"{source}: the file has no video track.")
                video = container.streams.video[0]
                rate = video.average_rate or video.guessed_rate
                if rate is None or abs(float(rate) - fps) > 0.01:
                    shown = f"{float(rate):.3g} fps" if rate else "an unknown frame rate"
                    raise H3Error(f"{source}: the clip is {shown}; H3 makes {fps} fps and an extension continues the "
                                  f"clip in one track, so convert it first (ffmpeg -i IN -r {fps} -c:v libx264 "
                                  "OUT.mp4).")
                codec = video.codec_context.name
                if codec != "h264":
                    raise H3Error(f"{source}: the clip's video is {codec}; its frames are copied into the result as "
                                  "they are, which needs H.264 (what h3-stream writes). Convert it first (ffmpeg -i "
                                  "IN -c:v libx264 OUT.mp4).")
                pixels = video.codec_context.pix_fmt
                if pixels not in ("yuv420p", "yuvj420p"):
                    raise H3Error(f"{source}: the clip's pixels are {pixels}; the new frames are 8-bit 4:2:0 in the "
                                  "same H.264 track, so convert it first (ffmpeg -i IN -pix_fmt yuv420p -c:v libx264 "
                                  "OUT.mp4).")
                width, height = video.codec_context.width, video.codec_context.height
                for side, value in (("width", width), ("height", height)):
                    problem = canvas_problem(value)
                    if problem:
                        raise H3Error(f"{source}: the clip is {width}x{height}; the new frames continue it at its "
                                      f"own canvas, and its {side} {value} {problem}. Scale or crop it first.")
                tail: collections.deque = collections.deque(maxlen=overlap)
                count = 0
                for frame in container.decode(video=0):
                    tail.append(frame.to_ndarray(format="rgb24"))
                    count += 1
                audio = None
                if container.streams.audio:
                    container.seek(0)
                    audio = _audio_tail(_resampled_audio(container, 0, sample_rate),
                                        _samples(count - min(overlap, count), fps, sample_rate),
                                        _samples(count, fps, sample_rate))
        except H3Error:
            raise
        except (OSError, ValueError, getattr(av, "FFmpegError", OSError)) as exc:
            raise H3Error(f"{source}: cannot decode the clip ({exc}); it is truncated or not a video file.") from None
        if count < overlap:
            raise H3Error(f"{source}: the clip has {count} frames; an extension is guided by its last {overlap}, so "
                          f"give a clip of at least {overlap} frames ({overlap / fps:.2f} s).")
        frames = torch.from_numpy(np.stack(list(tail))).float().div_(255.0)
        return cls(path, width, height, count, frames, audio, audio is not None)


def _samples(frame: int, fps: int, sample_rate: int) -> int:
    return int(round(frame * sample_rate / fps))


def _audio_tail(blocks, start: int, end: int) -> torch.Tensor:
    """Samples [start, end) of a stream of [2, n] blocks, zero-padded where the track is shorter."""
    out = np.zeros((2, end - start), dtype=np.float32)
    position = 0
    for block in blocks:
        lo, hi = max(start, position), min(end, position + block.shape[1])
        if hi > lo:
            out[:, lo - start:hi - start] = block[:, lo - position:hi - position]
        position += block.shape[1]
        if position >= end:
            break
    return torch.from_numpy(out)


def _annexb_to_length_prefixed(data: bytes, size: int) -> bytes:
    """An H.264 access unit from the encoder (start codes) as mp4 stores it (each NAL unit after its length)."""
    starts = []
    index = data.find(b"\x00\x00\x01")
    while index >= 0:
        starts.append(index + 3)
        index = data.find(b"\x00\x00\x01", index + 3)
    out = bytearray()
    for i, start in enumerate(starts):
        unit = data[start:starts[i + 1] - 3] if i + 1 < len(starts) else data[start:]
        if i + 1 < len(starts):
            unit = unit.rstrip(b"\x00")  # the zero byte of a following 4-byte start code
        out += len(unit).to_bytes(size, "big") + unit
    return bytes(out)


class StreamedMp4:
    """`with StreamedMp4(path, width, height) as mp4: mp4.add_video(frames); mp4.add_audio(samples) ...`; the file
    appears at `path` when the block ends without an exception (or at `finish()`). With `source` (a
    `ClipToExtend`) the clip's video comes first, copied, and its soundtrack up to `hold_back_samples` before its
    end (the caller cross-fades that tail with the new audio and adds it)."""

    def __init__(self, path, width: int, height: int, *, fps: int = FPS, sample_rate: int = AUDIO_SAMPLE_RATE,
                 source: ClipToExtend | None = None, hold_back_samples: int = 0):
        av = _av()
        self.path = Path(path).expanduser()
        self.width, self.height, self.fps, self.sample_rate = int(width), int(height), fps, sample_rate
        self.frames_written = 0
        self.samples_written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_staging(self.path)
        self.staging = staging_path(self.path)
        self._done = False
        try:
            self.container = av.open(str(self.staging), "w", format="mp4")
            self._open_streams(source, hold_back_samples)
        except BaseException as exc:
            self._discard()
            self._fail(exc)

    # -- set-up ------------------------------------------------------------------------------------------------

    def _open_streams(self, source: ClipToExtend | None, hold_back: int) -> None:
        av = _av()
        self.time_base = fractions.Fraction(1, self.fps)
        codec = "libx264" if "libx264" in av.codecs_available else "h264"
        self.video_offset = 0  # the new frames' first timestamp, in frames (after a copied clip: its end)
        self._new_frames = 0
        self._next_dts = None  # after a copied clip: the next decode timestamp, in frames
        self._pending_source = None
        if source is None:
            self.video = self.container.add_stream(codec, rate=self.fps)
            self.video.width, self.video.height, self.video.pix_fmt = self.width, self.height, "yuv420p"
            self.encoder = self.video.codec_context
            self._length_size = None
        else:
            self._input = av.open(str(source.path), "r")
            template = self._input.streams.video[0]
            self.video = self.container.add_stream_from_template(template)
            extradata = template.codec_context.extradata or b""
            if not extradata or extradata[0] != 1:
                raise H3Error(f"--extend {source.path}: its H.264 track keeps its parameter sets in the stream "
                              "(Annex B, as in a .ts file); remux it into an mp4 first (ffmpeg -i IN -c copy "
                              "OUT.mp4).")
            self._length_size = (extradata[4] & 3) + 1
            # A separate encoder for the new frames: its parameter sets go in-band with each keyframe (the track's
            # own are the clip's), and no B-frames, so its packets' decode order is their presentation order.
            self.encoder = av.CodecContext.create(codec, "w")
            self.encoder.width, self.encoder.height, self.encoder.pix_fmt = self.width, self.height, "yuv420p"
            self.encoder.time_base = self.time_base
            self.encoder.framerate = fractions.Fraction(self.fps)
            self.encoder.max_b_frames = 0
            if codec == "libx264":
                self.encoder.options = {"x264-params": "repeat-headers=1"}
        self.audio = self.container.add_stream("aac", rate=self.sample_rate)
        self.audio.layout = "stereo"
        if source is not None:
            self._copy_source(source, hold_back)

    def _copy_source(self, source: ClipToExtend, hold_back: int) -> None:
        """The clip's video packets, copied; its soundtrack (resampled to 32 kHz stereo, zero-padded or cut to its
        frames' length) re-encoded up to `hold_back` samples before its end. The new frames' timestamps continue
        after the clip's last frame."""
        av = _av()
        template = self._input.streams.video[0]
        end_pts, last_dts = None, None
        total_audio = _samples(source.num_frames, self.fps, self.sample_rate)
        keep_audio = max(0, total_audio - hold_back)
        audio_blocks = None
        if source.has_audio:
            audio_input = av.open(str(source.path), "r")
            audio_blocks = _resampled_audio(audio_input, 0, self.sample_rate)
        try:
            for packet in self._input.demux(template):
                if packet.dts is None:
                    continue
                end = packet.pts + (packet.duration or 0)
                end_pts = end if end_pts is None else max(end_pts, end)
                last_dts = packet.dts + (packet.duration or 0)
                packet.stream = self.video
                self.container.mux(packet)
                # The soundtrack alongside, as far as the video has come (the muxer interleaves the two).
                upto = min(keep_audio, _samples(int(float(end_pts * template.time_base) * self.fps), self.fps,
                                                self.sample_rate))
                self._source_audio(audio_blocks, upto)
            self._source_audio(audio_blocks, keep_audio)
        finally:
            if audio_blocks is not None:
                audio_blocks.close()
                audio_input.close()
            self._input.close()
        tb = template.time_base
        self.video_offset = int(round(float(end_pts * tb) * self.fps)) if end_pts is not None else 0
        self._next_dts = int(round(float(last_dts * tb) * self.fps)) if last_dts is not None else None
        self.frames_written = source.num_frames

    def _source_audio(self, blocks, upto: int) -> None:
        """The clip's soundtrack until sample `upto` (zeros where it is shorter or has none)."""
        pending = self._pending_source
        while self.samples_written < upto:
            if pending is None or pending.shape[1] == 0:
                pending = next(blocks, None) if blocks is not None else None
                if pending is None:
                    pending = np.zeros((2, upto - self.samples_written), dtype=np.float32)
            take = min(pending.shape[1], upto - self.samples_written)
            self.add_audio(torch.from_numpy(np.ascontiguousarray(pending[:, :take])))
            pending = pending[:, take:]
        self._pending_source = pending

    # -- appending -----------------------------------------------------------------------------------------------

    def add_video(self, frames) -> None:
        """Frames [n, H, W, 3] (float in [0, 1], or uint8) appended to the video track."""
        av = _av()
        pixels = _frames_uint8(frames)
        if pixels.shape[1:3] != (self.height, self.width):
            raise H3Error(f"frames of {pixels.shape[2]}x{pixels.shape[1]} given to a {self.width}x{self.height} "
                          "video.")
        try:
            for image in pixels:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
                frame.pts = self.video_offset + self._new_frames
                frame.time_base = self.time_base
                self._mux_video(self.encoder.encode(frame))
                self.frames_written += 1
                self._new_frames += 1
        except BaseException as exc:
            self._fail(exc)

    def add_audio(self, samples) -> None:
        """Stereo samples [2, n] (float, clamped to [-1, 1]) appended to the audio track."""
        av = _av()
        if not isinstance(samples, torch.Tensor) or samples.ndim != 2 or samples.shape[0] != 2:
            raise H3Error(f"audio must be stereo [2, N], got {getattr(samples, 'shape', type(samples))}.")
        if samples.shape[1] == 0:
            return
        block = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(samples.detach().float().clamp(-1, 1).cpu().numpy()), format="fltp",
            layout="stereo")
        block.sample_rate = self.sample_rate
        block.pts = self.samples_written
        block.time_base = fractions.Fraction(1, self.sample_rate)
        try:
            for packet in self.audio.encode(block):
                self.container.mux(packet)
        except BaseException as exc:
            self._fail(exc)
        self.samples_written += samples.shape[1]

    def _mux_video(self, packets) -> None:
        for packet in packets:
            if self._length_size is None:
                self.container.mux(packet)
                continue
            av = _av()
            copy = av.Packet(_annexb_to_length_prefixed(bytes(packet), self._length_size))
            copy.time_base = self.time_base
            copy.pts = packet.pts
            # Decode order continues the clip's without a gap (the clip may have had B-frames, so its decode clock
            # runs behind its presentation clock; a jump would read as a slower frame rate).
            copy.dts = packet.pts if self._next_dts is None else min(self._next_dts, packet.pts)
            self._next_dts = copy.dts + 1
            copy.is_keyframe = packet.is_keyframe
            copy.stream = self.video
            self.container.mux(copy)

    # -- the end -------------------------------------------------------------------------------------------------

    def finish(self) -> Path:
        """Flush the encoders, close the file and rename it into place."""
        if self._done:
            return self.path
        try:
            self._mux_video(self.encoder.encode(None))
            for packet in self.audio.encode(None):
                self.container.mux(packet)
            self.container.close()
            os.replace(self.staging, self.path)
        except BaseException as exc:
            self._discard()
            self._fail(exc)
        self._done = True
        return self.path

    def abort(self) -> None:
        """Drop the staging file (what was at `path` stays)."""
        self._discard()

    def _discard(self) -> None:
        if self._done:
            return
        self._done = True
        for closing in (getattr(self, "container", None), getattr(self, "_input", None)):
            try:
                if closing is not None:
                    closing.close()
            except Exception:  # noqa: BLE001 - closing a half-written file may fail; it is removed below
                pass
        remove(self.staging)

    def __enter__(self) -> "StreamedMp4":
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        if kind is None:
            self.finish()
        else:
            self.abort()

    def _fail(self, exc: BaseException):
        """Raise `exc`; a failed write (disk full, file-size limit) as one message, the staging file removed."""
        if self._is_write_error(exc):
            raise self._error(exc) from None
        raise exc

    def _is_write_error(self, exc: BaseException) -> bool:
        av = _av()
        return isinstance(exc, (OSError, getattr(av, "FFmpegError", OSError))) and not isinstance(exc, H3Error)

    def _error(self, exc: BaseException) -> BaseException:
        if not self._is_write_error(exc):
            return exc
        self._discard()
        kept = "; the file already there is unchanged" if self.path.exists() else ""
        return H3Error(f"{self.path}: could not write the output: {write_failure(exc, self.path.parent)}. Nothing was "
                       f"written{kept}.")
