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
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime.chunking import FUSED, ChunkingPolicy, RowChunks
from .dit_config import NUM_MODALITIES, NUM_MODULATIONS, H3DiTConfig
from .step_cache import StepCacheRun
from ..errors import H3Error
from ..runtime.phase_scoped import PhaseScopedWeights
from ..runtime.platform import Platform
from ..runtime.residency import AllResident


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
    """Multi-head self-attention with a fused QKV projection, per-head q/k RMSNorm and optional RoPE.

    Runs over row chunks in two passes (one chunk of all rows is the fused path): pass 1 projects keys and values of
    every row through the K/V row slice of the fused weight, pass 2 projects each query chunk through the Q slice
    and attends against the full K and V. Every weight row is applied to every input row exactly once, as in one fused
    projection. The main blocks wrap the same two passes with their AdaLN input and gated residual (`prepare` /
    `finish` in `forward`), so there is one attention loop for every caller and chunk size.
    """

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * heads * head_dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.out_proj = nn.Linear(heads * head_dim, hidden_size, bias=False)

    @property
    def inner_dim(self) -> int:
        return self.heads * self.head_dim

    def project_keys_values(self, x: torch.Tensor, rope_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `x` (B, n, hidden) -> normed, rotated keys and values, each (B, n, heads, head_dim)."""
        batch, rows, _ = x.shape
        # Rows [inner, 3 inner) of the [q; k; v] weight: a zero-copy view, so Q is not computed here.
        kv = F.linear(x, self.qkv_proj.weight[self.inner_dim:])
        keys, values = kv.view(batch, rows, 2, self.heads, self.head_dim).unbind(2)
        keys = self.k_norm(keys)
        if rope_rows is not None:
            keys = apply_rotary(keys, *rope_rows)
        return keys, values

    def project_queries(self, x: torch.Tensor, rope_rows=None) -> torch.Tensor:
        batch, rows, _ = x.shape
        queries = F.linear(x, self.qkv_proj.weight[: self.inner_dim]).view(batch, rows, self.heads, self.head_dim)
        queries = self.q_norm(queries)
        if rope_rows is not None:
            queries = apply_rotary(queries, *rope_rows)
        return queries

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Queries (B, n, heads, d) against all keys/values (B, S, heads, d), then out_proj: (B, n, hidden)."""
        batch, rows = queries.shape[:2]
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        return self.out_proj(out.transpose(1, 2).reshape(batch, rows, self.inner_dim))

    def write_keys_values(self, x_rows: torch.Tensor, rope_rows, keys, values, start: int, rows: int):
        """Pass-1 step: project rows `[start, start + n)` into the K/V buffers, allocating them on the first chunk."""
        chunk_keys, chunk_values = self.project_keys_values(x_rows, rope_rows)
        if keys is None:
            shape = (x_rows.shape[0], rows, self.heads, self.head_dim)
            keys, values = chunk_keys.new_empty(shape), chunk_values.new_empty(shape)
        end = start + x_rows.shape[1]
        keys[:, start:end] = chunk_keys
        values[:, start:end] = chunk_values
        return keys, values

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                chunks: RowChunks = FUSED, *, prepare: Callable | None = None,
                finish: Callable | None = None) -> torch.Tensor:
        """Attention over the rows of `x` (B, S, hidden) -> a new (B, S, hidden) tensor; `x` is left untouched.

        `prepare(start, end, rows)` makes the attention input of rows `[start, end)` from `x[:, start:end]` (the
        main block's AdaLN-modulated norm); it is kept in the output buffer until those rows' queries are projected.
        `finish(start, end, attended)` gives what the output holds for those rows (the block's gated residual).
        Without them the input is `x` itself and the output is the attention result.
        """
        rows = x.shape[1]
        keys = values = out = None
        # Pass 1: keys and values of every row. A prepared input is kept in `out`: pass 2 needs it for the queries.
        for start, end in chunks.ranges(rows):
            h = x[:, start:end]
            if prepare is not None:
                h = prepare(start, end, h)
                out = h.new_empty((x.shape[0], rows, h.shape[-1])) if out is None else out
                out[:, start:end] = h
            keys, values = self.write_keys_values(h, rope_slice(rope, start, end), keys, values, start, rows)
        source = x if prepare is None else out
        # Pass 2: a chunk's input rows are read once, for its queries, then replaced by its output.
        for start, end in chunks.query_ranges(rows):
            queries = self.project_queries(source[:, start:end], rope_slice(rope, start, end))
            result = self.attend(queries, keys, values)
            if finish is not None:
                result = finish(start, end, result)
            out = result.new_empty((x.shape[0], rows, result.shape[-1])) if out is None else out
            out[:, start:end] = result
        return out


