"""Stand-ins for the core ComfyUI nodes the example workflows use, with their real input names, types and defaults
(contract/object_info.json). They check what they receive the way the real nodes need it and record it."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
from comfy.nested_tensor import NestedTensor
from comfy_api.latest import io

SAVED: list[dict] = []  # what SaveVideo / SaveAudio received, in order


@dataclass
class VideoComponents:
    images: torch.Tensor
    audio: dict | None
    frame_rate: Fraction


def check_image(images) -> None:
    assert isinstance(images, torch.Tensor) and images.ndim == 4 and images.shape[-1] == 3, getattr(images, "shape",
                                                                                                     images)
    assert images.dtype == torch.float32 and images.device.type == "cpu"
    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0


def check_audio(audio) -> None:
    assert isinstance(audio, dict) and set(audio) >= {"waveform", "sample_rate"}, audio
    waveform = audio["waveform"]
    assert isinstance(waveform, torch.Tensor) and waveform.ndim == 3, getattr(waveform, "shape", waveform)
    assert isinstance(audio["sample_rate"], int)


class EmptyImage(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="EmptyImage", display_name="Empty Image", category="image", inputs=[
            io.Int.Input("width", default=512, min=1, max=16384, step=1),
            io.Int.Input("height", default=512, min=1, max=16384, step=1),
            io.Int.Input("batch_size", default=1, min=1, max=4096),
            io.Int.Input("color", default=0, min=0, max=0xFFFFFF, step=1),
        ], outputs=[io.Image.Output()])

    @classmethod
    def execute(cls, width, height, batch_size=1, color=0):
        rgb = torch.tensor([(color >> 16) & 0xFF, (color >> 8) & 0xFF, color & 0xFF], dtype=torch.float32) / 255.0
        return io.NodeOutput(rgb.expand(batch_size, height, width, 3).clone())


class CreateVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="CreateVideo", display_name="Create Video", category="video", inputs=[
            io.Image.Input("images"),
            io.Float.Input("fps", default=30.0, min=1.0, max=120.0, step=1.0),
            io.Audio.Input("audio", optional=True),
            io.Int.Input("bit_depth", min=8, max=10, default=8, step=2, optional=True),
        ], outputs=[io.Video.Output()])

    @classmethod
    def execute(cls, images, fps, audio=None, bit_depth=8):
        check_image(images)
        if audio is not None:
            check_audio(audio)
        return io.NodeOutput(VideoComponents(images, audio, Fraction(fps)))


class SaveVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        encoding = io.DynamicCombo.Input("encoding", display_name="encoding mode", optional=True, options=[
            io.DynamicCombo.Option("auto", []),
            io.DynamicCombo.Option("re-encode", [io.Float.Input("crf", default=23.0, min=0.0, max=51.0, step=1.0)]),
        ])
        return io.Schema(node_id="SaveVideo", display_name="Save Video", category="video", inputs=[
            io.Video.Input("video"),
            io.String.Input("filename_prefix", default="video/ComfyUI"),
            io.Combo.Input("format", options=["auto", "mp4"], default="auto"),
            io.DynamicCombo.Input("codec", options=[io.DynamicCombo.Option("auto", []),
                                                    io.DynamicCombo.Option("h264", [encoding])]),
        ], hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo], is_output_node=True)

    @classmethod
    def execute(cls, video, filename_prefix, format, codec):
        assert isinstance(video, VideoComponents)
        SAVED.append({"node": "SaveVideo", "prefix": filename_prefix, "images": video.images, "audio": video.audio,
                      "frame_rate": video.frame_rate})
        return io.NodeOutput(ui={"images": [{"filename": f"{filename_prefix}_00001_.mp4"}], "animated": (True,)})


class SaveAudioAdvanced(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SaveAudioAdvanced", display_name="Save Audio (Advanced)", category="audio",
                         inputs=[io.Audio.Input("audio"), io.String.Input("filename_prefix", default="audio/ComfyUI"),
                                 io.DynamicCombo.Input("format", options=[
                                     io.DynamicCombo.Option("flac", []),
                                     io.DynamicCombo.Option("mp3", [io.Combo.Input("quality", options=["V0", "128k",
                                                                                                       "320k"])]),
                                     io.DynamicCombo.Option("opus", [io.Combo.Input("quality", options=[
                                         "64k", "96k", "128k", "192k", "320k"])])])],
                         hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo], is_output_node=True,
                         outputs=[io.Audio.Output("audio")])

    @classmethod
    def execute(cls, audio, filename_prefix, format):
        check_audio(audio)
        SAVED.append({"node": "SaveAudioAdvanced", "prefix": filename_prefix, "audio": audio,
                      "format": format["format"]})
        return io.NodeOutput(audio, ui={"audio": [{"filename": f"{filename_prefix}_00001_.{format['format']}"}]})


class SaveAudio(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SaveAudio", display_name="Save Audio (FLAC) (DEPRECATED)", category="audio",
                         inputs=[io.Audio.Input("audio"), io.String.Input("filename_prefix", default="audio/ComfyUI")],
                         hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo], is_output_node=True, is_deprecated=True,
                         outputs=[io.Audio.Output("audio")])

    @classmethod
    def execute(cls, audio, filename_prefix="ComfyUI"):
        check_audio(audio)
        SAVED.append({"node": "SaveAudio", "prefix": filename_prefix, "audio": audio})
        return io.NodeOutput(audio, ui={"audio": [{"filename": f"{filename_prefix}_00001_.flac"}]})


class EmptyMiniMaxH3LatentAV(io.ComfyNode):
    """Core's empty H3 AV latent (comfy_extras/nodes_minimax_h3.py: `EmptyMiniMaxH3LatentAV`, `_empty_av_latent`,
    `temporal_shape`): `length` is rounded up to 17n + 5 frames (at least 5), which have 5n + 2 latent frames, and the
    audio gets round(frames / 24 * 40) latents per stereo channel."""

    @classmethod
    def define_schema(cls):
        tooltip = ("Frame count at 24 fps, snapped up to the model's 17k+5 grid (124 = ~5s; trained range is "
                   "~124-362, longer is untested)")
        return io.Schema(node_id="EmptyMiniMaxH3LatentAV", display_name="Empty MiniMax H3 AV Latent",
                         category="model/latent/minimax",
                         description="Joint video+audio latent for MiniMax H3. Duration snaps to the model's 17k+5 "
                                     "frame grid at 24 fps.",
                         inputs=[io.Int.Input("width", default=1344, min=32, max=16384, step=32),
                                 io.Int.Input("height", default=768, min=32, max=16384, step=32),
                                 io.Int.Input("length", default=124, min=5, max=3600, step=17, tooltip=tooltip)],
                         outputs=[io.Latent.Output()])

    @classmethod
    def execute(cls, width, height, length):
        frames = max(5, length) + (5 - max(5, length)) % 17
        video = torch.zeros(1, 24, (frames - 5) // 17 * 5 + 2, height // 16, width // 16)
        audio = torch.zeros(1, 32, 2, round(frames / 24 * 40))
        return io.NodeOutput({"samples": NestedTensor((video, audio))})


class LTXVSeparateAVLatent(io.ComfyNode):
    """Core's Separate AV Latent (comfy_extras/nodes_lt.py): the two streams as two LATENTs."""

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="LTXVSeparateAVLatent", display_name="Separate AV Latent", category="model/latent/ltxv",
                         description="Split a joint AV latent into its video and audio latents (any AV model, e.g. "
                                     "LTXV or MiniMax H3).",
                         inputs=[io.Latent.Input("av_latent")],
                         outputs=[io.Latent.Output(display_name="video_latent"),
                                  io.Latent.Output(display_name="audio_latent")])

    @classmethod
    def execute(cls, av_latent):
        video, audio = av_latent["samples"].unbind()
        return io.NodeOutput({**av_latent, "samples": video}, {**av_latent, "samples": audio})


class LTXVConcatAVLatent(io.ComfyNode):
    """Core's Concat AV Latent (comfy_extras/nodes_lt.py), for two plain LATENTs of matching length (core also fits
    an audio of another length, which no test here needs)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="LTXVConcatAVLatent", display_name="Concat AV Latent", category="model/latent/ltxv",
                         description="Merge a video latent and an audio latent into a joint AV latent (any AV model, "
                                     "e.g. LTXV or MiniMax H3).",
                         inputs=[io.Latent.Input("video_latent"), io.Latent.Input("audio_latent")],
                         outputs=[io.Latent.Output(display_name="latent")])

    @classmethod
    def execute(cls, video_latent, audio_latent):
        assert not getattr(video_latent["samples"], "is_nested", False), "the double joins plain latents only"
        return io.NodeOutput({**video_latent, **audio_latent,
                              "samples": NestedTensor((video_latent["samples"], audio_latent["samples"]))})


CORE_NODES = {cls.define_schema().node_id: cls for cls in (EmptyImage, CreateVideo, SaveVideo, SaveAudio,
                                                            SaveAudioAdvanced, EmptyMiniMaxH3LatentAV,
                                                            LTXVSeparateAVLatent, LTXVConcatAVLatent)}
