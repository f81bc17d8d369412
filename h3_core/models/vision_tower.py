"""The Qwen3-VL vision tower (for FL2VA keyframes) and its image preprocessing.

Preprocessing (the released `processor/preprocessor_config.json`): convert to RGB (transparency composited onto
white), resize with PIL bicubic so both sides are multiples of patch x merge (32 px) and the pixel count lies in
[min_pixels, max_pixels] with the aspect ratio kept as well as possible, scale to [0, 1], normalise with
mean/std 0.5, and cut into 16 px patches. An image fills both frames of the temporal patch (2). Patches are listed
in 2 x 2 merge-window order, so each group of 4 consecutive patches becomes one language-model token.

Tower: a linear patch embedding (stored as the reference's Conv3d kernel), a learned square position table
resampled bilinearly (corners aligned) to the image's patch grid, pre-norm ViT blocks (LayerNorm, attention with
2-axis rotary embedding over (row, column), tanh-GELU MLP), each image attending only to itself. The final merger
(LayerNorm, then 2 x 2 concat and an MLP) gives the tokens that replace `<|image_pad|>`; deep-stack mergers (2 x 2
concat, then LayerNorm and an MLP) tap chosen blocks and are added to those rows after the first decoder layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import H3Error
from ..json_values import is_positive_real, is_whole

# ---- configuration ---------------------------------------------------------------------------------------------------


def config_number(raw: Mapping[str, Any], key: str, default, where: str, *, real: bool = False):
    """`raw[key]` (else `default`) as a positive integer (or, `real`, a finite positive number): JSON true, 2.0 for a
    count and "2" are refused with one H3Error naming `where.key`."""
    value = raw.get(key, default)
    if not (is_positive_real(value) if real else is_whole(value)):
        raise H3Error(f"{where}.{key} must be a positive {'number' if real else 'integer'}, got {value!r}.")
    return float(value) if real else value


_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class VisionTowerConfig:
    """Hyper-parameters of the Qwen3-VL vision tower. Defaults are Qwen3-VL-32B's."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 5120
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        object.__setattr__(self, "deepstack_visual_indexes", tuple(int(i) for i in self.deepstack_visual_indexes))
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise H3Error(f"vision config: {name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise H3Error(f"vision config: hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a "
                          "head size divisible by 4 (two rotary axes, each rotating pairs).")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise H3Error(f"vision config: num_position_embeddings {self.num_position_embeddings} is not a square.")
        indexes = self.deepstack_visual_indexes
        if any(not 0 <= i < self.depth for i in indexes) or len(set(indexes)) != len(indexes):
            raise H3Error(f"vision config: deepstack_visual_indexes {str(list(indexes))[:80]} must be distinct block "
                          f"indices below depth {self.depth}.")
        if self.hidden_act not in _ACTIVATIONS:
            raise H3Error(f"vision config: hidden_act {self.hidden_act!r} is not supported "
                          f"({', '.join(_ACTIVATIONS)}).")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> "VisionTowerConfig":
        """From a Qwen3-VL `vision_config`; missing optional fields take transformers' defaults."""
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size"):
            if name not in raw:
                raise H3Error(f"vision_config has no '{name}'.")
        rope = raw.get("rope_parameters") or {}
        number = lambda key, default=None, **kw: config_number(raw, key, default, "vision_config", **kw)  # noqa: E731
        indexes = raw.get("deepstack_visual_indexes", (8, 16, 24))
        if not isinstance(indexes, (list, tuple)) or not all(type(i) is int and i >= 0 for i in indexes):
            raise H3Error(f"vision_config.deepstack_visual_indexes must be a list of block indices, got {indexes!r}.")
        return cls(
            depth=number("depth"),
            hidden_size=number("hidden_size"),
            intermediate_size=number("intermediate_size"),
            num_heads=number("num_heads"),
            in_channels=number("in_channels", 3),
            patch_size=number("patch_size", 16),
            temporal_patch_size=number("temporal_patch_size", 2),
            spatial_merge_size=number("spatial_merge_size", 2),
            out_hidden_size=number("out_hidden_size"),
            num_position_embeddings=number("num_position_embeddings", 2304),
            deepstack_visual_indexes=tuple(indexes),
            rope_theta=config_number(rope, "rope_theta", 10000.0, "vision_config", real=True),
            hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
        )


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Image preprocessing for the tower. Defaults are the released Qwen3-VL `preprocessor_config.json`."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __post_init__(self):
        object.__setattr__(self, "image_mean", tuple(float(v) for v in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(v) for v in self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise H3Error(f"image processor: image_mean {self.image_mean} / image_std {self.image_std} must be three "
                          "values each, std positive.")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise H3Error(f"image processor: need 0 < min_pixels ({self.min_pixels}) <= max_pixels "
                          f"({self.max_pixels}).")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ImageProcessorConfig":
        """From a `preprocessor_config.json` (`size.shortest_edge/longest_edge` or `min_pixels/max_pixels`)."""
        defaults = cls()
        size = raw.get("size") or {}
        for name, value in (("do_resize", True), ("do_rescale", True), ("do_normalize", True)):
            if raw.get(name, value) is not value:
                raise H3Error(f"image processor: {name}={raw.get(name)!r} is not supported; the Qwen3-VL tower "
                              "expects resized, rescaled and normalised pixels.")
        if raw.get("resample", 3) != 3:
            raise H3Error(f"image processor: resample={raw['resample']!r}; only bicubic (3) is supported.")
        return cls(
            patch_size=int(raw.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", defaults.merge_size)),
            min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", defaults.min_pixels))),
            max_pixels=int(size.get("longest_edge", raw.get("max_pixels", defaults.max_pixels))),
            image_mean=tuple(raw.get("image_mean", defaults.image_mean)),
            image_std=tuple(raw.get("image_std", defaults.image_std)),
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
        )


# ---- preprocessing ---------------------------------------------------------------------------------------------------


def fit_to_patch_grid(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): each a multiple of `factor`, area within [min_pixels, max_pixels], aspect kept.

    Sides are first rounded to the nearest multiple (Python's round, halves to even); if the area is then too large
    both sides are scaled down by the same ratio and floored to multiples, if too small scaled up and ceiled.
    """
    if min(height, width) < 1:
        raise H3Error(f"image of {width}x{height} pixels is empty.")
    if max(height, width) / min(height, width) > 200:
        raise H3Error(f"image of {width}x{height} pixels has an aspect ratio above 200:1; crop it first.")
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    if new_h * new_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / shrink / factor) * factor)
        new_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_h * new_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * grow / factor) * factor
        new_w = math.ceil(width * grow / factor) * factor
    return new_h, new_w


@dataclass(frozen=True)
class PreparedImage:
    """Normalised patches of one image, `(t * h * w, C * T * P * P)` float32 in merge-window order; `grid` is
    `(t, h, w)` in patches."""

    patches: torch.Tensor
    grid: tuple[int, int, int]
    merge_size: int

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge_size, w // self.merge_size

    @property
    def num_tokens(self) -> int:
        t, h, w = self.merged_grid
        return t * h * w


def _to_pil_rgb(image, index: int):
    from PIL import Image

    if isinstance(image, torch.Tensor):
        image = image.detach().cpu()
        if image.ndim == 4 and image.shape[0] == 1:
            image = image[0]
        if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
            raise H3Error(f"image {index}: a tensor image must be [H, W, C] (or [1, H, W, C]) with C in 1, 3, 4 "
                          f"(ComfyUI IMAGE layout), got shape {tuple(image.shape)}.")
        if image.is_floating_point():
            # ComfyUI IMAGE: float in [0, 1].
            image = (image.to(torch.float32).clamp(0, 1) * 255).round().to(torch.uint8)
        image = image.numpy()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise H3Error(f"image {index}: an array image must be uint8 [H, W] or [H, W, C], got {image.dtype} "
                          f"{image.shape}.")
        if image.ndim == 3 and image.shape[-1] == 1:
            image = image[..., 0]
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise H3Error(f"image {index}: expected a PIL image, a uint8 array or an IMAGE tensor, got "
                      f"{type(image).__name__}.")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        # Transparent pixels are composited onto white, as the reference processor does.
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def prepare_image(image, config: ImageProcessorConfig, index: int = 1) -> PreparedImage:
    """Resize, normalise and patchify one image for the vision tower."""
    from PIL import Image

    rgb = _to_pil_rgb(image, index)
    height, width = fit_to_patch_grid(rgb.height, rgb.width, config.factor, config.min_pixels, config.max_pixels)
    resized = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
    # Same arithmetic as the reference: rescale in float64, round to float32, then normalise in float32.
    pixels = (np.asarray(resized, dtype=np.float64) * config.rescale_factor).astype(np.float32)
    pixels = (pixels - np.asarray(config.image_mean, dtype=np.float32)) / np.asarray(config.image_std,
                                                                                      dtype=np.float32)
    x = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))  # (C, H, W)
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    x = x.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, row in block, col in block, C, py, px)
    x = x[:, :, :, :, :, None].expand(-1, -1, -1, -1, -1, t, -1, -1)  # the still image fills every frame
    patches = x.reshape(grid_h * grid_w, 3 * t * p * p).contiguous()
    return PreparedImage(patches, (1, grid_h, grid_w), m)


# The released Qwen3-VL video processor's pixel budget, over all the sampled frames of one video together.
VIDEO_MIN_PIXELS = 128 * 32 * 32
VIDEO_MAX_PIXELS = 768 * 32 * 32


def fit_video_to_patch_grid(num_frames: int, height: int, width: int, factor: int, temporal: int,
                            min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS) -> tuple[int, int]:
    """Qwen3-VL's video `smart_resize`: as `fit_to_patch_grid`, but the budget holds for `frames x height x width`
    (the frame count rounded to the temporal patch)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise H3Error(f"video of {width}x{height} pixels has an aspect ratio above 200:1; crop it first.")
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    frames = round(num_frames / temporal) * temporal
    if frames * new_h * new_w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        new_h = max(factor, math.floor(height / beta / factor) * factor)
        new_w = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * new_h * new_w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        new_h = math.ceil(height * beta / factor) * factor
        new_w = math.ceil(width * beta / factor) * factor
    return new_h, new_w


def _normalised_chw(image, config: ImageProcessorConfig) -> torch.Tensor:
    pixels = (np.asarray(image, dtype=np.float64) * config.rescale_factor).astype(np.float32)
    pixels = (pixels - np.asarray(config.image_mean, dtype=np.float32)) / np.asarray(config.image_std,
                                                                                      dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def _patches(frames: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """(T, C, H, W) normalised frames, T = the temporal patch -> (h * w, C * T * P * P) in merge-window order."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    _, c, height, width = frames.shape
    grid_h, grid_w = height // p, width // p
    x = frames.reshape(t, c, grid_h // m, m, p, grid_w // m, m, p)
    x = x.permute(2, 5, 3, 6, 1, 0, 4, 7)  # (block row, block col, row in block, col in block, C, T, py, px)
    return x.reshape(grid_h * grid_w, c * t * p * p).contiguous()


def prepare_video(frames: Sequence, config: ImageProcessorConfig, index: int = 1) -> list[PreparedImage]:
    """The sampled frames of one video reference (uint8 [H, W, 3] each) -> one prepared block per merged pair
    (grid `(1, h, w)`, an odd count repeating the last frame), resized together by the video pixel budget
    (BICUBIC)."""
    from PIL import Image

    if not len(frames):
        raise H3Error(f"video {index}: no frames to encode.")
    height, width = np.asarray(frames[0]).shape[:2]
    t = config.temporal_patch_size
    new_h, new_w = fit_video_to_patch_grid(len(frames), height, width, config.factor, t)
    tensors = []
    for frame in frames:
        pil = _to_pil_rgb(np.asarray(frame), index)
        if pil.size != (new_w, new_h):
            pil = pil.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        tensors.append(_normalised_chw(pil, config))
    tensors += [tensors[-1]] * (-len(tensors) % t)
    p = config.patch_size
    return [PreparedImage(_patches(torch.stack(tensors[i:i + t]), config), (1, new_h // p, new_w // p),
                          config.merge_size) for i in range(0, len(tensors), t)]


# ---- the tower -------------------------------------------------------------------------------------------------------


def _merge_window_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w, ...) raster grid -> (h * w, ...) rows in 2 x 2 merge-window order."""
    h, w = grid.shape[:2]
    rest = grid.shape[2:]
    grid = grid.reshape(h // merge, merge, w // merge, merge, *rest).transpose(1, 2)
    return grid.reshape(h * w, *rest)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class PatchEmbed(nn.Module):
    """A Conv3d with stride = kernel over one patch is a linear map of the flattened patch; the weight keeps the
    checkpoint's `[out, C, T, P, P]` shape."""

    def __init__(self, config: VisionTowerConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionTowerConfig):
        super().__init__()
        self.heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.heads, -1).unbind(1)
        # The reference rotates q and k in float32.
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, rows, head_dim)
        # Each image (each frame) attends only to itself.
        out = torch.cat([F.scaled_dot_product_attention(qs, ks, vs) for qs, ks, vs in
                         zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))], dim=2)
        return self.proj(out[0].transpose(0, 1).reshape(rows, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionTowerConfig):
        super().__init__()
        self.approximate = _ACTIVATIONS[config.hidden_act]
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionTowerConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2 x 2 neighbouring patches -> one language-model token. The final merger normalises each patch before the
    concat; the deep-stack mergers normalise the concatenated window (`norm_after_concat`)."""

    def __init__(self, config: VisionTowerConfig, norm_after_concat: bool):
        super().__init__()
        self.window_dim = config.hidden_size * config.spatial_merge_size ** 2
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.window_dim if norm_after_concat else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.window_dim, self.window_dim, bias=True)
        self.linear_fc2 = nn.Linear(self.window_dim, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_concat:
            x = self.norm(x.reshape(-1, self.window_dim))
        else:
            x = self.norm(x).reshape(-1, self.window_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, config: VisionTowerConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, norm_after_concat=True) for _ in config.deepstack_visual_indexes)

    def _position_embeddings(self, grid: tuple[int, int, int], device) -> torch.Tensor:
        """The learned square table resampled bilinearly (corners aligned) to an (h, w) grid, in float32."""
        t, h, w = grid
        side = self.config.position_grid_side

        def taps(n):
            src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
            low = src.floor()
            frac = src - low
            low = low.long()
            return torch.stack((low, (low + 1).clamp(max=side - 1)), -1), torch.stack((1 - frac, frac), -1)

        row_taps, row_weights = taps(h)
        col_taps, col_weights = taps(w)
        index = row_taps[:, None, :, None] * side + col_taps[None, :, None, :]  # (h, w, 2, 2)
        weight = row_weights[:, None, :, None] * col_weights[None, :, None, :]
        table = self.pos_embed.weight
        embedded = (table[index.reshape(h, w, 4)] * weight.reshape(h, w, 4, 1)).sum(2)  # float32 (promoted)
        return _merge_window_order(embedded, self.config.spatial_merge_size).repeat(t, 1)

    def _rotary(self, grid: tuple[int, int, int], device) -> torch.Tensor:
        """Rotary angles (t * h * w, head_dim) from each patch's (row, column), in merge-window order."""
        t, h, w = grid
        quarter = self.config.head_dim // 4
        half = 2 * quarter
        inv_freq = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        coords = _merge_window_order(torch.stack((rows, cols), -1), self.config.spatial_merge_size).float()
        angles = torch.cat((coords[:, :1] * inv_freq, coords[:, 1:] * inv_freq), dim=-1)
        return torch.cat((angles, angles), dim=-1).repeat(t, 1)

    def forward(self, images: Sequence[PreparedImage],
                check_interrupt: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prepared images -> merged tokens `(sum tokens, out_hidden)` and one deep-stack tensor per tapped block.
        `check_interrupt()` (optional) runs before every block and may raise to stop."""
        device = self.pos_embed.weight.device
        c = self.config
        for i, image in enumerate(images, start=1):
            t, h, w = image.grid
            if image.patches.shape != (t * h * w, c.patch_dim) or h % c.spatial_merge_size or w % c.spatial_merge_size:
                raise H3Error(f"image {i}: prepared patches {tuple(image.patches.shape)} on grid {image.grid} do not "
                              f"fit this tower (patch vector {c.patch_dim}, merge {c.spatial_merge_size}); prepare "
                              "it with the tower's own image processor settings.")
        patches = torch.cat([image.patches for image in images]).to(device)
        x = self.patch_embed(patches)
        x = x + torch.cat([self._position_embeddings(image.grid, device) for image in images]).to(x.dtype)
        angles = torch.cat([self._rotary(image.grid, device) for image in images])
        cos, sin = angles.cos(), angles.sin()
        lengths = [image.grid[1] * image.grid[2] for image in images for _ in range(image.grid[0])]
        deepstack = []
        for index, block in enumerate(self.blocks):
            if check_interrupt is not None:
                check_interrupt()
            x = block(x, cos, sin, lengths)
            if index in c.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[c.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
