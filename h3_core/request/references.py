"""Ref2VA references: the user's images, videos (with their soundtrack) and audio clips, checked and normalised onto
H3's own rates and sizes, in request order.

The request order is semantic: it numbers the `"<Picture i>"` / `"<Audio j>"` / `"<Video k>"` labels of the text
encoder's presentation and it advances the DiT's shared rotary clock (`layout.build_ref2va_layout`).

Normalisation follows the reference pipeline (diffusers `MiniMaxH3Ref2VASetupStep`):
* image: RGB, aspect within 1:4..4:1, resized (LANCZOS) by the `reference_image_size` rule, sides rounded to 32;
* video: frames resampled onto 24 fps by dropping / repeating whole frames, cut to the generated frame count, put on
  the canvas its own aspect ratio resolves to (the target canvas rule, LANCZOS);
* audio (a reference's or a video's soundtrack): cut to the generated duration at its own rate, mono duplicated to
  stereo, then at 32 kHz. Another rate is resampled with PyAV (libswresample); the reference uses torchaudio's
  sinc resampler, so those samples differ slightly. At 32 kHz nothing is resampled and the two agree exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import H3Error
from .grid import AUDIO_SAMPLE_RATE, CANVAS_MULTIPLE, FPS
from .keyframes import _to_pil

MAX_REFERENCE_IMAGES = 9
MAX_REFERENCE_VIDEOS = 3
MAX_REFERENCE_AUDIOS = 3
MAX_REFERENCES = 12
# The released model's canvas (a video reference is put on it as the target is) and image reference short edge.
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344
REFERENCE_IMAGE_SHORT_EDGE = 2048
# How an image reference is sized: "reference" as diffusers (2048 short edge, upscaling included); "max" as core
# ComfyUI's max (down to a 2048 short edge, never up); "match" down to the target canvas's area, never up.
REFERENCE_IMAGE_SIZES = ("reference", "max", "match")
# The text encoder reads a video reference at 2 fps, frames merged in pairs.
VIDEO_SAMPLE_FPS = 2.0
# Reference audio rates read (then resampled to 32 kHz): from telephone audio (8 kHz, the lowest rate in common use)
# to 384 kHz (the highest of today's converters and hi-res PCM). Outside, the header is corrupt or the data is not
# audio: 1 Hz resampled to 32 kHz gave no samples (a traceback), 1 GHz would decode 10^9 samples a second.
MIN_AUDIO_RATE = 8_000
MAX_AUDIO_RATE = 384_000


@dataclass
class Reference:
    """One normalised reference. `kind` "image": `image` (PIL RGB); "video": `frames` uint8 [F, H, W, 3] at 24 fps
    and optionally `audio`; "audio": `audio`. `audio` is float32 [2, N] at 32 kHz."""

    kind: str
    image: object = None
    frames: np.ndarray | None = None
    audio: torch.Tensor | None = None
    label: str = ""  # how errors name it: "reference_images[0]", "--ref-video clip.mp4", ...

    @property
    def has_audio(self) -> bool:
        return self.audio is not None


@dataclass
class ReferenceRequest:
    """The references of one request in request order (what `generate(reference_images=..., ...)` builds)."""

    references: list[Reference] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.references)


# ---- limits ---------------------------------------------------------------------------------------------------------


def check_reference_counts(images: int, videos: int, audios: int, names=("reference_images", "reference_videos",
                                                                            "reference_audios")) -> None:
    """The released model's limits, each violation one error naming the argument (`names`: the surface's)."""
    for count, limit, name, what in ((images, MAX_REFERENCE_IMAGES, names[0], "image"),
                                     (videos, MAX_REFERENCE_VIDEOS, names[1], "video"),
                                     (audios, MAX_REFERENCE_AUDIOS, names[2], "audio")):
        if count > limit:
            raise H3Error(f"{name}: {count} {what} references given; H3 accepts at most {limit}. Drop "
                          f"{count - limit} of them.")
    if images + videos + audios > MAX_REFERENCES:
        raise H3Error(f"{images + videos + audios} references given ({', '.join(names)}); H3 accepts at most "
                      f"{MAX_REFERENCES} in total.")
    if audios and not images and not videos:
        raise H3Error(f"{names[2]}: an audio reference must come with at least one image or video reference "
                      f"({names[0]} / {names[1]}); H3 does not condition on audio references alone.")


# ---- geometry -------------------------------------------------------------------------------------------------------


def resolve_canvas(aspect_width: float, aspect_height: float, short_edge: int = CANVAS_SHORT_EDGE,
                   max_pixels: int = CANVAS_MAX_PIXELS, multiple: int = CANVAS_MULTIPLE) -> tuple[int, int]:
    """H3's canvas `(height, width)` for an aspect ratio: short edge 768, area capped, sides rounded to 32."""
    ratio = aspect_width / aspect_height
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def reference_image_scale(width: int, height: int, rule: str, target_width: int, target_height: int,
                          short_edge: int = REFERENCE_IMAGE_SHORT_EDGE) -> float:
    if rule == "reference":
        return short_edge / min(width, height)
    if rule == "max":
        return min(1.0, short_edge / min(width, height))
    if rule == "match":
        return min(1.0, math.sqrt(target_width * target_height / (width * height)))
    raise H3Error(f"reference_image_size {rule!r}: use one of {', '.join(REFERENCE_IMAGE_SIZES)}.")


