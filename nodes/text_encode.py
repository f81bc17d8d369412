"""H3StreamTextEncode: prompt (+ first / last keyframe) -> the text encoder's states."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .request_inputs import canvas_error, canvas_inputs
from .sockets import H3Cond, H3Conditioning, H3Model
from .telemetry import memory_report


class H3StreamTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamTextEncode",
            display_name="H3 Text Encode",
            category="H3 Stream",
            description="Encodes the prompt (and the optional first / last keyframes, FL2VA) with H3's Qwen3-VL text "
                        "encoder. An offloaded text encoder is released right after, before the transformer loads (every "
                        "offloaded component is released when a phase that does not run it starts).",
            inputs=[
                H3Model.Input("h3_model"),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="Shots, camera and the sound (dialogue, effects, music) in one text."),
                io.Image.Input("first_frame", optional=True, tooltip="FL2VA: the video starts on this image."),
                io.Image.Input("last_frame", optional=True, tooltip="FL2VA: the video ends on this image."),
                *canvas_inputs(),
            ],
            outputs=[H3Cond.Output(display_name="h3_cond")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, width, height) -> bool | str:
        return canvas_error(width, height) or True

    @classmethod
    def execute(cls, h3_model, prompt, width, height, first_frame=None, last_frame=None) -> io.NodeOutput:
        pipeline = h3_model.pipeline
        comfy_runtime.free_memory_for({"text_encoder": pipeline.sources.text_encoder}, h3_model.settings,
                                      pipeline.device)
        with memory_report(cls.hidden.unique_id, h3_model, "text encoder"):
            comfy_runtime.check_interrupt()
            conditioning = pipeline.encode_prompt(prompt, width=width, height=height, first_frame=first_frame,
                                                  last_frame=last_frame)
        comfy_runtime.soft_empty_cache()
        return io.NodeOutput(H3Conditioning(conditioning, int(width), int(height)))
