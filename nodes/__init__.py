"""The h3-stream V3 nodes. Imported by the pack's `comfy_entrypoint` only, inside a running ComfyUI (or its test
double): this is the layer that speaks ComfyUI; everything it computes comes from `h3_core`."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .decode_audio import H3StreamDecodeAudio
from .decode_video import H3StreamDecodeVideo
from .latent_from_core import H3StreamLatentFromCore
from .latent_to_core import H3StreamLatentToCore
from .generate_remote import H3StreamGenerateRemote
from .guides import H3StreamGuide
from .loader import H3StreamLoader
from .long_video import H3StreamExtend, H3StreamLongVideo
from .lora import H3StreamLoRA
from .memory_report import H3StreamMemoryReport
from .model_loader import H3StreamModelLoader
from .model_sources import register_h3_folder
from .references import H3StreamReferenceMedia, H3StreamReferences
from .sampler import H3StreamAVSampler, H3StreamSampler
from .text_encode import H3StreamEncodePrompt, H3StreamTextEncode
from .unload import H3StreamUnload

# Node ids are stable: never rename one (saved workflows refer to it); append inputs only.
NODES: tuple[type[io.ComfyNode], ...] = (
    H3StreamLoader,
    H3StreamTextEncode,
    H3StreamSampler,
    H3StreamDecodeVideo,
    H3StreamDecodeAudio,
    H3StreamMemoryReport,
    H3StreamUnload,
    H3StreamLoRA,
    H3StreamLatentToCore,
    H3StreamLatentFromCore,
    H3StreamModelLoader,
    H3StreamGenerateRemote,
    H3StreamReferences,
    H3StreamEncodePrompt,
    H3StreamAVSampler,
    H3StreamReferenceMedia,
    H3StreamGuide,
    H3StreamLongVideo,
    H3StreamExtend,
)


class H3StreamExtension(ComfyExtension):
    async def on_load(self) -> None:
        register_h3_folder()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
