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
        partition_input(list(model_sources.PARTITIONS)),
        *memory_inputs(),
        dtype_input(),
        io.Combo.Input("device", options=list(comfy_runtime.DEVICES), default="auto", tooltip=DEVICE_TOOLTIP),
        *source_inputs(optional=True),
        reclaim_input(optional=True),
    ]


def memory_inputs() -> list:
    """The hand-set memory widgets, in their saved order (the legacy loader's, and the custom memory profile's)."""
    return [
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
    ]


def reclaim_input(optional: bool) -> io.Int.Input:
    return (
        io.Int.Input("mps_reclaim_every", default=0, min=0, max=1024, optional=optional,
                     tooltip="Apple MPS only: empty the Metal cache after every this many row chunks, so "
                             "freed activations go back to the shared memory. 0: never.")
    )


DEVICE_TOOLTIP = "auto: the device ComfyUI computes on (cpu with --cpu)."


def partition_input(options: list[str]) -> io.Combo.Input:
    return io.Combo.Input("partition", options=options, default="FL2VA",
                          tooltip="Which transformer weights: FL2VA (text and first/last frame to video+audio) "
                                  "or Ref2VA (reference to video+audio).")


def dtype_input() -> io.Combo.Input:
    return io.Combo.Input("dtype", options=list(DTYPES), default="auto",
                          tooltip="Compute dtype of the transformer and text encoder. auto keeps the checkpoint's "
                                  "(bf16 with fp32 islands for the released weights). The VAEs always run in "
                                  "float32.")


def h3_folder_input(optional: bool) -> io.Combo.Input:
    return io.Combo.Input("h3_folder", options=model_sources.h3_folder_choices(), default=model_sources.NONE,
                          optional=optional,
                          tooltip="For source 'models/h3 folder': an official (diffusers) or original release "
                                  "download in models/h3/<name>/.")


def repack_inputs(optional: bool) -> list:
    return [
        io.Combo.Input("diffusion_model", options=model_sources.diffusion_model_choices(),
                       default=model_sources.NONE, optional=optional,
                       tooltip="For source 'ComfyUI repack files': the transformer, e.g. "
                               "minimax_h3_fl2va_bf16.safetensors; the fp8 / int8 / NVFP4 repacks and .gguf files "
                               "load too (with the pack's quant extra installed)."),
        io.Combo.Input("text_encoder", options=model_sources.text_encoder_choices(),
                       default=model_sources.NONE, optional=optional,
                       tooltip="For source 'ComfyUI repack files': qwen3vl_32b_minimax_h3_bf16.safetensors or a "
                               "quantised repack; a published Qwen3-VL .gguf loads too (its mmproj-*.gguf beside "
                               "it for keyframes and references, and the H3 tokenizer.json beside it)."),
        io.Combo.Input("video_vae", options=model_sources.video_vae_choices(),
                       default=model_sources.NONE, optional=optional,
                       tooltip="For source 'ComfyUI repack files': minimax_h3_video_vae_*.safetensors."),
        io.Combo.Input("audio_vae", options=model_sources.audio_vae_choices(),
                       default=model_sources.NONE, optional=optional,
                       tooltip="For source 'ComfyUI repack files': minimax_h3_audio_vae_*.safetensors."),
    ]


def repo_id_input(optional: bool) -> io.String.Input:
    return io.String.Input("repo_id", default=model_sources.DEFAULT_REPO_ID, optional=optional,
                           tooltip="For source 'Hugging Face repo': only the folders of the chosen partition are "
                                   "downloaded. HF_HUB_OFFLINE=1 uses the local cache only.")


def source_inputs(optional: bool) -> list:
    return [h3_folder_input(optional), *repack_inputs(optional), repo_id_input(optional)]


def model_loader_inputs() -> list:
    """Every input of H3StreamModelLoader: a source that brings only its own inputs, a memory profile (custom brings
    the hand-set widgets), dtype and device. Append only: saved workflows address widgets by position."""
    from h3_core.planning.memory_profiles import CUSTOM, PROFILES

    source = io.DynamicCombo.Input("source", options=[
        io.DynamicCombo.Option(model_sources.TINY, [partition_input(list(model_sources.TINY_PARTITIONS))]),
        io.DynamicCombo.Option(model_sources.H3_FOLDER, [h3_folder_input(False),
                                                         partition_input(list(model_sources.PARTITIONS))]),
        io.DynamicCombo.Option(model_sources.COMFY_REPACK, repack_inputs(False)),
        io.DynamicCombo.Option(model_sources.HUGGING_FACE, [repo_id_input(False),
                                                            partition_input(list(model_sources.PARTITIONS))]),
    ], tooltip="Where the weights are: the embedded tiny test model (random weights, runs anywhere in seconds), a "
               "folder under models/h3/, the ComfyUI repack files in diffusion_models / text_encoders / vae (the "
               "transformer file decides the partition), or a Hugging Face repo id.")
    profile = io.DynamicCombo.Input("memory_profile", options=[
        *(io.DynamicCombo.Option(name, []) for name in PROFILES),
        io.DynamicCombo.Option(CUSTOM, [*memory_inputs(), reclaim_input(optional=False)]),
    ], tooltip="The memory this run may use. A profile plans each component's residency from the checkpoint "
               "headers before anything loads (the node shows the plan), and H3 Sampler sizes each request's row "
               "chunks within it or refuses the request. GPU profiles: 90% of the card; Mac profiles: 75% of the "
               "unified memory (what macOS lets the GPU use); auto: 90% of what is free when the node runs. "
               "custom: set every residency and chunking value by hand.")
    return [source, profile, dtype_input(),
            io.Combo.Input("device", options=comfy_runtime.available_devices(), default="auto",
                           tooltip=DEVICE_TOOLTIP + " Lists only the devices this machine has.")]
