"""The H3 video VAE ("f16t4d24"): a causal 3-D CNN encoder and a ViT decoder, with the reference's temporal clip
chunking and spatial tiling.

Module names follow the original (native) checkpoint, so native and ComfyUI files map onto the parameters one to one.
The decoder's fused QKV weight is held in logical `[q_all; k_all; v_all]` row order (the native file interleaves it
per head; the loader de-interleaves once) and its SwiGLU input projection as `[gate; value]` (the native order).

Pixel space at the public API is RGB in [0, 1], frames last (`[B, F, H, W, 3]`); inside, the networks see
ImageNet-normalised `[B, 3, F, H, W]`. Latents at the public API are normalised per channel with the checkpoint's
`latents_mean` / `latents_std`.

Memory: decoding works clip by clip (7 latent frames -> 28 pixel frames) and, inside a clip, tile by tile; decoded
frames are blended and written straight into a preallocated output buffer (CPU by default), so the device holds at
most one clip canvas, one raw tile and the overlap strips the blend still needs, whatever the video length.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import H3Error
from ..runtime.phase_scoped import PhaseScopedWeights
from ..runtime.residency import AllResident

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Published per-channel latent statistics of the released video VAE (identical to `video_vae/config.json` of the
# release and to ComfyUI's hard-coded lists); used when a ComfyUI file does not carry them.
PUBLISHED_LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075,
    -0.2727581858634949, -1.3675414323806763, -0.2553254961967468, -0.26907554268836975,
    -0.5376840829849243, -0.0464097298681736, 0.6657370328903198, 0.19690127670764923,
    -0.5460608005523682, -0.4035342037677765, -0.23683024942874908, 0.25928452610969543,
    -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)
PUBLISHED_LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.68317747116088865, 1.7549455165863037,
    1.5636216402053833, 2.194143533706665, 0.96531379222869875, 1.05698859691619875,
    0.841948926448822, 0.7729952931404114, 1.8955937623977661, 0.946841835975647,
    0.7996809482574463, 0.44988900423049925, 0.7197399735450745, 0.69362932443618775,
    2.961095094680786, 2.7694199085235595, 3.0496184825897215, 2.1088054180145265,
    3.276226282119751, 3.1627357006073, 2.28168129920959475, 2.6127843856811525,
)


# ---- configuration ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoVAEConfig:
    """Architecture and latent geometry of the video VAE. Defaults are the released model."""

    in_channels: int = 3
    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    decoder_num_layers: int = 36
    decoder_num_heads: int = 32
    decoder_head_dim: int = 64
    decoder_ffn_dim: int = 8192
    decoder_num_register_tokens: int = 4
    decoder_rope_theta: float = 100.0
    decoder_rope_dim_ratio: float = 0.75
    decoder_norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = PUBLISHED_LATENTS_MEAN
    latents_std: tuple[float, ...] = PUBLISHED_LATENTS_STD

    def __post_init__(self):
        levels = len(self.block_out_channels)
        if not (len(self.spatial_downsample_factors) == len(self.temporal_downsample_factors) == levels):
            raise ValueError(f"block_out_channels, spatial_downsample_factors and temporal_downsample_factors must "
                             f"have one entry per level; got {levels}, {len(self.spatial_downsample_factors)} and "
                             f"{len(self.temporal_downsample_factors)}.")
        for width in self.block_out_channels:
            if width % self.norm_num_groups:
                raise ValueError(f"encoder width {width} is not divisible by norm_num_groups={self.norm_num_groups}.")
        for s, t in zip(self.spatial_downsample_factors, self.temporal_downsample_factors):
            if s not in (1, 2) or t not in (1, 2):
                raise ValueError(f"downsample factors must be 1 or 2, got spatial {s}, temporal {t}.")
        if self.rope_dim % 6 or self.rope_dim > self.decoder_head_dim:
            raise ValueError(f"decoder_head_dim * decoder_rope_dim_ratio = {self.rope_dim} must be a multiple of 6 "
                             f"(two halves x three axes) and at most decoder_head_dim={self.decoder_head_dim}.")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError(f"latents_mean / latents_std need {self.latent_channels} values each, got "
                             f"{len(self.latents_mean)} / {len(self.latents_std)}.")
        if any(not s > 0 for s in self.latents_std):
            raise ValueError("every latents_std value must be positive.")
        if self.clip_length < 1 or not 0 <= self.token_drop < self.tokens_per_chunk:
            raise ValueError(f"clip_length={self.clip_length} / token_drop={self.token_drop} do not form a valid "
                             "temporal chunking (need clip_length >= 1 and 0 <= token_drop < tokens per clip).")

    @property
    def spatial_ratio(self) -> int:
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_ratio(self) -> int:
        return math.prod(self.temporal_downsample_factors)

    @property
    def decoder_dim(self) -> int:
        return self.decoder_num_heads * self.decoder_head_dim

    @property
    def rope_dim(self) -> int:
        """Head channels rotated by the decoder RoPE (48 of 64 for the released model)."""
        return int(self.decoder_head_dim * self.decoder_rope_dim_ratio)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_ratio * self.spatial_ratio ** 2

    # Temporal chunking, derived as in the reference: a 17-frame clip is not a multiple of 4, so the decoder drops an
    # implicit leading pad and cross-fades the tail that token_drop leaves behind.
    @property
    def frame_pre_padding(self) -> int:
        return (-self.clip_length) % self.temporal_ratio

    @property
    def tokens_per_chunk(self) -> int:
        return math.ceil(self.clip_length / self.temporal_ratio)

    @property
    def token_overlap(self) -> int:
        return (-self.token_drop) % self.tokens_per_chunk

    @property
    def frame_overlap(self) -> int:
        return max(self.token_overlap * self.temporal_ratio - self.frame_pre_padding, 0)


@dataclass(frozen=True)
class TilingOptions:
    """Spatial tiling in pixels. The reference (and the released frames) use 256-px tiles with >= 64-px overlaps."""

    enabled: bool = True
    tile_size: int = 256
    min_overlap: int = 64

    def check(self, spatial_ratio: int) -> "TilingOptions":
        if not self.enabled:
            return self
        for name, value in (("tile_size", self.tile_size), ("tile_min_overlap", self.min_overlap)):
            if not isinstance(value, int) or value <= 0 or value % spatial_ratio:
                raise H3Error(f"{name}={value!r}: must be a positive multiple of {spatial_ratio} pixels (one latent "
                              f"cell). The reference uses tile_size=256, tile_min_overlap=64.")
        if self.min_overlap >= self.tile_size:
            raise H3Error(f"tile_min_overlap={self.min_overlap} must be smaller than tile_size={self.tile_size}.")
        return self


@dataclass(frozen=True)
class DecodeAutocast:
    """The decoder's autocast region: `dtype=None` means none (the fp32 weights compute in fp32). Which dtype a
    device uses is the platform's rule (`Platform.decode_autocast_dtype`: fp16 on CUDA only, as the reference)."""

    device_type: str
    dtype: torch.dtype | None = None

    def context(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def _full_precision(x: torch.Tensor):
    """Leave autocast for a region the reference keeps fp32 (embedding, norms, output projection)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return nullcontext()


# ---- encoder: causal 3-D CNN -----------------------------------------------------------------------------------------


class CausalConv3d(nn.Conv3d):
    """3-D convolution with reflect padding in space and causal zero padding in time (frames in front only)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride=1, spatial_padding: int = 0,
                 temporal_padding: int = 0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        self.spatial_padding = spatial_padding
        self.temporal_padding = temporal_padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.spatial_padding
        if p:
            x = F.pad(x, (p, p, p, p, 0, 0), mode="reflect")
        if self.temporal_padding:
            x = F.pad(x, (0, 0, 0, 0, self.temporal_padding, 0))
        return F.conv3d(x, self.weight, self.bias, stride=self.stride)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm with statistics per frame: time is folded into the batch so frames never mix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, 1, h, w)
        frames = F.group_norm(frames, self.num_groups, self.weight, self.bias, self.eps)
        return frames.view(b, t, c, h, w).permute(0, 2, 1, 3, 4).contiguous()


class EncoderResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int, eps: float):
        super().__init__()
        self.norm1 = FrameGroupNorm(groups, in_channels, eps=eps)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, spatial_padding=1, temporal_padding=2)
        self.norm2 = FrameGroupNorm(groups, out_channels, eps=eps)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, spatial_padding=1, temporal_padding=2)
        self.nin_shortcut = CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        shortcut = self.nin_shortcut(x) if self.nin_shortcut is not None else x
        return shortcut + h


class Downsample(nn.Module):
    """Strided 3x3x3 conv; a spatial stride of 2 is preceded by a reflect pad of one row and column bottom-right."""

    def __init__(self, channels: int, temporal_stride: int, spatial_stride: int):
        super().__init__()
        self.spatial_stride = spatial_stride
        self.conv = CausalConv3d(channels, channels, 3, stride=(temporal_stride, spatial_stride, spatial_stride),
                                 temporal_padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spatial_stride == 2:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode="reflect")
        return self.conv(x)


class EncoderLevel(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, temporal_stride: int,
                 spatial_stride: int, groups: int, eps: float):
        super().__init__()
        self.block = nn.ModuleList(
            EncoderResnetBlock(in_channels if i == 0 else out_channels, out_channels, groups, eps)
            for i in range(num_blocks))
        self.downsample = (Downsample(out_channels, temporal_stride, spatial_stride)
                           if temporal_stride * spatial_stride > 1 else None)

    def forward(self, x: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """`check_interrupt()` (optional) runs before every block and the downsampling (a 256 px tile's first level
        took about a second on 2 loaded CPU cores even at the tiny model's widths)."""
        for block in self.block:
            if check_interrupt is not None:
                check_interrupt()
            x = block(x)
        if self.downsample is None:
            return x
        if check_interrupt is not None:
            check_interrupt()
        return self.downsample(x)


class VideoEncoder(nn.Module):
    """`[B, 3, F, H, W]` ImageNet-normalised pixels -> `[B, 2 * latent_channels, T, H/16, W/16]` (mean | logvar)."""

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        c = config
        widths = c.block_out_channels
        self.conv_in = CausalConv3d(c.in_channels, widths[0], 3, spatial_padding=1, temporal_padding=2)
        self.down = nn.ModuleList(
            EncoderLevel(widths[max(i - 1, 0)], widths[i], c.layers_per_block, c.temporal_downsample_factors[i],
                         c.spatial_downsample_factors[i], c.norm_num_groups, c.norm_eps)
            for i in range(len(widths)))
        self.norm_out = FrameGroupNorm(c.norm_num_groups, widths[-1], eps=c.norm_eps)
        self.conv_out = CausalConv3d(widths[-1], 2 * c.latent_channels, 3, spatial_padding=1, temporal_padding=2)

    def forward(self, x: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """`check_interrupt()` (optional) runs inside every level (see `EncoderLevel`) and may raise to stop."""
        x = self.conv_in(x)
        for level in self.down:
            x = level(x, check_interrupt)
        return self.conv_out(F.silu(self.norm_out(x)))


# ---- decoder: ViT over latent voxels ---------------------------------------------------------------------------------


def decoder_rotary(frames: int, height: int, width: int, suffix: int, rope_dim: int, theta: float,
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[N + suffix, rope_dim]` (float32) for a `frames x height x width` token grid plus suffix tokens.

    Coordinates are length-normalised per axis, `((i + 0.5) / n) * 2 - 1`, so the decoder sees the same positions at
    any tile or chunk size; suffix tokens sit at 0 on every axis. Angles `2 pi * coord * theta^(-j / F)` per axis are
    laid out `[t | h | w]` and repeated for the two rotate-half halves.
    """
    per_axis = rope_dim // 6
    inv_freq = 1.0 / theta ** (torch.arange(per_axis, dtype=torch.float32, device=device) / per_axis)
    axes = [2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0 for n in (frames, height, width)]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    coords = torch.cat((coords, coords.new_zeros(suffix, 3)))
    angles = 2.0 * math.pi * coords[:, :, None] * inv_freq[None, None, :]
    angles = angles.flatten(1).repeat(1, 2)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) rotation of the first `cos.shape[-1]` channels of every head; `x` is `[B, N, heads, D]`."""
    rot = cos.shape[-1]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    rotary, passthrough = x[..., :rot], x[..., rot:]
    first, second = rotary.chunk(2, dim=-1)
    turned = torch.cat((-second, first), dim=-1)
    return torch.cat((rotary * cos + turned * sin, passthrough), dim=-1)


class DecoderAttention(nn.Module):
    """Self-attention with a fused, biased QKV projection (rows `[q; k; v]`) and per-head RMS-normalised q / k."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.eps = eps
        self.to_qkv = nn.Linear(dim, 3 * heads * head_dim, bias=True)
        self.to_out = nn.Linear(heads * head_dim, dim, bias=True)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention over every token of the tile, `[B, N, heads, D]` in and out.

        The single attention call of the decoder: a chunked-attention implementation replaces this method.
        """
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.to_qkv(x).view(batch, tokens, 3, self.heads, self.head_dim).unbind(2)
        # The reference normalises q / k in float32 whatever the compute dtype.
        with _full_precision(x):
            q = F.rms_norm(q.float(), (self.head_dim,), eps=self.eps).to(q.dtype)
            k = F.rms_norm(k.float(), (self.head_dim,), eps=self.eps).to(k.dtype)
        q = _rotate(q, *rope)
        k = _rotate(k, *rope)
        out = self.attend(q, k, v)
        return self.to_out(out.reshape(batch, tokens, self.heads * self.head_dim))


class DecoderFeedForward(nn.Module):
    """SwiGLU: `w2(silu(gate) * value)`, `w1` rows stored `[gate; value]` (the native order)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * hidden, bias=True)
        self.w2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * value)


class DecoderBlock(nn.Module):
    """Pre-norm block; each residual branch is scaled by a learned per-channel vector."""

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        c = config
        dim = c.decoder_dim
        self.eps = c.decoder_norm_eps
        self.norm1 = nn.RMSNorm(dim, eps=c.decoder_norm_eps)
        self.attn = DecoderAttention(dim, c.decoder_num_heads, c.decoder_head_dim, c.decoder_norm_eps)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = nn.RMSNorm(dim, eps=c.decoder_norm_eps)
        self.ff = DecoderFeedForward(dim, c.decoder_ffn_dim)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def _norm(self, norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 (as the reference), then handed to the projections in their dtype.
        with _full_precision(x):
            return norm(x.float()).to(self.attn.to_qkv.weight.dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self._norm(self.norm1, x), rope) * self.scale1
        return x + self.ff(self._norm(self.norm2, x)) * self.scale2


class VideoDecoder(nn.Module):
    """`[B, latent_channels, T, h, w]` -> `[B, 3, 4T, 16h, 16w]` ImageNet-normalised pixels.

    One token per latent voxel (t, h, w order), then the learned register tokens and one zero token, all at position 0;
    full attention over the tile; the suffix is dropped and each token becomes a `4 x 16 x 16` pixel block.
    """

    def __init__(self, config: VideoVAEConfig):
        super().__init__()
        c = config
        self.config = c
        dim = c.decoder_dim
        self.x_embedder = nn.Linear(c.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, c.decoder_num_register_tokens, dim))
        self.transformer_blocks = nn.ModuleList(DecoderBlock(c) for _ in range(c.decoder_num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=c.decoder_norm_eps)
        self.proj_out = nn.Linear(dim, c.patch_dim)
        # Where the transformer blocks' weights live during a forward (one forward per tile of a clip);
        # load_video_vae(residency="layerwise") replaces it with a manager that streams them (see residency.py).
        self.block_residency = AllResident(c.decoder_num_layers)

    def forward(self, latent: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """`check_interrupt()` (optional) runs before every block and may raise to stop (the streamed blocks are
        released)."""
        c = self.config
        batch, channels, frames, height, width = latent.shape
        tokens = latent.permute(0, 2, 3, 4, 1).reshape(batch, frames * height * width, channels)
        with _full_precision(tokens):
            x = self.x_embedder(tokens.to(self.x_embedder.weight.dtype))
        num_patches = x.shape[1]
        suffix = (self.register_tokens.to(x.dtype).expand(batch, -1, -1), x.new_zeros(batch, 1, x.shape[-1]))
        x = torch.cat((x, *suffix), dim=1)
        rope = decoder_rotary(frames, height, width, c.decoder_num_register_tokens + 1, c.rope_dim,
                              c.decoder_rope_theta, x.device)

        residency = self.block_residency
        residency.begin_pass()
        try:
            for index, block in enumerate(self.transformer_blocks):
                if check_interrupt is not None:
                    check_interrupt()
                residency.acquire(index)  # block `index` on the device (and the next `prefetch` on their way)
                x = block(x, rope)
                residency.release(index)
        finally:
            residency.end_pass()  # also after an exception in a block: the next tile starts clean

        with _full_precision(x):
            x = self.proj_out(self.norm_out(x.float()).to(self.proj_out.weight.dtype))
        x = x[:, :num_patches]
        pt, p = c.temporal_ratio, c.spatial_ratio
        x = x.reshape(batch, frames, height, width, 3, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(batch, 3, frames * pt, height * p, width * p)


# ---- tiling and blending ---------------------------------------------------------------------------------------------


def split_tiles(length: int, tile_size: int, min_overlap: int, step: int) -> tuple[list[int], list[int], list[int]]:
    """Tile starts, sizes and overlaps covering `length` (all in the same unit).

    The tile count is the smallest N with `N * tile - (N - 1) * min_overlap >= length`; the slack is spread over the
    overlaps round-robin in whole `step`s, so every overlap is at least `min_overlap` and tile starts stay on the grid.
    """
    if tile_size >= length:
        return [0], [length], []
    count = math.ceil(length / tile_size)
    while tile_size * count - min_overlap * (count - 1) < length:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    slack = tile_size * count - sum(overlaps) - length
    for i in range(slack // step):
        overlaps[i % (count - 1)] += step
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile_size - overlap)
    return starts, [tile_size] * count, overlaps


def linear_blend(previous: torch.Tensor, current: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Cross-fade the last `extent` entries of `previous` into the first `extent` of `current` along `dim`.

    Weight `1 - p / extent` on `previous` and `p / extent` on `current` at offset p; returns `current` with its head
    replaced by the blend.
    """
    extent = min(previous.shape[dim], current.shape[dim], extent)
    if extent <= 0:
        return current
    ramp = torch.arange(extent, device=current.device, dtype=current.dtype) / extent
    shape = [1] * current.ndim
    shape[dim] = extent
    ramp = ramp.view(shape)
    head = (previous.narrow(dim, previous.shape[dim] - extent, extent) * (1 - ramp)
            + current.narrow(dim, 0, extent) * ramp)
    if extent == current.shape[dim]:
        return head
    return torch.cat((head, current.narrow(dim, extent, current.shape[dim] - extent)), dim=dim)


def stitch_tiles(make_tile: Callable[[int, int], torch.Tensor], row_sizes: Sequence[int], col_sizes: Sequence[int],
                 row_overlaps: Sequence[int], col_overlaps: Sequence[int]) -> torch.Tensor:
    """Produce tiles in raster order and stitch them into one canvas, blending overlaps linearly.

    Same arithmetic as the reference: each tile is blended vertically with the *un-blended* tile above, then
    horizontally with the *un-blended* tile to its left, and cropped by the overlaps it shares with the tiles below and
    to the right. Only the overlap strips of raw neighbours are kept, so one raw tile is alive at a time.
    """
    if len(row_sizes) == 1 and len(col_sizes) == 1:
        return make_tile(0, 0)
    canvas = None
    above: list[torch.Tensor | None] = [None] * len(col_sizes)
    out_y = 0
    for i in range(len(row_sizes)):
        below: list[torch.Tensor | None] = [None] * len(col_sizes)
        left_strip = None
        out_x = 0
        tile_height = 0
        for j in range(len(col_sizes)):
            raw = make_tile(i, j)
            tile = raw
            if i > 0:
                tile = linear_blend(above[j], tile, row_overlaps[i - 1], dim=-2)
            if j > 0:
                tile = linear_blend(left_strip, tile, col_overlaps[j - 1], dim=-1)
            if i < len(row_sizes) - 1:
                below[j] = raw[..., -row_overlaps[i]:, :].clone()
                tile = tile[..., : -row_overlaps[i], :]
            if j < len(col_sizes) - 1:
                left_strip = raw[..., :, -col_overlaps[j]:].clone()
                tile = tile[..., :, : -col_overlaps[j]]
            del raw
            if canvas is None:
                height = sum(row_sizes) - sum(row_overlaps)
                width = sum(col_sizes) - sum(col_overlaps)
                canvas = tile.new_empty(*tile.shape[:-2], height, width)
            canvas[..., out_y:out_y + tile.shape[-2], out_x:out_x + tile.shape[-1]] = tile
            out_x += tile.shape[-1]
            tile_height = tile.shape[-2]
        above = below
        out_y += tile_height
    return canvas


# ---- the model -------------------------------------------------------------------------------------------------------


@dataclass
class _TemporalPlan:
    """How a latent video is cut into decoder clips: padded length, clip count and the output frame count."""

    latent_frames: int
    pad_tokens: int
    num_clips: int
    output_frames: int


class VideoVAE(nn.Module):
    """The H3 video VAE. Build it with `h3_core.load_video_vae`; use `encode` / `decode`."""

    def __init__(self, config: VideoVAEConfig, tiling: TilingOptions | None = None,
                 autocast: DecodeAutocast | None = None):
        super().__init__()
        c = config
        self.config = c
        self.encoder = VideoEncoder(c)
        self.quant_conv = nn.Conv3d(2 * c.latent_channels, 2 * c.latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(c.latent_channels, c.latent_channels, 1)
        self.decoder = VideoDecoder(c)
        self.tiling = (tiling or TilingOptions()).check(c.spatial_ratio)
        self.autocast = autocast or DecodeAutocast("cpu")
        # Phase-scoped weights when loaded layerwise: "encoder" (the CNN encoder and quant_conv), materialised for
        # the duration of one `encode` call.
        self.weight_phases = PhaseScopedWeights()

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def close(self, restore: bool = True) -> None:
        """Drop the residency manager and phase-scoped weights: every streamed parameter gets its host tensor back
        (on the CPU), and the model then runs with all weights where they are. A resident VAE has nothing to
        release. `H3Pipeline.release` calls this with `restore=False` (the VAE is dropped)."""
        self.decoder.block_residency.close(restore)
        self.decoder.block_residency = AllResident(len(self.decoder.transformer_blocks))
        self.weight_phases.close(restore)
        self.weight_phases = PhaseScopedWeights()

    def _channel_stats(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)
        return mean, std

    @staticmethod
    def _pixel_stats(device) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=device).view(1, 3, 1, 1, 1)
        std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=device).view(1, 3, 1, 1, 1)
        return mean, std

    # ---- one clip ---------------------------------------------------------------------------------------------------

    def encode_clip(self, pixels: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Posterior moments `[B, 2C, t, h, w]` of one clip of ImageNet-normalised pixels `[B, 3, f, H, W]`, tiled.

        With layerwise residency the encoder's weights exist only inside the "encoder" phase, which `encode` opens.
        `check_interrupt()` (optional) runs before every encoder level of every tile.
        """
        def moments(x):
            return self.quant_conv(self.encoder(x, check_interrupt))

        if not self.tiling.enabled:
            return moments(pixels)
        ratio = self.config.spatial_ratio
        (ys, yl, yo), (xs, xl, xo) = (split_tiles(n, self.tiling.tile_size, self.tiling.min_overlap, ratio)
                                      for n in pixels.shape[-2:])

        def tile(i, j):
            return moments(pixels[..., ys[i]:ys[i] + yl[i], xs[j]:xs[j] + xl[j]])

        return stitch_tiles(tile, [n // ratio for n in yl], [n // ratio for n in xl], [o // ratio for o in yo],
                            [o // ratio for o in xo])

    def decode_clip(self, latent: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """ImageNet-normalised pixels `[B, 3, 4t, 16h, 16w]` of one clip of raw latents `[B, C, t, h, w]`, tiled.
        `check_interrupt()` (optional) runs before every decoder block of every tile."""
        def pixels(z):
            z = self.post_quant_conv(z)
            with self.autocast.context():
                return self.decoder(z, check_interrupt)

        if not self.tiling.enabled:
            return pixels(latent)
        ratio = self.config.spatial_ratio
        (ys, yl, yo), (xs, xl, xo) = (split_tiles(n * ratio, self.tiling.tile_size, self.tiling.min_overlap, ratio)
                                      for n in latent.shape[-2:])

        def tile(i, j):
            y, x = ys[i] // ratio, xs[j] // ratio
            return pixels(latent[..., y:y + yl[i] // ratio, x:x + xl[j] // ratio])

        return stitch_tiles(tile, yl, xl, yo, xo)

    # ---- temporal plan ----------------------------------------------------------------------------------------------

    def temporal_plan(self, latent_frames: int) -> _TemporalPlan:
        """Clip count and output length of a decode, as the reference computes them.

        `latent_frames + token_drop` tokens are padded (by repeating the last latent) to whole 5-token chunks; clip i
        decodes tokens `[5i, 5i + 7)`. The reference has no clip at all for 2 latent frames (5 pixel frames); as in
        ComfyUI, one more chunk of padding is added there so the same recipe applies. One latent frame is decoded on
        its own (see `decode`).
        """
        c = self.config
        if latent_frames == 1:
            return _TemporalPlan(1, 0, 1, 1)
        chunk, ratio = c.tokens_per_chunk, c.temporal_ratio
        tokens = latent_frames + c.token_drop
        pad = (-tokens) % chunk
        clips = (tokens + pad) // chunk - int(c.token_drop > 0)
        if clips < 1:
            pad += chunk
            clips += 1
        padded = latent_frames + pad
        total = 0
        tail = 0
        for i in range(clips):
            start = i * chunk
            clip_frames = (min(start + chunk + c.token_overlap, padded) - start) * ratio
            total += max(0, min(chunk * ratio, clip_frames) - c.frame_pre_padding)
            if c.token_drop > 0:
                tail = max(0, min(2 * chunk * ratio, clip_frames) - chunk * ratio - c.frame_pre_padding)
        total += tail
        # The last latent of a 17-frame clip covers only clip_length % 4 frames; the others cover 4.
        intra_tail = c.clip_length % ratio
        dropped = sum(intra_tail if intra_tail and (latent_frames + k) % chunk == 0 else ratio for k in range(pad))
        return _TemporalPlan(latent_frames, pad, clips, total - dropped)

    def output_frames(self, latent_frames: int) -> int:
        """Pixel frames `decode` returns for `latent_frames` latent frames (`(T - 2) / 5 * 17 + 5` on the grid)."""
        return self.temporal_plan(latent_frames).output_frames

    # ---- public API -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, *, out: torch.Tensor | None = None,
               output_device: torch.device | str = "cpu",
               check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Normalised latent `[B, C, T, H/16, W/16]` -> frames `[B, F, H, W, 3]` float32 in [0, 1].

        Clips are decoded one at a time; each finished run of frames is de-normalised, clamped and copied into `out`
        (allocated on `output_device` when not given), so the device never holds more than one clip.
        A single latent frame decodes to the last of its 4 frames (the reference's image path).
        `check_interrupt()` (optional) runs before every decoder block of every tile and may raise to stop; `out`
        then holds the frames decoded so far and the model is left as it was.
        """
        c = self.config
        if not isinstance(latent, torch.Tensor) or latent.ndim != 5 or latent.shape[1] != c.latent_channels \
                or not latent.is_floating_point() or min(latent.shape) < 1:
            got = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise H3Error(f"video latent: expected a float tensor [B, {c.latent_channels}, T, H/16, W/16] with every "
                          f"dimension >= 1, got {got}.")
        batch, _, frames, height, width = latent.shape
        plan = self.temporal_plan(frames)
        shape = (batch, plan.output_frames, height * c.spatial_ratio, width * c.spatial_ratio, 3)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=output_device)
        elif tuple(out.shape) != shape or out.dtype != torch.float32:
            raise H3Error(f"out: expected a float32 buffer of shape {list(shape)} for this latent, got "
                          f"{str(out.dtype).replace('torch.', '')} {list(out.shape)}.")

        device = self.device
        lat_mean, lat_std = self._channel_stats(device)
        px_mean, px_std = self._pixel_stats(device)
        z = latent.to(device=device, dtype=torch.float32) * lat_std + lat_mean
        written = 0

        def emit(part: torch.Tensor) -> None:
            nonlocal written
            count = min(part.shape[2], plan.output_frames - written)
            if count <= 0:
                return
            # Frame by frame, an interrupt check between: 17 frames at 1920x1088 are 400 MB, seconds to convert.
            for index in range(count):
                if check_interrupt is not None:
                    check_interrupt()
                frame_rgb = (part[:, :, index:index + 1].float() * px_std + px_mean).clamp(0, 1)
                out[:, written:written + 1].copy_(frame_rgb.permute(0, 2, 3, 4, 1))
                written += 1

        if frames == 1:
            emit(self.decode_clip(z, check_interrupt)[:, :, -1:])
            return out

        if plan.pad_tokens:
            z = torch.cat((z, z[:, :, -1:].expand(-1, -1, plan.pad_tokens, -1, -1)), dim=2)
        chunk, clip_len = c.tokens_per_chunk, c.tokens_per_chunk * c.temporal_ratio
        tail = None
        for i in range(plan.num_clips):
            start = i * chunk
            clip = self.decode_clip(z[:, :, start:start + chunk + c.token_overlap], check_interrupt)
            head = clip[:, :, c.frame_pre_padding:clip_len]
            if tail is not None:
                head = linear_blend(tail, head, c.frame_overlap, dim=2)
            # Keep only the small tail so the clip canvas can be freed before the next clip decodes.
            tail = clip[:, :, clip_len + c.frame_pre_padding:2 * clip_len].clone() if c.token_drop > 0 else None
            del clip
            emit(head)
            del head
        if tail is not None:
            emit(tail)
        if written != plan.output_frames:  # pragma: no cover - the plan and the loop are kept in step by the tests
            raise AssertionError(f"decoded {written} frames, planned {plan.output_frames}")
        return out

    @torch.no_grad()
    def encode(self, frames: torch.Tensor, *, posterior: str = "mean", seed: int = 42,
               check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Frames `[B, F, H, W, 3]` in [0, 1] -> normalised latent `[B, C, T, H/16, W/16]` (float32).

        17-frame clips (the last padded by repeating its last frame) are encoded one at a time and the last
        `token_drop` latent frames dropped: `17k + 5` frames give `5k + 2` latents. One frame gives one latent.
        The result lives on the model's device.

        `posterior="mean"` (ComfyUI's choice) takes the posterior mean. `posterior="sample"` is the reference
        pipeline's condition recipe (diffusers `encode_vae_condition`): `mean + exp(logvar / 2) * eps` with logvar
        clamped to [-30, 20] and eps drawn on the CPU from a generator seeded `seed` (42 in the release),
        rounded to float16, then normalised. `check_interrupt()` (optional) runs before every encoder level of every
        tile and may raise to stop.
        """
        if posterior not in ("mean", "sample"):
            raise H3Error(f"posterior must be 'mean' or 'sample', got {posterior!r}.")
        c = self.config
        ratio = c.spatial_ratio
        if not isinstance(frames, torch.Tensor) or frames.ndim != 5 or frames.shape[-1] != 3 \
                or not frames.is_floating_point() or min(frames.shape) < 1:
            got = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise H3Error(f"frames: expected a float tensor [B, F, H, W, 3] in [0, 1], got {got}.")
        if frames.shape[2] % ratio or frames.shape[3] % ratio:
            raise H3Error(f"frames: height x width {frames.shape[2]} x {frames.shape[3]} must both be multiples of "
                          f"{ratio}; resize or crop the frames first.")
        device = self.device
        px_mean, px_std = self._pixel_stats(device)
        lat_mean, lat_std = self._channel_stats(device)

        def clip_pixels(start: int, stop: int) -> torch.Tensor:
            x = frames[:, start:stop].to(device=device, dtype=torch.float32).permute(0, 4, 1, 2, 3)
            return (x - px_mean) / px_std

        count = frames.shape[1]
        # The mean alone unless sampling (then the log-variance half of the moments is kept too).
        keep = c.latent_channels if posterior == "mean" else 2 * c.latent_channels
        with self.weight_phases.phase("encoder"):  # once for every clip and tile, not per tile
            if count == 1:
                moments = self.encode_clip(clip_pixels(0, 1), check_interrupt)[:, :keep, -1:]
            else:
                parts = []
                for start in range(0, count, c.clip_length):
                    x = clip_pixels(start, min(start + c.clip_length, count))
                    if x.shape[2] < c.clip_length:
                        x = torch.cat((x, x[:, :, -1:].expand(-1, -1, c.clip_length - x.shape[2], -1, -1)), dim=2)
                    parts.append(self.encode_clip(x, check_interrupt)[:, :keep])
                moments = torch.cat(parts, dim=2)
                if c.token_drop:
                    moments = moments[:, :, : -c.token_drop]
        mean = moments[:, : c.latent_channels]
        if posterior == "sample":
            std = torch.exp(0.5 * moments[:, c.latent_channels:].clamp(-30.0, 20.0))
            eps = torch.randn(tuple(mean.shape), generator=torch.Generator("cpu").manual_seed(int(seed)),
                              dtype=torch.float32).to(mean.device)
            mean = (mean + std * eps).to(torch.float16).float()
        return (mean - lat_mean) / lat_std
