"""The pack's own socket types and the values that travel through them.

ComfyUI passes these values by reference and keeps them in its execution cache while the producing node's inputs are
unchanged, so every payload is frozen: a downstream node never changes what an upstream node produced.
"""

from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from .memory_settings import MemorySettings

H3Model = io.Custom("H3_MODEL")
H3Cond = io.Custom("H3_COND")
H3Latent = io.Custom("H3_LATENT")
H3Refs = io.Custom("H3_REFS")


@dataclass(frozen=True)
class H3ModelHandle:
    """What `H3_MODEL` carries: the pipeline (it loads each component when a phase first needs it and keeps it until
    released), the settings it was built with, and the LoRAs ((file, strength), ...) the sampler applies to its
    transformer (H3 LoRA nodes add to a copy; one pipeline serves every handle made from it)."""

    pipeline: object  # h3_core.pipeline.H3Pipeline
    settings: MemorySettings
    description: str
    loras: tuple = ()


@dataclass(frozen=True)
class H3Conditioning:
    """What `H3_COND` carries: the text encoder's output for one prompt and the canvas its keyframes were fitted to."""

    conditioning: object  # h3_core.pipeline.Conditioning
    width: int
    height: int
    reference_frames: int = 0  # the frame count Ref2VA references were cut to (0: none)

    @property
    def has_keyframes(self) -> bool:
        return bool(self.conditioning.keyframes)
