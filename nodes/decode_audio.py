"""H3StreamDecodeAudio: audio latents -> ComfyUI AUDIO, 32 kHz stereo, trimmed to the video's length."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .sockets import H3Latent, H3Model
from .telemetry import audio_health_report, phase


class H3StreamDecodeAudio(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamDecodeAudio",
            display_name="H3 Decode Audio",
            category="H3 Stream/decode",
            description="Decodes the audio latents into a 32 kHz stereo AUDIO as long as the video "
                        "({'waveform': [1, 2, T], 'sample_rate': 32000}).",
            inputs=[H3Model.Input("h3_model"), H3Latent.Input("h3_latent")],
            outputs=[io.Audio.Output(display_name="audio")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, h3_model, h3_latent) -> io.NodeOutput:
        from h3_core.request.grid import AUDIO_SAMPLE_RATE

        pipeline = h3_model.pipeline
        shape = h3_latent.shape
        plan = pipeline.plan(width=shape.width, height=shape.height, num_frames=shape.num_frames)
        warnings = []
        with phase(cls.hidden.unique_id, h3_model, "audio decode", ("audio decode",), plan) as extra:
            # An audio health error raises here (ComfyUI shows it on this node, nothing downstream saves); warnings
            # join the node's progress text.
            waveform = pipeline.decode_audio(h3_latent, check_interrupt=comfy_runtime.check_interrupt,
                                             audio_warnings=warnings)
            extra.update(audio_health_report(warnings))
        return io.NodeOutput({"waveform": waveform[None], "sample_rate": AUDIO_SAMPLE_RATE})
