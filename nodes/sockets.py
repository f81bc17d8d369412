"""The pack's own socket types and the values that travel through them.

ComfyUI passes these values by reference and keeps them in its execution cache while the producing node's inputs are
unchanged, so every payload is frozen: a downstream node never changes what an upstream node produced.
"""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from . import comfy_runtime
from .memory_settings import MemorySettings

H3Model = io.Custom("H3_MODEL")
H3Cond = io.Custom("H3_COND")  # h3_core.pipeline.Conditioning: the states, and the request they were encoded for
H3Latent = io.Custom("H3_LATENT")
H3Refs = io.Custom("H3_REFS")
H3Guides = io.Custom("H3_GUIDES")  # a tuple of h3_core.request.guides.Guide, in the order the H3 Guide nodes chain


def after_input(what: str):
    """The `after` socket of a node that must run last: any output, only for the order of execution."""
    return io.AnyType.Input("after", optional=True, tooltip=f"Any output that must exist before {what}.")


class RunsEveryTime:
    """For output nodes that act on the world (a report, an unload): queued again, they run again."""

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        return float("nan")  # never equal to the last run's


@dataclass(frozen=True)
class H3ModelHandle:
    """What `H3_MODEL` carries: the pipeline (it loads each component when a phase first needs it and keeps it until
    released), the settings it was built with, and the LoRAs ((file, strength), ...) the sampler applies to its
    transformer (H3 LoRA Loader nodes add to a copy; one pipeline serves every handle made from it)."""

    pipeline: object  # h3_core.pipeline.H3Pipeline
    settings: MemorySettings
    description: str
    loras: tuple = ()

    @classmethod
    def open(cls, sources, settings: MemorySettings, device, what: str, log) -> "H3ModelHandle":
        """The handle both loaders output: a pipeline built with the settings (it loads nothing yet)."""
        from h3_core.pipeline import H3Pipeline

        pipeline = H3Pipeline(sources, device=device, dtype=settings.torch_dtype,
                              component_options=settings.component_options(), **settings.keep_options(), log=log)
        comfy_runtime.register_pipeline(pipeline)  # "Unload models" and other nodes' free_memory evict it
        described = f"{what}: {settings.describe()}"
        log(described)
        return cls(pipeline, settings, described)
