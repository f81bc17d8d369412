"""The Qwen3-VL language path as H3 uses it: token embeddings and the first `layer` decoder layers.

The conditioning is `hidden_states[layer]` of the Hugging Face model (layer 50 of 64 for H3): the raw residual stream
after decoder layer `layer - 1`, with no final norm. Decoder layers above it, the final norm and `lm_head` are never
built. Each layer is pre-norm: RMSNorm, grouped-query attention with per-head q/k RMSNorm and interleaved multimodal
RoPE (sections t/h/w), then RMSNorm and a SwiGLU MLP.

Precision follows the reference: weights and the residual stream in the checkpoint dtype (bf16), RMSNorm computed
in float32 and rounded back before its scale, rotary angles computed in float32 and rounded to the activation dtype.

FL2VA keyframes run through the vision tower (`vision_tower.py`); its merged features replace the `<|image_pad|>`
embeddings and its deep-stack features are added to those rows after the first decoder layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime.chunking import (FUSED, ChunkingBackend, RowChunks, backend_row_limit,
                                 warn_chunk_size_clamped)
from ..errors import H3Error
from ..runtime.phase_scoped import PhaseScopedWeights
from ..runtime.residency import AllResident
from .tokenizer import ReferenceTokens
from .vision_tower import (ImageProcessorConfig, PreparedImage, VisionTower, VisionTowerConfig, config_number,
                           prepare_image, prepare_video)


# ---- configuration ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LanguageModelConfig:
    """Hyper-parameters of the Qwen3-VL language model. Defaults are Qwen3-VL-32B, H3's text encoder."""

    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 25600
    num_hidden_layers: int = 64
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    attention_bias: bool = False

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise H3Error(f"text config: {name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise H3Error(f"text config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads {self.num_key_value_heads}.")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2 or self.head_dim % 2:
            raise H3Error(f"text config: mrope_section {list(self.mrope_section)} must be three sizes (t, h, w) that "
                          f"add up to head_dim / 2 = {self.head_dim // 2}.")
        if self.mrope_section[1] > self.mrope_section[0] or self.mrope_section[2] > self.mrope_section[0]:
            raise H3Error(f"text config: interleaved mrope_section {list(self.mrope_section)} needs the t section to "
                          "be the largest.")

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "LanguageModelConfig":
        """From a Qwen3-VL `text_config`; missing optional fields take transformers' defaults."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if name not in raw:
                raise H3Error(f"text_config has no '{name}'.")
        if raw.get("hidden_act", "silu") != "silu":
            raise H3Error(f"text_config.hidden_act is {raw['hidden_act']!r}; Qwen3-VL uses 'silu'.")
        # transformers >= 5 writes rope_parameters; 4.x wrote rope_theta plus rope_scaling.
        rope = dict(raw.get("rope_scaling") or {})
        rope.update(raw.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise H3Error(f"text_config rope_type {rope_type!r} (RoPE scaling) is not supported; H3's encoder uses "
                          "plain interleaved mRoPE.")
        number = lambda key, default=None, **kw: config_number(raw, key, default, "text_config", **kw)  # noqa: E731
        heads = number("num_attention_heads")
        section = rope.get("mrope_section", (24, 20, 20))
        if not isinstance(section, (list, tuple)) or not all(type(v) is int and v > 0 for v in section):
            raise H3Error(f"text_config mrope_section must be a list of positive integers, got {section!r}.")
        return cls(
            vocab_size=number("vocab_size"),
            hidden_size=number("hidden_size"),
            intermediate_size=number("intermediate_size"),
            num_hidden_layers=number("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=number("num_key_value_heads", heads) if raw.get("num_key_value_heads") else heads,
            head_dim=number("head_dim", 128) if raw.get("head_dim") else 128,
            rms_norm_eps=number("rms_norm_eps", 1e-6, real=True),
            rope_theta=config_number(rope, "rope_theta", raw.get("rope_theta", 500_000.0), "text_config", real=True),
            mrope_section=tuple(section),
            attention_bias=bool(raw.get("attention_bias", False)),
        )


@dataclass(frozen=True)
class TextEncoderConfig:
    """The language model and, when the checkpoint has one, the vision tower."""

    language: LanguageModelConfig = LanguageModelConfig()
    vision: VisionTowerConfig | None = VisionTowerConfig()

    def __post_init__(self):
        if self.vision is not None and self.vision.out_hidden_size != self.language.hidden_size:
            raise H3Error(f"vision_config.out_hidden_size {self.vision.out_hidden_size} differs from the language "
                          f"model's hidden_size {self.language.hidden_size}.")

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "TextEncoderConfig":
        """From a `Qwen3VLForConditionalGeneration` `config.json` (or a bare text config)."""
        text = raw.get("text_config", raw)
        if not isinstance(text, Mapping):
            raise H3Error("text_config is not an object.")
        vision_raw = raw.get("vision_config")
        vision = VisionTowerConfig.from_hf_dict(vision_raw) if isinstance(vision_raw, Mapping) else None
        return cls(LanguageModelConfig.from_hf_dict(text), vision)

    def without_vision(self) -> "TextEncoderConfig":
        return dataclasses.replace(self, vision=None)


# ---- building blocks -------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen's RMSNorm: normalise in float32, round to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class InterleavedMRoPE(nn.Module):
    """Multimodal RoPE with the t/h/w frequencies interleaved: frequency j follows axis h when j % 3 == 1 and
    j < 3 * sections[1], axis w when j % 3 == 2 and j < 3 * sections[2], else axis t. Rotate-half convention."""

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, int, int]):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        axis = [0] * (head_dim // 2)
        for which in (1, 2):
            for j in range(which, 3 * sections[which], 3):
                axis[j] = which
        self.axis_of_frequency = axis

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` (3, L) integer t/h/w positions -> float32 cos, sin of shape (L, head_dim)."""
        device = positions.device
        # Recomputed per call (cheap) so the module holds no buffer that loading on the meta device would orphan.
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).to(torch.float32)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        axis = torch.tensor(self.axis_of_frequency, device=device)
        per_frequency = positions.to(torch.float32)[axis]  # (head_dim / 2, L)
        angles = (per_frequency * inv_freq[:, None]).transpose(0, 1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, L, D) queries against (B, H_kv, S, D) keys/values, causal (or the given boolean `mask`, for a chunk of
    queries); K/V heads shared by groups of queries."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, config: LanguageModelConfig):
        super().__init__()
        c = config
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _rotated(self, proj: nn.Linear, norm: RMSNorm, x, cos, sin) -> torch.Tensor:
        batch, rows, _ = x.shape
        h = norm(proj(x).view(batch, rows, -1, self.head_dim)).transpose(1, 2)
        # The reference rounds cos/sin to the activation dtype before rotating.
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        return h * cos + rotate_half(h) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                chunks: RowChunks = FUSED) -> torch.Tensor:
        """One forward for every chunk size (`FUSED` is one chunk of all rows): keys and values are projected chunk
        by chunk, then each chunk of queries attends to the keys up to its last row (causal)."""
        batch, rows, _ = x.shape
        keys = values = out = None
        for start, end in chunks.ranges(rows):
            k = self._rotated(self.k_proj, self.k_norm, x[:, start:end], cos[start:end], sin[start:end])
            v = self.v_proj(x[:, start:end]).view(batch, end - start, -1, self.head_dim).transpose(1, 2)
            if end - start == rows:  # one chunk: the projections are the full-length keys and values, no copy
                keys, values = k, v
                continue
            if keys is None:
                keys = k.new_empty(k.shape[:2] + (rows, self.head_dim))
                values = v.new_empty(keys.shape)
            keys[:, :, start:end], values[:, :, start:end] = k, v
        for start, end in chunks.ranges(rows):
            q = self._rotated(self.q_proj, self.q_norm, x[:, start:end], cos[start:end], sin[start:end])
            # Query row i (absolute start + i) sees keys 0 .. start + i; for all rows that is plain causal attention.
            mask = None if end - start == rows else \
                torch.ones(end - start, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
            attended = causal_attention(q, keys[:, :, :end], values[:, :, :end], mask)
            result = self.o_proj(attended.transpose(1, 2).reshape(batch, end - start, -1))
            if end - start == rows:
                return result
            out = result.new_empty((batch, rows, result.shape[-1])) if out is None else out
            out[:, start:end] = result
        return out


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LanguageModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                chunks: RowChunks = FUSED) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, chunks)
        # Rows are independent in the MLP: one chunk at a time, written into the new residual `x` in place.
        for start, end in chunks.ranges(x.shape[1]):
            rows = x[:, start:end]
            x[:, start:end] = rows + self.mlp(self.post_attention_layernorm(rows))
        return x


