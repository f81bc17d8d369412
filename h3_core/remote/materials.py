"""The media a remote request carries, as files: keyframes fitted to the canvas and Ref2VA references normalised as a
local run normalises them (`GenerationRequest.normalised_references`), each encoded once, in request order.

What is sent is what a local run would condition on, so the server's own preparation leaves it as it is (its resize
rules are the same as h3-stream's): a reference image as PNG (lossless), the smaller of the user's image and its
resized one (an image the rule upscales goes as given and the server upscales it: the same pixels, less to send);
a reference video at its own size and frame rate, cut to the generated duration (the server
puts it on its canvas and onto 24 fps by the same rules), as H.264 (near-lossless, CRF 12) with its soundtrack as
normalised for a local run, in AAC at 32 kHz stereo; audio clips as 32-bit float WAV at 32 kHz stereo (lossless)."""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

import numpy as np

from ..errors import H3Error
from ..request.generation_request import GenerationRequest
from ..request.grid import AUDIO_SAMPLE_RATE
from ..request.keyframes import _to_pil, prepare_keyframes
from ..request.references import _video_entry, video_frames_uint8
from .serving_rules import server_keyframes


@dataclass(frozen=True)
class Material:
    """One condition: `kind` "image" / "video" / "video_audio" / "audio", `role` "keyframe" / "reference",
    `frame_index` 0 / -1 for a keyframe, the encoded file and its media type."""

    kind: str
    role: str
    data: bytes
    media_type: str
    filename: str
    label: str
    frame_index: int | None = None

    def data_uri(self) -> str:
        return f"data:{self.media_type};base64," + base64.b64encode(self.data).decode("ascii")


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _needs_pyav(label: str):
    try:
        import av
    except ImportError:
        raise H3Error(f"{label}: sending a video or audio reference to a server needs PyAV (pip install "
                      "'h3-stream[video]' or pip install av).") from None
    return av


def _audio_frames(av, waveform, stream_rate: int):
    samples = np.ascontiguousarray(waveform.numpy(), dtype=np.float32)
    block = 1024
    for start in range(0, samples.shape[1], block):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + block]), format="fltp",
                                           layout="stereo")
        frame.sample_rate = stream_rate
        frame.pts = start
        yield frame


def _mp4(frames: np.ndarray, fps: float, audio, label: str) -> bytes:
    from fractions import Fraction

    av = _needs_pyav(label)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        rate = Fraction(fps).limit_denominator(1001)
        video = container.add_stream("libx264" if "libx264" in av.codecs_available else "h264", rate=rate)
        even = frames.shape[1] % 2 == 0 and frames.shape[2] % 2 == 0  # 4:2:0 needs even sides
        video.width, video.height = frames.shape[2], frames.shape[1]
        video.pix_fmt = "yuv420p" if even else "yuv444p"
        video.options = {"crf": "12", "preset": "veryfast"}
        sound = container.add_stream("aac", rate=AUDIO_SAMPLE_RATE, layout="stereo") if audio is not None else None
        for picture in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(picture), format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            for frame in _audio_frames(av, audio, AUDIO_SAMPLE_RATE):
                frame.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
                container.mux(sound.encode(frame))
            container.mux(sound.encode())
    return buffer.getvalue()


def _wav(audio, label: str) -> bytes:
    from fractions import Fraction

    av = _needs_pyav(label)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        stream = container.add_stream("pcm_f32le", rate=AUDIO_SAMPLE_RATE, layout="stereo")
        for frame in _audio_frames(av, audio, AUDIO_SAMPLE_RATE):
            frame.time_base = Fraction(1, AUDIO_SAMPLE_RATE)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def source_video(request: GenerationRequest, index: int, label: str) -> tuple[np.ndarray, float]:
    """Reference video `index` as the user gave it — frames uint8 [F, H, W, 3] at its own rate — cut to the generated
    duration."""
    frames, _, fps, _ = _video_entry(request.reference_videos[index], label)
    return video_frames_uint8(frames, label)[: math.ceil(request.seconds * float(fps))], float(fps)


def request_materials(request: GenerationRequest, *, images: list | None = None,
                      videos: list | None = None, engine: str = "the server") -> list[Material]:
    """The keyframes (fitted to the canvas, as a local run fits them), then the references in request order.
    `images`: the reference images to send, when the engine picks them (else the smaller of the user's and the
    resized one); `videos`: (frames, fps) of each reference video to send, when the engine picks them (else the
    user's, cut to the generated duration)."""
    materials = []
    # Guides that are an image at the first / last frame go as those keyframes (fitted as first_frame / last_frame
    # are); `check_servable` has refused any other guide, naming the engine.
    keyframes = server_keyframes(request, engine)
    fitted = prepare_keyframes([keyframe.image for keyframe in keyframes], request.width, request.height)
    for keyframe, image in zip(keyframes, fitted):
        anchor = "first" if keyframe.frame_index == 0 else "last"
        materials.append(Material("image", "keyframe", _png(image), "image/png", f"{anchor}_frame.png", keyframe.label,
                                  frame_index=keyframe.frame_index))
    references = request.normalised_references()
    for index, reference in enumerate(references.references if references else ()):
        if reference.kind == "image":
            if images is not None:
                image = images[index]
            else:  # images come first, in request order
                source = _to_pil(request.reference_images[index], "reference")
                image = min(source, reference.image, key=lambda candidate: candidate.size[0] * candidate.size[1])
            materials.append(Material("image", "reference", _png(image), "image/png", f"reference_{index}.png",
                                      reference.label))
        elif reference.kind == "video":
            video_index = index - len(request.reference_images)
            frames, fps = (videos[video_index] if videos is not None
                           else source_video(request, video_index, reference.label))
            kind = "video_audio" if reference.has_audio else "video"
            materials.append(Material(kind, "reference", _mp4(frames, float(fps), reference.audio, reference.label),
                                      "video/mp4", f"reference_{index}.mp4", reference.label))
        else:
            materials.append(Material("audio", "reference", _wav(reference.audio, reference.label), "audio/wav",
                                      f"reference_{index}.wav", reference.label))
    return materials
