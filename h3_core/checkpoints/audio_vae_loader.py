"""Load the H3 audio VAE from any of its three checkpoint layouts.

* **diffusers** `audio_vae/`: `config.json` (`AutoencoderKLMiniMaxH3Audio`) + `diffusion_pytorch_model*.safetensors`.
* **native** `audio_vae/`: `model.safetensors`, `config.json` (latent statistics), `metadata.json` (constructor
  arguments).
  Both store weight-normed convolutions as `weight_g` / `weight_v` pairs (or the `parametrizations.weight.original0/1`
  spelling), folded here into `weight` with the kernel weight norm itself uses.
* **comfy** single file (`minimax_h3_audio_vae_fp32.safetensors`): same names, weight norm already folded.

Every key, shape and dtype is checked before anything is placed; each problem raises one `CheckpointError` naming the
file and key. The weights are always float32.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..models.audio_vae import PUBLISHED_LATENTS_MEAN as AUDIO_PUBLISHED_MEAN
from ..models.audio_vae import PUBLISHED_LATENTS_STD as AUDIO_PUBLISHED_STD
from ..models.audio_vae import WEIGHT_NORM_MODULES, AudioVAE, AudioVAEConfig, fold_weight_norm
from ..models.meta_models import meta_model
from ..runtime.platform import Platform
from ..runtime.residency import Residency
from .checkpoint import (AUDIO_DETECT_KEY, Checkpoint, HeaderSizes, WeightSpec, check_config_sizes, count_indexed,
                         not_a_checkpoint, open_folder_files, read_json, resolve_source, shape_reader)
from .vae_common import (check_vae, config_error, int_list, latent_stats, open_single_file, open_vae, populate,
                         positive_number, require_value, stats_from_file, weights_folder)

AUDIO_DIFFUSERS_CLASS = "AutoencoderKLMiniMaxH3Audio"
WEIGHT_NORM_SPELLINGS = (("weight_g", "weight_v"), ("parametrizations.weight.original0",
                                                    "parametrizations.weight.original1"))
# Materialised only while `encode` runs when loaded layerwise (the decoder's upsampling stages stream instead).
AUDIO_PHASE_SCOPED = {"encoder": ("encoder.", "pre_block.", "mean_proj.", "logs_proj.")}


def _audio_plan(config: AudioVAEConfig, spelling: tuple[str, str] | None, prefix: str = "") -> list[WeightSpec]:
    """`spelling` is the (g, v) key suffix pair for layouts that store weight norm; None when it is folded."""
    model = meta_model(AudioVAE, config)
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
    ups = count_indexed(lambda k: shape(k + ".bias"), "decoder.ups.{}.0")
    kernels = tuple(conv(f"decoder.ups.{i}.0")[-1] for i in range(ups))
    per_stage = count_indexed(lambda k: shape(k + ".act.alpha"), "decoder.resblocks.{}.activations.0") // max(ups, 1)
    res_kernels = tuple(conv(f"decoder.resblocks.{j}.convs1.0")[-1] for j in range(per_stage))
    dilation_count = count_indexed(lambda k: shape(k + ".bias"), "decoder.resblocks.0.convs1.{}")
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
        raise config_error(path, exc) from None


def _audio_config_from_diffusers(raw: dict, path: Path) -> AudioVAEConfig:
    channels = positive_number(raw, "latent_channels", 32, path)
    stats = latent_stats(raw, path, channels, required=True)
    dilations = raw.get("resblock_dilation_sizes", ((1, 3, 5),) * 3)
    if not isinstance(dilations, (list, tuple)) or not all(
            isinstance(d, (list, tuple)) and d and all(type(v) is int and v > 0 for v in d) for d in dilations):
        raise CheckpointError(f"{path}: 'resblock_dilation_sizes' must be a list of lists of positive integers, got "
                              f"{str(dilations)[:60]}.", path=path, key="resblock_dilation_sizes")
    try:
        return AudioVAEConfig(
            encoder_dim=positive_number(raw, "encoder_dim", 64, path),
            encoder_rates=int_list(raw, "encoder_rates", (2, 4, 4, 5, 5), path),
            latent_dim=positive_number(raw, "latent_dim", 2048, path),
            latent_channels=channels,
            num_attention_heads=positive_number(raw, "num_attention_heads", 8, path),
            decoder_dim=positive_number(raw, "decoder_dim", 1024, path),
            decoder_rates=int_list(raw, "decoder_rates", (5, 5, 2, 2, 2, 2, 2), path),
            decoder_kernel_sizes=int_list(raw, "decoder_kernel_sizes", (9, 9, 4, 4, 4, 4, 4), path),
            resblock_kernel_sizes=int_list(raw, "resblock_kernel_sizes", (3, 7, 11), path),
            resblock_dilation_sizes=tuple(tuple(int(v) for v in d) for d in dilations),
            sample_rate=positive_number(raw, "sampling_rate", raw.get("sample_rate", 32000), path),
            latents_mean=stats[0],
            latents_std=stats[1],
        )
    except ValueError as exc:
        raise config_error(path, exc) from None


def _check_audio_config_against_header(config: AudioVAEConfig, config_path: Path, sizes: HeaderSizes) -> None:
    """The sizes the config implies against the tensor shapes, before the module is built."""
    def conv(key: str, index: int):  # a convolution stored folded or as a weight-norm pair
        for suffix in ("weight_v", "parametrizations.weight.original1", "weight"):
            if f"{key}.{suffix}" in sizes.files:
                return sizes.dim(f"{key}.{suffix}", index)
        return sizes.dim(f"{key}.weight_v", index)

    c = config
    blocks, where = sizes.count("encoder.block.", "encoder stages")
    stages = len(c.decoder_rates)
    check_config_sizes(config_path, [
        # encoder.block.0 is the input convolution; the last two are the output activation and convolution
        ("encoder_rates (their number)", len(c.encoder_rates), (blocks - 3, f"{blocks} - 3 blocks: {where}")),
        ("decoder_rates (their number)", stages, sizes.count("decoder.ups.", "upsamplers")),
        ("resblock_kernel_sizes (their number) x decoder_rates (their number)", len(c.resblock_kernel_sizes) * stages,
         sizes.count("decoder.resblocks.", "residual blocks")),
    ])
    check_config_sizes(config_path, [
        (f"resblock_dilation_sizes[{j}] (their number)", len(dilations),
         sizes.count(f"decoder.resblocks.{j}.convs1.", f"dilated convolutions in residual block {j}"))
        for j, dilations in enumerate(c.resblock_dilation_sizes)])
    check_config_sizes(config_path, [
        ("encoder_dim", c.encoder_dim, conv("encoder.block.0", 0)),
        ("latent_dim", c.latent_dim, conv(f"encoder.block.{len(c.encoder_rates) + 2}", 0)),
        ("latent_channels", c.latent_channels, sizes.dim("mean_proj.weight", 0)),
        ("decoder_dim", c.decoder_dim, sizes.dim("decoder.conv_pre.bias", 0)),
    ])


def _native_audio_base(metadata: dict, path: Path) -> dict:
    """Constructor arguments of the original `DacAudioVAE` that tensor shapes cannot tell."""
    require_value(metadata, "attn_proj", True, path, "the released model has the attention projection")
    require_value(metadata, "decoder_type", "bigvgan", path, "the released decoder is BigVGAN")
    base = {}
    if "encoder_rates" in metadata:
        base["encoder_rates"] = int_list(metadata, "encoder_rates", None, path)
    if "decoder_rates" in metadata:
        base["decoder_rates"] = int_list(metadata, "decoder_rates", None, path)
    if "sample_rate" in metadata:
        base["sample_rate"] = positive_number(metadata, "sample_rate", None, path)
    return base


def _weight_norm_spelling(keys, prefix: str) -> tuple[str, str] | None:
    for g, v in WEIGHT_NORM_SPELLINGS:
        if any(k.startswith(prefix + "encoder.block.0.") and k.endswith("." + g) for k in keys):
            return g, v
    return None


def resolve_audio_vae_checkpoint(source: str | os.PathLike) -> Checkpoint:
    """Find the layout of `source`, read its config and open (but do not read) its tensors."""
    return resolve_source(source, "Give a diffusers or native audio_vae/ folder or a ComfyUI "
                          "minimax_h3_audio_vae_fp32.safetensors file.", _resolve_audio_single_file,
                          _resolve_audio_folder, owning_folder=weights_folder)


def _resolve_audio_folder(folder: Path) -> Checkpoint:
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
        _check_audio_config_against_header(config, folder / "config.json", HeaderSizes(folder, files, "H3 audio VAE"))
    else:
        files = open_folder_files(folder, "model")
        if AUDIO_DETECT_KEY not in files:
            raise not_a_checkpoint(folder, files.keys(), "audio_vae", "an H3 audio VAE checkpoint")
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: no config.json with the latent statistics (latents_mean / latents_std) "
                                  "beside model.safetensors; restore it from the release.", path=folder)
        raw = read_json(folder / "config.json")
        metadata = read_json(folder / "metadata.json") if (folder / "metadata.json").is_file() else {}
        base = _native_audio_base(metadata, folder / "metadata.json")
        if "num_attention_heads" in raw:
            base["num_attention_heads"] = positive_number(raw, "num_attention_heads", None, folder / "config.json")
        channels = next((files[k].shape(k)[0] for k in ("mean_proj.weight",) if k in files), 32)
        stats = latent_stats(raw, folder / "config.json", channels, required=True)
        shape, need = shape_reader(folder, files, "H3 VAE")
        layout, config = "native", _audio_shapes_config(folder, shape, need, base, stats)
    spelling = _weight_norm_spelling(files.keys(), "")
    if spelling is None:
        raise CheckpointError(f"{folder}: no weight-norm pair (weight_g / weight_v) for 'encoder.block.0'; a {layout} "
                              "audio VAE stores its convolutions with weight norm. The file is incomplete, or it is a "
                              "ComfyUI single file (pass the .safetensors file itself).", path=folder,
                              key="encoder.block.0.weight_g")
    ckpt = Checkpoint("audio_vae", folder, layout, config, files, _audio_plan(config, spelling))
    return check_vae(ckpt, _audio_describe(ckpt))


def _resolve_audio_single_file(path: Path) -> Checkpoint:
    file, prefix = open_single_file(path)
    if prefix + AUDIO_DETECT_KEY not in file:
        raise not_a_checkpoint(path, file.keys(), "audio_vae", "an H3 audio VAE checkpoint")
    files = {k: file for k in file.keys()}
    shape, need = shape_reader(path, files, "H3 VAE", prefix)
    stats, stat_keys = stats_from_file(file, prefix, need("mean_proj.weight")[0],
                                       (AUDIO_PUBLISHED_MEAN, AUDIO_PUBLISHED_STD))
    config = _audio_shapes_config(path, shape, need, {}, stats)
    spelling = _weight_norm_spelling(file.keys(), prefix)
    ckpt = Checkpoint("audio_vae", path, "comfy", config, files, _audio_plan(config, spelling, prefix),
                      allowed_extra=stat_keys)
    return check_vae(ckpt, _audio_describe(ckpt))


def _audio_describe(ckpt: Checkpoint) -> str:
    c = ckpt.config
    return (f"a {ckpt.layout} H3 audio VAE (encoder width {c.encoder_dim}, latent_dim {c.latent_dim}, decoder width "
            f"{c.decoder_dim})")


def load_audio_vae(source: str | os.PathLike, *, device="cpu", dtype: torch.dtype | None = None,
                   residency: Residency | str = Residency.RESIDENT, prefetch: int | None = None,
                   resident_blocks: int | list[int] | None = None) -> AudioVAE:
    """Load the H3 audio VAE from a diffusers or native `audio_vae/` folder or a ComfyUI single file (float32).

    `residency="layerwise"` streams the decoder's upsampling stages, each unit one upsampler with the AMP blocks
    that follow it (7 units; stage 0 holds most of the decoder's weights): at most `prefetch + 1` stages are on the
    device, `resident_blocks` (the first N stages, or indices) stay there; weight-norm pairs are folded when a stage
    is materialised. The encoder side (encoder, pre_block, posterior projections) is materialised only during
    `encode` (phase "encoder"); conv_pre, the output activation, conv_post and dec_in_proj stay resident.
    """
    device, manager, ckpt = open_vae("audio_vae", source, resolve_audio_vae_checkpoint, dtype=dtype, device=device,
                                     residency=residency, prefetch=prefetch, resident_blocks=resident_blocks)
    with torch.device("meta"):
        model = AudioVAE(ckpt.config)
    blocks = [tuple(f"decoder.{p}" for p in model.decoder.stage_prefixes(i)) for i in range(len(model.decoder.ups))]
    populate(model, ckpt, device, manager, blocks, AUDIO_PHASE_SCOPED)
    model.decoder.between_blocks = Platform.for_device(device).trim_host_heap
    return model