@dataclass(frozen=True)
class _RowWidths:
    """A decoder layer's widths as the chunking's limits read them (`chunking.RowWidths`)."""

    hidden_size: int
    inner_dim: int
    ffn_dim: int
    num_attention_heads: int


class LanguageModel(nn.Module):
    """Token embeddings and the first `num_layers` decoder layers; no final norm, no head."""

    def __init__(self, config: LanguageModelConfig, num_layers: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(num_layers))
        self.rotary = InterleavedMRoPE(config.head_dim, config.rope_theta, config.mrope_section)
        # Where the decoder layers' weights live while the forward runs; load_text_encoder(residency="layerwise")
        # replaces it with a manager that streams them one layer at a time (see residency.py).
        self.block_residency = AllResident(num_layers)
        # Rows per chunk of attention queries and MLP for long prompts (None: the fused path).
        self.chunk_size: int | None = None
        # The device's hard limits (MPS: no buffer over 4 GiB, so no materialised score matrix of a prompt over
        # about 5.8k rows in one call): the platform's `chunking`; None sets none.
        self.chunking: ChunkingBackend | None = None

    def chunk_rows(self, rows: int, batch: int, element_bytes: int) -> int | None:
        """Rows per chunk for a prompt of `rows` rows: `chunk_size`, lowered to the device's hard limit (with a
        `ChunkSizeClamped` warning when an explicit size was), as the transformer's chunks are."""
        if self.chunking is None:
            return self.chunk_size
        c = self.config
        widths = _RowWidths(c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size,
                            c.num_attention_heads)
        hard = backend_row_limit(rows, widths, batch=batch, element_bytes=element_bytes, backend=self.chunking)
        if hard is None or (self.chunk_size is not None and self.chunk_size <= hard):
            return self.chunk_size
        if self.chunk_size is not None:
            warn_chunk_size_clamped(self.chunk_size, hard, rows, self.chunking)
        return hard

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, visual_rows: torch.Tensor | None = None,
                deepstack: Sequence[torch.Tensor] = (),
                check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """`inputs_embeds` (1, L, hidden), `positions` (3, L) -> the residual stream after the last layer.

        `deepstack[i]` is added to the `visual_rows` after layer i; the last layer's output is read before any
        addition (the reference records `hidden_states[i + 1]` before it too). `check_interrupt()` (optional) runs
        before every layer and after every row chunk, and may raise to stop.
        """
        cos, sin = self.rotary(positions)
        x = inputs_embeds
        batch, rows, _ = inputs_embeds.shape
        chunks = RowChunks(self.chunk_rows(rows, batch, inputs_embeds.element_size()),
                           check_interrupt=check_interrupt)
        last = len(self.layers) - 1
        residency = self.block_residency
        residency.begin_pass()
        try:
            for index, layer in enumerate(self.layers):
                if check_interrupt is not None:
                    check_interrupt()
                residency.acquire(index)  # layer `index` on the device (and the next `prefetch` on their way)
                x = layer(x, cos, sin, chunks)
                residency.release(index)
                if index < len(deepstack) and index < last:
                    x = x.index_add(1, visual_rows, deepstack[index].to(x.dtype)[None])
        finally:
            residency.end_pass()  # also after an exception in a layer: the next prompt starts clean
        return x


