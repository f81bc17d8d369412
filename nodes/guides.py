"""H3 Guide: one guide (an image, a clip, an audio, or a clip with its soundtrack) anchored at any frame of the video,
appended to the guides of the H3 Guide before it. H3 Text Encode and H3 Generate (remote server) take the list as
`h3_guides` (the request's `guides`).

What the inputs make (as core's "Add Guide for MiniMax H3" reads its image and audio):
- image alone: one frame (a batch of 1) is an image guide; a batch of several frames is a clip (h3_core crops it to
  the 17k + 5 frame grid: 5, 22, 39, ... with a note).
- video alone: its frames are a clip and its soundtrack, when it has one, goes with it (a clip with soundtrack); it
  must be at 24 fps, H3's rate (its frames are placed one per output frame).
- audio alone: an audio guide, starting at `frame`'s time.
- image + audio, or video + audio: the frames with that audio as their soundtrack (the audio replaces a video's own).
- image + video: refused (which frames are meant?).
Audio is made 32 kHz stereo here (h3_core's reference-audio rule); whether a guide fits the video, overlaps another or
runs past the end is h3_core's check, which names the guide by its `label`: "H3 Guide #<node> (frame <frame>)".
"""

from __future__ import annotations

from comfy_api.latest import io

from .sockets import H3Guides

# core's MiniMaxH3AddGuide frame_idx range: past-the-end values are the request's error, in the video's frame count.
FRAME_LIMIT = 9999
# 23.976 fps (NTSC film) plays at 24 fps 0.1 % faster, which no one sees or hears: taken, with a note. Any other rate
# would change the clip's speed, so it is refused with how to convert it.
FPS_TOLERANCE = 0.03
DESCRIPTION = ("Anchors an image, a clip, an audio, or a clip with its soundtrack at any frame of the video (negative "
               "frames count from the end: -1 is the last frame). Chain H3 Guide nodes through h3_guides to anchor "
               "several frames; connect the last one to H3 Text Encode (or H3 Generate, remote server). A VIDEO "
               "brings its soundtrack along; an AUDIO with an image or a video becomes its soundtrack.")


