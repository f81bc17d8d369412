"""Preflight for a memory budget: bytes per component and activations at the requested size, read from checkpoint
headers before anything is allocated; picks residency and the DiT's chunk budget, or refuses with the numbers.

Estimates, not allocator traces: weights are exact (header sizes), activations are counted from the tensors each
phase keeps alive. Phases run one after the other (text encoder, then sampling, then decoding) and the text encoder is
released before sampling, so the peak is that of the largest phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..components import COMPONENTS
from ..errors import H3Error
from ..runtime.platform import Platform
from .layout import AUDIO_CHANNELS, LatentShape

GiB = 1 << 30
# Text rows assumed before the prompt is tokenised (a long prompt; keyframes add about 64 rows per 256x256 image).
TEXT_ROWS_ESTIMATE = 512
# Smallest chunk the planner considers: below this per-chunk overhead dominates.
MIN_CHUNK_ROWS = 64


class MemoryBudgetError(H3Error):
    """The request cannot fit the memory budget even with every component streamed."""


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


@dataclass
class ComponentEstimate:
    name: str
    total_bytes: int  # all weights
    unit_bytes: int  # largest streamed unit (block / layer); 0 if the component has none
    fixed_bytes: int  # weights that stay on the device when streamed
    activation_bytes: int
    streamable: bool
    residency: str = "resident"

    def device_bytes(self, prefetch: int = 0) -> int:
        if self.residency == "layerwise":
            return self.fixed_bytes + (prefetch + 1) * self.unit_bytes + self.activation_bytes
        return self.total_bytes + self.activation_bytes


@dataclass
class MemoryPlan:
    budget_bytes: int
    components: list[ComponentEstimate]
    component_options: dict = field(default_factory=dict)
    dit_chunk_budget: int | None = None

    @property
    def peak_bytes(self) -> int:
        return max(c.device_bytes() for c in self.components)

    def describe(self) -> str:
        lines = [f"memory preflight (budget {_fmt(self.budget_bytes)}):"]
        for c in self.components:
            lines.append(f"  {c.name:<13} weights {_fmt(c.total_bytes):>10}  activations {_fmt(c.activation_bytes):>10}"
                         f"  -> {c.residency:<9} peak {_fmt(c.device_bytes())}")
        if self.dit_chunk_budget is not None:
            lines.append(f"  transformer chunks sized for {_fmt(self.dit_chunk_budget)} of temporaries")
        lines.append(f"  estimated peak {_fmt(self.peak_bytes)}")
        return "\n".join(lines)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dit_estimate(source, shape: LatentShape, dtype) -> tuple[ComponentEstimate, object, int]:
    from ..checkpoints.dit_loader import resolve_dit_checkpoint, target_dtype

    ckpt = resolve_dit_checkpoint(source)
    c = ckpt.config
    blocks: dict[int, int] = {}
    fixed = 0
    residual_dtype = torch.float32
    for spec in ckpt.specs:
        stored = ckpt.files[spec.keys[0]].dtype(spec.keys[0])
        target = target_dtype(spec.name, stored, dtype)
        size = ckpt.numel(spec) * _dtype_bytes(target)
        if spec.name == "condition_proj.weight":
            residual_dtype = target
        if spec.name.startswith("blocks."):
            index = int(spec.name.split(".")[1])
            blocks[index] = blocks.get(index, 0) + size
        else:
            fixed += size
    rows = (TEXT_ROWS_ESTIMATE + AUDIO_CHANNELS * shape.audio_latents
            + shape.latent_frames * (shape.latent_height // 2) * (shape.latent_width // 2))
    element = _dtype_bytes(residual_dtype)
    # Full-length buffers every block keeps: residual in and out, K and V, the attention output, per-row modulation.
    full_length = rows * element * (3 * c.hidden_size + 2 * c.inner_dim + 6 * c.hidden_size // 3)
    from ..runtime.chunking import projection_elements_per_row

    fused_temporaries = rows * element * projection_elements_per_row(c)
    estimate = ComponentEstimate("transformer", fixed + sum(blocks.values()), max(blocks.values(), default=0), fixed,
                                 full_length + fused_temporaries, streamable=True)
    return estimate, c, rows


def _text_encoder_estimate(source, layer: int) -> ComponentEstimate:
    from ..checkpoints.text_encoder_loader import resolve_text_encoder_checkpoint

    ckpt = resolve_text_encoder_checkpoint(source, layer)
    layers: dict[int, int] = {}
    fixed = 0
    for spec in ckpt.specs:
        size = sum(ckpt.files[k].nbytes(k) for k in spec.keys)  # the loader keeps the stored dtype by default
        if spec.name.startswith("language_model.layers."):
            index = int(spec.name.split(".")[2])
            layers[index] = layers.get(index, 0) + size
        else:
            fixed += size
    hidden = ckpt.config.language.hidden_size
    activations = TEXT_ROWS_ESTIMATE * 4 * (8 * hidden + 2 * ckpt.config.language.intermediate_size)
    return ComponentEstimate("text_encoder", fixed + sum(layers.values()), max(layers.values(), default=0), fixed,
                             activations, streamable=True)


def _vae_estimates(video_source, audio_source, shape: LatentShape) -> list[ComponentEstimate]:
    from ..checkpoints.audio_vae_loader import resolve_audio_vae_checkpoint
    from ..checkpoints.video_vae_loader import resolve_video_vae_checkpoint

    from ..models.audio_vae import AudioVAE

    out = []
    for name, ckpt in (("video_vae", resolve_video_vae_checkpoint(video_source)),
                       ("audio_vae", resolve_audio_vae_checkpoint(audio_source))):
        if name == "video_vae":
            unit_of = lambda n: n.split(".")[2] if n.startswith("decoder.transformer_blocks.") else None  # noqa: E731
        else:
            with torch.device("meta"):
                decoder = AudioVAE(ckpt.config).decoder
            stages = [tuple(f"decoder.{p}" for p in decoder.stage_prefixes(i)) for i in range(len(decoder.ups))]
            unit_of = lambda n: next((str(i) for i, p in enumerate(stages) if n.startswith(p)), None)  # noqa: E731
        total = 0
        units: dict[str, int] = {}
        for spec in ckpt.specs:
            size = ckpt.numel(spec) * 4  # VAEs always run in float32
            total += size
            unit = unit_of(spec.name)
            if unit is not None:
                units[unit] = units.get(unit, 0) + size
        if name == "video_vae":
            c = ckpt.config
            # One 17-frame clip of pixels on the device, the decoder's tokens for one tile (256 px -> 16x16 latents
            # over 7 latent frames) with their fused QKV and MLP temporaries.
            clip_pixels = 17 * shape.height * shape.width * 3 * 4
            tile_tokens = 7 * 16 * 16
            width = c.decoder_num_heads * c.decoder_head_dim
            activations = clip_pixels + tile_tokens * 4 * (8 * width + 3 * c.decoder_ffn_dim) \
                + tile_tokens * 4 * 16 * 16 * 3 * 4
        else:
            c = ckpt.config
            # Largest stage of the upsampler: channels halve as the length grows by the rate; x2 anti-alias resampling.
            samples = 800 * shape.audio_latents * AUDIO_CHANNELS
            activations = 6 * 4 * samples * max(8, c.decoder_dim // 2 ** len(c.decoder_rates)) * 2
        fixed = total - sum(units.values())
        out.append(ComponentEstimate(name, total, max(units.values(), default=0), fixed, activations,
                                     streamable=bool(units)))
    return out


def plan_for_budget(sources, *, device="cpu", budget_bytes: int, width: int, height: int, num_frames: int,
                    dtype: torch.dtype | None = None, chunk_size: int | None = None) -> MemoryPlan:
    """Choose residency per component and the DiT's chunk budget so that every phase fits `budget_bytes`."""
    if budget_bytes <= 0:
        raise H3Error(f"memory budget must be positive, got {budget_bytes} bytes.")
    shape = LatentShape.for_request(width, height, num_frames)
    dit, config, rows = _dit_estimate(sources.transformer, shape, dtype)
    text = _text_encoder_estimate(sources.text_encoder, sources.text_encoder_layer)
    components = [text, dit, *_vae_estimates(sources.video_vae, sources.audio_vae, shape)]
    must_stream = Platform.for_device(device).unified_memory  # see admission.py
    for c in components:
        if c.streamable and (must_stream or c.device_bytes() > budget_bytes):
            c.residency = "layerwise"
    # The DiT's per-chunk temporaries get whatever the weights and full-length buffers leave.
    from ..runtime.chunking import projection_elements_per_row

    element = 2 if (dtype or torch.bfloat16) in (torch.bfloat16, torch.float16) else 4
    per_row = element * projection_elements_per_row(config)
    fused_temporaries = rows * per_row
    fixed_part = dit.device_bytes() - fused_temporaries
    chunk_budget = None
    if chunk_size is None and fixed_part + fused_temporaries > budget_bytes:
        chunk_budget = budget_bytes - fixed_part
        if chunk_budget < MIN_CHUNK_ROWS * per_row:
            chunk_budget = None  # reported below as not fitting
        else:
            dit.activation_bytes -= fused_temporaries - min(fused_temporaries, chunk_budget)
    elif chunk_size is not None:
        dit.activation_bytes -= fused_temporaries - min(rows, chunk_size) * per_row
    plan = MemoryPlan(budget_bytes, components, dit_chunk_budget=chunk_budget)
    too_big = [c for c in components if c.device_bytes() > budget_bytes]
    if too_big:
        worst = max(too_big, key=lambda c: c.device_bytes())
        raise MemoryBudgetError(
            f"this request does not fit a {_fmt(budget_bytes)} budget: the {worst.name} phase needs about "
            f"{_fmt(worst.device_bytes())} even with {'layerwise residency' if worst.streamable else 'the weights'} "
            f"and the smallest chunks.\n{plan.describe()}\nUse a smaller size or fewer seconds, or raise the budget."
        )
    options: dict = {}
    for c in components:
        opts = {}
        if c.residency == "layerwise":
            opts["residency"] = "layerwise"
        if c.name == "transformer":
            if chunk_size is not None:
                opts["chunk_size"] = chunk_size
            elif chunk_budget is not None:
                opts["memory_budget"] = int(chunk_budget)
        options[c.name] = opts
    plan.component_options = options
    return plan


