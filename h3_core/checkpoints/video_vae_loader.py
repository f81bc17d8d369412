"""Load the H3 video VAE from any of its three checkpoint layouts.

* **diffusers** `vae/`: `config.json` (`AutoencoderKLMiniMaxH3`, with `latents_mean` / `latents_std`) and
  `diffusion_pytorch_model*.safetensors`; renamed modules, separate `to_q/to_k/to_v`, feed-forward rows `[value; gate]`.
* **native** `video_vae/`: wrapper `config.json` (`latents_mean` / `latents_std`, tile and clip settings) and
  `source/config.json` + `source/model.safetensors`; fused QKV per head interleaved, feed-forward rows `[gate; value]`,
  an unused `decoder.mask_token`.
* **comfy** single file (`minimax_h3_video_vae_fp16.safetensors`): native names and order, fp16; sizes read from the
  tensor shapes; latent statistics from its `latents_mean` / `latents_std` buffers, else the published constants.

Every key, shape and dtype is checked before anything is placed; each problem raises one `CheckpointError` naming the
file and key. The weights are always float32 (fp16 files are upcast exactly).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..models.video_vae import PUBLISHED_LATENTS_MEAN as VIDEO_PUBLISHED_MEAN
from ..models.video_vae import PUBLISHED_LATENTS_STD as VIDEO_PUBLISHED_STD
from ..models.video_vae import DecodeAutocast, TilingOptions, VideoVAE, VideoVAEConfig
from ..runtime.platform import Platform
from ..runtime.residency import Residency
from .checkpoint import (Checkpoint, HeaderSizes, WeightSpec, cat_rows, check_config_sizes, count_indexed,
                         deinterleave_rows, not_a_checkpoint, open_folder_files, read_json, resolve_source,
                         shape_reader, swap_halves)
from .vae_common import (check_vae, config_error, count_value, int_list, latent_stats, open_single_file, open_vae,
                         populate, positive_number, require_value, state_shapes, stats_from_file, weights_folder)

VIDEO_DIFFUSERS_CLASS = "AutoencoderKLMiniMaxH3"
VIDEO_DETECT_KEYS = ("decoder.transformer_blocks.0.scale1", "encoder.down.0.block.0.conv1.weight")
NATIVE_HEAD_DIM = 64  # released decoder head width; not recoverable from a ComfyUI file's shapes


def _diffusers_video_key(name: str) -> str:
    """Our (native) parameter name -> the diffusers `AutoencoderKLMiniMaxH3` name (single-tensor cases)."""
    parts = name.split(".")
    if parts[:2] == ["encoder", "down"]:
        level, rest = parts[2], parts[3:]
        if rest[0] == "block":
            sub = ["conv_shortcut" if rest[2] == "nin_shortcut" else rest[2]] + rest[3:]
            return ".".join(["encoder", "down_blocks", level, "resnets", rest[1], *sub])
        return ".".join(["encoder", "down_blocks", level, "downsamplers", "0", *rest[1:]])
    if name.startswith("decoder.x_embedder."):
        return "decoder.proj_in." + parts[-1]
    if name.startswith("decoder.transformer_blocks."):
        base, sub = ".".join(parts[:3]), ".".join(parts[3:])
        sub = {"attn.to_out.weight": "attn.to_out.0.weight", "attn.to_out.bias": "attn.to_out.0.bias",
               "ff.w1.weight": "ff.net.0.proj.weight", "ff.w1.bias": "ff.net.0.proj.bias",
               "ff.w2.weight": "ff.net.2.weight", "ff.w2.bias": "ff.net.2.bias"}.get(sub, sub)
        return f"{base}.{sub}"
    return name


def _video_plan(layout: str, config: VideoVAEConfig, prefix: str = "") -> list[WeightSpec]:
    c = config
    specs = []
    inner = c.decoder_num_heads * c.decoder_head_dim
    for name, shape in state_shapes(VideoVAE, config).items():
        if layout in ("native", "comfy"):
            combine = deinterleave_rows(c.decoder_num_heads, c.decoder_head_dim) if ".attn.to_qkv." in name else None
            specs.append(WeightSpec(name, (prefix + name,), (shape,), combine))
        elif ".attn.to_qkv." in name:
            base, kind = name.rsplit(".to_qkv.", 1)
            part = (inner,) + shape[1:]
            specs.append(WeightSpec(name, tuple(f"{base}.to_{x}.{kind}" for x in "qkv"), (part,) * 3, cat_rows))
        elif ".ff.w1." in name:
            # diffusers stores the SwiGLU input rows [value; gate]; the model wants [gate; value].
            specs.append(WeightSpec(name, (_diffusers_video_key(name),), (shape,), swap_halves))
        else:
            specs.append(WeightSpec(name, (_diffusers_video_key(name),), (shape,)))
    return specs


def _video_config_from_diffusers(raw: dict, path: Path) -> VideoVAEConfig:
    require_value(raw, "spatial_padding_mode", "reflect", path, "the released encoder pads space by reflection")
    require_value(raw, "in_channels", 3, path, "RGB input")
    require_value(raw, "out_channels", 3, path, "RGB output")
    stats = latent_stats(raw, path, raw.get("latent_channels", 24), required=True)
    heads = positive_number(raw, "decoder_num_attention_heads", 32, path)
    head_dim = positive_number(raw, "decoder_attention_head_dim", 64, path)
    try:
        return VideoVAEConfig(
            latent_channels=positive_number(raw, "latent_channels", 24, path),
            block_out_channels=int_list(raw, "block_out_channels", (128, 256, 256, 512, 512, 1024), path),
            layers_per_block=positive_number(raw, "layers_per_block", 2, path),
            spatial_downsample_factors=int_list(raw, "spatial_downsample_factors", (2, 2, 2, 2, 1, 1), path),
            temporal_downsample_factors=int_list(raw, "temporal_downsample_factors", (1, 2, 2, 1, 1, 1), path),
            norm_num_groups=positive_number(raw, "norm_num_groups", 32, path),
            norm_eps=positive_number(raw, "norm_eps", 1e-6, path, float),
            decoder_num_layers=positive_number(raw, "decoder_num_layers", 36, path),
            decoder_num_heads=heads,
            decoder_head_dim=head_dim,
            decoder_ffn_dim=int(heads * head_dim * positive_number(raw, "decoder_ffn_mult", 4, path, float)),
            decoder_num_register_tokens=positive_number(raw, "decoder_num_register_tokens", 4, path),
            decoder_rope_theta=positive_number(raw, "decoder_rope_theta", 100.0, path, float),
            decoder_rope_dim_ratio=positive_number(raw, "decoder_rope_dim_ratio", 0.75, path, float),
            decoder_norm_eps=positive_number(raw, "decoder_norm_eps", 1e-5, path, float),
            clip_length=positive_number(raw, "clip_length", 17, path),
            token_drop=count_value(raw, "token_drop", 3, path),
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise config_error(path, exc) from None


def _video_config_from_native(wrapper: dict, wrapper_path: Path, source: dict, source_path: Path,
                              shape) -> VideoVAEConfig:
    for key, value, why in (("padding_mode", "reflect", "the released encoder pads space by reflection"),
                            ("use_t_isolated_gn", True, "per-frame GroupNorm"),
                            ("causal_encoder", True, "the released encoder is causal"),
                            ("use_vit_decoder", True, "the released decoder is a ViT"),
                            ("use_3d_conv", True, "3-D convolutions"),
                            ("in_channels", 3, "RGB input"), ("out_ch", 3, "RGB output")):
        require_value(source, key, value, source_path, why)
    z_channels = positive_number(source, "z_channels", 24, source_path)
    if source.get("embed_dim", z_channels) != z_channels:
        raise CheckpointError(f"{source_path}: embed_dim {source.get('embed_dim')} differs from z_channels "
                              f"{z_channels}; only equal values are supported.", path=source_path, key="embed_dim")
    ch = positive_number(source, "ch", 128, source_path)
    mult = int_list(source, "ch_mult", (1, 2, 2, 4, 4, 8), source_path)
    blocks = source.get("num_res_blocks", 2)
    if isinstance(blocks, list):
        if len(set(blocks)) != 1:
            raise CheckpointError(f"{source_path}: num_res_blocks {blocks} differs between levels; only one count "
                                  "for every level is supported.", path=source_path, key="num_res_blocks")
        blocks = blocks[0]
    blocks = positive_number({"num_res_blocks": blocks}, "num_res_blocks", None, source_path)
    vit = source.get("vit_decoder_kwargs") or {}
    if not isinstance(vit, dict):
        raise CheckpointError(f"{source_path}: 'vit_decoder_kwargs' must be an object.", path=source_path,
                              key="vit_decoder_kwargs")
    heads = positive_number(vit, "heads", 32, source_path)
    head_dim = positive_number(vit, "dim_head", 64, source_path)
    stats = latent_stats(wrapper, wrapper_path, z_channels, required=True)
    ffn = shape("decoder.transformer_blocks.0.ff.w2.weight")
    registers = shape("decoder.register_tokens")
    try:
        return VideoVAEConfig(
            latent_channels=z_channels,
            block_out_channels=tuple(ch * m for m in mult),
            layers_per_block=blocks,
            spatial_downsample_factors=int_list(source, "space_down", (2, 2, 2, 2, 1, 1), source_path),
            temporal_downsample_factors=int_list(source, "time_down", (1, 2, 2, 1, 1, 1), source_path),
            decoder_num_layers=positive_number(vit, "num_layers", 36, source_path),
            decoder_num_heads=heads,
            decoder_head_dim=head_dim,
            decoder_ffn_dim=ffn[1] if ffn else 4 * heads * head_dim,
            decoder_num_register_tokens=registers[1] if registers else positive_number(vit, "num_register_tokens", 4,
                                                                               source_path),
            decoder_rope_theta=positive_number(vit, "rope_theta", 100.0, source_path, float),
            decoder_rope_dim_ratio=positive_number(vit, "rope_dim_ratio", 0.75, source_path, float),
            decoder_norm_eps=positive_number(vit, "eps", 1e-5, source_path, float),
            clip_length=positive_number(wrapper, "vae_clip_length", source.get("clip_length", 17), wrapper_path),
            token_drop=count_value(wrapper, "vae_token_drop", source.get("token_drop", 3), wrapper_path),
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise config_error(source_path, exc) from None


def _video_config_from_shapes(path: Path, shape, need, stats) -> VideoVAEConfig:
    defaults = VideoVAEConfig()
    levels = count_indexed(shape, "encoder.down.{}.block.0.conv1.weight")
    if levels != len(defaults.block_out_channels):
        raise CheckpointError(f"{path}: {levels} encoder levels; the released layout has "
                              f"{len(defaults.block_out_channels)} and a single file does not say how the others "
                              "downsample.", path=path)
    for i, (s, t) in enumerate(zip(defaults.spatial_downsample_factors, defaults.temporal_downsample_factors)):
        has = shape(f"encoder.down.{i}.downsample.conv.weight") is not None
        if has != (s * t > 1):
            key = f"encoder.down.{i}.downsample.conv.weight"
            raise CheckpointError(f"{path}: encoder level {i} {'has' if has else 'lacks'} a downsample convolution, "
                                  "unlike the released layout.", path=path, key=key)
    dim = need("decoder.x_embedder.weight")[0]
    if dim % NATIVE_HEAD_DIM:
        raise CheckpointError(f"{path}: decoder width {dim} is not a multiple of the {NATIVE_HEAD_DIM}-wide heads.",
                              path=path, key="decoder.x_embedder.weight")
    try:
        return VideoVAEConfig(
            in_channels=need("encoder.conv_in.weight")[1],
            latent_channels=need("post_quant_conv.weight")[0],
            block_out_channels=tuple(need(f"encoder.down.{i}.block.0.conv1.weight")[0] for i in range(levels)),
            layers_per_block=count_indexed(shape, "encoder.down.0.block.{}.conv1.weight"),
            decoder_num_layers=count_indexed(shape, "decoder.transformer_blocks.{}.scale1"),
            decoder_num_heads=dim // NATIVE_HEAD_DIM,
            decoder_head_dim=NATIVE_HEAD_DIM,
            decoder_ffn_dim=need("decoder.transformer_blocks.0.ff.w2.weight")[1],
            decoder_num_register_tokens=need("decoder.register_tokens")[1],
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise config_error(path, exc) from None


# How each layout's config.json spells the sizes checked against the weights.
_VIDEO_CONFIG_KEYS = {
    "diffusers": dict(levels="block_out_channels (their number)", width="block_out_channels[{}]",
                      blocks="layers_per_block", latent="latent_channels", layers="decoder_num_layers",
                      dim=("decoder_num_attention_heads", "decoder_attention_head_dim"),
                      ffn="decoder_ffn_mult", registers="decoder_num_register_tokens"),
    "native": dict(levels="ch_mult (their number)", width="ch x ch_mult[{}]", blocks="num_res_blocks",
                   latent="z_channels", layers="vit_decoder_kwargs.num_layers",
                   dim=("vit_decoder_kwargs.heads", "vit_decoder_kwargs.dim_head"), ffn="decoder feed-forward multiple",
                   registers="vit_decoder_kwargs.num_register_tokens"),
}


def _check_video_config_against_header(config: VideoVAEConfig, layout: str, config_path: Path,
                                       sizes: HeaderSizes) -> None:
    """The sizes the config implies against the tensor shapes, before the module is built (a config asking 10^6
    decoder blocks would take hours to build)."""
    names = _VIDEO_CONFIG_KEYS[layout]
    key = (lambda name: _diffusers_video_key(name)) if layout == "diffusers" else (lambda name: name)
    down = "encoder.down_blocks." if layout == "diffusers" else "encoder.down."
    c = config
    checks = [(names["levels"], len(c.block_out_channels), sizes.count(down, "encoder levels"))]
    check_config_sizes(config_path, checks)
    checks = [(names["width"].format(i), width, sizes.dim(key(f"encoder.down.{i}.block.0.conv1.weight"), 0))
              for i, width in enumerate(c.block_out_channels)]
    resnets = "encoder.down_blocks.0.resnets." if layout == "diffusers" else "encoder.down.0.block."
    checks += [
        (names["blocks"], c.layers_per_block, sizes.count(resnets, "blocks in encoder level 0")),
        (names["latent"], c.latent_channels, sizes.dim("post_quant_conv.weight", 0)),
        (names["layers"], c.decoder_num_layers, sizes.count("decoder.transformer_blocks.", "decoder blocks")),
        (((names["dim"][0], c.decoder_num_heads), (names["dim"][1], c.decoder_head_dim)), c.decoder_dim,
         sizes.dim(key("decoder.x_embedder.weight"), 0)),
        (names["registers"], c.decoder_num_register_tokens, sizes.dim("decoder.register_tokens", 1)),
    ]
    check_config_sizes(config_path, checks)
    if c.decoder_num_layers:  # as the multiple of the width the config gives (the width itself is checked above)
        ffn, where = sizes.dim(key("decoder.transformer_blocks.0.ff.w2.weight"), 1)
        check_config_sizes(config_path, [(names["ffn"], c.decoder_ffn_dim / c.decoder_dim,
                                          (ffn / c.decoder_dim, where))])


def _find_video_folder(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    for name in ("vae", "video_vae", "visual_vae"):  # repo root (diffusers) or a release partition (native)
        if (folder / name / "config.json").is_file():
            return folder / name
    raise CheckpointError(
        f"{folder}: not an H3 video VAE folder: no config.json. Expected a diffusers vae/ folder, a native video_vae/ "
        "folder (config.json + source/) or a ComfyUI .safetensors file.", path=folder)


def resolve_video_vae_checkpoint(source: str | os.PathLike) -> Checkpoint:
    """Find the layout of `source`, read its config and open (but do not read) its tensors."""
    return resolve_source(source, "Give a diffusers vae/ folder, a native video_vae/ folder or a ComfyUI "
                          "minimax_h3_video_vae_*.safetensors file.", _resolve_video_single_file,
                          _resolve_video_folder, owning_folder=weights_folder)


def _resolve_video_folder(path: Path) -> Checkpoint:
    if path.name == "source" and (path.parent / "config.json").is_file():
        path = path.parent
    folder = _find_video_folder(path)
    raw = read_json(folder / "config.json")
    if raw.get("_class_name") == VIDEO_DIFFUSERS_CLASS:
        config = _video_config_from_diffusers(raw, folder / "config.json")
        files = open_folder_files(folder, "diffusion_pytorch_model")
        _check_video_config_against_header(config, "diffusers", folder / "config.json", HeaderSizes(
            folder, files, "H3 video VAE"))
        ckpt = Checkpoint("video_vae", folder, "diffusers", config, files, _video_plan("diffusers", config))
        return check_vae(ckpt, _video_describe(ckpt), accept_quantised=True)
    source_name = raw.get("source_path", "source")
    if not isinstance(source_name, str) or Path(source_name).name != source_name:
        source_name = "source"
    source_folder = folder / source_name
    if not (source_folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder}: config.json is neither a diffusers '{VIDEO_DIFFUSERS_CLASS}' config nor a native wrapper "
            f"with a '{source_name}/config.json' beside it. Point at the vae/ (diffusers) or video_vae/ (native) "
            "folder.",
            path=folder / "config.json", key="_class_name")
    source_raw = read_json(source_folder / "config.json")
    files = open_folder_files(source_folder, "model")
    if not all(k in files for k in VIDEO_DETECT_KEYS):
        raise not_a_checkpoint(source_folder, files.keys(), "video_vae", "an H3 video VAE checkpoint")
    shape, _ = shape_reader(source_folder, files, "H3 VAE")
    config = _video_config_from_native(raw, folder / "config.json", source_raw, source_folder / "config.json", shape)
    _check_video_config_against_header(config, "native", source_folder / "config.json",
                                       HeaderSizes(source_folder, files, "H3 video VAE"))
    defaults = {}
    for ours, theirs in (("tile_size", "vae_tile_size"), ("tile_min_overlap", "vae_tile_overlap_min")):
        if theirs in raw:
            defaults[ours] = positive_number(raw, theirs, None, folder / "config.json")
    ckpt = Checkpoint("video_vae", folder, "native", config, files, _video_plan("native", config),
                      allowed_extra={"decoder.mask_token"}, defaults=defaults)
    return check_vae(ckpt, _video_describe(ckpt), accept_quantised=True)


def _resolve_video_single_file(path: Path) -> Checkpoint:
    file, prefix = open_single_file(path)
    if not all(prefix + k in file for k in VIDEO_DETECT_KEYS):
        raise not_a_checkpoint(path, file.keys(), "video_vae", "an H3 video VAE checkpoint")
    files = {k: file for k in file.keys()}
    shape, need = shape_reader(path, files, "H3 VAE", prefix)
    stats, stat_keys = stats_from_file(file, prefix, need("post_quant_conv.weight")[0],
                                       (VIDEO_PUBLISHED_MEAN, VIDEO_PUBLISHED_STD))
    config = _video_config_from_shapes(path, shape, need, stats)
    ckpt = Checkpoint("video_vae", path, "comfy", config, files, _video_plan("comfy", config, prefix),
                      allowed_extra={prefix + "decoder.mask_token"} | stat_keys)
    return check_vae(ckpt, _video_describe(ckpt), accept_quantised=True)


def _video_describe(ckpt: Checkpoint) -> str:
    c = ckpt.config
    return (f"a {ckpt.layout} H3 video VAE ({len(c.block_out_channels)} encoder levels, {c.decoder_num_layers} decoder "
            f"blocks of width {c.decoder_dim})")



# Materialised only while `encode` runs when loaded layerwise (the decoder's blocks stream instead).
VIDEO_PHASE_SCOPED = {"encoder": ("encoder.", "quant_conv.")}


def load_video_vae(source: str | os.PathLike, *, device="cpu", dtype: torch.dtype | None = None,
                   residency: Residency | str = Residency.RESIDENT, prefetch: int | None = None,
                   resident_blocks: int | list[int] | None = None, tiling: bool = True, tile_size: int | None = None,
                   tile_min_overlap: int | None = None, decode_autocast=None) -> VideoVAE:
    """Load the H3 video VAE from a diffusers `vae/` folder, a native `video_vae/` folder or a ComfyUI single file.

    `tiling` (default True: the released frames are tiled ones), `tile_size` / `tile_min_overlap` in pixels
    (default 256 / 64, or the native config's values), `decode_autocast` (default: fp16 on CUDA only).
    Weights are float32, read into the process's own memory (resident) or streamed from the files (layerwise).

    `residency="layerwise"` streams the ViT decoder's transformer blocks (one pass per decoded tile): they stay in
    the memory maps and are upcast / de-interleaved when materialised; at most `prefetch + 1` are on the device
    (`prefetch` default 0, 1 on CUDA), `resident_blocks` (the first N, or indices) stay there. The CNN encoder and
    quant_conv are materialised only during `encode` (phase "encoder"). `vae.close()` releases it.
    """
    device, manager, ckpt = open_vae("video_vae", source, resolve_video_vae_checkpoint, dtype=dtype, device=device,
                                     residency=residency, prefetch=prefetch, resident_blocks=resident_blocks)
    tiles = TilingOptions(
        enabled=bool(tiling),
        tile_size=tile_size or ckpt.defaults.get("tile_size", 256),
        min_overlap=tile_min_overlap or ckpt.defaults.get("tile_min_overlap", 64),
    )
    tiles.check(ckpt.config.spatial_ratio)
    autocast = DecodeAutocast(device.type,
                              Platform.for_device(device).decode_autocast_dtype(decode_autocast))
    with torch.device("meta"):
        model = VideoVAE(ckpt.config, tiles, autocast)
    blocks = [(f"decoder.transformer_blocks.{i}.",) for i in range(ckpt.config.decoder_num_layers)]
    populate(model, ckpt, device, manager, blocks, VIDEO_PHASE_SCOPED)
    return model