# ---- normalisation --------------------------------------------------------------------------------------------------


def normalise_image(image, label: str, rule: str, target_width: int, target_height: int,
                    short_edge: int = REFERENCE_IMAGE_SHORT_EDGE):
    from PIL import Image

    try:
        pil = _to_pil(image, "reference")
    except H3Error as exc:
        raise H3Error(f"{label}: {exc}") from None
    width, height = pil.size
    if width > 4 * height or height > 4 * width:
        raise H3Error(f"{label}: the image is {width}x{height}; H3 takes reference images between 1:4 and 4:1. "
                      "Crop it.")
    scale = reference_image_scale(width, height, rule, target_width, target_height, short_edge)
    size = (max(CANVAS_MULTIPLE, round(width * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE),
            max(CANVAS_MULTIPLE, round(height * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE))
    if pil.size != size:
        pil = pil.resize(size, Image.Resampling.LANCZOS)
    return pil


def video_frames_uint8(frames, label: str) -> np.ndarray:
    """Frames as uint8 [F, H, W, 3]: a [F, H, W, 3] tensor / array (float in [0, 1] as ComfyUI's IMAGE, or uint8),
    or a list of PIL images."""
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise H3Error(f"{label}: the video has no frames.")
        frames = np.stack([np.asarray(_to_pil(frame, "video frame")) for frame in frames])
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu()
        if frames.is_floating_point():
            if not torch.isfinite(frames).all():
                raise H3Error(f"{label}: the video frames contain NaN or Inf values.")
            frames = (frames.float().clamp(0, 1) * 255).round().to(torch.uint8)
        frames = frames.numpy()
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise H3Error(f"{label}: video frames must be [frames, height, width, 3] RGB, got shape "
                      f"{tuple(frames.shape)}.")
    if frames.shape[0] == 0:
        raise H3Error(f"{label}: the video has no frames.")
    if min(frames.shape[1:3]) < 1:
        raise H3Error(f"{label}: the video frames are empty ({frames.shape[2]}x{frames.shape[1]}).")
    if frames.dtype != np.uint8:
        if not np.issubdtype(frames.dtype, np.floating):
            raise H3Error(f"{label}: video frames must be uint8 or float in [0, 1], got {frames.dtype}.")
        frames = (np.clip(np.nan_to_num(frames), 0, 1) * 255.0).round().astype(np.uint8)
    return frames


def normalise_video(frames, fps: float, label: str, num_frames: int, short_edge: int = CANVAS_SHORT_EDGE,
                    max_pixels: int = CANVAS_MAX_PIXELS) -> np.ndarray:
    """uint8 frames at 24 fps, at most `num_frames` of them, on the canvas their own aspect ratio resolves to."""
    from PIL import Image

    frames = video_frames_uint8(frames, label)
    if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise H3Error(f"{label}: the video's frame rate must be a positive number, got {fps!r}.")
    if fps != FPS:
        # Every frame is held until the slot of the next one (ffmpeg's fps filter, as the reference mirrors it).
        scale = FPS / float(fps)
        slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
        frames = np.repeat(frames, np.diff(slots, append=math.floor(frames.shape[0] * scale + 0.5)), axis=0)
        if frames.shape[0] == 0:
            raise H3Error(f"{label}: the video is too short to give one frame at 24 fps.")
    frames = frames[:num_frames]
    height, width = frames.shape[1:3]
    if width > 4 * height or height > 4 * width:
        raise H3Error(f"{label}: the video is {width}x{height}; H3 takes reference videos between 1:4 and 4:1.")
    canvas_h, canvas_w = resolve_canvas(width, height, short_edge, max_pixels)
    if (height, width) == (canvas_h, canvas_w):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((canvas_w, canvas_h), Image.Resampling.LANCZOS))
                     for f in frames])


