"""Load the H3 video and audio VAEs from any of their three checkpoint layouts.

Video VAE
* **diffusers** `vae/`: `config.json` (`AutoencoderKLMiniMaxH3`, with `latents_mean` / `latents_std`) and
  `diffusion_pytorch_model*.safetensors`; renamed modules, separate `to_q/to_k/to_v`, feed-forward rows `[value; gate]`.
* **native** `video_vae/`: wrapper `config.json` (`latents_mean` / `latents_std`, tile and clip settings) and
  `source/config.json` + `source/model.safetensors`; fused QKV per head interleaved, feed-forward rows `[gate; value]`,
  an unused `decoder.mask_token`.
* **comfy** single file (`minimax_h3_video_vae_fp16.safetensors`): native names and order, fp16; sizes read from the
  tensor shapes; latent statistics from its `latents_mean` / `latents_std` buffers, else the published constants.

Audio VAE
* **diffusers** `audio_vae/`: `config.json` (`AutoencoderKLMiniMaxH3Audio`) + `diffusion_pytorch_model*.safetensors`.
* **native** `audio_vae/`: `model.safetensors`, `config.json` (latent statistics), `metadata.json` (constructor
  arguments).
  Both store weight-normed convolutions as `weight_g` / `weight_v` pairs (or the `parametrizations.weight.original0/1`
  spelling), folded here into `weight` with the kernel weight norm itself uses.
* **comfy** single file (`minimax_h3_audio_vae_fp32.safetensors`): same names, weight norm already folded.

Every key, shape and dtype is checked before anything is placed; each problem raises one `CheckpointError` naming the
file and key. VAE weights are always float32 (fp16 files are upcast exactly).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from ..runtime.admission import ComponentPlan, check_admission
from ..runtime.platform import Platform
from ..models.audio_vae import (PUBLISHED_LATENTS_MEAN as AUDIO_PUBLISHED_MEAN, PUBLISHED_LATENTS_STD as AUDIO_PUBLISHED_STD,
                        WEIGHT_NORM_MODULES, AudioVAE, AudioVAEConfig, fold_weight_norm)
from .checkpoint import (WeightSpec, cat_rows, check_tensors, deinterleave_rows, expected_shapes, open_folder_files,
                         read_json, set_tensor, swap_halves)
from ..errors import CheckpointError, H3Error
from ..runtime.host_store import HostTensor
from ..runtime.layerwise import LayerwiseOffloadManager, layerwise_manager
from ..runtime.residency import Residency
from .placement import attach_layerwise
from .safetensors_io import SafetensorsFile, refuse_pickle
from ..models.video_vae import (PUBLISHED_LATENTS_MEAN as VIDEO_PUBLISHED_MEAN, PUBLISHED_LATENTS_STD as VIDEO_PUBLISHED_STD,
                        DecodeAutocast, TilingOptions, VideoVAE, VideoVAEConfig)

VIDEO_DIFFUSERS_CLASS = "AutoencoderKLMiniMaxH3"
AUDIO_DIFFUSERS_CLASS = "AutoencoderKLMiniMaxH3Audio"
# Prefixes a single-file VAE may carry when cut out of a combined checkpoint.
COMFY_PREFIXES = ("vae.", "first_stage_model.")
VIDEO_DETECT_KEYS = ("decoder.transformer_blocks.0.scale1", "encoder.down.0.block.0.conv1.weight")
AUDIO_DETECT_KEY = "pre_block.attn.zero_k_bias"
NATIVE_HEAD_DIM = 64  # released decoder head width; not recoverable from a ComfyUI file's shapes
WEIGHT_NORM_SPELLINGS = (("weight_g", "weight_v"), ("parametrizations.weight.original0",
                                                    "parametrizations.weight.original1"))


@dataclass
class VAECheckpoint:
    """A resolved, validated VAE checkpoint: layout, config, where every source key lives, and loader defaults."""

    kind: str  # "video" or "audio"
    source: Path
    layout: str
    config: VideoVAEConfig | AudioVAEConfig
    files: dict[str, SafetensorsFile]
    specs: list[WeightSpec]
    allowed_extra: set[str] = field(default_factory=set)
    defaults: dict = field(default_factory=dict)

    def weight(self, spec: WeightSpec) -> torch.Tensor:
        tensors = [self.files[k].tensor(k) for k in spec.keys]
        return spec.combine(*tensors) if spec.combine else tensors[0]

    @property
    def paths(self) -> list[Path]:
        return sorted({f.path for f in self.files.values()})


# ---- shared helpers --------------------------------------------------------------------------------------------------


def _expected(model_cls, config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = model_cls(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _stats(raw: dict, path: Path, channels: int, required: bool):
    """`latents_mean` / `latents_std` from a config dict: `channels` floats each."""
    values = []
    for key in ("latents_mean", "latents_std"):
        value = raw.get(key)
        if value is None and not required:
            return None
        if (not isinstance(value, (list, tuple)) or len(value) != channels
                or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)):
            raise CheckpointError(
                f"{path}: '{key}' must be a list of {channels} numbers (the per-channel latent statistics), got "
                f"{str(value)[:60]}. Restore the config.json of the release.", path=path, key=key)
        values.append(tuple(float(v) for v in value))
    return tuple(values)


def _int_list(raw: dict, key: str, default, path: Path) -> tuple[int, ...]:
    value = raw.get(key, default)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and v > 0 for v in value):
        raise CheckpointError(f"{path}: '{key}' must be a list of positive integers, got {value!r}.", path=path,
                              key=key)
    return tuple(value)


def _number(raw: dict, key: str, default, path: Path, kind=int):
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)) \
            or value <= 0:
        raise CheckpointError(f"{path}: '{key}' must be a positive {kind.__name__}, got {value!r}.", path=path, key=key)
    return kind(value)


def _count_value(raw: dict, key: str, default, path: Path) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{path}: '{key}' must be a non-negative integer, got {value!r}.", path=path, key=key)
    return value


def _require(raw: dict, key: str, expected, path: Path, why: str) -> None:
    if key in raw and raw[key] != expected:
        raise CheckpointError(f"{path}: '{key}' is {raw[key]!r}; only {expected!r} is supported ({why}).", path=path,
                              key=key)


def _config_error(path: Path, exc: ValueError) -> CheckpointError:
    return CheckpointError(f"{path}: the configuration does not describe a valid H3 VAE: {exc}", path=path)


def _single_file(path: Path) -> tuple[SafetensorsFile, str]:
    """Open a single-file checkpoint and find its key prefix (none, `vae.` or `first_stage_model.`)."""
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path}: expected a .safetensors file or a checkpoint folder.", path=path)
    file = SafetensorsFile(path)
    for prefix in COMFY_PREFIXES:
        if any(k.startswith(prefix) for k in file.keys()):
            return file, prefix
    return file, ""


def _what_is_it(keys) -> str:
    keys = list(keys)
    if any(k.startswith(("decoder.proj_in.", "encoder.down_blocks.")) for k in keys):
        return " It is a diffusers-layout video VAE file; pass the folder holding it and its config.json."
    if any(k.startswith(("blocks.", "model.diffusion_model.", "transformer_blocks.")) for k in keys) and not any(
            k.startswith(("decoder.", "encoder.")) for k in keys):
        return " It looks like a transformer checkpoint; pass it to load_dit instead."
    if any(k.endswith(AUDIO_DETECT_KEY) for k in keys):
        return " It looks like an audio VAE checkpoint; pass it to load_audio_vae instead."
    if any(k.endswith("scale1") and "transformer_blocks" in k for k in keys):
        return " It looks like a video VAE checkpoint; pass it to load_video_vae instead."
    if any(k.startswith(("model.layers.", "visual.", "language_model.")) for k in keys):
        return " It looks like a text encoder checkpoint."
    return ""


def _weights_folder(path: Path) -> Path | None:
    """The checkpoint folder a weights file belongs to, when `path` is the weights file of a folder layout."""
    if path.name.startswith("diffusion_pytorch_model") and (path.parent / "config.json").is_file():
        return path.parent
    if path.name.startswith("model") and (path.parent / "metadata.json").is_file():
        return path.parent  # native audio_vae/
    if path.name.startswith("model") and (path.parent.parent / "config.json").is_file() and \
            (path.parent / "config.json").is_file():
        return path.parent.parent  # native video_vae/source/
    return None


def _not_a(kind: str, path: Path, keys) -> CheckpointError:
    sample = sorted(keys)[:3]
    return CheckpointError(
        f"{path}: not an H3 {kind} VAE checkpoint (found {', '.join(sample) or 'no tensors'}"
        f"{' ...' if len(keys) > 3 else ''}).{_what_is_it(keys)}", path=path)


def _check(ckpt: VAECheckpoint, describe: str) -> VAECheckpoint:
    """Strict key, shape and dtype checks; one error naming the file and key."""
    check_tensors(ckpt.source, ckpt.files, expected_shapes(ckpt.specs), describe, ignore=ckpt.allowed_extra.__contains__,
                  dtype_rule="VAE weights must be floating point (fp32, fp16 or bf16). Quantised integer variants are "
                             "not supported")
    return ckpt


def _count(shape: Callable[[str], tuple | None], pattern: str) -> int:
    n = 0
    while shape(pattern.format(n)) is not None:
        n += 1
    return n


def _shape_reader(path: Path, file: SafetensorsFile, prefix: str):
    def shape(key):
        key = prefix + key
        return file.shape(key) if key in file else None

    def need(key):
        s = shape(key)
        if s is None:
            raise CheckpointError(f"{path}: missing key '{prefix + key}', needed to read the model size; the file is "
                                  "not a complete H3 VAE.", path=path, key=prefix + key)
        return s

    return shape, need


def _stats_from_file(file: SafetensorsFile, prefix: str, channels: int, published):
    """Latent statistics stored in a single file as `latents_mean` / `latents_std` buffers, else `published`."""
    keys = (prefix + "latents_mean", prefix + "latents_std")
    if not all(k in file for k in keys):
        return published, set()
    for key in keys:
        if file.shape(key) != (channels,) or not file.dtype(key).is_floating_point:
            raise CheckpointError(f"{file.path}: '{key}' must be {channels} floats (the latent statistics), got "
                                  f"{str(file.dtype(key)).replace('torch.', '')} {list(file.shape(key))}.",
                                  path=file.path, key=key)
    mean, std = (tuple(float(v) for v in file.tensor(k).double().tolist()) for k in keys)
    return (mean, std), set(keys)


# ---- video VAE -------------------------------------------------------------------------------------------------------


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
    for name, shape in _expected(VideoVAE, config).items():
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
    _require(raw, "spatial_padding_mode", "reflect", path, "the released encoder pads space by reflection")
    _require(raw, "in_channels", 3, path, "RGB input")
    _require(raw, "out_channels", 3, path, "RGB output")
    stats = _stats(raw, path, raw.get("latent_channels", 24), required=True)
    heads = _number(raw, "decoder_num_attention_heads", 32, path)
    head_dim = _number(raw, "decoder_attention_head_dim", 64, path)
    try:
        return VideoVAEConfig(
            latent_channels=_number(raw, "latent_channels", 24, path),
            block_out_channels=_int_list(raw, "block_out_channels", (128, 256, 256, 512, 512, 1024), path),
            layers_per_block=_number(raw, "layers_per_block", 2, path),
            spatial_downsample_factors=_int_list(raw, "spatial_downsample_factors", (2, 2, 2, 2, 1, 1), path),
            temporal_downsample_factors=_int_list(raw, "temporal_downsample_factors", (1, 2, 2, 1, 1, 1), path),
            norm_num_groups=_number(raw, "norm_num_groups", 32, path),
            norm_eps=_number(raw, "norm_eps", 1e-6, path, float),
            decoder_num_layers=_number(raw, "decoder_num_layers", 36, path),
            decoder_num_heads=heads,
            decoder_head_dim=head_dim,
            decoder_ffn_dim=int(heads * head_dim * _number(raw, "decoder_ffn_mult", 4, path, float)),
            decoder_num_register_tokens=_number(raw, "decoder_num_register_tokens", 4, path),
            decoder_rope_theta=_number(raw, "decoder_rope_theta", 100.0, path, float),
            decoder_rope_dim_ratio=_number(raw, "decoder_rope_dim_ratio", 0.75, path, float),
            decoder_norm_eps=_number(raw, "decoder_norm_eps", 1e-5, path, float),
            clip_length=_number(raw, "clip_length", 17, path),
            token_drop=_count_value(raw, "token_drop", 3, path),
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise _config_error(path, exc) from None


def _video_config_from_native(wrapper: dict, wrapper_path: Path, source: dict, source_path: Path,
                              shape) -> VideoVAEConfig:
    for key, value, why in (("padding_mode", "reflect", "the released encoder pads space by reflection"),
                            ("use_t_isolated_gn", True, "per-frame GroupNorm"),
                            ("causal_encoder", True, "the released encoder is causal"),
                            ("use_vit_decoder", True, "the released decoder is a ViT"),
                            ("use_3d_conv", True, "3-D convolutions"),
                            ("in_channels", 3, "RGB input"), ("out_ch", 3, "RGB output")):
        _require(source, key, value, source_path, why)
    z_channels = _number(source, "z_channels", 24, source_path)
    if source.get("embed_dim", z_channels) != z_channels:
        raise CheckpointError(f"{source_path}: embed_dim {source.get('embed_dim')} differs from z_channels "
                              f"{z_channels}; only equal values are supported.", path=source_path, key="embed_dim")
    ch = _number(source, "ch", 128, source_path)
    mult = _int_list(source, "ch_mult", (1, 2, 2, 4, 4, 8), source_path)
    blocks = source.get("num_res_blocks", 2)
    if isinstance(blocks, list):
        if len(set(blocks)) != 1:
            raise CheckpointError(f"{source_path}: num_res_blocks {blocks} differs between levels; only one count "
                                  "for every level is supported.", path=source_path, key="num_res_blocks")
        blocks = blocks[0]
    vit = source.get("vit_decoder_kwargs") or {}
    if not isinstance(vit, dict):
        raise CheckpointError(f"{source_path}: 'vit_decoder_kwargs' must be an object.", path=source_path,
                              key="vit_decoder_kwargs")
    heads = _number(vit, "heads", 32, source_path)
    head_dim = _number(vit, "dim_head", 64, source_path)
    stats = _stats(wrapper, wrapper_path, z_channels, required=True)
    ffn = shape("decoder.transformer_blocks.0.ff.w2.weight")
    registers = shape("decoder.register_tokens")
    try:
        return VideoVAEConfig(
            latent_channels=z_channels,
            block_out_channels=tuple(ch * m for m in mult),
            layers_per_block=blocks,
            spatial_downsample_factors=_int_list(source, "space_down", (2, 2, 2, 2, 1, 1), source_path),
            temporal_downsample_factors=_int_list(source, "time_down", (1, 2, 2, 1, 1, 1), source_path),
            decoder_num_layers=_number(vit, "num_layers", 36, source_path),
            decoder_num_heads=heads,
            decoder_head_dim=head_dim,
            decoder_ffn_dim=ffn[1] if ffn else 4 * heads * head_dim,
            decoder_num_register_tokens=registers[1] if registers else _number(vit, "num_register_tokens", 4,
                                                                               source_path),
            decoder_rope_theta=_number(vit, "rope_theta", 100.0, source_path, float),
            decoder_rope_dim_ratio=_number(vit, "rope_dim_ratio", 0.75, source_path, float),
            decoder_norm_eps=_number(vit, "eps", 1e-5, source_path, float),
            clip_length=_number(wrapper, "vae_clip_length", source.get("clip_length", 17), wrapper_path),
            token_drop=_count_value(wrapper, "vae_token_drop", source.get("token_drop", 3), wrapper_path),
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise _config_error(source_path, exc) from None


def _video_config_from_shapes(path: Path, shape, need, stats) -> VideoVAEConfig:
    defaults = VideoVAEConfig()
    levels = _count(shape, "encoder.down.{}.block.0.conv1.weight")
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
            layers_per_block=_count(shape, "encoder.down.0.block.{}.conv1.weight"),
            decoder_num_layers=_count(shape, "decoder.transformer_blocks.{}.scale1"),
            decoder_num_heads=dim // NATIVE_HEAD_DIM,
            decoder_head_dim=NATIVE_HEAD_DIM,
            decoder_ffn_dim=need("decoder.transformer_blocks.0.ff.w2.weight")[1],
            decoder_num_register_tokens=need("decoder.register_tokens")[1],
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise _config_error(path, exc) from None


def _find_video_folder(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    for name in ("vae", "video_vae", "visual_vae"):  # repo root (diffusers) or a release partition (native)
        if (folder / name / "config.json").is_file():
            return folder / name
    raise CheckpointError(
        f"{folder}: not an H3 video VAE folder: no config.json. Expected a diffusers vae/ folder, a native video_vae/ "
        "folder (config.json + source/) or a ComfyUI .safetensors file.", path=folder)


def resolve_video_vae_checkpoint(source: str | os.PathLike) -> VAECheckpoint:
    """Find the layout of `source`, read its config and open (but do not read) its tensors."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder. Give a diffusers vae/ folder, a native video_vae/ "
                              "folder or a ComfyUI minimax_h3_video_vae_*.safetensors file.", path=path)
    refuse_pickle(path)
    if path.is_file() and _weights_folder(path) is not None:
        path = _weights_folder(path)
    if path.is_file():
        return _resolve_video_single_file(path)
    if path.name == "source" and (path.parent / "config.json").is_file():
        path = path.parent
    folder = _find_video_folder(path)
    raw = read_json(folder / "config.json")
    if raw.get("_class_name") == VIDEO_DIFFUSERS_CLASS:
        config = _video_config_from_diffusers(raw, folder / "config.json")
        files = open_folder_files(folder, "diffusion_pytorch_model")
        ckpt = VAECheckpoint("video", folder, "diffusers", config, files, _video_plan("diffusers", config))
        return _check(ckpt, _video_describe(ckpt))
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
        raise _not_a("video", source_folder, files.keys())

    def shape(key):
        return files[key].shape(key) if key in files else None

    config = _video_config_from_native(raw, folder / "config.json", source_raw, source_folder / "config.json", shape)
    ckpt = VAECheckpoint("video", folder, "native", config, files, _video_plan("native", config),
                         allowed_extra={"decoder.mask_token"})
    defaults = {}
    for ours, theirs in (("tile_size", "vae_tile_size"), ("tile_min_overlap", "vae_tile_overlap_min")):
        if theirs in raw:
            defaults[ours] = _number(raw, theirs, None, folder / "config.json")
    ckpt.defaults = defaults
    return _check(ckpt, _video_describe(ckpt))


