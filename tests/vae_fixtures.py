"""Tiny random H3 video and audio VAEs written in the three real checkpoint layouts.

The reference models (diffusers `AutoencoderKLMiniMaxH3` / `AutoencoderKLMiniMaxH3Audio`) are the source of the
weights; the diffusers layout is written by their own `save_pretrained`, the native and ComfyUI layouts by the
conversions the spec describes (`h3-components.md` §3.9, §4.4, §6), implemented here independently of `h3_core`.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

# Same temporal / spatial layout as the release (so a ComfyUI file, which carries no config, describes it), tiny widths.
TINY_VIDEO = dict(
    block_out_channels=(32, 32, 32, 32, 32, 64), layers_per_block=1, decoder_num_layers=2,
    decoder_num_attention_heads=2, decoder_attention_head_dim=64,
)
TINY_AUDIO = dict(encoder_dim=4, latent_dim=512, decoder_dim=128)
# Small tiles so a 96 x 112 px canvas needs 2 x 3 tiles (uneven overlaps 32 / 48 px).
TILE, OVERLAP = 64, 32


def _stats(channels: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mean = (0.5 * torch.randn(channels, generator=g)).tolist()
    std = (0.5 + torch.rand(channels, generator=g)).tolist()
    return mean, std


def _randomize(model, seed: int, *, fp16_exact: bool, rules):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = rules(name, param, generator)
            if fp16_exact:  # the ComfyUI video file is fp16: keep every weight representable there
                value = value.half().float()
            param.copy_(value)
    return model


def _video_rule(name, param, g):
    shape = param.shape
    if name.endswith(("norm1.weight", "norm2.weight", "norm_out.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith(("scale1", "scale2")):
        return 0.5 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("register_tokens"):
        return torch.randn(shape, generator=g)
    if name.endswith("bias"):
        return 0.05 * torch.randn(shape, generator=g)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=g) / fan_in ** 0.5


def reference_video(seed: int = 0):
    """A diffusers reference video VAE with random fp16-representable weights and random latent statistics."""
    from diffusers import AutoencoderKLMiniMaxH3

    mean, std = _stats(24, seed + 100)
    model = AutoencoderKLMiniMaxH3(**TINY_VIDEO, latents_mean=tuple(mean), latents_std=tuple(std)).eval()
    return _randomize(model, seed, fp16_exact=True, rules=_video_rule)


def video_native_state(reference) -> dict[str, torch.Tensor]:
    """Reference weights under the native names: per-head interleaved QKV, SwiGLU rows [gate; value], mask_token."""
    ref = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    heads = reference.config.decoder_num_attention_heads
    head_dim = reference.config.decoder_attention_head_dim
    out = {}
    for key in list(ref):
        parts = key.split(".")
        if parts[:2] == ["encoder", "down_blocks"]:
            level = parts[2]
            if parts[3] == "resnets":
                sub = ["nin_shortcut" if parts[5] == "conv_shortcut" else parts[5]] + parts[6:]
                out[".".join(["encoder", "down", level, "block", parts[4], *sub])] = ref.pop(key)
            else:  # downsamplers.0.conv.*
                out[".".join(["encoder", "down", level, "downsample", *parts[5:]])] = ref.pop(key)
        elif key.startswith("decoder.proj_in."):
            out["decoder.x_embedder." + parts[-1]] = ref.pop(key)
    for i in range(reference.config.decoder_num_layers):
        src = f"decoder.transformer_blocks.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (ref.pop(f"{src}attn.to_{x}.{kind}") for x in "qkv")
            rest = q.shape[1:]
            stacked = torch.stack([t.reshape(heads, head_dim, *rest) for t in (q, k, v)], dim=1)
            out[f"{src}attn.to_qkv.{kind}"] = stacked.reshape(3 * heads * head_dim, *rest).contiguous()
            out[f"{src}attn.to_out.{kind}"] = ref.pop(f"{src}attn.to_out.0.{kind}")
            value, gate = ref.pop(f"{src}ff.net.0.proj.{kind}").chunk(2)
            out[f"{src}ff.w1.{kind}"] = torch.cat([gate, value])
            out[f"{src}ff.w2.{kind}"] = ref.pop(f"{src}ff.net.2.{kind}")
    out.update(ref)  # conv_in, norm_out, conv_out, quant convs, block norms / scales, register tokens, decoder out
    dim = heads * head_dim
    out["decoder.mask_token"] = torch.zeros(1, 1, dim)
    return out


def save_video_diffusers(reference, folder: Path) -> Path:
    reference.save_pretrained(folder, safe_serialization=True)
    return folder


def save_video_native(reference, folder: Path) -> Path:
    """`video_vae/` of a release partition: wrapper config, `source/config.json`, `source/model.safetensors`."""
    cfg = reference.config
    source = folder / "source"
    source.mkdir(parents=True, exist_ok=True)
    ch = cfg.block_out_channels[0]
    (source / "config.json").write_text(json.dumps({
        "_class_name": "AutoencoderKLLegacy", "in_channels": 3, "out_ch": 3, "ch": ch,
        "ch_mult": [w // ch for w in cfg.block_out_channels], "num_res_blocks": cfg.layers_per_block,
        "embed_dim": 24, "z_channels": 24, "space_down": list(cfg.spatial_downsample_factors),
        "space_up": [1, 2, 2, 2, 2, 1], "time_down": list(cfg.temporal_downsample_factors), "padding_mode": "reflect",
        "use_t_isolated_gn": True, "causal_encoder": True, "causal_decoder": False, "use_3d_conv": True,
        "use_vit_decoder": True, "pixel_norm_type": "imagenet",
        "vit_decoder_kwargs": {"dim_head": cfg.decoder_attention_head_dim, "heads": cfg.decoder_num_attention_heads,
                               "num_layers": cfg.decoder_num_layers, "ffn_activation_fn": "silu",
                               "ffn_use_gated": True, "norm_type": "rms_norm", "qk_norm_type": "rms_norm",
                               "rope_dim_ratio": 0.75, "rope_theta": 100.0},
    }, indent=2))
    (folder / "config.json").write_text(json.dumps({
        "auto_map": {"AutoModel": "klvae.AutoencoderKLLegacy"}, "source_path": "source",
        "latents_mean": list(cfg.latents_mean), "latents_std": list(cfg.latents_std),
        "vae_tile_size": TILE, "vae_tile_overlap_min": OVERLAP, "vae_clip_length": 17, "vae_token_drop": 3,
    }, indent=2))
    save_file(video_native_state(reference), source / "model.safetensors")
    return folder


def save_video_comfy(reference, path: Path, *, with_stats: bool = True, prefix: str = "") -> Path:
    """The ComfyUI repack: native names and QKV order, fp16, optional latents_mean / latents_std buffers."""
    state = {k: v.half() for k, v in video_native_state(reference).items()}
    if with_stats:
        state["latents_mean"] = torch.tensor(reference.config.latents_mean)
        state["latents_std"] = torch.tensor(reference.config.latents_std)
    save_file({prefix + k: v.contiguous() for k, v in state.items()}, path)
    return path


# ---- audio -----------------------------------------------------------------------------------------------------------


def _audio_rule(name, param, g):
    shape = param.shape
    if name.endswith(".alpha") and param.ndim == 3:  # Snake (linear scale)
        return 0.5 + torch.rand(shape, generator=g)
    if name.endswith((".alpha", ".beta")):  # SnakeBeta (log scale)
        return 0.2 * torch.randn(shape, generator=g)
    if name == "decoder.conv_post.weight_g":  # keep the waveform mostly inside the final clamp to [-1, 1]
        return 0.04 + 0.02 * torch.rand(shape, generator=g)
    if name.endswith("weight_g"):
        return 0.8 + 0.4 * torch.rand(shape, generator=g)
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith(("bias", "q_bias", "v_bias")):
        return 0.05 * torch.randn(shape, generator=g)
    fan_in = math.prod(shape[1:]) if param.ndim > 1 else 8
    return torch.randn(shape, generator=g) / fan_in ** 0.5


def reference_audio(seed: int = 0):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    mean, std = _stats(32, seed + 200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the reference uses the deprecated torch weight_norm
        model = AutoencoderKLMiniMaxH3Audio(**TINY_AUDIO, latents_mean=mean, latents_std=std).eval()
    return _randomize(model, seed, fp16_exact=False, rules=_audio_rule)


def save_audio_diffusers(reference, folder: Path) -> Path:
    reference.save_pretrained(folder, safe_serialization=True)
    return folder


def save_audio_native(reference, folder: Path) -> Path:
    """`audio_vae/` of a release partition: `model.safetensors` (weight_g / weight_v), config.json, metadata.json."""
    cfg = reference.config
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in reference.state_dict().items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"sample_rate": 32000, "latent_channels": 32,
                                                    "latents_mean": list(cfg.latents_mean),
                                                    "latents_std": list(cfg.latents_std)}, indent=2))
    (folder / "metadata.json").write_text(json.dumps({
        "encoder_dim": cfg.encoder_dim, "encoder_rates": list(cfg.encoder_rates), "latent_dim": cfg.latent_dim,
        "decoder_dim": cfg.decoder_dim, "decoder_rates": list(cfg.decoder_rates), "sample_rate": 32000,
        "vae_latent_channels": 32, "attn_proj": True, "decoder_type": "bigvgan"}, indent=2))
    return folder


def folded_audio_state(reference) -> dict[str, torch.Tensor]:
    """The reference state with every weight-norm pair replaced by the weight the reference's own weight-norm hook
    (`torch.nn.utils.weight_norm`) computes for its forward."""
    from torch.nn.utils.weight_norm import WeightNorm

    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    with torch.no_grad():
        for name, module in reference.named_modules():
            hooks = [h for h in module._forward_pre_hooks.values() if isinstance(h, WeightNorm)]
            if hooks:
                del state[f"{name}.weight_g"], state[f"{name}.weight_v"]
                state[f"{name}.weight"] = hooks[0].compute_weight(module).detach().clone()
    return {k: v.contiguous() for k, v in state.items()}


def save_audio_comfy(reference, path: Path, *, with_stats: bool = True) -> Path:
    state = folded_audio_state(reference)
    if with_stats:
        state["latents_mean"] = torch.tensor(reference.config.latents_mean)
        state["latents_std"] = torch.tensor(reference.config.latents_std)
    save_file(state, path)
    return path


# ---- reference pipelines (diffusers decode / encode steps, tensors in and out) ---------------------------------------


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def reference_video_decode(reference, latent: torch.Tensor) -> torch.Tensor:
    """diffusers `MiniMaxH3VideoDecodeStep`: de-normalise, decode, revert ImageNet, clamp; frames last."""
    mean = torch.tensor(reference.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(reference.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = reference.decode(latent * std + mean, return_dict=False)[0]
    return _to_frames(video)


def _to_frames(video: torch.Tensor) -> torch.Tensor:
    pixel_mean = torch.tensor(IMAGENET_MEAN).view(1, -1, 1, 1, 1)
    pixel_std = torch.tensor(IMAGENET_STD).view(1, -1, 1, 1, 1)
    return (video.float() * pixel_std + pixel_mean).clamp(0, 1).permute(0, 2, 3, 4, 1)


def reference_video_decode_clip(reference, latent: torch.Tensor) -> torch.Tensor:
    """The reference spatial (tiled) decode of one latent clip, frames last; for lengths `decode` cannot take."""
    mean = torch.tensor(reference.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(reference.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        return _to_frames(reference._decode_clip(latent * std + mean))


def reference_video_encode(reference, frames: torch.Tensor) -> torch.Tensor:
    """diffusers `encode_vae_condition` with the posterior mean (ComfyUI's choice) and no fp16 rounding."""
    mean = torch.tensor(reference.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(reference.config.latents_std).view(1, -1, 1, 1, 1)
    pixel_mean = torch.tensor(IMAGENET_MEAN).view(1, -1, 1, 1, 1)
    pixel_std = torch.tensor(IMAGENET_STD).view(1, -1, 1, 1, 1)
    pixels = (frames.permute(0, 4, 1, 2, 3) - pixel_mean) / pixel_std
    with torch.no_grad():
        posterior = reference.encode(pixels, return_dict=False)[0]
    return (posterior.mode() - mean) / std


def reference_audio_decode(reference, latent: torch.Tensor) -> torch.Tensor:
    """diffusers `MiniMaxH3AudioDecodeStep` per batch item: stereo channels as two batch items of the mono VAE."""
    mean = torch.tensor(reference.config.latents_mean).view(1, -1, 1)
    std = torch.tensor(reference.config.latents_std).view(1, -1, 1)
    outs = []
    with torch.no_grad():
        for item in latent:  # [32, 2, Ta]
            z = item.permute(1, 0, 2) * std + mean  # [2, 32, Ta]
            outs.append(reference.decode(z, return_dict=False)[0][:, 0])  # [2, samples]
    return torch.stack(outs)


def reference_audio_encode(reference, waveform: torch.Tensor) -> torch.Tensor:
    """diffusers reference-audio encode (posterior mean, channel-major), normalised, as `[B, 32, 2, Ta]`."""
    mean = torch.tensor(reference.config.latents_mean).view(1, -1, 1)
    std = torch.tensor(reference.config.latents_std).view(1, -1, 1)
    outs = []
    with torch.no_grad():
        for item in waveform:  # [2, samples]
            posterior = reference.encode(item[:, None], return_dict=False)[0]
            outs.append(((posterior.mode() - mean) / std).permute(1, 0, 2))  # [32, 2, Ta]
    return torch.stack(outs)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- memory accounting -----------------------------------------------------------------------------------------------


class LiveTensorBytes:
    """Peak bytes of tensor storages created (and still alive) while the context is active, on one device type.

    A `TorchDispatchMode` sees every op; each output storage that is new (not an input's, not already counted) is
    counted until the storage is freed. This measures what the computation itself allocates — buffers created before
    the context (weights, a preallocated output) are not counted — deterministically and on any device, CPU included.
    """

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._mode = None

    def _drop(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor) or t.device.type != tracker.device_type:
                        continue
                    storage = t.untyped_storage()
                    key, size = storage.data_ptr(), storage.nbytes()
                    if size == 0 or key in inputs or key in tracker._live:
                        continue
                    tracker._live[key] = size
                    tracker.current += size
                    tracker.peak = max(tracker.peak, tracker.current)
                    weakref.finalize(storage, tracker._drop, key)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def one_error(call, cls, *fragments):
    """`call()` raises one `cls` (an H3Error) whose message holds every fragment; returns it."""
    import pytest

    from h3_core.errors import H3Error

    with pytest.raises(cls) as info:
        call()
    assert isinstance(info.value, H3Error)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value
