"""H3StreamLatentToCore: our H3 latent -> core's MiniMax H3 AV LATENT, for core's H3 nodes (VAE Decode, latent
upscalers, guides, samplers)."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .sockets import H3Latent


class H3StreamLatentToCore(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamLatentToCore",
            display_name="H3 Latent to Core",
            category="H3 Stream/latent",
            description="Hands the H3 sampler's latents to core's MiniMax H3 nodes as an AV LATENT (video "
                        "[1, 24, T, H/16, W/16] and audio [1, 32, 2, Ta], normalised as core's VAEs expect). The "
                        "values are unchanged: converting back gives the same latents bit for bit.",
            inputs=[H3Latent.Input("h3_latent")],
            outputs=[io.Latent.Output(display_name="latent")],
        )

    @classmethod
    def execute(cls, h3_latent) -> io.NodeOutput:
        from h3_core.pipeline.core_latent import latents_to_core

        return io.NodeOutput(comfy_runtime.av_latent(*latents_to_core(h3_latent)))
