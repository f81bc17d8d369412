"""What the video and audio VAE loaders share: config number readers, single-file prefix detection, the strict
check, the loaders' opening, and placing float32 tensors (resident or streamed).

VAE weights are always float32 (fp16 files are upcast exactly).
"""

from __future__ import annotations

from contextlib import closing
import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from ..errors import CheckpointError, H3Error
from ..json_values import is_positive_real, is_whole
from ..models.meta_models import meta_model
from ..runtime.file_reads import FileReader
from ..runtime.host_store import HostTensor
from ..runtime.platform import Platform
from ..runtime.layerwise import LayerwiseOffloadManager
from .checkpoint import QUANTISED_NEEDS_FORMAT, QUANTISED_NOT_SUPPORTED, Checkpoint, full_precision
from .placement import attach_layerwise, residency_manager, set_tensor
from .safetensors_io import SafetensorsFile

# Prefixes a single-file VAE may carry when cut out of a combined checkpoint.
COMFY_PREFIXES = ("vae.", "first_stage_model.")


def state_shapes(model_cls, config) -> dict[str, tuple[int, ...]]:
    """Shape of every state-dict entry of `model_cls(config)`, built on the meta device."""
    return {name: tuple(t.shape) for name, t in meta_model(model_cls, config).state_dict().items()}


def latent_stats(raw: dict, path: Path, channels: int, required: bool):
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


def int_list(raw: dict, key: str, default, path: Path) -> tuple[int, ...]:
    value = raw.get(key, default)
    if not isinstance(value, (list, tuple)) or not all(is_whole(v) for v in value):
        raise CheckpointError(f"{path}: '{key}' must be a list of positive integers, got {value!r}.", path=path,
                              key=key)
    return tuple(value)


def positive_number(raw: dict, key: str, default, path: Path, kind=int):
    value = raw.get(key, default)
    if not (is_whole(value) if kind is int else is_positive_real(value)):
        raise CheckpointError(f"{path}: '{key}' must be a positive {kind.__name__}, got {value!r}.", path=path, key=key)
    return kind(value)


def count_value(raw: dict, key: str, default, path: Path) -> int:
    value = raw.get(key, default)
    if not is_whole(value, 0):
        raise CheckpointError(f"{path}: '{key}' must be a non-negative integer, got {value!r}.", path=path, key=key)
    return value


def require_value(raw: dict, key: str, expected, path: Path, why: str) -> None:
    if key in raw and raw[key] != expected:
        raise CheckpointError(f"{path}: '{key}' is {raw[key]!r}; only {expected!r} is supported ({why}).", path=path,
                              key=key)


def config_error(path: Path, exc: ValueError) -> CheckpointError:
    return CheckpointError(f"{path}: the configuration does not describe a valid H3 VAE: {exc}", path=path)


def open_single_file(path: Path) -> tuple[SafetensorsFile, str]:
    """Open a single-file checkpoint and find its key prefix (none, `vae.` or `first_stage_model.`)."""
    file = SafetensorsFile(path)
    for prefix in COMFY_PREFIXES:
        if any(k.startswith(prefix) for k in file.keys()):
            return file, prefix
    return file, ""


def weights_folder(path: Path) -> Path | None:
    """The checkpoint folder a weights file belongs to, when `path` is the weights file of a folder layout."""
    if path.name.startswith("diffusion_pytorch_model") and (path.parent / "config.json").is_file():
        return path.parent
    if path.name.startswith("model") and (path.parent / "metadata.json").is_file():
        return path.parent  # native audio_vae/
    if path.name.startswith("model") and (path.parent.parent / "config.json").is_file() and \
            (path.parent / "config.json").is_file():
        return path.parent.parent  # native video_vae/source/
    return None


def check_vae(ckpt: Checkpoint, describe: str, *, accept_quantised: bool = False) -> Checkpoint:
    """Strict key, shape and dtype checks; one error naming the file and key. `accept_quantised`: ComfyUI
    quantised layers are read (the video VAE)."""
    rule = QUANTISED_NEEDS_FORMAT if accept_quantised else QUANTISED_NOT_SUPPORTED
    return ckpt.check(describe, accept_quantised=accept_quantised,
                      dtype_rule=f"VAE weights must be fp32, fp16 or bf16; {rule}. Use minimax_h3_video_vae_fp16 / "
                                 "minimax_h3_audio_vae_fp32 or the official vae/ and audio_vae/ folders")


def stats_from_file(file: SafetensorsFile, prefix: str, channels: int, published):
    """Latent statistics stored in a single file as `latents_mean` / `latents_std` buffers, else `published`."""
    keys = (prefix + "latents_mean", prefix + "latents_std")
    if not all(k in file for k in keys):
        return published, set()
    for key in keys:
        if file.shape(key) != (channels,) or not full_precision(file.dtype(key)):
            raise CheckpointError(f"{file.path}: '{key}' must be {channels} floats (the latent statistics), got "
                                  f"{str(file.dtype(key)).replace('torch.', '')} {list(file.shape(key))}.",
                                  path=file.path, key=key)
    mean, std = (tuple(float(v) for v in file.tensor(k).double().tolist()) for k in keys)
    return (mean, std), set(keys)


def open_vae(component: str, source, resolve: Callable[[object], Checkpoint], *, dtype, device, residency, prefetch,
             resident_blocks) -> tuple[torch.device, LayerwiseOffloadManager | None, Checkpoint]:
    """The opening both VAE loaders share: float32 only, the residency checked against the platform before anything
    is read (`residency_manager`), then `resolve(source)`. Returns the device, the manager (None: resident) and the
    checkpoint."""
    if dtype not in (None, torch.float32):
        autocast = " — on CUDA the decoder still runs under fp16 autocast." if component == "video_vae" else "."
        raise H3Error(f"dtype={dtype}: the {component.replace('_vae', ' VAE')} keeps float32 weights (the reference "
                      f"does; lower precision degrades it). Leave dtype unset{autocast}")
    device = torch.device(device)
    manager = residency_manager(component, device, residency, prefetch, resident_blocks)
    return device, manager, resolve(source)


def populate(model: nn.Module, ckpt: Checkpoint, device: torch.device, manager: LayerwiseOffloadManager | None,
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
    with closing(FileReader()) as reader:
        for spec in ckpt.specs:
            # Quantised layers (the video VAE's): stored payloads, dequantised into float32 where materialised.
            recipe = ckpt.recipe(spec, lambda stored: torch.float32, shapes[spec.name], Platform.for_device(device))
            if manager is not None and spec.name in parameters and spec.name.startswith(prefixes):
                recipes[spec.name] = recipe  # buffers (resampling filters) are never streamed
                set_tensor(model, spec.name, torch.empty(0, dtype=torch.float32, device=device))
                continue
            set_tensor(model, spec.name, recipe.resident_value(device, reader))
    if manager is not None:
        manager, model.weight_phases = attach_layerwise(model, recipes, manager, blocks=blocks, phases=phases,
                                                        device=device)
        model.decoder.block_residency = manager
    model.eval()
    model.checkpoint_layout = ckpt.layout
    model.checkpoint_files = ckpt.paths
