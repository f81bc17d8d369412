"""H3 References: the Ref2VA references (images, videos with their soundtrack, audios) for H3 Text Encode, which
cuts and fits them to its canvas and duration. The legacy node also carries a duration of its own."""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from .request_inputs import NODE_NAMES, duration_inputs, frame_count_error, num_frames
from .sockets import H3Refs

# The released model's limits (h3_core.request.references): one socket per reference it accepts.
IMAGE_SOCKETS = tuple(f"ref_image_{i}" for i in range(1, 10))
VIDEO_SOCKETS = tuple(f"ref_video_{i}" for i in range(1, 4))
AUDIO_SOCKETS = tuple(f"ref_audio_{i}" for i in range(1, 4))
DESCRIPTION = ("Ref2VA references for H3 Text Encode (with the Ref2VA transformer: the loader's partition ref2va): "
               "up to 9 images, 3 videos (their soundtrack is used) and 3 audios, read in the order images, videos, "
               "audios.")


@dataclass(frozen=True)
class H3References:
    """What `H3_REFS` carries: the connected references in request order (images, videos, audios, each by socket
    number) as h3_core takes them, the image size rule, `labels` naming each entry by its socket for errors, and
    (legacy node only) the frame count its own duration widgets gave."""

    images: tuple
    videos: tuple  # (frames [F, H, W, 3], waveform [C, N] | None, fps, sample_rate | None)
    audios: tuple  # (waveform [C, N], sample_rate)
    image_size: str
    labels: tuple  # ((kind, index), socket name) pairs
    num_frames: int | None = None

    def request_fields(self, num_frames: int) -> dict:
        """The references as `GenerationRequest` fields, for a request of `num_frames` frames."""
        from h3_core.errors import H3Error

        if self.num_frames is not None and self.num_frames != num_frames:
            raise H3Error(f"h3_refs: H3 References (legacy) cuts its references to {self.num_frames} frames but H3 "
                          f"Text Encode makes {num_frames}; set the same duration on both, or use the new H3 "
                          "References, which takes the duration from H3 Text Encode.")
        return dict(reference_images=self.images, reference_videos=self.videos, reference_audios=self.audios,
                    reference_image_size=self.image_size, reference_labels=self.labels)


def _inputs(*widgets) -> list:
    return [
        *widgets,
        io.Combo.Input("ref_image_size", options=["reference", "max", "match"], default="reference",
                       tooltip="reference: 2048-px short edge (as the reference pipeline); max: down to it, never "
                               "up; match: down to the video's area."),
        *[io.Image.Input(name, optional=True, tooltip="A reference image (the first of a batch).")
          for name in IMAGE_SOCKETS],
        *[io.Video.Input(name, optional=True, tooltip="A reference video; its audio is used too.")
          for name in VIDEO_SOCKETS],
        *[io.Audio.Input(name, optional=True, tooltip="A reference voice, sound or music clip.")
          for name in AUDIO_SOCKETS],
    ]


class H3StreamReferenceMedia(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamReferenceMedia",
            display_name="H3 References",
            category="H3 Stream/conditioning",
            description=DESCRIPTION + " Videos and audios are cut to H3 Text Encode's duration.",
            search_aliases=["minimax h3", "ref2va", "reference image", "reference audio"],
            inputs=_inputs(),
            outputs=[H3Refs.Output(display_name="h3_refs")],
        )

    @classmethod
    def execute(cls, ref_image_size, **connected) -> io.NodeOutput:
        return io.NodeOutput(collect(ref_image_size, connected))


class H3StreamReferences(io.ComfyNode):
    """The references node as saved workflows have it, with its own duration (H3 Text Encode checks it)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamReferences",
            display_name="H3 References (own duration, legacy)",
            category="H3 Stream/conditioning",
            description="Superseded by H3 References, which takes the duration from H3 Text Encode; kept so that "
                        "saved workflows still load and run. " + DESCRIPTION,
            inputs=_inputs(*duration_inputs()),
            outputs=[H3Refs.Output(display_name="h3_refs")],
            is_deprecated=True,
        )

    @classmethod
    def validate_inputs(cls, frames) -> bool | str:
        return frame_count_error(frames) or True

    @classmethod
    def execute(cls, seconds, frames, ref_image_size, **connected) -> io.NodeOutput:
        return io.NodeOutput(collect(ref_image_size, connected, num_frames(seconds, frames)))


def collect(ref_image_size, connected: dict, frames: int | None = None) -> H3References:
    """The connected sockets in request order, each checked for its kind (the rest is the request's rules)."""
    from h3_core.errors import H3Error
    from h3_core.request.references import check_reference_counts

    images = [(n, connected[n]) for n in IMAGE_SOCKETS if connected.get(n) is not None]
    videos = [(n, connected[n]) for n in VIDEO_SOCKETS if connected.get(n) is not None]
    audios = [(n, connected[n]) for n in AUDIO_SOCKETS if connected.get(n) is not None]
    if not (images or videos or audios):
        raise H3Error("H3 References: connect at least one reference (ref_image_*, ref_video_* or ref_audio_*).")
    check_reference_counts(len(images), len(videos), len(audios), NODE_NAMES.references)
    for name, audio in audios:
        if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
            raise H3Error(f"{name}: expected an AUDIO ({{'waveform': [1, C, N], 'sample_rate': int}}).")
    labels = tuple([(("image", i), n) for i, (n, _) in enumerate(images)]
                   + [(("video", i), n) for i, (n, _) in enumerate(videos)]
                   + [(("audio", i), n) for i, (n, _) in enumerate(audios)])
    return H3References(images=tuple(image for _, image in images),
                        videos=tuple(video_entry(video, name) for name, video in videos),
                        audios=tuple((audio["waveform"], int(audio["sample_rate"])) for _, audio in audios),
                        image_size=ref_image_size, labels=labels, num_frames=frames)


def video_entry(video, socket: str):
    """A VIDEO (core's VideoInput: `get_components()`; or its components) -> h3_core's video reference tuple
    (frames, waveform [C, N] or None, fps, sample rate or None); also read by H3 Guide."""
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
