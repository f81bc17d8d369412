"""H3StreamTextEncode: prompt (+ first / last keyframe) -> the text encoder's states."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .request_inputs import canvas_error, canvas_inputs
from .sockets import H3Cond, H3Conditioning, H3Model, H3Refs
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
                H3Refs.Input("h3_refs", optional=True,
                             tooltip="Ref2VA: references from H3 References (needs the Ref2VA transformer)."),
            ],
            outputs=[H3Cond.Output(display_name="h3_cond")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, width, height) -> bool | str:
        return canvas_error(width, height) or True

    @classmethod
    def execute(cls, h3_model, prompt, width, height, first_frame=None, last_frame=None,
                h3_refs=None) -> io.NodeOutput:
        pipeline = h3_model.pipeline
        references = None
        if h3_refs is not None:
            from h3_core.request.references import build_references
            from h3_core.sources.model_sources import canvas_rules

            pipeline.check_ref2va_transformer()
            references = build_references(h3_refs.images, h3_refs.videos, h3_refs.audios,
                                          num_frames=h3_refs.num_frames, width=width, height=height,
                                          reference_image_size=h3_refs.image_size,
                                          names=("ref_image", "ref_video", "ref_audio"),
                                          labels=dict(h3_refs.labels), canvas_rules=canvas_rules(pipeline.sources))
        comfy_runtime.free_memory_for({"text_encoder": pipeline.sources.text_encoder}, h3_model.settings,
                                      pipeline.device)
        with memory_report(cls.hidden.unique_id, h3_model, "text encoder"):
            comfy_runtime.check_interrupt()
            conditioning = pipeline.encode_prompt(prompt, width=width, height=height, first_frame=first_frame,
                                                  last_frame=last_frame, references=references)
        comfy_runtime.soft_empty_cache()
        return io.NodeOutput(H3Conditioning(conditioning, int(width), int(height),
                                            h3_refs.num_frames if h3_refs is not None else 0))