def _resolve_video_single_file(path: Path) -> VAECheckpoint:
    file, prefix = _single_file(path)
    if not all(prefix + k in file for k in VIDEO_DETECT_KEYS):
        raise _not_a("video", path, file.keys())
    shape, need = _shape_reader(path, file, prefix)
    stats, stat_keys = _stats_from_file(file, prefix, need("post_quant_conv.weight")[0],
                                        (VIDEO_PUBLISHED_MEAN, VIDEO_PUBLISHED_STD))
    config = _video_config_from_shapes(path, shape, need, stats)
    files = {k: file for k in file.keys()}
    ckpt = VAECheckpoint("video", path, "comfy", config, files, _video_plan("comfy", config, prefix),
                         allowed_extra={prefix + "decoder.mask_token"} | stat_keys)
    return _check(ckpt, _video_describe(ckpt))


def _video_describe(ckpt: VAECheckpoint) -> str:
    c = ckpt.config
    return (f"a {ckpt.layout} H3 video VAE ({len(c.block_out_channels)} encoder levels, {c.decoder_num_layers} decoder "
            f"blocks of width {c.decoder_dim})")


# ---- audio VAE -------------------------------------------------------------------------------------------------------


def _audio_plan(config: AudioVAEConfig, spelling: tuple[str, str] | None, prefix: str = "") -> list[WeightSpec]:
    """`spelling` is the (g, v) key suffix pair for layouts that store weight norm; None when it is folded."""
    with torch.device("meta"):
        model = AudioVAE(config)
    # Modules whose `weight` the original checkpoint stores as a weight-norm pair.
    normed = {name for name, module in model.named_modules() if isinstance(module, WEIGHT_NORM_MODULES)}
    if not spelling:
        normed = set()
    specs = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        owner, _, leaf = name.rpartition(".")
        if owner in normed and leaf == "weight":
            g_shape = (shape[0],) + (1,) * (len(shape) - 1)
            keys = (f"{prefix}{owner}.{spelling[0]}", f"{prefix}{owner}.{spelling[1]}")
            specs.append(WeightSpec(name, keys, (g_shape, shape), fold_weight_norm))
        else:
            specs.append(WeightSpec(name, (prefix + name,), (shape,)))
    return specs