def rope_slice(rope: tuple[torch.Tensor, torch.Tensor] | None, start: int, end: int):
    """The (cos, sin) rows of packed rows `[start, end)`."""
    if rope is None:
        return None
    cos, sin = rope
    return cos[start:end], sin[start:end]


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
    """Main block: AdaLN-modulated attention and SwiGLU, modulation rows chosen per packed row.

    One forward for every chunk size (`FUSED` is one chunk of all rows). Its only full-length buffers are K, V and
    the output, which first holds the modulated attention input, then each chunk's post-attention residual as soon as
    that chunk's queries are done, then the MLP result in place; the AdaLN rows, projections and MLP temporaries exist
    for one chunk at a time.
    """

    def __init__(self, config: H3DiTConfig):
        super().__init__()
        c = config
        self.hidden_size = c.hidden_size
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.ffn_dim)
        self.adaln_proj = AdaLNProjection(c.time_embed_dim, NUM_MODULATIONS * NUM_MODALITIES * c.hidden_size)

    def modulation(self, time_act: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """shift, scale, gate (attention), shift, scale, gate (MLP): each `[3M, hidden]`, row `3m + tag`."""
        return self.split_table(self.adaln_proj(time_act))

    def split_table(self, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This block's AdaLN table `[M, 6 * 3 * hidden]` (the projection's output) -> the six modulations."""
        return table.view(-1, NUM_MODULATIONS * self.hidden_size).chunk(6, -1)

    def forward(self, x, time_act, adaln_index, rope, chunks: RowChunks = FUSED, *, table: torch.Tensor | None = None):
        """`table`: this block's AdaLN table for this call, computed beforehand (an `AdaLNPlan`'s, or by the caller
        that streams the projection on its own); None projects `time_act` here."""
        modulation = self.modulation(time_act) if table is None else self.split_table(table)
        out = self.attention_residual(x, modulation, adaln_index, rope, chunks)
        return self.mlp_residual_(out, modulation, adaln_index, chunks)

    def attention_residual(self, x, modulation, adaln_index, rope, chunks: RowChunks = FUSED) -> torch.Tensor:
        """`x + gate1 * attn(norm1(x) * (1 + scale1) + shift1)` as a new tensor; `x` is left untouched."""
        shift, scale, gate = modulation[:3]

        def modulated_input(start: int, end: int, rows: torch.Tensor) -> torch.Tensor:
            index = adaln_index[start:end]
            return self.norm1(rows) * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)

        def gated_residual(start: int, end: int, attended: torch.Tensor) -> torch.Tensor:
            return x[:, start:end] + gate.index_select(0, adaln_index[start:end]) * attended

        return self.attn(x, rope, chunks, prepare=modulated_input, finish=gated_residual)

    def mlp_residual_(self, x, modulation, adaln_index, chunks: RowChunks = FUSED) -> torch.Tensor:
        """`x + gate2 * mlp(norm2(x) * (1 + scale2) + shift2)`, written into `x` chunk by chunk (rows independent)."""
        shift, scale, gate = modulation[3:]
        for start, end in chunks.ranges(x.shape[1]):
            index = adaln_index[start:end]
            residual = x[:, start:end]
            h = self.norm2(residual) * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)
            x[:, start:end] = residual + gate.index_select(0, index) * self.mlp(h)
        return x


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

    def forward(self, x, time_act, timestep_indices, video_indices, audio_indices, chunks: RowChunks = FUSED):
        """Packed rows -> (video velocity rows, audio velocity rows), batch first."""
        shift, scale = self.adaln_proj(time_act).chunk(2, dim=-1)
        video = self.head_rows(self.video_out, x, shift, scale, timestep_indices, video_indices, chunks)
        audio = self.head_rows(self.audio_out, x, shift, scale, timestep_indices, audio_indices, chunks)
        return video, audio

    def head_rows(self, head: nn.Linear, x, shift, scale, timestep_indices, row_indices, chunks: RowChunks = FUSED):
        """The modulated output norm and `head` on the packed rows `row_indices`, chunk by chunk."""
        count = row_indices.numel()
        out = None
        for start, end in chunks.ranges(count):
            rows = row_indices[start:end]
            step = timestep_indices.index_select(0, rows)
            y = self.norm(x.index_select(1, rows)) * (1.0 + scale.index_select(0, step)) + shift.index_select(0, step)
            result = head(y.to(head.weight.dtype))
            out = result.new_empty((x.shape[0], count, result.shape[-1])) if out is None else out
            out[:, start:end] = result
        return out


# ---- the model ------------------------------------------------------------------------------------------------------


def out_of_memory_error(exc: BaseException, rows: int, chunk_size: int | None) -> H3Error:
    """The user-facing error for running out of device memory inside the blocks (streamed blocks are released by
    the caller's `finally`)."""
    chunk = f"chunk size {chunk_size}" if chunk_size else "the fused (unchunked) forward"
    return H3Error(
        f"out of device memory in the transformer with {rows} packed rows and {chunk} ({exc}). Every streamed block "
        "was released. Use a smaller chunk size (chunk_size=256, or a memory_budget), layerwise residency, a smaller "
        "size or fewer seconds."
    )



class AdaLNPlan:
    """Every block's AdaLN table for each distinct timestep set of a sampling run, kept on the host.

    The modulation depends only on a call's distinct timesteps, all known before the first step: `H3DiT.adaln_plan`
    runs each block's projection once per planned call, in one pass over the blocks, with that call's own input (the
    same `[M, time_embed_dim]` tensor, hence the same GEMM shape M as the per-step forward: bitwise the same rows; a
    GEMM's kernel choice, so its rounding, depends on M). `tables[i]` is block i's `[R, adaln_out]` host tensor holding
    the rows of every planned call one after the other; `call(timestep)` gives the `AdaLNCall` a forward takes as
    `modulation=`, which copies block i's rows to the device as the block runs.
    """

    def __init__(self, keys: list[tuple[float, ...]], tables: list[torch.Tensor], non_blocking: bool = False):
        self.keys = tuple(keys)
        self.tables = tables
        self.non_blocking = non_blocking  # pinned tables: the copies are queued behind the running work
        self.offsets = {}
        start = 0
        for key in self.keys:
            self.offsets[key] = (start, len(key))
            start += len(key)

    @staticmethod
    def key(timestep: torch.Tensor) -> tuple[float, ...]:
        """The plan key of a call's distinct timesteps `[M]` (its exact float32 values)."""
        return tuple(timestep.detach().to("cpu", torch.float32).reshape(-1).tolist())

    @property
    def host_bytes(self) -> int:
        """Host bytes of every table (num_layers x planned rows x adaln_out x element size)."""
        return sum(t.numel() * t.element_size() for t in self.tables)

    def call(self, timestep: torch.Tensor) -> "AdaLNCall":
        """The tables of the call whose distinct timesteps are `timestep` (a CPU tensor: no device sync)."""
        key = self.key(timestep)
        if key not in self.offsets:
            raise H3Error(f"the AdaLN plan has no call with timesteps {list(key)}; build it with the timesteps of "
                          "every call of the run (`model.adaln_plan([...])`).")
        return AdaLNCall(self, *self.offsets[key])


class AdaLNCall:
    """One call's view of an `AdaLNPlan`: rows `[start, start + rows)` of every block's table."""

    def __init__(self, plan: AdaLNPlan, start: int, rows: int):
        self.plan, self.start, self.rows = plan, start, rows

    def table(self, index: int, device: torch.device | str) -> torch.Tensor:
        """Block `index`'s table `[M, adaln_out]` on `device` (no copy when the device is the host)."""
        rows = self.plan.tables[index][self.start : self.start + self.rows]
        return rows.to(device, non_blocking=self.plan.non_blocking)


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
        # load_dit(residency="layerwise") streams each block's AdaLN projection (`blocks.N.adaln_proj.`) as a unit of
        # its own: a forward given an AdaLN plan (`modulation=`) never materialises it. Resident (the default): the
        # projection belongs to its block's weights, wherever `block_residency` keeps them.
        self.adaln_residency = AllResident(c.num_layers)
        self.weight_phases = PhaseScopedWeights()
        # The default chunking of every forward; a call may pass its own (`forward(..., chunking=)`).
        self.chunking = ChunkingPolicy()
        # LoRAs applied now ((file, strength), ...) and the fold streamed weights get when materialised; set by
        # `h3_core.set_loras`. `weight_recipes` (name -> HostTensor, set by the loader) re-make a resident weight.
        self.loras: tuple = ()
        self.lora_fold = None
        self.weight_recipes: dict = {}

    def close(self, restore: bool = True) -> None:
        """Drop the residency managers and phase-scoped weights, as the other components' `close` does: every
        streamed parameter gets its host tensor back (on the host store's device) and the forward then runs with all
        weights where they are, LoRAs still applied. `restore=False` drops them instead (`H3Pipeline.release`: the
        model is being dropped and is not usable afterwards)."""
        streamed = self.streamed_parameter_names()
        self.block_residency.close(restore)
        self.block_residency = AllResident(self.config.num_layers)
        self.adaln_residency.close(restore)
        self.adaln_residency = AllResident(self.config.num_layers)
        self.weight_phases.close(restore)
        self.weight_phases = PhaseScopedWeights()
        fold = self.lora_fold
        if restore and fold is not None and fold.targets() & streamed:
            # The restored host tensors are the checkpoint's: fold the LoRAs into copies, as `set_loras` does for
            # resident weights (streamed ones got them at each materialisation).
            for name, parameter in self.named_parameters():
                if name in streamed and name in fold.targets():
                    parameter.data = fold.fold(name, parameter.data.clone())

    def streamed_parameter_names(self) -> frozenset[str]:
        """Parameters a residency materialises (streamed blocks and AdaLN projections, kept blocks, phase-scoped
        weights)."""
        return (self.block_residency.managed_parameters() | self.adaln_residency.managed_parameters()
                | self.weight_phases.managed_parameters())

    def set_weight_transform(self, transform) -> None:
        """`transform(tensors)` edits streamed weights in place each time they are materialised (a LoRA fold)."""
        self.block_residency.set_transform(transform)
        self.adaln_residency.set_transform(transform)
        self.weight_phases.set_transform(transform)

    @property
    def adaln_streamed_apart(self) -> bool:
        """The AdaLN projections are streamed as units of their own (`adaln_residency`), not with their blocks."""
        return not isinstance(self.adaln_residency, AllResident)

    def configure_chunking(self, chunk_size: int | None = None, memory_budget: int | None = None,
                           between_chunks=None) -> None:
        """Row chunking of the blocks and output heads: `chunk_size` rows (None: from `memory_budget`, None: fused).

        `between_chunks` (no arguments) runs after every chunk of a chunked loop: the backend's reclaim policy
        (None keeps the current one; the default does nothing).
        """
        self.chunking = ChunkingPolicy(chunk_size, memory_budget, between_chunks or self.chunking.between_chunks)

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

    def _check_precomputed(self, encoder_hidden_states, timestep, refined_text, modulation) -> None:
        if refined_text is not None:
            want = (*encoder_hidden_states.shape[:2], self.config.hidden_size)
            if tuple(refined_text.shape) != want:
                raise ValueError(f"refined_text must be {want} (refine_text(encoder_hidden_states)), got "
                                 f"{tuple(refined_text.shape)}.")
        if modulation is not None and modulation.rows != timestep.shape[0]:
            raise ValueError(f"modulation holds the tables of {modulation.rows} timesteps but this call has "
                             f"{timestep.shape[0]}; pass `plan.call(timestep)` for this call's timesteps.")

    def embed_time(self, timestep: torch.Tensor) -> torch.Tensor:
        """Distinct timesteps `[M]` -> the AdaLN input `silu(t_emb)`, kept float32 (each table casts it itself)."""
        return F.silu(self.time_embedder(timestep))

    def refine_text(self, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """Text states `[B, L, text_dim]` -> the refined text rows `[B, L, hidden]` every call of a request packs
        (condition projection + token refiner; their weights materialised for this phase only). Pass the result as
        `forward(..., refined_text=)` to skip recomputing it at every step."""
        with self.weight_phases.phase("text"):
            return self.token_refiner(self.condition_proj(encoder_hidden_states.to(self.condition_proj.weight.dtype)))

    def adaln_plan(self, timesteps_per_call, *, before_block: Callable[[int], None] | None = None) -> AdaLNPlan:
        """The `AdaLNPlan` of a run whose calls get the distinct timesteps `timesteps_per_call` (each `[M]`, as the
        forward gets them; calls with equal timesteps share their rows), in one pass over the blocks.

        Only the AdaLN projections are materialised (`adaln_residency`; a residency streaming whole blocks streams
        them whole); LoRAs folded into them apply. The tables are on the host, page-locked where copies to the device
        are asynchronous. `before_block(i)` is called before block i's projection is fetched.
        """
        keys, inputs = [], []
        device = self.time_embedder.proj_in.weight.device
        for timestep in timesteps_per_call:
            key = AdaLNPlan.key(timestep)
            if key not in keys:
                keys.append(key)
                inputs.append(timestep)
        rows = sum(len(key) for key in keys)
        platform = Platform.for_device(device)
        pin = platform.asynchronous_copies
        residency = self.adaln_residency if self.adaln_streamed_apart else self.block_residency
        tables = []
        with torch.no_grad():
            time_acts = [self.embed_time(t.to(device)) for t in inputs]  # the forward's `time_act`, call by call
            residency.begin_pass()
            try:
                for i, block in enumerate(self.blocks):
                    if before_block is not None:
                        before_block(i)
                    residency.acquire(i)
                    table, start = None, 0
                    for time_act in time_acts:
                        out = block.adaln_proj(time_act)
                        if table is None:
                            table = torch.empty((rows, out.shape[-1]), dtype=out.dtype, pin_memory=pin)
                        table[start : start + out.shape[0]].copy_(out)
                        start += out.shape[0]
                    residency.release(i)
                    tables.append(table)
            finally:
                residency.end_pass()
        return AdaLNPlan(keys, tables, non_blocking=pin)

    def adaln_plan_bytes(self, timesteps_per_call) -> int:
        """Host bytes `adaln_plan(timesteps_per_call)` takes, without building it."""
        rows = sum(len(key) for key in dict.fromkeys(AdaLNPlan.key(t) for t in timesteps_per_call))
        projection = self.blocks[0].adaln_proj.linear
        return len(self.blocks) * rows * projection.out_features * projection.weight.element_size()

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                token_tags, position_ids, video_indices, audio_indices, text_indices, return_dict: bool = False, *,
                chunking: ChunkingPolicy | None = None, before_block: Callable[[int], None] | None = None,
                refined_text: torch.Tensor | None = None, modulation: AdaLNCall | None = None,
                step_cache: StepCacheRun | None = None):
        """The diffusers call (`return_dict=True` gives an `H3DiTOutput` with diffusers' field names, False the
        tuple `(video, audio)`), plus options of this call only: `chunking` (default: the model's `chunking`),
        `before_block(i)`, called before block i is fetched (the place for a caller's interrupt check), and the
        step-invariant work done beforehand: `refined_text` (`refine_text(encoder_hidden_states)`, then the text
        refiner does not run) and `modulation` (this call's `AdaLNPlan.call(timestep)`, then no AdaLN projection
        runs or is materialised). Both give bitwise the outputs of the call without them. `step_cache` (one
        `StepCacheRun` for every call of a sampling run) may skip the middle blocks (see step_cache.py); a streamed
        block it skips is neither materialised nor read."""
        self._check_inputs(hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                           token_tags, position_ids, video_indices, audio_indices, text_indices)
        self._check_precomputed(encoder_hidden_states, timestep, refined_text, modulation)
        rows = position_ids.shape[0]
        residency, adaln = self.block_residency, self.adaln_residency
        # The AdaLN projections streamed apart are fetched only when this call projects its own tables.
        apart = modulation is None and self.adaln_streamed_apart
        passes = (residency, adaln) if apart else (residency,)
        order = list(range(len(self.blocks)))
        if step_cache is not None:
            step_cache.begin_call()
            order = step_cache.planned_order()  # the likely path: the reads ahead follow it
            for r in passes:
                r.set_order(order, next_head=step_cache.first_blocks)
        # The passes begin before the input projections: streamed blocks start arriving while those run.
        for r in passes:
            r.begin_pass()
        chunks = None
        try:
            rope = self.rope(position_ids)
            # Input projections; the fp32 islands run on fp32 rows and are rounded to the residual dtype afterwards.
            text = self.refine_text(encoder_hidden_states) if refined_text is None else refined_text
            video = self.video_patch_proj(hidden_states.to(self.video_patch_proj.weight.dtype))
            audio = self.audio_patch_proj(audio_hidden_states.to(self.audio_patch_proj.weight.dtype))
            x = text.new_zeros((text.shape[0], rows, text.shape[-1]))
            x = x.index_copy(1, text_indices, text)
            x = x.index_copy(1, video_indices, video.to(x.dtype))
            x = x.index_copy(1, audio_indices, audio.to(x.dtype))
            del text, video, audio  # now copied into x; alive through the blocks they would cost a full-length buffer

            time_act = self.embed_time(timestep)
            adaln_index = timestep_indices * NUM_MODALITIES + token_tags.clamp(min=0)
            chunks = (chunking or self.chunking).plan(rows, self.config, batch=x.shape[0], dtype=x.dtype,
                                                      device=x.device)
            block_input = first_output = None
            position = 0
            while position < len(order):
                i = order[position]
                position += 1
                block = self.blocks[i]
                if before_block is not None:
                    before_block(i)  # e.g. the caller's interrupt check, between blocks
                if step_cache is not None and i == 0:
                    block_input = x
                table = None
                if modulation is not None:
                    table = modulation.table(i, x.device)
                elif apart:
                    adaln.acquire(i)
                    table = block.adaln_proj(time_act)
                    adaln.release(i)
                residency.acquire(i)  # block i on the device (and the next `prefetch` on their way)
                x = block(x, time_act, adaln_index, rope, chunks, table=table)
                residency.release(i)
                if step_cache is None:
                    continue
                if i == step_cache.decision_block:
                    hit = step_cache.decide(block_input, x)
                    block_input = None
                    order = step_cache.order_after_decision(hit)
                    for r in passes:
                        r.set_order(order, next_head=step_cache.first_blocks)
                    if hit:
                        x = step_cache.apply(x)
                    else:
                        first_output = x
                elif first_output is not None and i == step_cache.middle[-1]:
                    step_cache.record_middle(first_output, x)
                    first_output = None
        except torch.OutOfMemoryError as exc:
            raise out_of_memory_error(exc, rows, chunks.size if chunks is not None else None) from None
        finally:
            for r in passes:
                r.end_pass()  # also after an exception in a block: the next forward starts clean

        video, audio = self.final_layer(x, time_act, timestep_indices, video_indices, audio_indices, chunks)
        return H3DiTOutput(video, audio) if return_dict else (video, audio)


class H3DiTOutput(NamedTuple):
    """`forward(..., return_dict=True)`: the fields of diffusers' `MiniMaxH3TransformerOutput` (a tuple as well)."""

    sample: torch.Tensor  # video velocity rows, in `video_indices` order
    audio_sample: torch.Tensor  # audio velocity rows, in `audio_indices` order