def plan_components(sources, *, device="cpu", residency: str = "auto", chunk_size: int | None = None,
                    memory_budget_gb: float | None = None, width: int, height: int, num_frames: int,
                    log: Callable[[str], None] | None = None) -> dict:
    """Loader options per component from the user's settings; with a memory budget, the preflight decides.

    `residency` applies to all four components: "resident", "layerwise", or "auto" (layerwise on Apple MPS, where the
    admission rules require it for every component; resident elsewhere).
    """
    if memory_budget_gb is not None:
        from .planning import plan_for_budget

        if not memory_budget_gb > 0:
            raise H3Error(f"memory budget must be a positive number of GB, got {memory_budget_gb}.")
        plan = plan_for_budget(sources, device=device, budget_bytes=int(memory_budget_gb * 2**30), width=width,
                               height=height, num_frames=num_frames, chunk_size=chunk_size)
        if log:
            log(plan.describe())
        return plan.component_options
    if residency == "auto":
        residency = Platform.for_device(device).default_residency
    options: dict = {name: ({"residency": residency} if residency != "resident" else {})
                     for name in COMPONENTS}
    if chunk_size is not None:  # rows per chunk of attention queries and MLP, in the transformer and text encoder
        options["transformer"]["chunk_size"] = chunk_size
        options["text_encoder"]["chunk_size"] = chunk_size
    return options