def text_positions(num_tokens: int, device=None) -> torch.Tensor:
    """Text-only positions: the same arange on all three axes (3, L)."""
    return torch.arange(num_tokens, device=device).expand(3, num_tokens)


def multimodal_positions(num_tokens: int, image_spans: Sequence[tuple[int, int]],
                         merged_grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Qwen3-VL's 3-axis positions (3, L): text runs count up on all axes; an image's pad run of `t x h x w` merged
    tokens starts every axis at the running position p (t stays p, h = p + row, w = p + column), and the text after
    it resumes at p + max(h, w)."""
    positions = torch.empty(3, num_tokens, dtype=torch.long)
    cursor = 0  # next position value
    done = 0  # tokens placed
    for (start, count), (t, h, w) in zip(image_spans, merged_grids):
        if t * h * w != count or start < done:
            raise H3Error(f"image span ({start}, {count}) does not match its merged grid {(t, h, w)}.")
        positions[:, done:start] = torch.arange(start - done) + cursor
        cursor += start - done
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        positions[0, start : start + count] = frame.flatten() + cursor
        positions[1, start : start + count] = row.flatten() + cursor
        positions[2, start : start + count] = col.flatten() + cursor
        cursor += max(h, w)
        done = start + count
    positions[:, done:] = torch.arange(num_tokens - done) + cursor
    return positions


# ---- the encoder -----------------------------------------------------------------------------------------------------


class TextEncoder(nn.Module):
    """H3's conditioner: `encode(prompt, images=())` -> `(states [L, hidden], tags [L])`.

    `layer` decoder layers are built; the states are `hidden_states[layer]`. Load it with
    `h3_core.load_text_encoder`, which also attaches the tokenizer and the image preprocessing.
    """

    def __init__(self, config: TextEncoderConfig, layer: int):
        super().__init__()
        if not isinstance(layer, int) or isinstance(layer, bool) or not 1 <= layer <= config.language.num_hidden_layers:
            raise H3Error(f"layer={layer!r}: must be an integer from 1 to {config.language.num_hidden_layers} (the "
                          "model's decoder layers); H3 reads layer 50.")
        self.config = config
        self.layer = layer
        self.language_model = LanguageModel(config.language, layer)
        self.vision_tower = VisionTower(config.vision) if config.vision is not None else None
        self.tokenizer = None  # an H3Tokenizer, attached by the loader
        self.missing_vision: str | None = None  # why a GGUF language file has no vision tower (the loader's words)
        self.image_processor = ImageProcessorConfig()
        # Phase-scoped weights ("embeddings": the token table, "vision": the vision tower) when loaded layerwise.
        self.weight_phases = PhaseScopedWeights()

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, images: Sequence[PreparedImage] = (),
                image_spans: Sequence[tuple[int, int]] = (),
                check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Token ids (L,) and, for each image, its prepared patches and its pad run -> states (L, hidden).
        `check_interrupt()` (optional) runs between the vision blocks, the decoder layers and their row chunks."""
        if len(images) != len(image_spans):
            raise H3Error(f"{len(images)} prepared images but {len(image_spans)} image spans in the tokens.")
        device = self.device
        ids = input_ids.to(device=device, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise H3Error("no tokens to encode; an empty prompt is presented as one <|endoftext|> token.")
        if int(ids.max()) >= self.config.language.vocab_size or int(ids.min()) < 0:
            raise H3Error(f"token id {int(ids.max())} is outside the encoder's vocabulary of "
                          f"{self.config.language.vocab_size}; the tokenizer does not belong to this checkpoint.")
        with self.weight_phases.phase("embeddings"):
            x = self.language_model.embed_tokens(ids)[None]
        visual_rows, deepstack = None, ()
        if images:
            if self.vision_tower is None:
                raise self.no_vision_error("keyframe images")
            with self.weight_phases.phase("vision"):
                merged, deepstack = self.vision_tower(images, check_interrupt)
            visual_rows = torch.cat([torch.arange(s, s + n) for s, n in image_spans]).to(device)
            if merged.shape[0] != visual_rows.numel():
                raise H3Error(f"the images give {merged.shape[0]} vision features but the tokens hold "
                              f"{visual_rows.numel()} <|image_pad|> rows.")
            x = x.index_copy(1, visual_rows, merged.to(x.dtype)[None])
            merged_grids = [image.merged_grid for image in images]
            positions = multimodal_positions(ids.numel(), image_spans, merged_grids).to(device)
        else:
            positions = text_positions(ids.numel(), device)
        return self.language_model(x, positions, visual_rows, deepstack, check_interrupt)[0]

    def no_vision_error(self, what: str) -> H3Error:
        """The one error for images given to an encoder without a vision tower; a GGUF language file's
        (`missing_vision`, set by the loader) says where its mmproj goes."""
        if self.missing_vision:
            return H3Error(f"cannot encode {what}: {self.missing_vision}")
        return H3Error(f"this text-encoder checkpoint has no vision tower ('visual.*' weights), so it cannot encode "
                       f"{what}. Use a checkpoint that includes the Qwen3-VL vision tower.")

    def close(self, restore: bool = True) -> None:
        """Drop the residency manager and phase-scoped weights: every streamed parameter gets its host tensor back
        (the memory map; on the CPU), and the forward then runs with all weights where they are. A resident encoder
        has nothing to release. `H3Pipeline.release` calls this with `restore=False` (the encoder is dropped)."""
        self.language_model.block_residency.close(restore)
        self.language_model.block_residency = AllResident(len(self.language_model.layers))
        self.weight_phases.close(restore)
        self.weight_phases = PhaseScopedWeights()

    @torch.no_grad()
    def encode(self, prompt: str, images=(), *,
               check_interrupt: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states[layer]` of the presentation of `prompt` with keyframe `images` in front, and the per-token
        DiT tags (1 text, 0 vision block; a CPU tensor). Images: PIL images, HWC uint8 arrays, or [H, W, C] /
        [B, H, W, C] tensors in [0, 1] (ComfyUI IMAGE; each batch item is one keyframe). `check_interrupt()`
        (optional) runs between layers and row chunks and may raise to stop; the encoder stays usable."""
        if self.tokenizer is None:
            raise H3Error("this text encoder has no tokenizer; load it with h3_core.load_text_encoder(..., "
                          "tokenizer=<tokenizer.json>).")
        images = _as_image_list(images)
        if images and self.vision_tower is None:
            raise self.no_vision_error("keyframe images")
        prepared = [prepare_image(image, self.image_processor, index=i + 1) for i, image in enumerate(images)]
        presentation = self.tokenizer.present(prompt, [image.num_tokens for image in prepared])
        states = self(torch.tensor(presentation.token_ids), prepared, presentation.image_spans, check_interrupt)
        return states, torch.tensor(presentation.tags, dtype=torch.long)


    @torch.no_grad()
    def encode_references(self, prompt: str, references, *,
                          check_interrupt: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The Ref2VA presentation's `hidden_states[layer]` and tags. `references`, in request order:
        `("image", image)`, `("video", sampled frames, block seconds, has_audio)` (the 2 fps frames and one time
        per merged pair) or `("audio",)` (a label only: audio never enters the encoder). `check_interrupt` as
        `encode`'s."""
        if self.tokenizer is None:
            raise H3Error("this text encoder has no tokenizer; load it with h3_core.load_text_encoder(..., "
                          "tokenizer=<tokenizer.json>).")
        prepared: list[PreparedImage] = []
        tokens: list[ReferenceTokens] = []
        counts = {"image": 0, "video": 0}
        for entry in references:
            kind = entry[0]
            if kind in ("image", "video") and self.vision_tower is None:
                raise self.no_vision_error(f"reference {kind}s")
            if kind == "image":
                counts["image"] += 1
                image = prepare_image(entry[1], self.image_processor, index=counts["image"])
                prepared.append(image)
                tokens.append(ReferenceTokens("image", image.num_tokens))
            elif kind == "video":
                counts["video"] += 1
                _, frames, seconds, has_audio = entry
                blocks = prepare_video(frames, self.image_processor, index=counts["video"])
                if len(blocks) != len(seconds):
                    raise H3Error(f"video {counts['video']}: {len(blocks)} merged frame pairs but {len(seconds)} "
                                  "block timestamps.")
                prepared.extend(blocks)
                tokens.append(ReferenceTokens("video", blocks[0].num_tokens, tuple(seconds), bool(has_audio)))
            elif kind == "audio":
                tokens.append(ReferenceTokens("audio", has_audio=True))
            else:
                raise H3Error(f"reference kind must be 'image', 'video' or 'audio', got {kind!r}.")
        presentation = self.tokenizer.present_references(prompt, tokens)
        states = self(torch.tensor(presentation.token_ids), prepared, presentation.image_spans, check_interrupt)
        return states, torch.tensor(presentation.tags, dtype=torch.long)


def _as_image_list(images) -> list:
    if images is None:
        return []
    if isinstance(images, torch.Tensor):
        # A ComfyUI IMAGE batch [B, H, W, C]: one keyframe per batch item.
        return list(images) if images.ndim == 4 else [images]
    if not isinstance(images, (list, tuple)):
        return [images]
    return list(images)
