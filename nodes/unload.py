"""H3StreamUnload: release every loaded H3 component now (the next run loads them again)."""

from __future__ import annotations

from comfy_api.latest import io, ui

from . import comfy_runtime
from .sockets import H3Model, RunsEveryTime, after_input


class H3StreamUnload(RunsEveryTime, io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamUnload",
            display_name="H3 Unload Models",
            category="H3 Stream/memory",
            description="Releases the H3 components this model has loaded (device copies, host stores and memory "
                        "maps) and empties the device cache. Connect 'after' to run it last.",
            inputs=[H3Model.Input("h3_model"),
                    after_input("unloading")],
            outputs=[],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def execute(cls, h3_model, after=None) -> io.NodeOutput:
        h3_model.pipeline.release_all()
        comfy_runtime.soft_empty_cache()
        return io.NodeOutput(ui=ui.PreviewText(f"released: {h3_model.description}"))
