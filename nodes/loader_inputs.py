"""The loader's widgets, in their saved order, with their defaults and tooltips (declarative: what the loader does
is in loader.py)."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime, model_sources
from .memory_settings import DTYPES, LAYERWISE_OFFLOAD, RESIDENCIES, RESIDENT
from .request_inputs import MAX_CHUNK_SIZE

RESIDENCY_TOOLTIP = ("RESIDENT keeps every weight of the {what} on the device, loaded through every phase and prompt. "
                     "LAYERWISE_OFFLOAD keeps its {blocks} in host memory (on Apple MPS: the memory-mapped files "
                     "themselves) and moves them to the device one at a time; it is released (device copies and host "
                     "store) when a phase that does not run it starts, and loaded again when one does.{extra} On MPS "
                     "every component must be LAYERWISE_OFFLOAD.")


def _residency_input(name: str, what: str, blocks: str, default: str, extra: str = "") -> io.Combo.Input:
    return io.Combo.Input(name, options=list(RESIDENCIES), default=default,
                          tooltip=RESIDENCY_TOOLTIP.format(what=what, blocks=blocks, extra=extra))


def loader_inputs() -> list:
    """Every input of H3StreamLoader. Append only: saved workflows address widgets by position."""
    return [
        io.Combo.Input("source", options=list(model_sources.SOURCES), default=model_sources.TINY,
                       tooltip="Where the weights are: the embedded tiny test model (random weights, runs "
                               "anywhere in seconds), a folder under models/h3/, the ComfyUI repack files in "
                               "diffusion_models / text_encoders / vae, or a Hugging Face repo id."),
        io.Combo.Input("partition", options=list(model_sources.PARTITIONS), default="FL2VA",
                       tooltip="Which transformer weights: FL2VA (text and first/last frame to video+audio) "
                               "or Ref2VA (reference to video+audio)."),
        _residency_input("transformer_residency", "transformer (33B DiT)", "blocks", LAYERWISE_OFFLOAD),
        _residency_input("text_encoder_residency", "text encoder (Qwen3-VL)", "decoder layers",
                         LAYERWISE_OFFLOAD, " The text encoder goes right after encoding, before sampling."),
        _residency_input("video_vae_residency", "video VAE", "decoder blocks", RESIDENT),
        _residency_input("audio_vae_residency", "audio VAE", "upsampling stages", RESIDENT),
        io.Int.Input("prefetch", default=-1, min=-1, max=8,
                     tooltip="Blocks copied ahead of the one computing, for every LAYERWISE_OFFLOAD "
                             "component. -1: the device's default (1 on CUDA, 0 elsewhere)."),
        io.Int.Input("resident_blocks", default=0, min=0, max=256,
                     tooltip="With layerwise offload, keep this many of the first transformer blocks on the "
                             "device (faster, costs about 1.2 GiB each in bf16)."),
        io.Int.Input("chunk_size", default=0, min=0, max=MAX_CHUNK_SIZE,
                     tooltip="Packed rows per chunk of the transformer's attention and MLP. 0: from the "
                             "memory budget (one fused pass when there is no budget)."),
        io.Int.Input("memory_budget_mib", default=0, min=0, max=1 << 22,
                     tooltip="MiB one row chunk's temporaries may take; sets the chunk size when chunk_size "
                             "is 0. 0: no budget."),
        io.Combo.Input("dtype", options=list(DTYPES), default="auto",
                       tooltip="Compute dtype of the transformer and text encoder. auto keeps the "
                               "checkpoint's (bf16 with fp32 islands for the released weights). The VAEs "
                               "always run in float32."),
        io.Combo.Input("device", options=list(comfy_runtime.DEVICES), default="auto",
                       tooltip="auto: the device ComfyUI computes on (cpu with --cpu)."),
        io.Combo.Input("h3_folder", options=model_sources.h3_folder_choices(),
                       default=model_sources.NONE, optional=True,
                       tooltip="For source 'models/h3 folder': an official (diffusers) or original release "
                               "download in models/h3/<name>/."),
        io.Combo.Input("diffusion_model", options=model_sources.diffusion_model_choices(),
                       default=model_sources.NONE, optional=True,
                       tooltip="For source 'ComfyUI repack files': the transformer, e.g. "
                               "minimax_h3_fl2va_bf16.safetensors (int8 / fp8 repacks are refused)."),
        io.Combo.Input("text_encoder", options=model_sources.text_encoder_choices(),
                       default=model_sources.NONE, optional=True,
                       tooltip="For source 'ComfyUI repack files': qwen3vl_32b_minimax_h3_bf16.safetensors."),
        io.Combo.Input("video_vae", options=model_sources.video_vae_choices(),
                       default=model_sources.NONE, optional=True,
                       tooltip="For source 'ComfyUI repack files': minimax_h3_video_vae_*.safetensors."),
        io.Combo.Input("audio_vae", options=model_sources.audio_vae_choices(),
                       default=model_sources.NONE, optional=True,
                       tooltip="For source 'ComfyUI repack files': minimax_h3_audio_vae_*.safetensors."),
        io.String.Input("repo_id", default=model_sources.DEFAULT_REPO_ID, optional=True,
                        tooltip="For source 'Hugging Face repo': only the folders of the chosen partition are "
                                "downloaded. HF_HUB_OFFLINE=1 uses the local cache only."),
        io.Int.Input("mps_reclaim_every", default=0, min=0, max=1024, optional=True,
                     tooltip="Apple MPS only: empty the Metal cache after every this many row chunks, so "
                             "freed activations go back to the shared memory. 0: never."),
    ]