def resample_audio(waveform: torch.Tensor, sample_rate: int, label: str) -> torch.Tensor:
    """[C, N] float32 at `sample_rate` -> [C, M] at 32 kHz through PyAV's libswresample."""
    try:
        import av
    except ImportError:
        raise H3Error(f"{label}: the audio is at {sample_rate} Hz and H3 needs {AUDIO_SAMPLE_RATE} Hz; resampling "
                      "it needs PyAV (pip install av), or give the audio at 32000 Hz.") from None
    channels = waveform.shape[0]
    layout = "mono" if channels == 1 else "stereo"
    resampler = av.audio.resampler.AudioResampler(format="fltp", layout=layout, rate=AUDIO_SAMPLE_RATE)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(waveform.numpy(), dtype=np.float32), format="fltp",
                                       layout=layout)
    frame.sample_rate = int(sample_rate)
    chunks = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
    if not chunks:  # shorter than the resampler's filter: it gives nothing
        raise H3Error(f"{label}: the audio is {waveform.shape[1]} samples ({waveform.shape[1] / sample_rate * 1000:.2g} "
                      f"ms) at {sample_rate:,} Hz, too short to resample to {AUDIO_SAMPLE_RATE:,} Hz; give a longer "
                      "clip (a reference is normally seconds long).")
    return torch.from_numpy(np.concatenate(chunks, axis=-1).astype(np.float32))


