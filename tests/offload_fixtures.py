"""Random H3 transformers written in the real checkpoint layouts without the reference library (fast to import).

The residency tests compare the layerwise path with the resident path of the same loader on the same file, so the
weights need not come from the reference model; the layouts follow `h3-model.md` §7 (native: fused QKV per-head
interleaved, `fc1` as `[gate; up]`; diffusers: separate `to_q/to_k/to_v`, `ff.net.0.proj` as `[up; gate]`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3_core.models.dit_config import H3DiTConfig
from h3_core.models.dit import H3DiT, RotaryEmbedding3D

SMALL = H3DiTConfig(
    num_layers=6, num_refiner_layers=2, hidden_size=32, num_attention_heads=2, attention_head_dim=16, ffn_dim=48,
    in_channels=4, audio_in_channels=8, text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16,
    rope_freq_dim=2,
)


def random_state(config: H3DiTConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every parameter of the model in logical (h3_core) order, drawn at random; `rope.inv_freq` exact."""
    with torch.device("meta"):
        model = H3DiT(config)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        if p.ndim == 1 and "norm" in name:
            value = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
        else:
            value = torch.randn(p.shape, generator=g) / (p.shape[-1] if p.ndim > 1 else 8) ** 0.5
        state[name] = value.to(dtype)
    state["rope.inv_freq"] = RotaryEmbedding3D.frequencies(config.rope_freq_dim, config.rope_theta)
    return state


def random_dit(config: H3DiTConfig, seed: int = 0) -> H3DiT:
    model = H3DiT(config).eval()
    model.load_state_dict(random_state(config, seed))
    model.requires_grad_(False)
    return model


def interleave_qkv(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[q_all; k_all; v_all] rows -> the native per-head [q k v] rows."""
    return weight.reshape(3, heads, head_dim, -1).transpose(0, 1).reshape(3 * heads * head_dim, -1).contiguous()


def save_native(state: dict[str, torch.Tensor], config: H3DiTConfig, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, value in state.items():
        if name.endswith("attn.qkv_proj.weight"):
            value = interleave_qkv(value, config.num_attention_heads, config.attention_head_dim)
        out[name] = value.contiguous()
    (folder / "config.json").write_text(json.dumps(config.to_native_dict(), indent=2))
    save_file(out, folder / "model.safetensors")
    return folder


def save_comfy(state: dict[str, torch.Tensor], path: Path) -> Path:
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items() if k != "rope.inv_freq"}, path)
    return path


def _diffusers_sub(sub: str) -> str:
    return {
        "attn.q_norm.weight": "attn.norm_q.weight", "attn.k_norm.weight": "attn.norm_k.weight",
        "attn.out_proj.weight": "attn.to_out.0.weight", "mlp.fc1.weight": "ff.net.0.proj.weight",
        "mlp.fc2.weight": "ff.net.2.weight",
    }.get(sub, sub)


_DIFFUSERS_GLOBALS = {
    "video_patch_proj.": "proj_in.", "audio_patch_proj.": "audio_proj_in.", "condition_proj.": "context_embedder.",
    "time_embedder.proj_in.": "time_embedder.linear_1.", "time_embedder.proj_out.": "time_embedder.linear_2.",
    "final_layer.norm.": "norm_out.norm.", "final_layer.adaln_proj.linear.": "norm_out.linear.",
    "final_layer.video_out.": "proj_out.", "final_layer.audio_out.": "audio_proj_out.",
    "token_refiner.final_norm.": "token_refiner.final_norm.",
}


def save_diffusers(state: dict[str, torch.Tensor], config: H3DiTConfig, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, value in state.items():
        if name == "rope.inv_freq":
            continue
        if name.startswith(("blocks.", "token_refiner.blocks.")):
            refiner = name.startswith("token_refiner.")
            rest = name.split("blocks.", 1)[1]
            index, _, sub = rest.partition(".")
            base = f"token_refiner.refiner_blocks.{index}." if refiner else f"transformer_blocks.{index}."
            if sub == "attn.qkv_proj.weight":
                for letter, part in zip("qkv", value.chunk(3, dim=0)):
                    out[f"{base}attn.to_{letter}.weight"] = part.contiguous()
            elif sub == "mlp.fc1.weight":
                gate, up = value.chunk(2, dim=0)
                out[base + _diffusers_sub(sub)] = torch.cat((up, gate)).contiguous()
            else:
                out[base + _diffusers_sub(sub)] = value.contiguous()
            continue
        ours = next(p for p in _DIFFUSERS_GLOBALS if name.startswith(p))
        out[_DIFFUSERS_GLOBALS[ours] + name[len(ours):]] = value.contiguous()
    (folder / "config.json").write_text(json.dumps(config.to_diffusers_dict(), indent=2))
    save_file(out, folder / "diffusion_pytorch_model.safetensors")
    return folder


def same_outputs(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))
