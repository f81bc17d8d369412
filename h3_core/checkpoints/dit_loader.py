"""Load the H3 DiT from any of its three checkpoint layouts.

* **diffusers** folder: `config.json` (`MiniMaxH3Transformer3DModel`), `diffusion_pytorch_model*.safetensors`
  (+ `.index.json`); separate `to_q/to_k/to_v`, feed-forward input rows stored `[up; gate]`.
* **native** folder (original FL2VA / Ref2VA release): `config.json` (`MiniMaxH3DiTModel`), `model*.safetensors`
  (+ `model.safetensors.index.json`); fused QKV stored per head interleaved, `fc1` stored `[gate; up]`,
  `rope.inv_freq` shipped.
* **comfy** single `.safetensors` (ComfyUI repack): native names, optionally prefixed `model.diffusion_model.`, QKV
  already in logical order, config read from the tensor shapes.

Tensors come from memory maps (see `safetensors_io`); every key, shape and dtype is checked before anything is
placed, and each problem raises one `CheckpointError` naming the file and key.
"""

from __future__ import annotations

import os
from contextlib import closing
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..models.dit import H3DiT, RotaryEmbedding3D
from ..models.dit_config import DIFFUSERS_CLASS_NAME, NATIVE_CLASS_NAME, H3DiTConfig
from ..models.meta_models import meta_model
from ..runtime.chunking import ChunkingPolicy
from ..runtime.file_reads import FileReader
from ..runtime.host_store import HostTensor
from ..runtime.platform import Platform
from ..runtime.residency import Residency
from .checkpoint import (QUANTISED_NEEDS_FORMAT, Checkpoint, HeaderSizes, WeightSpec, cat_rows, check_config_sizes,
                         compute_dtype, count_indexed, deinterleave_rows, expected_shapes, not_a_checkpoint,
                         open_folder_files, open_weights_file, read_json, resolve_source, shape_reader, swap_halves)
from .lora_loader import set_loras
from .placement import attach_layerwise, companion_manager, residency_manager, set_tensor
from .quantised import detect_quantised

COMFY_PREFIX = "model.diffusion_model."
# Parameters kept float32 whatever dtype is requested: the released checkpoint's fp32 islands.
FP32_ISLANDS = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                "final_layer.audio_out.", "rope.")
LAYOUTS = ("diffusers", "native", "comfy")


# ---- key plans ------------------------------------------------------------------------------------------------------


def _diffusers_block_key(sub: str) -> str:
    renames = {
        "attn.q_norm.weight": "attn.norm_q.weight",
        "attn.k_norm.weight": "attn.norm_k.weight",
        "attn.out_proj.weight": "attn.to_out.0.weight",
        "mlp.fc1.weight": "ff.net.0.proj.weight",
        "mlp.fc2.weight": "ff.net.2.weight",
    }
    return renames.get(sub, sub)


_DIFFUSERS_GLOBALS = {
    "video_patch_proj.": "proj_in.",
    "audio_patch_proj.": "audio_proj_in.",
    "condition_proj.": "context_embedder.",
    "time_embedder.proj_in.": "time_embedder.linear_1.",
    "time_embedder.proj_out.": "time_embedder.linear_2.",
    "final_layer.norm.": "norm_out.norm.",
    "final_layer.adaln_proj.linear.": "norm_out.linear.",
    "final_layer.video_out.": "proj_out.",
    "final_layer.audio_out.": "audio_proj_out.",
    "token_refiner.final_norm.": "token_refiner.final_norm.",
}