def check_sample_rate(sample_rate, label: str) -> int:
    """A reference's sample rate as an int, from MIN_AUDIO_RATE to MAX_AUDIO_RATE Hz (a file's header or an
    argument: the readers check it before decoding)."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate < 1:
        raise H3Error(f"{label}: the sample rate must be a positive whole number of Hz, got {sample_rate!r}.")
    if not MIN_AUDIO_RATE <= sample_rate <= MAX_AUDIO_RATE:
        raise H3Error(f"{label}: the audio is at {int(sample_rate):,} Hz; H3 reads audio at {MIN_AUDIO_RATE:,} to "
                      f"{MAX_AUDIO_RATE:,} Hz, resampled to {AUDIO_SAMPLE_RATE:,} Hz. Check that it is audio, and "
                      f"resample it to {AUDIO_SAMPLE_RATE} Hz first (ffmpeg -i IN -ar {AUDIO_SAMPLE_RATE} OUT.wav).")
    return int(sample_rate)


def normalise_audio(waveform, sample_rate, label: str, max_seconds: float) -> torch.Tensor:
    """Stereo float32 [2, N] at 32 kHz, cut to `max_seconds` (at the source rate, before resampling)."""
    sample_rate = check_sample_rate(AUDIO_SAMPLE_RATE if sample_rate is None else sample_rate, label)
    if isinstance(waveform, np.ndarray):
        waveform = torch.from_numpy(waveform)
    if not isinstance(waveform, torch.Tensor) or not waveform.is_floating_point():
        raise H3Error(f"{label}: audio must be a float waveform [channels, samples], got "
                      f"{getattr(waveform, 'dtype', type(waveform).__name__)}.")
    if waveform.ndim == 3 and waveform.shape[0] == 1:  # ComfyUI AUDIO: [batch 1, channels, samples]
        waveform = waveform[0]
    if waveform.ndim == 1:
        waveform = waveform[None]
    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2):
        raise H3Error(f"{label}: audio must be mono or stereo [channels, samples], got shape "
                      f"{tuple(waveform.shape)}. Mix more channels down to stereo first (a tensor does not say "
                      "which is left and which right).")
    if waveform.shape[1] == 0:
        raise H3Error(f"{label}: the audio has no samples.")
    waveform = waveform.detach().cpu().to(torch.float32)
    if not torch.isfinite(waveform).all():
        raise H3Error(f"{label}: the audio contains NaN or Inf samples.")
    waveform = waveform[:, : int(max_seconds * int(sample_rate))]
    if waveform.shape[0] != 2:
        waveform = waveform.expand(2, -1).contiguous()
    if int(sample_rate) != AUDIO_SAMPLE_RATE:
        waveform = resample_audio(waveform, int(sample_rate), label)
    return waveform.contiguous()


def _video_entry(entry, label):
    """(frames, waveform | None[, fps[, sample_rate]]) or a dict with those keys."""
    if isinstance(entry, dict):
        unknown = set(entry) - {"frames", "audio", "waveform", "fps", "sample_rate"}
        if unknown or "frames" not in entry:
            raise H3Error(f"{label}: a video reference is (frames, waveform | None) or a dict with 'frames' and "
                          f"optionally 'audio', 'fps', 'sample_rate'; got keys {sorted(entry)}.")
        return (entry["frames"], entry.get("audio", entry.get("waveform")), entry.get("fps", FPS),
                entry.get("sample_rate"))
    if isinstance(entry, (tuple, list)) and 2 <= len(entry) <= 4:
        frames, audio, *rest = entry
        fps = rest[0] if rest else FPS
        sample_rate = rest[1] if len(rest) > 1 else None
        return frames, audio, fps, sample_rate
    raise H3Error(f"{label}: a video reference is (frames, waveform | None), optionally followed by fps and the "
                  f"waveform's sample rate; got {type(entry).__name__}.")


def _audio_entry(entry, label):
    if isinstance(entry, dict):
        return entry.get("waveform", entry.get("audio")), entry.get("sample_rate")
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        return entry[0], entry[1]
    return entry, None


def build_references(images=(), videos=(), audios=(), *, num_frames: int, width: int, height: int,
                     reference_image_size: str = "reference",
                     names=("reference_images", "reference_videos", "reference_audios"),
                     labels=None, canvas_rules: dict | None = None) -> ReferenceRequest:
    """Check and normalise a request's references; request order is images, then videos, then audios.

    `images`: PIL images / [H, W, 3] tensors / paths; `videos`: (frames, waveform | None[, fps[, sample_rate]]);
    `audios`: waveform [C, N] at 32 kHz, or (waveform, sample_rate), or ComfyUI AUDIO dicts. `names` are the
    surface's argument names and `labels`, optionally, per-entry names for errors (file names in the CLI).
    `canvas_rules` (`sources.canvas_rules`) are the model's canvas short edge / area and image short edge."""
    images, videos, audios = list(images or ()), list(videos or ()), list(audios or ())
    check_reference_counts(len(images), len(videos), len(audios), names)
    if reference_image_size not in REFERENCE_IMAGE_SIZES:
        raise H3Error(f"reference_image_size {reference_image_size!r}: use one of "
                      f"{', '.join(REFERENCE_IMAGE_SIZES)}.")
    labels = labels or {}
    rules = canvas_rules or {}
    short_edge = rules.get("canvas_short_edge", CANVAS_SHORT_EDGE)
    max_pixels = rules.get("canvas_max_pixels", CANVAS_MAX_PIXELS)
    image_edge = rules.get("reference_image_short_edge", REFERENCE_IMAGE_SHORT_EDGE)
    seconds = num_frames / FPS
    out = []
    for kind, entries, name in (("image", images, names[0]), ("video", videos, names[1]),
                                ("audio", audios, names[2])):
        for index, entry in enumerate(entries):
            label = labels.get((kind, index), f"{name}[{index}]")
            if kind == "image":
                out.append(Reference("image", image=normalise_image(entry, label, reference_image_size, width,
                                                                    height, image_edge), label=label))
            elif kind == "video":
                frames, audio, fps, rate = _video_entry(entry, label)
                normalised = normalise_video(frames, fps, label, num_frames, short_edge, max_pixels)
                sample_video_for_text_encoder(normalised, label)  # long enough for the text encoder's 2 fps pairs
                sound = None if audio is None else normalise_audio(audio, rate, f"{label} (soundtrack)", seconds)
                out.append(Reference("video", frames=normalised, audio=sound, label=label))
            else:
                waveform, rate = _audio_entry(entry, label)
                out.append(Reference("audio", audio=normalise_audio(waveform, rate, label, seconds), label=label))
    return ReferenceRequest(out)


# ---- the text encoder's view of a video -----------------------------------------------------------------------------


def sample_video_for_text_encoder(frames: np.ndarray, label: str = "video reference", fps: float = FPS,
                                  sample_fps: float = VIDEO_SAMPLE_FPS,
                                  temporal_patch: int = 2) -> tuple[list[np.ndarray], list[float]]:
    """The frames the text encoder sees (every `fps / sample_fps`-th, deduplicated) and one timestamp per merged
    pair (the mean of its frames' times; an odd count repeats the last)."""
    stride = fps / sample_fps
    indices, cursor = [], 0.0
    while round(cursor) < frames.shape[0]:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        minimum = round((temporal_patch - 1) * stride) + 1
        raise H3Error(f"{label}: the video has {frames.shape[0]} frames at {fps:g} fps; the text encoder reads "
                      f"it at {sample_fps:g} fps in pairs, so it needs at least {minimum} frames "
                      f"({minimum / fps:.2g} seconds).")
    times = [i / sample_fps for i in range(len(indices))]
    times += [times[-1]] * (-len(times) % temporal_patch)
    blocks = [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
    return [frames[i] for i in indices], blocks
