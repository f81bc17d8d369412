"""H3StreamMemoryReport: the memory figures of this process as text (for API users, who have no badge)."""

from __future__ import annotations

from comfy_api.latest import io, ui

from .sockets import H3Model, RunsEveryTime, after_input
from .telemetry import DevicePeak, gib, host_peak_bytes


class H3StreamMemoryReport(RunsEveryTime, io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamMemoryReport",
            display_name="H3 Memory Report",
            category="H3 Stream/memory",
            description="Reports the model's memory settings, the device memory in use now (CUDA: allocated; MPS: "
                        "held by the Metal driver) and the process's peak host memory (RSS).",
            inputs=[H3Model.Input("h3_model"),
                    after_input("reporting")],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def execute(cls, h3_model, after=None) -> io.NodeOutput:
        device = h3_model.pipeline.device
        lines = [h3_model.description,
                 f"device {device}: {gib(DevicePeak(device).bytes())} now",
                 f"host: process peak {gib(host_peak_bytes())}"]
        text = "\n".join(lines)
        return io.NodeOutput(text, ui=ui.PreviewText(text))
