"""H3StreamLoader: where the model is, and how each component is placed in memory. Nothing is read here: the
pipeline loads each component when its phase first needs it."""

from __future__ import annotations

import logging

from comfy_api.latest import io

from . import comfy_runtime, model_sources
from .loader_inputs import loader_inputs
from .memory_settings import MemorySettings
from .sockets import H3Model, H3ModelHandle

log = logging.getLogger("h3_stream")


class H3StreamLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamLoader",
            display_name="H3 Loader (residency, legacy)",
            category="H3 Stream/loaders",
            description="Superseded by H3 Loader (memory profiles, source-specific inputs); kept so that saved "
                        "workflows still load and run. Points at an H3 model and chooses, per component, whether "
                        "its weights stay on the device or stream block by block from host memory.",
            search_aliases=["minimax h3", "h3 loader", "layerwise offload"],
            inputs=loader_inputs(),
            outputs=[H3Model.Output(display_name="h3_model")],
            hidden=[io.Hidden.unique_id],  # the node that shows a Hugging Face download's progress
            is_deprecated=True,  # hidden from the node search; saved workflows keep working
        )

    @classmethod
    def validate_inputs(cls, device) -> bool | str:
        # Only the device is taken here: ComfyUI then checks every other combo itself (one error, on that input),
        # and the residencies' admission, which needs all of them, is checked when the node runs.
        if device is None:
            return True  # linked: checked again when the node runs
        return comfy_runtime.device_error(device) or True

    @classmethod
    def fingerprint_inputs(cls, source=None, h3_folder=model_sources.NONE, diffusion_model=model_sources.NONE,
                           text_encoder=model_sources.NONE, video_vae=model_sources.NONE,
                           audio_vae=model_sources.NONE, **settings):
        return model_sources.fingerprint(source, h3_folder=h3_folder, diffusion_model=diffusion_model,
                                         text_encoder=text_encoder, video_vae=video_vae, audio_vae=audio_vae)

    @classmethod
    def execute(cls, source, partition, transformer_residency, text_encoder_residency, video_vae_residency,
                audio_vae_residency, prefetch, resident_blocks, chunk_size, memory_budget_mib, dtype, device,
                h3_folder=model_sources.NONE, diffusion_model=model_sources.NONE, text_encoder=model_sources.NONE,
                video_vae=model_sources.NONE, audio_vae=model_sources.NONE, repo_id=model_sources.DEFAULT_REPO_ID,
                mps_reclaim_every=0) -> io.NodeOutput:
        from h3_core.errors import H3Error

        problem = comfy_runtime.device_error(device)
        if problem:
            raise H3Error(problem)
        torch_device = comfy_runtime.torch_device(device)
        settings = MemorySettings.build(
            transformer=transformer_residency, text_encoder=text_encoder_residency, video_vae=video_vae_residency,
            audio_vae=audio_vae_residency, prefetch=prefetch, resident_blocks=resident_blocks, chunk_size=chunk_size,
            memory_budget_mib=memory_budget_mib, dtype=dtype, device=str(torch_device),
            mps_reclaim_every=mps_reclaim_every)
        refused = settings.admission_error()
        if refused:
            raise H3Error(refused)
        sources = model_sources.resolve_sources(source, partition, h3_folder=h3_folder,
                                                diffusion_model=diffusion_model, text_encoder=text_encoder,
                                                video_vae=video_vae, audio_vae=audio_vae, repo_id=repo_id,
                                                node_id=cls.hidden.unique_id)
        return io.NodeOutput(H3ModelHandle.open(sources, settings, torch_device, f"H3 {partition} from {source}",
                                                log.info))

