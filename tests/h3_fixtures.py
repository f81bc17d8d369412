"""Tiny random H3 transformers written in the three real checkpoint layouts, and packed inputs for them.

The reference model (diffusers `MiniMaxH3Transformer3DModel`) is the source of the weights; the diffusers layout is
written by its own `save_pretrained`, the native and ComfyUI layouts by the conversions the spec describes
(`h3-model.md` §7), implemented here independently of `h3_core`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from h3_core.models.dit_config import H3DiTConfig

TINY = H3DiTConfig(
    num_layers=2, num_refiner_layers=2, hidden_size=64, num_attention_heads=3, attention_head_dim=32, ffn_dim=96,
    in_channels=4, audio_in_channels=8, text_dim=48, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32,
    rope_freq_dim=4,
)
TINY_B = H3DiTConfig(
    num_layers=3, num_refiner_layers=1, hidden_size=48, num_attention_heads=2, attention_head_dim=40, ffn_dim=80,
    in_channels=6, audio_in_channels=4, text_dim=24, freq_dim=16, time_embed_hidden_dim=40, time_embed_dim=24,
    rope_freq_dim=5,
)


def reference_model(config: H3DiTConfig, seed: int = 0):
    """A diffusers reference transformer with every parameter drawn at random (fp32)."""
    from diffusers import MiniMaxH3Transformer3DModel

    kwargs = {k: v for k, v in config.to_diffusers_dict().items() if not k.startswith("_")}
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    model = MiniMaxH3Transformer3DModel(**kwargs).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight") and param.ndim == 1:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                fan_in = param.shape[-1] if param.ndim > 1 else 8
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in ** 0.5)
    return model


def native_state(reference, config: H3DiTConfig, *, interleave_qkv: bool = True) -> dict[str, torch.Tensor]:
    """Reference weights renamed to native keys; QKV per-head interleaved (native) or logical (ComfyUI)."""
    ref = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    out: dict[str, torch.Tensor] = {}

    def block(dst: str, src: str):
        q, k, v = (ref.pop(f"{src}attn.to_{x}.weight") for x in "qkv")
        if interleave_qkv:
            per_head = torch.stack([t.reshape(heads, head_dim, -1) for t in (q, k, v)], dim=1)  # [H, 3, D, in]
            out[f"{dst}attn.qkv_proj.weight"] = per_head.reshape(3 * heads * head_dim, -1).contiguous()
        else:
            out[f"{dst}attn.qkv_proj.weight"] = torch.cat([q, k, v])
        out[f"{dst}attn.q_norm.weight"] = ref.pop(f"{src}attn.norm_q.weight")
        out[f"{dst}attn.k_norm.weight"] = ref.pop(f"{src}attn.norm_k.weight")
        out[f"{dst}attn.out_proj.weight"] = ref.pop(f"{src}attn.to_out.0.weight")
        up, gate = ref.pop(f"{src}ff.net.0.proj.weight").chunk(2)
        out[f"{dst}mlp.fc1.weight"] = torch.cat([gate, up])
        out[f"{dst}mlp.fc2.weight"] = ref.pop(f"{src}ff.net.2.weight")
        for n in ("norm1.weight", "norm2.weight", "adaln_proj.linear.weight", "adaln_proj.linear.bias"):
            if f"{src}{n}" in ref:
                out[f"{dst}{n}"] = ref.pop(f"{src}{n}")

    for i in range(config.num_layers):
        block(f"blocks.{i}.", f"transformer_blocks.{i}.")
    for i in range(config.num_refiner_layers):
        block(f"token_refiner.blocks.{i}.", f"token_refiner.refiner_blocks.{i}.")
    renames = {
        "proj_in.": "video_patch_proj.", "audio_proj_in.": "audio_patch_proj.", "context_embedder.": "condition_proj.",
        "time_embedder.linear_1.": "time_embedder.proj_in.", "time_embedder.linear_2.": "time_embedder.proj_out.",
        "norm_out.norm.": "final_layer.norm.", "norm_out.linear.": "final_layer.adaln_proj.linear.",
        "proj_out.": "final_layer.video_out.", "audio_proj_out.": "final_layer.audio_out.",
        "token_refiner.final_norm.": "token_refiner.final_norm.",
    }
    for key in list(ref):
        for src, dst in renames.items():
            if key.startswith(src):
                out[dst + key[len(src):]] = ref.pop(key)
                break
    assert not ref, f"unconverted reference keys: {sorted(ref)}"
    return out


def save_diffusers(reference, folder: Path, *, shard_bytes: int | None = None) -> Path:
    kwargs = {"safe_serialization": True}
    if shard_bytes:
        kwargs["max_shard_size"] = shard_bytes
    reference.save_pretrained(folder, **kwargs)
    return folder


def save_native(reference, config: H3DiTConfig, folder: Path, *, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    state = native_state(reference, config, interleave_qkv=True)
    exponents = torch.arange(0, 2 * config.rope_freq_dim, 2, dtype=torch.float32) / (2 * config.rope_freq_dim)
    state["rope.inv_freq"] = 1.0 / (config.rope_theta ** exponents)
    (folder / "config.json").write_text(json.dumps(config.to_native_dict(), indent=2))
    keys = sorted(state)
    if shards == 1:
        save_file(state, folder / "model.safetensors")
        return folder
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[s::shards]}
        save_file(part, folder / name)
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def save_comfy(reference, config: H3DiTConfig, path: Path, *, prefix: str = "") -> Path:
    state = native_state(reference, config, interleave_qkv=False)
    save_file({prefix + k: v.contiguous() for k, v in state.items()}, path)
    return path


def cast_like_release(reference):
    """bf16 everywhere except the fp32 islands, as the released checkpoint stores it."""
    islands = ("proj_in.", "audio_proj_in.", "time_embedder.", "proj_out.", "audio_proj_out.")
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if not name.startswith(islands):
                param.data = param.data.to(torch.bfloat16)
    return reference


def packed_inputs(config: H3DiTConfig, *, text_len=7, latent_frames=3, latent_hw=(4, 6), audio_latents=5,
                  anchors=("first", "last"), vision_rows=2, t_video=0.3, t_audio=0.55, seed=1, batch=1):
    """A packed T2VA/FL2VA forward input with text, keyframe, audio and video rows and three distinct timesteps."""
    from h3_core.pipeline.layout import build_packed_layout
    from h3_core.pipeline.sampler import row_timesteps

    g = torch.Generator().manual_seed(seed)
    text_tags = torch.ones(text_len, dtype=torch.long)
    text_tags[1:1 + vision_rows] = 0
    lh, lw = latent_hw
    layout = build_packed_layout(text_tags, latent_frames, lh, lw, audio_latents, anchors, config.patch_size)
    timestep, timestep_indices = row_timesteps(layout, t_video, t_audio)
    return dict(
        hidden_states=torch.randn(batch, layout.video_indices.numel(), config.video_patch_dim, generator=g),
        audio_hidden_states=torch.randn(batch, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, config.text_dim, generator=g),
        timestep=timestep,
        timestep_indices=timestep_indices,
        **layout.model_kwargs(),
    )


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tiny_copy_with(tiny: Path, tmp_path: Path, component_glob: str, key: str, value: float) -> tuple[Path, Path]:
    """A copy of the tiny model with every element of one tensor of one component set to `value` (NaN, Inf, a value
    that overflows): the copy's folder and the edited file."""
    root = tmp_path / "edited"
    shutil.copytree(tiny, root)
    path = next(root.glob(component_glob))
    state = load_file(path)
    state[key] = torch.full_like(state[key], value)
    save_file(state, path)
    return root, path