def _audio_shapes_config(path: Path, shape, need, base: dict, stats) -> AudioVAEConfig:
    """Audio config from tensor shapes; `base` supplies what shapes cannot tell (rates, heads, dilations)."""
    defaults = AudioVAEConfig()

    def conv(key):  # the weight shape, whether stored folded or as a weight-norm pair
        for suffix in ("weight", "weight_v", "parametrizations.weight.original1"):
            s = shape(f"{key}.{suffix}")
            if s is not None:
                return s
        return need(f"{key}.weight")

    blocks = 0
    while shape(f"encoder.block.{blocks + 1}.block.3.alpha") is not None:
        blocks += 1
    encoder_rates = base.get("encoder_rates") or tuple(conv(f"encoder.block.{i + 1}.block.4")[-1] // 2
                                                      for i in range(blocks))
    ups = _count(lambda k: shape(k + ".bias"), "decoder.ups.{}.0")
    kernels = tuple(conv(f"decoder.ups.{i}.0")[-1] for i in range(ups))
    per_stage = _count(lambda k: shape(k + ".act.alpha"), "decoder.resblocks.{}.activations.0") // max(ups, 1)
    res_kernels = tuple(conv(f"decoder.resblocks.{j}.convs1.0")[-1] for j in range(per_stage))
    dilation_count = _count(lambda k: shape(k + ".bias"), "decoder.resblocks.0.convs1.{}")
    rates = base.get("decoder_rates")
    if rates is None:
        if kernels != defaults.decoder_kernel_sizes:
            raise CheckpointError(f"{path}: decoder upsampler kernels {list(kernels)} differ from the released "
                                  f"{list(defaults.decoder_kernel_sizes)}, and the file does not say its rates.",
                                  path=path)
        rates = defaults.decoder_rates
    dilations = base.get("resblock_dilation_sizes") or tuple(
        defaults.resblock_dilation_sizes[0][:dilation_count] for _ in res_kernels)
    try:
        return AudioVAEConfig(
            encoder_dim=conv("encoder.block.0")[0],
            encoder_rates=tuple(encoder_rates),
            latent_dim=conv(f"encoder.block.{blocks + 2}")[0],
            latent_channels=need("mean_proj.weight")[0],
            num_attention_heads=base.get("num_attention_heads", defaults.num_attention_heads),
            decoder_dim=need("decoder.conv_pre.bias")[0],
            decoder_rates=tuple(rates),
            decoder_kernel_sizes=kernels,
            resblock_kernel_sizes=res_kernels,
            resblock_dilation_sizes=tuple(tuple(d) for d in dilations),
            sample_rate=base.get("sample_rate", defaults.sample_rate),
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise _config_error(path, exc) from None


def _audio_config_from_diffusers(raw: dict, path: Path) -> AudioVAEConfig:
    channels = _number(raw, "latent_channels", 32, path)
    stats = _stats(raw, path, channels, required=True)
    dilations = raw.get("resblock_dilation_sizes", ((1, 3, 5),) * 3)
    if not isinstance(dilations, (list, tuple)) or not all(isinstance(d, (list, tuple)) for d in dilations):
        raise CheckpointError(f"{path}: 'resblock_dilation_sizes' must be a list of lists.", path=path,
                              key="resblock_dilation_sizes")
    try:
        return AudioVAEConfig(
            encoder_dim=_number(raw, "encoder_dim", 64, path),
            encoder_rates=_int_list(raw, "encoder_rates", (2, 4, 4, 5, 5), path),
            latent_dim=_number(raw, "latent_dim", 2048, path),
            latent_channels=channels,
            num_attention_heads=_number(raw, "num_attention_heads", 8, path),
            decoder_dim=_number(raw, "decoder_dim", 1024, path),
            decoder_rates=_int_list(raw, "decoder_rates", (5, 5, 2, 2, 2, 2, 2), path),
            decoder_kernel_sizes=_int_list(raw, "decoder_kernel_sizes", (9, 9, 4, 4, 4, 4, 4), path),
            resblock_kernel_sizes=_int_list(raw, "resblock_kernel_sizes", (3, 7, 11), path),
            resblock_dilation_sizes=tuple(tuple(int(v) for v in d) for d in dilations),
            sample_rate=_number(raw, "sampling_rate", raw.get("sample_rate", 32000), path),
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise _config_error(path, exc) from None


def _native_audio_base(metadata: dict, path: Path) -> dict:
    """Constructor arguments of the original `DacAudioVAE` that tensor shapes cannot tell."""
    _require(metadata, "attn_proj", True, path, "the released model has the attention projection")
    _require(metadata, "decoder_type", "bigvgan", path, "the released decoder is BigVGAN")
    base = {}
    if "encoder_rates" in metadata:
        base["encoder_rates"] = _int_list(metadata, "encoder_rates", None, path)
    if "decoder_rates" in metadata:
        base["decoder_rates"] = _int_list(metadata, "decoder_rates", None, path)
    if "sample_rate" in metadata:
        base["sample_rate"] = _number(metadata, "sample_rate", None, path)
    return base


def _weight_norm_spelling(keys, prefix: str) -> tuple[str, str] | None:
    for g, v in WEIGHT_NORM_SPELLINGS:
        if any(k.startswith(prefix + "encoder.block.0.") and k.endswith("." + g) for k in keys):
            return g, v
    return None


def resolve_audio_vae_checkpoint(source: str | os.PathLike) -> VAECheckpoint:
    """Find the layout of `source`, read its config and open (but do not read) its tensors."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder. Give a diffusers or native audio_vae/ folder or a "
                              "ComfyUI minimax_h3_audio_vae_fp32.safetensors file.", path=path)
    refuse_pickle(path)
    if path.is_file() and _weights_folder(path) is not None:
        path = _weights_folder(path)
    if path.is_file():
        return _resolve_audio_single_file(path)
    folder = path
    has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json"))
    if not has_weights and (folder / "audio_vae").is_dir():
        folder = folder / "audio_vae"  # repo root or release partition
    diffusers_weights = any(folder.glob("diffusion_pytorch_model*.safetensors")) or (
        folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    if diffusers_weights:
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: diffusers weights without config.json; download the folder again.",
                                  path=folder)
        raw = read_json(folder / "config.json")
        if raw.get("_class_name") != AUDIO_DIFFUSERS_CLASS:
            raise CheckpointError(f"{folder / 'config.json'}: _class_name is {raw.get('_class_name')!r}, not "
                                  f"'{AUDIO_DIFFUSERS_CLASS}'. Point at the audio_vae/ folder of an H3 download.",
                                  path=folder / "config.json", key="_class_name")
        files = open_folder_files(folder, "diffusion_pytorch_model")
        layout, config = "diffusers", _audio_config_from_diffusers(raw, folder / "config.json")
    else:
        files = open_folder_files(folder, "model")
        if AUDIO_DETECT_KEY not in files:
            raise _not_a("audio", folder, files.keys())
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: no config.json with the latent statistics (latents_mean / latents_std) "
                                  "beside model.safetensors; restore it from the release.", path=folder)
        raw = read_json(folder / "config.json")
        metadata = read_json(folder / "metadata.json") if (folder / "metadata.json").is_file() else {}
        base = _native_audio_base(metadata, folder / "metadata.json")
        if "num_attention_heads" in raw:
            base["num_attention_heads"] = _number(raw, "num_attention_heads", None, folder / "config.json")
        channels = next((files[k].shape(k)[0] for k in ("mean_proj.weight",) if k in files), 32)
        stats = _stats(raw, folder / "config.json", channels, required=True)

        def shape(key):
            return files[key].shape(key) if key in files else None

        def need(key):
            s = shape(key)
            if s is None:
                raise CheckpointError(f"{folder}: missing key '{key}', needed to read the model size.", path=folder,
                                      key=key)
            return s

        layout, config = "native", _audio_shapes_config(folder, shape, need, base, stats)
    spelling = _weight_norm_spelling(files.keys(), "")
    if spelling is None:
        raise CheckpointError(f"{folder}: no weight-norm pair (weight_g / weight_v) for 'encoder.block.0'; a {layout} "
                              "audio VAE stores its convolutions with weight norm. The file is incomplete, or it is a "
                              "ComfyUI single file (pass the .safetensors file itself).", path=folder,
                              key="encoder.block.0.weight_g")
    ckpt = VAECheckpoint("audio", folder, layout, config, files, _audio_plan(config, spelling))
    return _check(ckpt, _audio_describe(ckpt))


def _resolve_audio_single_file(path: Path) -> VAECheckpoint:
    file, prefix = _single_file(path)
    if prefix + AUDIO_DETECT_KEY not in file:
        raise _not_a("audio", path, file.keys())
    shape, need = _shape_reader(path, file, prefix)
    stats, stat_keys = _stats_from_file(file, prefix, need("mean_proj.weight")[0],
                                        (AUDIO_PUBLISHED_MEAN, AUDIO_PUBLISHED_STD))
    config = _audio_shapes_config(path, shape, need, {}, stats)
    spelling = _weight_norm_spelling(file.keys(), prefix)
    files = {k: file for k in file.keys()}
    ckpt = VAECheckpoint("audio", path, "comfy", config, files, _audio_plan(config, spelling, prefix),
                         allowed_extra=stat_keys)
    return _check(ckpt, _audio_describe(ckpt))


def _audio_describe(ckpt: VAECheckpoint) -> str:
    c = ckpt.config
    return (f"a {ckpt.layout} H3 audio VAE (encoder width {c.encoder_dim}, latent_dim {c.latent_dim}, decoder width "
            f"{c.decoder_dim})")


# ---- building the modules -------------------------------------------------------------------------------------------


def _float32_only(dtype, what: str) -> None:
    if dtype not in (None, torch.float32):
        raise H3Error(f"dtype={dtype}: the {what} keeps float32 weights (the reference does; lower precision degrades "
                      "it). Leave dtype unset" + (" — on CUDA the decoder still runs under fp16 autocast." if
                                                  what == "video VAE" else "."))


def _residency_manager(component: str, device: torch.device, residency, prefetch,
                       resident_blocks) -> LayerwiseOffloadManager | None:
    """Check the residency setting against the platform's admission rules before anything is read; the manager
    for a layerwise load, None for a resident one."""
    mode = Residency.parse(residency)
    check_admission({component: ComponentPlan(mode, str(device))}, Platform.for_device(device))
    if mode is Residency.RESIDENT:
        return None
    return layerwise_manager(device, prefetch=prefetch, resident_blocks=resident_blocks)


def _populate(model: nn.Module, ckpt: VAECheckpoint, device: torch.device, manager: LayerwiseOffloadManager | None,
              blocks: list[tuple[str, ...]], phases: dict[str, tuple[str, ...]]) -> None:
    """Place every tensor as float32 on `device`; with a `manager`, the parameters under `blocks` (one unit per
    entry) and `phases` are left in the memory maps and handed to it instead.

    One recipe per tensor serves both paths: the sources are upcast to float32 first, then combined (QKV rows,
    weight-norm fold), so a streamed parameter is materialised with the same numbers as a resident one.
    """
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    parameters = {name for name, _ in model.named_parameters()}
    prefixes = tuple(p for unit in blocks for p in unit) + tuple(p for ps in phases.values() for p in ps)
    recipes: dict[str, HostTensor] = {}
    for spec in ckpt.specs:
        sources = tuple(ckpt.files[k].tensor(k) for k in spec.keys)
        recipe = HostTensor(sources, torch.float32, shapes[spec.name], spec.combine)
        if manager is not None and spec.name in parameters and spec.name.startswith(prefixes):
            recipes[spec.name] = recipe  # buffers (resampling filters) are never streamed
            set_tensor(model, spec.name, torch.empty(0, dtype=torch.float32, device=device))
            continue
        set_tensor(model, spec.name, recipe.host_value().to(device))
    if manager is not None:
        manager, model.weight_phases = attach_layerwise(model, recipes, manager, blocks=blocks, phases=phases,
                                                        device=device)
        model.decoder.block_residency = manager
    model.eval()
    model.checkpoint_layout = ckpt.layout
    model.checkpoint_files = ckpt.paths


# Materialised only while `encode` runs when loaded layerwise (the decoders' blocks stream instead).
VIDEO_PHASE_SCOPED = {"encoder": ("encoder.", "quant_conv.")}
AUDIO_PHASE_SCOPED = {"encoder": ("encoder.", "pre_block.", "mean_proj.", "logs_proj.")}

_VIDEO_OPTIONS = ("tiling", "tile_size", "tile_min_overlap", "decode_autocast")


def load_video_vae(source: str | os.PathLike, *, device="cpu", dtype: torch.dtype | None = None,
                   residency: Residency | str = Residency.RESIDENT, prefetch: int | None = None,
                   resident_blocks: int | list[int] | None = None, **options) -> VideoVAE:
    """Load the H3 video VAE from a diffusers `vae/` folder, a native `video_vae/` folder or a ComfyUI single file.

    Options: `tiling` (default True: the released frames are tiled ones), `tile_size` / `tile_min_overlap` in pixels
    (default 256 / 64, or the native config's values), `decode_autocast` (default: fp16 on CUDA only).
    Weights are float32; on the CPU with an fp32 file they are the memory-mapped file pages themselves.

    `residency="layerwise"` streams the ViT decoder's transformer blocks (one pass per decoded tile): they stay in
    the memory maps and are upcast / de-interleaved when materialised; at most `prefetch + 1` are on the device
    (`prefetch` default 0, 1 on CUDA), `resident_blocks` (the first N, or indices) stay there. The CNN encoder and
    quant_conv are materialised only during `encode` (phase "encoder"). `vae.close()` releases it.
    """
    unknown = sorted(set(options) - set(_VIDEO_OPTIONS))
    if unknown:
        raise TypeError(f"load_video_vae() got unknown option(s) {unknown}; supported: {list(_VIDEO_OPTIONS)}.")
    _float32_only(dtype, "video VAE")
    device = torch.device(device)
    manager = _residency_manager("video_vae", device, residency, prefetch, resident_blocks)
    ckpt = resolve_video_vae_checkpoint(source)
    tiling = TilingOptions(
        enabled=bool(options.get("tiling", True)),
        tile_size=options.get("tile_size") or ckpt.defaults.get("tile_size", 256),
        min_overlap=options.get("tile_min_overlap") or ckpt.defaults.get("tile_min_overlap", 64),
    )
    tiling.check(ckpt.config.spatial_ratio)
    autocast = DecodeAutocast(device.type, Platform.for_device(device).decode_autocast_dtype(options.get("decode_autocast")))
    with torch.device("meta"):
        model = VideoVAE(ckpt.config, tiling, autocast)
    blocks = [(f"decoder.transformer_blocks.{i}.",) for i in range(ckpt.config.decoder_num_layers)]
    _populate(model, ckpt, device, manager, blocks, VIDEO_PHASE_SCOPED)
    return model


def load_audio_vae(source: str | os.PathLike, *, device="cpu", dtype: torch.dtype | None = None,
                   residency: Residency | str = Residency.RESIDENT, prefetch: int | None = None,
                   resident_blocks: int | list[int] | None = None, **options) -> AudioVAE:
    """Load the H3 audio VAE from a diffusers or native `audio_vae/` folder or a ComfyUI single file (float32).

    `residency="layerwise"` streams the decoder's upsampling stages, each unit one upsampler with the AMP blocks
    that follow it (7 units; stage 0 holds most of the decoder's weights): at most `prefetch + 1` stages are on the
    device, `resident_blocks` (the first N stages, or indices) stay there; weight-norm pairs are folded when a stage
    is materialised. The encoder side (encoder, pre_block, posterior projections) is materialised only during
    `encode` (phase "encoder"); conv_pre, the output activation, conv_post and dec_in_proj stay resident.
    """
    if options:
        raise TypeError(f"load_audio_vae() got unknown option(s) {sorted(options)}; it takes none.")
    _float32_only(dtype, "audio VAE")
    device = torch.device(device)
    manager = _residency_manager("audio_vae", device, residency, prefetch, resident_blocks)
    ckpt = resolve_audio_vae_checkpoint(source)
    with torch.device("meta"):
        model = AudioVAE(ckpt.config)
    blocks = [tuple(f"decoder.{p}" for p in model.decoder.stage_prefixes(i)) for i in range(len(model.decoder.ups))]
    _populate(model, ckpt, device, manager, blocks, AUDIO_PHASE_SCOPED)
    return model