class H3StreamGuide(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamGuide",
            display_name="H3 Guide",
            category="H3 Stream/conditioning",
            description=DESCRIPTION,
            search_aliases=["minimax h3", "add guide", "keyframe", "guide frame", "extend", "continuation"],
            inputs=[
                io.Int.Input("frame", default=0, min=-FRAME_LIMIT, max=FRAME_LIMIT,
                             tooltip="The video frame (at 24 fps) the guide starts at: 0 is the first frame; negative "
                                     "values count from the end (-1 is the last frame, -22 the start of a 22-frame "
                                     "clip that ends the video)."),
                H3Guides.Input("h3_guides", optional=True,
                               tooltip="Guides from another H3 Guide node; this guide is added after them."),
                io.Image.Input("image", optional=True,
                               tooltip="One image (a batch of 1) to anchor, or several frames to anchor as a clip "
                                       "(cropped to 5, 22, 39, ... = 17k + 5 frames)."),
                io.Video.Input("video", optional=True,
                               tooltip="A clip at 24 fps to anchor; its soundtrack, when it has one, is anchored with "
                                       "it. Connect an image or a video, not both."),
                io.Audio.Input("audio", optional=True,
                               tooltip="Audio to anchor from this frame's time: alone, or as the soundtrack of the "
                                       "image / video (it replaces the video's own). Resampled to 32 kHz stereo."),
            ],
            outputs=[H3Guides.Output(display_name="h3_guides")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, frame, h3_guides=None, image=None, video=None, audio=None) -> io.NodeOutput:
        from . import comfy_runtime

        node_id = cls.hidden.unique_id
        guide = make_guide(frame, image=image, video=video, audio=audio, node_id=node_id,
                           note=lambda text: comfy_runtime.send_progress_text(node_id, text))
        return io.NodeOutput(tuple(h3_guides or ()) + (guide,))


def guide_label(node_id, frame: int) -> str:
    return f"H3 Guide #{node_id} (frame {frame})" if node_id is not None else f"H3 Guide (frame {frame})"


def make_guide(frame: int, *, image=None, video=None, audio=None, node_id=None, note=lambda text: None):
    """The connected core IMAGE / VIDEO / AUDIO -> one `h3_core.request.guides.Guide`, or one error in the node's
    words (only what the node alone can tell: nothing connected, an image and a video, a video not at 24 fps).
    `note(text)`: what the node's text should say (a 23.976 fps video taken as 24 fps)."""
    from h3_core.errors import H3Error
    from h3_core.request.grid import AUDIO_SAMPLE_RATE, FPS, MAX_SECONDS
    from h3_core.request.guides import Guide
    from h3_core.request.references import normalise_audio

    from .references import video_entry

    label = guide_label(node_id, frame)
    if image is None and video is None and audio is None:
        raise H3Error(f"{label}: connect an image, a video or an audio to anchor (it has none).")
    if image is not None and video is not None:
        raise H3Error(f"{label}: connect an image or a video, not both (a clip's frames come from one of them).")
    frames, soundtrack = None, None
    if image is not None:
        frames = _image_frames(image, label, "image")
    if video is not None:
        images, video_waveform, rate, video_sample_rate = video_entry(video, f"{label}: video")
        if abs(rate - FPS) > FPS_TOLERANCE:
            raise H3Error(f"{label}: video: the clip is at {rate:g} fps and H3 makes {FPS} fps, one guide frame per "
                          f"video frame; convert it to {FPS} fps first (e.g. ffmpeg -i IN -r {FPS} OUT.mp4, then Load "
                          "Video), or connect its frames to image to use them as they are.")
        if rate != FPS:
            note(f"video at {rate:.3f} fps placed one frame per output frame at {FPS} fps "
                 f"({abs(FPS / rate - 1) * 100:.1f} % {'faster' if rate < FPS else 'slower'}).")
        frames = _image_frames(images, label, "video")
        if video_waveform is not None:
            soundtrack = (video_waveform, video_sample_rate)
    if audio is not None:  # alone, or the image's / the video's soundtrack (it replaces the video's own)
        if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
            raise H3Error(f"{label}: audio: expected an AUDIO ({{'waveform': [1, C, N], 'sample_rate': int}}), got "
                          f"{type(audio).__name__}.")
        source = audio["waveform"]
        if source.ndim == 3:
            if source.shape[0] != 1:
                raise H3Error(f"{label}: audio: a batch of {source.shape[0]} waveforms; connect one.")
            source = source[0]
        soundtrack = (source, int(audio["sample_rate"]))
    waveform = None
    if soundtrack is not None:
        # Longer than any video is cut at the source rate (h3_core says when it runs past the end of this one).
        waveform = normalise_audio(*soundtrack, f"{label}: audio", max_seconds=4 * MAX_SECONDS)
    return Guide(frame=int(frame), frames=frames, audio=waveform, sample_rate=AUDIO_SAMPLE_RATE, label=label)


def _image_frames(images, label: str, socket: str):
    """A core IMAGE [B, H, W, C] (or [H, W, C]) -> float32 RGB frames [B, H, W, 3] in [0, 1] on the CPU."""
    import torch

    from h3_core.errors import H3Error

    if not isinstance(images, torch.Tensor):
        raise H3Error(f"{label}: {socket}: expected an IMAGE tensor [frames, height, width, 3], got "
                      f"{type(images).__name__}.")
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4 or images.shape[-1] not in (3, 4) or images.shape[0] == 0:
        raise H3Error(f"{label}: {socket}: expected frames [frames, height, width, 3], got {tuple(images.shape)}.")
    return images[..., :3].detach().to("cpu", torch.float32).clamp(0.0, 1.0)
