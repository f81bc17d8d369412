"""The MiniMax H3 diffusion transformer (DiT).

One packed sequence of text, condition, audio and video rows runs through a stack of identical blocks with full
self-attention; modality enters only through the input projections, the output heads and a per-row index into each
block's AdaLN table. Module names follow the original (native) checkpoint, so native and ComfyUI files map onto the
parameters one to one; the fused QKV weight is held in logical `[q_all; k_all; v_all]` row order and the SwiGLU input
projection as `[gate; up]`.

Precision follows the released checkpoint: the patch projections, the time MLP and the output heads are float32
"islands"; the residual stream has the dtype of the text projection (bf16 for the real weights).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import NUM_MODALITIES, NUM_MODULATIONS, H3DiTConfig
from .residency import AllResident, PhaseScopedWeights


# ---- rotary embedding -------------------------------------------------------------------------------------------


class RotaryEmbedding3D(nn.Module):
    """Partial 3-axis rotary embedding: `rope_freq_dim` frequencies per (t, h, w) axis, split-half convention."""

    def __init__(self, rope_freq_dim: int, rope_theta: float):
        super().__init__()
        self.register_buffer("inv_freq", self.frequencies(rope_freq_dim, rope_theta), persistent=True)

    @staticmethod
    def frequencies(rope_freq_dim: int, rope_theta: float) -> torch.Tensor:
        """`theta ** (-2k / (2 F))`, k < F, float32; equal to the `rope.inv_freq` the native release ships."""
        exponents = torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32, device="cpu") / (2 * rope_freq_dim)
        return 1.0 / (rope_theta ** exponents)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids` (S, 3) -> cos, sin of shape (S, 3 * rope_freq_dim), in float32.

        Only the first half of the rotated channels is returned: the split-half rotation uses the same angle for
        channel i and i + 3 * rope_freq_dim.
        """
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(torch.float32).view(1, 1, -1)
        angles = angles.flatten(1)  # (S, 3 * F): t block, h block, w block
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` channels of every head of `x` (..., S, H, D); pass the rest through."""
    half = cos.shape[-1]
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]), dim=-1)


# ---- building blocks ----------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention with a fused QKV projection, per-head q/k RMSNorm and optional RoPE."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * heads * head_dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.out_proj = nn.Linear(heads * head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        batch, rows, _ = x.shape
        q, k, v = self.qkv_proj(x).view(batch, rows, 3, self.heads, self.head_dim).unbind(2)
        q = self.q_norm(q)
        k = self.k_norm(k)
        if rope is not None:
            q = apply_rotary(q, *rope)
            k = apply_rotary(k, *rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out_proj(out.transpose(1, 2).reshape(batch, rows, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """`fc2(silu(gate) * up)` with `fc1` rows stored `[gate; up]` (the native order)."""

    def __init__(self, hidden_size: int, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, 2 * ffn_dim, bias=False)
        self.fc2 = nn.Linear(ffn_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class AdaLNProjection(nn.Module):
    """Per-block AdaLN table: `[M, time_embed_dim]` -> `[M, 6 * 3 * hidden]` (checkpoint name `adaln_proj.linear`)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=True)

    def forward(self, time_act: torch.Tensor) -> torch.Tensor:
        return self.linear(time_act.to(self.linear.weight.dtype))


class RefinerBlock(nn.Module):
    """Pre-norm block of the text token refiner: no RoPE, no AdaLN."""

    def __init__(self, config: H3DiTConfig):
        super().__init__()
        c = config
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, config: H3DiTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(config) for _ in range(config.num_refiner_layers))
        self.final_norm = nn.RMSNorm(config.hidden_size, eps=config.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


class TransformerBlock(nn.Module):
    """Main block: AdaLN-modulated attention and SwiGLU, modulation rows chosen per packed row."""

    def __init__(self, config: H3DiTConfig):
        super().__init__()
        c = config
        self.hidden_size = c.hidden_size
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.ffn_dim)
        self.adaln_proj = AdaLNProjection(c.time_embed_dim, NUM_MODULATIONS * NUM_MODALITIES * c.hidden_size)

    def forward(self, x, time_act, adaln_index, rope):
        # [M, 18 * hidden] -> [3M, 6 * hidden]: row 3m + tag; chunks shift/scale/gate (attention), then (MLP).
        table = self.adaln_proj(time_act).view(-1, NUM_MODULATIONS * self.hidden_size)
        shift1, scale1, gate1, shift2, scale2, gate2 = (t.index_select(0, adaln_index) for t in table.chunk(6, -1))
        x = x + gate1 * self.attn(self.norm1(x) * (1.0 + scale1) + shift1, rope)
        return x + gate2 * self.mlp(self.norm2(x) * (1.0 + scale2) + shift2)


class TimeEmbedder(nn.Module):
    """Sinusoid (cos first, t unscaled in [0, 1]) followed by a float32 MLP."""

    def __init__(self, freq_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in = nn.Linear(freq_dim, hidden_dim, bias=True)
        self.proj_out = nn.Linear(hidden_dim, out_dim, bias=True)

    def sinusoid(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device)
        freqs = torch.exp(exponent / half)
        angles = t.to(torch.float32)[:, None] * freqs[None, :]
        return torch.cat((angles.cos(), angles.sin()), dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        e = self.sinusoid(t).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_in(e)))


class FinalLayer(nn.Module):
    """Output norm modulated per timestep (shift, scale), then float32 video and audio heads."""

    def __init__(self, config: H3DiTConfig):
        super().__init__()
        c = config
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.final_norm_eps)
        self.adaln_proj = AdaLNProjection(c.time_embed_dim, 2 * c.hidden_size)
        self.video_out = nn.Linear(c.hidden_size, c.video_patch_dim, bias=True)
        self.audio_out = nn.Linear(c.hidden_size, c.audio_in_channels, bias=True)

    def modulate(self, x, time_act, timestep_indices):
        shift, scale = self.adaln_proj(time_act).chunk(2, dim=-1)
        return self.norm(x) * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)

    def heads(self, y, video_indices, audio_indices):
        video = self.video_out(y.index_select(1, video_indices).to(self.video_out.weight.dtype))
        audio = self.audio_out(y.index_select(1, audio_indices).to(self.audio_out.weight.dtype))
        return video, audio


# ---- the model ------------------------------------------------------------------------------------------------------


class H3DiT(nn.Module):
    """The H3 transformer. Call it like `diffusers.MiniMaxH3Transformer3DModel` with `return_dict=False`."""

    def __init__(self, config: H3DiTConfig):
        super().__init__()
        self.config = config
        c = config
        self.video_patch_proj = nn.Linear(c.video_patch_dim, c.hidden_size, bias=True)
        self.audio_patch_proj = nn.Linear(c.audio_in_channels, c.hidden_size, bias=True)
        self.condition_proj = nn.Linear(c.text_dim, c.hidden_size, bias=True)
        self.time_embedder = TimeEmbedder(c.freq_dim, c.time_embed_hidden_dim, c.time_embed_dim)
        self.rope = RotaryEmbedding3D(c.rope_freq_dim, c.rope_theta)
        self.token_refiner = TokenRefiner(c)
        self.blocks = nn.ModuleList(TransformerBlock(c) for _ in range(c.num_layers))
        self.final_layer = FinalLayer(c)
        # Where the block weights and the phase-scoped weights (phase "text": condition_proj + token_refiner) live
        # while the forward runs; load_dit(residency="layerwise") replaces both (see residency.py).
        self.block_residency = AllResident(c.num_layers)
        self.weight_phases = PhaseScopedWeights()

    @property
    def residual_dtype(self) -> torch.dtype:
        """The dtype of the packed residual stream: that of the text projection (bf16 for the released weights)."""
        return self.condition_proj.weight.dtype

    def _check_inputs(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                      token_tags, position_ids, video_indices, audio_indices, text_indices):
        c = self.config
        if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
            raise ValueError(f"position_ids must be (seq_len, 3), got {tuple(position_ids.shape)}.")
        rows = position_ids.shape[0]
        if tuple(token_tags.shape) != (rows,) or tuple(timestep_indices.shape) != (rows,):
            raise ValueError(
                f"token_tags {tuple(token_tags.shape)} and timestep_indices {tuple(timestep_indices.shape)} must both "
                f"be ({rows},), one entry per row of position_ids."
            )
        for name, tensor, width, index in (
            ("hidden_states", hidden_states, c.video_patch_dim, video_indices),
            ("audio_hidden_states", audio_hidden_states, c.audio_in_channels, audio_indices),
            ("encoder_hidden_states", encoder_hidden_states, c.text_dim, text_indices),
        ):
            if tensor.ndim != 3 or tensor.shape[-1] != width or tensor.shape[1] != index.numel():
                raise ValueError(
                    f"{name} must be (batch, {index.numel()}, {width}) to match its index tensor and the model, got "
                    f"{tuple(tensor.shape)}."
                )
        covered = video_indices.numel() + audio_indices.numel() + text_indices.numel()
        if covered != rows:
            raise ValueError(
                f"video, audio and text indices cover {covered} rows but the layout has {rows}; every row must "
                "belong to exactly one stream."
            )
        if timestep.ndim != 1:
            raise ValueError(f"timestep must be 1-D (the distinct timesteps), got shape {tuple(timestep.shape)}.")

    def embed_time(self, timestep: torch.Tensor) -> torch.Tensor:
        """Distinct timesteps `[M]` -> the AdaLN input `silu(t_emb)`, kept float32 (each table casts it itself)."""
        return F.silu(self.time_embedder(timestep))

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                token_tags, position_ids, video_indices, audio_indices, text_indices, return_dict: bool = False):
        self._check_inputs(hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                           token_tags, position_ids, video_indices, audio_indices, text_indices)
        rows = position_ids.shape[0]
        rope = self.rope(position_ids)

        # Input projections; the fp32 islands run on fp32 rows and are rounded to the residual dtype afterwards.
        with self.weight_phases.phase("text"):
            text = self.token_refiner(self.condition_proj(encoder_hidden_states.to(self.condition_proj.weight.dtype)))
        video = self.video_patch_proj(hidden_states.to(self.video_patch_proj.weight.dtype))
        audio = self.audio_patch_proj(audio_hidden_states.to(self.audio_patch_proj.weight.dtype))
        x = text.new_zeros((text.shape[0], rows, text.shape[-1]))
        x = x.index_copy(1, text_indices, text)
        x = x.index_copy(1, video_indices, video.to(x.dtype))
        x = x.index_copy(1, audio_indices, audio.to(x.dtype))

        time_act = self.embed_time(timestep)
        adaln_index = timestep_indices * NUM_MODALITIES + token_tags.clamp(min=0)
        residency = self.block_residency
        residency.begin_pass()
        try:
            for i, block in enumerate(self.blocks):
                residency.acquire(i)  # block i on the device (and the next `prefetch` on their way)
                x = block(x, time_act, adaln_index, rope)
                residency.release(i)
        finally:
            residency.end_pass()  # also after an exception in a block: the next forward starts clean

        y = self.final_layer.modulate(x, time_act, timestep_indices)
        return self.final_layer.heads(y, video_indices, audio_indices)
