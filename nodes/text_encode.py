"""H3 Text Encode: prompt (+ first / last keyframes, or references) -> the text encoder's states, for the request's
canvas and duration set here (H3 Sampler makes what was encoded). The legacy node has no duration of its own."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .request_inputs import canvas_inputs, duration_inputs, frame_count_error, names_for, num_frames
from .sockets import H3Cond, H3Guides, H3Model, H3Refs
from .telemetry import phase

DESCRIPTION = ("Encodes the prompt (and the optional first / last keyframes, FL2VA; or references, Ref2VA) with H3's "
               "Qwen3-VL text encoder. An offloaded text encoder is released right after, before the transformer "
               "loads.")


def _inputs(*request_widgets) -> list:
    return [
        H3Model.Input("h3_model"),
        io.String.Input("prompt", multiline=True, default="",
                        tooltip="Shots, camera and the sound (dialogue, effects, music) in one text."),
        io.Image.Input("first_frame", optional=True, tooltip="FL2VA: the video starts on this image."),
        io.Image.Input("last_frame", optional=True, tooltip="FL2VA: the video ends on this image."),
        *request_widgets,
        H3Refs.Input("h3_refs", optional=True,
                     tooltip="Ref2VA: references from H3 References (needs the Ref2VA transformer)."),
    ]


GUIDES_TOOLTIP = ("Guides at any frame (an image, a clip, an audio, a clip with its soundtrack) from a chain of H3 Guide "
                  "nodes.")


class H3StreamEncodePrompt(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamEncodePrompt",
            display_name="H3 Text Encode",
            category="H3 Stream/conditioning",
            description=DESCRIPTION + " The canvas and the duration are set here, once: H3 Sampler makes them. "
                                      "Guides from H3 Guide anchor media at any frame.",
            search_aliases=["minimax h3", "h3 prompt", "clip text encode"],
            # h3_guides last: inputs are only ever appended (saved workflows are positional).
            inputs=[*_inputs(*canvas_inputs(), *duration_inputs()),
                    H3Guides.Input("h3_guides", optional=True, tooltip=GUIDES_TOOLTIP)],
            outputs=[H3Cond.Output(display_name="h3_cond")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, frames) -> bool | str:
        # One input only: ComfyUI reports a failed check under every input the check takes. The canvas is the
        # request's rule, checked when the node runs, before anything loads.
        return frame_count_error(frames) or True

    @classmethod
    def execute(cls, h3_model, prompt, width, height, seconds, frames, first_frame=None, last_frame=None,
                h3_refs=None, h3_guides=None) -> io.NodeOutput:
        count = num_frames(seconds, frames)
        return encode(cls.hidden.unique_id, h3_model, prompt=prompt, width=width, height=height, num_frames=count,
                      first_frame=first_frame, last_frame=last_frame, guides=tuple(h3_guides or ()),
                      **(h3_refs.request_fields(count) if h3_refs is not None else {}), names=names_for(frames))


class H3StreamTextEncode(io.ComfyNode):
    """The text encoder as saved workflows have it: the canvas here, the duration on the legacy sampler (and, for
    references, on the legacy H3 References)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamTextEncode",
            display_name="H3 Text Encode (no duration, legacy)",
            category="H3 Stream/conditioning",
            description="Superseded by H3 Text Encode, which also sets the duration; kept so that saved workflows "
                        "still load and run. " + DESCRIPTION,
            inputs=_inputs(*canvas_inputs()),
            outputs=[H3Cond.Output(display_name="h3_cond")],
            hidden=[io.Hidden.unique_id],
            is_deprecated=True,
        )

    @classmethod
    def execute(cls, h3_model, prompt, width, height, first_frame=None, last_frame=None,
                h3_refs=None) -> io.NodeOutput:
        from h3_core.request.generation_request import DEFAULT_FRAMES

        # The legacy sampler sets the duration; references are cut to the legacy H3 References' own.
        count = h3_refs.num_frames if h3_refs is not None and h3_refs.num_frames else DEFAULT_FRAMES
        return encode(cls.hidden.unique_id, h3_model, prompt=prompt, width=width, height=height, num_frames=count,
                      first_frame=first_frame, last_frame=last_frame,
                      **(h3_refs.request_fields(count) if h3_refs is not None else {}), names=names_for(0))


def encode(node_id, h3_model, **request) -> io.NodeOutput:
    """Both encoders: the request, checked in the widgets' words, then the text-encode phase with its report."""
    from h3_core.request.generation_request import GenerationRequest

    request = GenerationRequest(**request)
    pipeline = h3_model.pipeline
    with phase(node_id, h3_model, "text encoder", ("text encode",), pipeline.plan_request(request)):
        conditioning = pipeline.encode_prompt(request, check_interrupt=comfy_runtime.check_interrupt)
    return io.NodeOutput(conditioning)