def _expected_tensors(config: H3DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter and persistent buffer of the model with its shape."""
    model = meta_model(H3DiT, config)
    out = {name: tuple(p.shape) for name, p in model.named_parameters()}
    out.update({name: tuple(b.shape) for name, b in model.named_buffers()})
    return out


def _plan(layout: str, config: H3DiTConfig, prefix: str = "") -> list[WeightSpec]:
    c = config
    specs = []
    for name, shape in _expected_tensors(config).items():
        if name == "rope.inv_freq" and layout != "native":
            continue  # recomputed from rope_theta; only the native release ships it
        if layout in ("native", "comfy"):
            combine = None
            if layout == "native" and name.endswith("attn.qkv_proj.weight"):
                combine = deinterleave_rows(c.num_attention_heads, c.attention_head_dim)
            specs.append(WeightSpec(name, (prefix + name,), (shape,), combine))
            continue
        # diffusers
        if name.startswith("blocks.") or name.startswith("token_refiner.blocks."):
            head, _, rest = name.partition(".blocks.") if name.startswith("token_refiner.") else ("", "", name[7:])
            index, _, sub = rest.partition(".")
            base = (f"token_refiner.refiner_blocks.{index}." if head else f"transformer_blocks.{index}.")
            if sub == "attn.qkv_proj.weight":
                part = (c.inner_dim, c.hidden_size)
                specs.append(WeightSpec(name, tuple(base + f"attn.to_{x}.weight" for x in "qkv"), (part,) * 3,
                                        cat_rows))
            elif sub == "mlp.fc1.weight":
                specs.append(WeightSpec(name, (base + _diffusers_block_key(sub),), (shape,), swap_halves))
            else:
                specs.append(WeightSpec(name, (base + _diffusers_block_key(sub),), (shape,)))
            continue
        for ours, theirs in _DIFFUSERS_GLOBALS.items():
            if name.startswith(ours):
                specs.append(WeightSpec(name, (theirs + name[len(ours):],), (shape,)))
                break
        else:  # pragma: no cover - the model and this table are kept in step by the tests
            raise AssertionError(f"no diffusers key for {name}")
    return specs


# ---- reading a source -------------------------------------------------------------------------------------------------


def _not_a_transformer(path: Path, keys) -> CheckpointError:
    return not_a_checkpoint(path, keys, "transformer", "an H3 transformer checkpoint: no 'blocks.N...' / "
                                                      "'transformer_blocks.N...' keys")


def _config_from_shapes(path: Path, shape, need) -> H3DiTConfig:
    hidden, patch_dim = need("video_patch_proj.weight")
    head_dim = need("blocks.0.attn.q_norm.weight")[0]
    inner = need("blocks.0.attn.out_proj.weight")[1]
    t_hidden, freq_dim = need("time_embedder.proj_in.weight")
    inv_freq = shape("rope.inv_freq")
    try:
        return H3DiTConfig(
            num_layers=count_indexed(shape, "blocks.{}.norm1.weight"),
            num_refiner_layers=count_indexed(shape, "token_refiner.blocks.{}.norm1.weight"),
            hidden_size=hidden,
            num_attention_heads=inner // head_dim,
            attention_head_dim=head_dim,
            ffn_dim=need("blocks.0.mlp.fc2.weight")[1],
            in_channels=patch_dim // 4,
            audio_in_channels=need("audio_patch_proj.weight")[1],
            text_dim=need("condition_proj.weight")[1],
            freq_dim=freq_dim,
            time_embed_hidden_dim=t_hidden,
            time_embed_dim=need("time_embedder.proj_out.weight")[0],
            # Not recoverable from shapes unless shipped; the released model rotates 3/4 of each head (16 of 128 / 8).
            rope_freq_dim=inv_freq[0] if inv_freq else head_dim // 8,
        )
    except ValueError as exc:
        raise CheckpointError(f"{path}: tensor shapes do not form an H3 transformer: {exc}", path=path) from None


def resolve_dit_checkpoint(source: str | os.PathLike) -> Checkpoint:
    """Find the layout of `source`, read its config and open (but do not read) its tensors."""
    return resolve_source(source, "Give a diffusers or native transformer folder or a ComfyUI .safetensors file.",
                          _resolve_comfy, _resolve_folder, gguf=True)


def _resolve_folder(folder: Path) -> Checkpoint:
    if not (folder / "config.json").is_file() and (folder / "transformer" / "config.json").is_file():
        folder = folder / "transformer"  # the root of a partition or of the official repo
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{folder}: not an H3 transformer folder: no config.json. Expected a diffusers folder (config.json + "
            "diffusion_pytorch_model*.safetensors), a native release folder (config.json + model*.safetensors) or "
            "a ComfyUI .safetensors file.",
            path=folder,
        )
    raw = read_json(config_path)
    class_name = raw.get("_class_name")
    if class_name == DIFFUSERS_CLASS_NAME:
        layout, stem = "diffusers", "diffusion_pytorch_model"
    elif class_name == NATIVE_CLASS_NAME:
        layout, stem = "native", "model"
    else:
        raise CheckpointError(
            f"{config_path}: _class_name is {class_name!r}, not an H3 transformer ('{DIFFUSERS_CLASS_NAME}' or "
            f"'{NATIVE_CLASS_NAME}'). Point at the transformer/ folder of an H3 download.",
            path=config_path,
            key="_class_name",
        )
    config = H3DiTConfig.from_dict(raw, source=config_path)
    files = open_folder_files(folder, stem)
    quantised, _ = detect_quantised(folder, files)  # sizes are read from a quantised weight's dequantised shape
    _check_config_against_header(config, layout, config_path, HeaderSizes(folder, files, "H3 transformer",
                                                                          quantised=quantised))
    return _check(Checkpoint("transformer", folder, layout, config, files, _plan(layout, config)))


def _check_config_against_header(config: H3DiTConfig, layout: str, config_path: Path, sizes: HeaderSizes) -> None:
    """Every size the config implies against the tensor shapes in the headers, before the module is built (building
    it for a config asking 10^9 blocks would never finish)."""
    def key(native: str) -> str:
        if layout != "diffusers":
            return native
        if native.startswith("blocks.0."):
            return "transformer_blocks.0." + _diffusers_block_key(native[len("blocks.0."):])
        ours = next(p for p in _DIFFUSERS_GLOBALS if native.startswith(p))
        return _DIFFUSERS_GLOBALS[ours] + native[len(ours):]

    c = config
    blocks = "transformer_blocks." if layout == "diffusers" else "blocks."
    refiner = "token_refiner.refiner_blocks." if layout == "diffusers" else "token_refiner.blocks."
    name = lambda field: c.config_key(field, layout)  # noqa: E731
    checks = [
        (name("num_layers"), c.num_layers, sizes.count(blocks, "transformer blocks")),
        (name("num_refiner_layers"), c.num_refiner_layers, sizes.count(refiner, "token-refiner blocks")),
        (name("hidden_size"), c.hidden_size, sizes.dim(key("video_patch_proj.weight"), 0)),
    ]
    if c.num_layers:
        checks += [
            (name("attention_head_dim"), c.attention_head_dim, sizes.dim(key("blocks.0.attn.q_norm.weight"), 0)),
            (((name("num_attention_heads"), c.num_attention_heads), (name("attention_head_dim"), c.attention_head_dim)),
             c.inner_dim,
             sizes.dim(key("blocks.0.attn.out_proj.weight"), 1)),
            (name("ffn_dim"), c.ffn_dim, sizes.dim(key("blocks.0.mlp.fc2.weight"), 1)),
        ]
    checks += [
        (((name("in_channels"), c.in_channels), (name("patch_size"), list(c.patch_size))), c.video_patch_dim,
         sizes.dim(key("video_patch_proj.weight"), 1)),
        (name("audio_in_channels"), c.audio_in_channels, sizes.dim(key("audio_patch_proj.weight"), 1)),
        (name("text_dim"), c.text_dim, sizes.dim(key("condition_proj.weight"), 1)),
        (name("freq_dim"), c.freq_dim, sizes.dim(key("time_embedder.proj_in.weight"), 1)),
        (name("time_embed_hidden_dim"), c.time_embed_hidden_dim, sizes.dim(key("time_embedder.proj_in.weight"), 0)),
        (name("time_embed_dim"), c.time_embed_dim, sizes.dim(key("time_embedder.proj_out.weight"), 0)),
    ]
    check_config_sizes(config_path, checks)


def _resolve_comfy(path: Path) -> Checkpoint:
    file = open_weights_file(path)  # a ComfyUI .safetensors repack, or a GGUF file with the same names
    keys = file.keys()
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in keys) else ""
    if any(k.endswith("adaln_t_table") for k in keys):
        raise CheckpointError(
            f"{path}: this is a 'pruned' ComfyUI variant (adaln_t_table replaces the time MLP); it approximates the "
            "released model and is not supported. Use minimax_h3_fl2va_bf16 / minimax_h3_ref2va_bf16.",
            path=path,
            key="adaln_t_table",
        )
    if not any(k.startswith(prefix + "blocks.") for k in keys):
        raise _not_a_transformer(path, keys)
    files = {k: file for k in keys}
    quantised, _ = detect_quantised(path, files)  # sizes are read from a quantised weight's dequantised shape
    config = _config_from_shapes(path, *shape_reader(path, files, "H3 transformer", prefix, quantised))
    # rope.inv_freq is recomputed from rope_theta; a repack may still ship it.
    return _check(Checkpoint("transformer", path, "comfy", config, files, _plan("comfy", config, prefix),
                             allowed_extra={"rope.inv_freq", COMFY_PREFIX + "rope.inv_freq"}))


def _check(ckpt: Checkpoint) -> Checkpoint:
    """Strict key, shape and dtype checks; one error naming the file and key."""
    expected = expected_shapes(ckpt.specs)
    present = set(ckpt.files)
    missing = [k for k in expected if k not in present]
    if missing and not any(k.startswith(("blocks.", "transformer_blocks.", COMFY_PREFIX + "blocks."))
                           for k in present):
        raise _not_a_transformer(ckpt.source, present)
    return ckpt.check(f"a {ckpt.config.num_layers}-block {ckpt.layout} H3 transformer", accept_quantised=True,
                      dtype_rule=f"H3 transformer weights must be bf16, fp16 or fp32; {QUANTISED_NEEDS_FORMAT}. Use "
                                 "minimax_h3_fl2va_bf16 / minimax_h3_ref2va_bf16 or the official transformer/ folder")


# ---- building the module --------------------------------------------------------------------------------------------


def is_fp32_island(name: str) -> bool:
    return name.startswith(FP32_ISLANDS)


def target_dtype(name: str, stored: torch.dtype, dtype: torch.dtype | None,
                 main: torch.dtype | None = None) -> torch.dtype:
    """The fp32 islands are float32 whatever is stored or asked (a repack that saved one's weight in bf16 beside an
    fp32 bias failed the first forward); dtype=None keeps the rest in the file's `main` dtype
    (`Checkpoint.main_dtype`: only a tensor stored otherwise is cast; main None: every tensor as stored); a dtype
    casts everything but the islands."""
    if name == "rope.inv_freq" or is_fp32_island(name):
        return torch.float32
    if dtype is not None:
        return dtype
    return stored if main is None else main


# With layerwise residency: streamed per block (`blocks.N.`), or materialised only for the text phase.
PHASE_SCOPED = {"text": ("condition_proj.", "token_refiner.")}


def _offloaded(name: str) -> bool:
    return name.startswith("blocks.") or any(name.startswith(p) for ps in PHASE_SCOPED.values() for p in ps)


def load_dit(source: str | os.PathLike, *, device="cpu", dtype: torch.dtype | None = None,
             residency: Residency | str = Residency.RESIDENT,
             prefetch: int | None = None,
             resident_blocks: int | list[int] | None = None,
             chunk_size: int | None = None, memory_budget: int | None = None, loras=None) -> H3DiT:
    """Load the H3 transformer from a diffusers folder, a native release folder or a ComfyUI single file.

    `dtype=None` keeps the checkpoint's dtypes (bf16 with fp32 islands for the released weights; a tensor stored in
    another dtype than the file's others is cast to theirs); a dtype casts everything except the fp32 islands (patch
    projections, time MLP, output heads). Resident weights are read into the process's own memory (explicit reads,
    never a view of the memory map), so later changes to the files cannot reach a loaded model.

    `residency="layerwise"` keeps the blocks in a host store (the memory maps themselves on CPU/MPS: no copy and no
    QKV de-interleave at load; pinned slabs on CUDA) and materialises at most `prefetch + 1` of them on the device
    during a forward (`prefetch` default 0, 1 on CUDA); `resident_blocks` (the first N, or indices) stay on the
    device; the text refiner and condition projection are materialised only for the text phase of each forward.
    Each block's AdaLN projection is streamed apart (`model.adaln_residency`: one unit at a time, never kept on the
    device): `h3_core.denoise` reads its outputs from a plan built once per run; a plain forward fetches it per block.

    `loras=[(file, strength), ...]` applies LoRAs (every published H3 format, see `lora_loader`): folded into each
    block when it is materialised, into resident weights once; `h3_core.set_loras(model, ...)` changes them later.
    """
    chunking = ChunkingPolicy(chunk_size, memory_budget)  # checked before any reading
    dtype = compute_dtype(dtype, "transformer")
    device = torch.device(device)
    manager = residency_manager("transformer", device, residency, prefetch, resident_blocks)
    layerwise = manager is not None
    ckpt = resolve_dit_checkpoint(source)
    main = ckpt.main_dtype(is_fp32_island)
    with torch.device("meta"):
        model = H3DiT(ckpt.config)
    recipes: dict[str, HostTensor] = {}
    with closing(FileReader()) as reader:
        for spec in ckpt.specs:
            # The memory-mapped sources and how the parameter is made from them (the combine: QKV de-interleave,
            # ...): the host store of a streamed block, and what a LoRA change re-makes a resident weight from.
            # A quantised weight's recipe holds its stored payloads and dequantises them where it is materialised.
            recipe = ckpt.recipe(spec, lambda stored: target_dtype(spec.name, stored, dtype, main),
                                 _expected_shape(model, spec.name), Platform.for_device(device))
            recipes[spec.name] = recipe
            if layerwise and _offloaded(spec.name):
                set_tensor(model, spec.name, torch.empty(0, dtype=recipe.dtype, device=device))
                continue
            set_tensor(model, spec.name, recipe.resident_value(device, reader))
    if ckpt.layout != "native":
        c = ckpt.config
        model.rope._buffers["inv_freq"] = RotaryEmbedding3D.frequencies(c.rope_freq_dim, c.rope_theta).to(device)
    if layerwise:
        blocks = [(f"blocks.{i}.",) for i in range(len(model.blocks))]
        # Each block's AdaLN projection is a unit of its own (~39 % of the weights): the sampling loop reads its
        # outputs from an AdaLN plan built in one pass before the first step, so it never fetches these units.
        adaln = companion_manager(manager)
        model.block_residency, model.weight_phases = attach_layerwise(
            model, {n: r for n, r in recipes.items() if _offloaded(n)}, manager, blocks=blocks, phases=PHASE_SCOPED,
            device=device, split=(adaln, [(f"blocks.{i}.adaln_proj.",) for i in range(len(model.blocks))]))
        model.adaln_residency = adaln
    model.weight_recipes = {name: r for name, r in recipes.items() if name in dict(model.named_parameters())}
    model.eval()
    model.chunking = chunking
    model.checkpoint_layout = ckpt.layout
    model.checkpoint_files = ckpt.paths
    if loras:
        set_loras(model, loras)
    return model


def _expected_shape(meta_model: nn.Module, name: str) -> tuple[int, ...]:
    owner_name, _, leaf = name.rpartition(".")
    return tuple(getattr(meta_model.get_submodule(owner_name), leaf).shape)

