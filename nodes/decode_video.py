"""H3StreamDecodeVideo: video latents -> ComfyUI IMAGE frames at 24 fps (feeds core CreateVideo)."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .sockets import H3Latent, H3Model
from .telemetry import phase


class H3StreamDecodeVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamDecodeVideo",
            display_name="H3 Decode Video",
            category="H3 Stream/decode",
            description="Decodes the video latents one 17-frame clip at a time into IMAGE frames [F, H, W, 3] in "
                        "[0, 1], plus the frame rate for Create Video.",
            inputs=[H3Model.Input("h3_model"), H3Latent.Input("h3_latent")],
            outputs=[io.Image.Output(display_name="images"), io.Float.Output(display_name="fps")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, h3_model, h3_latent) -> io.NodeOutput:
        from h3_core.request.grid import FPS

        pipeline = h3_model.pipeline
        shape = h3_latent.shape
        plan = pipeline.plan(width=shape.width, height=shape.height, num_frames=shape.num_frames)
        with phase(cls.hidden.unique_id, h3_model, "video decode", ("video decode",), plan):
            frames = pipeline.decode_video(h3_latent, check_interrupt=comfy_runtime.check_interrupt)
        return io.NodeOutput(frames, float(FPS))
