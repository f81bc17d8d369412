"""H3StreamLatentFromCore: core's MiniMax H3 AV LATENT -> our H3 latent, for H3 Decode Video and H3 Decode Audio."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .sockets import H3Latent


class H3StreamLatentFromCore(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamLatentFromCore",
            display_name="H3 Latent from Core",
            category="H3 Stream/latent",
            description="Takes a MiniMax H3 AV LATENT from core's nodes (Empty MiniMax H3 AV Latent, KSampler, "
                        "Concat AV Latent, ...) for the H3 decoders. It must hold one video [1, 24, 5n + 2, H/16, "
                        "W/16] and its audio [1, 32, 2, Ta]; the values are unchanged.",
            inputs=[io.Latent.Input("latent")],
            outputs=[H3Latent.Output(display_name="h3_latent")],
        )

    @classmethod
    def execute(cls, latent) -> io.NodeOutput:
        from h3_core.pipeline.core_latent import latents_from_core

        return io.NodeOutput(latents_from_core(comfy_runtime.latent_streams(latent), source="latent"))
