"""H3StreamReferences: the Ref2VA references (images, videos with their soundtrack, audios) for H3 Text Encode."""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from .request_inputs import frame_count_error, sampler_inputs
from .sockets import H3Refs

# The released model's limits (h3_core.request.references): one socket per reference it accepts.
IMAGE_SOCKETS = tuple(f"ref_image_{i}" for i in range(1, 10))
VIDEO_SOCKETS = tuple(f"ref_video_{i}" for i in range(1, 4))
AUDIO_SOCKETS = tuple(f"ref_audio_{i}" for i in range(1, 4))


@dataclass(frozen=True)
class H3References:
    """What `H3_REFS` carries: the connected references in request order (images, videos, audios, each by socket
    number) as h3_core takes them, the frame count they are cut to, and the image size rule. `labels` name each
    entry by its socket for errors."""

    images: tuple
    videos: tuple  # (frames [F, H, W, 3], waveform [C, N] | None, fps, sample_rate | None)
    audios: tuple  # (waveform [C, N], sample_rate)
    num_frames: int
    image_size: str
    labels: tuple  # ((kind, index), socket name) pairs


def _video_entry(video, socket: str):
    """A VIDEO (core's VideoInput: `get_components()`; or its components) -> h3_core's video reference tuple."""
    from h3_core.errors import H3Error

    components = video.get_components() if hasattr(video, "get_components") else video
    images = getattr(components, "images", None)
    if images is None:
        raise H3Error(f"{socket}: expected a VIDEO (images, audio, frame rate), got {type(video).__name__}.")
    audio = getattr(components, "audio", None)
    waveform, rate = (None, None) if audio is None else (audio["waveform"], int(audio["sample_rate"]))
    if waveform is not None and waveform.ndim == 3:
        waveform = waveform[0]  # batch 1
    return images, waveform, float(getattr(components, "frame_rate", 24)), rate


class H3StreamReferences(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        seconds, frames = sampler_inputs()[:2]
        return io.Schema(
            node_id="H3StreamReferences",
            display_name="H3 References",
            category="H3 Stream",
            description="Ref2VA references for H3 Text Encode (with the Ref2VA transformer: the loader's partition "
                        "ref2va): up to 9 images, 3 videos (their soundtrack is used) and 3 audios, read in the order "
                        "images, videos, audios. Videos and audios are cut to the generated duration, so seconds / "
                        "frames must equal the sampler's.",
            inputs=[
                seconds, frames,
                io.Combo.Input("ref_image_size", options=["reference", "max", "match"], default="reference",
                               tooltip="reference: 2048-px short edge (as the reference pipeline); max: down to "
                                       "it, never up; match: down to the video's area."),
                *[io.Image.Input(name, optional=True, tooltip="A reference image (the first of a batch).")
                  for name in IMAGE_SOCKETS],
                *[io.Video.Input(name, optional=True, tooltip="A reference video; its audio is used too.")
                  for name in VIDEO_SOCKETS],
                *[io.Audio.Input(name, optional=True, tooltip="A reference voice, sound or music clip.")
                  for name in AUDIO_SOCKETS],
            ],
            outputs=[H3Refs.Output(display_name="h3_refs")],
        )

    @classmethod
    def validate_inputs(cls, frames) -> bool | str:
        return frame_count_error(None, frames) or True

    @classmethod
    def execute(cls, seconds, frames, ref_image_size, **connected) -> io.NodeOutput:
        from h3_core.errors import H3Error
        from h3_core.request.grid import frames_for_seconds
        from h3_core.request.references import check_reference_counts

        error = frame_count_error(seconds, frames)
        if error:
            raise H3Error(error)
        images = [(n, connected[n]) for n in IMAGE_SOCKETS if connected.get(n) is not None]
        videos = [(n, connected[n]) for n in VIDEO_SOCKETS if connected.get(n) is not None]
        audios = [(n, connected[n]) for n in AUDIO_SOCKETS if connected.get(n) is not None]
        if not (images or videos or audios):
            raise H3Error("H3 References: connect at least one reference (ref_image_*, ref_video_* or ref_audio_*).")
        check_reference_counts(len(images), len(videos), len(audios), ("ref_image", "ref_video", "ref_audio"))
        labels = tuple([(("image", i), n) for i, (n, _) in enumerate(images)]
                       + [(("video", i), n) for i, (n, _) in enumerate(videos)]
                       + [(("audio", i), n) for i, (n, _) in enumerate(audios)])
        for name, audio in audios:
            if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
                raise H3Error(f"{name}: expected an AUDIO ({{'waveform': [1, C, N], 'sample_rate': int}}).")
        return io.NodeOutput(H3References(
            images=tuple(image for _, image in images),
            videos=tuple(_video_entry(video, name) for name, video in videos),
            audios=tuple((audio["waveform"], int(audio["sample_rate"])) for _, audio in audios),
            num_frames=frames if frames > 0 else frames_for_seconds(seconds),
            image_size=ref_image_size, labels=labels))
