"""Preflight for a memory budget: bytes per component and activations at the requested size, read from checkpoint
headers before anything is allocated; `runtime.memory_plan` then picks residency and the DiT's chunk budget, or
refuses with the numbers.

Estimates, not allocator traces: weights are exact (header sizes), activations are counted from the tensors each
phase keeps alive. Phases (`PHASES`) run one after the other and each holds only its own component unless the caller
keeps others loaded (`keep`), so the plan checks every phase's sum: its component's weights, host store, staging ring
and activations, plus the weights, stores and rings of every kept component.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .. import settings
from ..checkpoints.audio_vae_loader import AUDIO_PHASE_SCOPED, resolve_audio_vae_checkpoint
from ..checkpoints.dit_loader import PHASE_SCOPED as DIT_PHASE_SCOPED
from ..checkpoints.dit_loader import is_fp32_island, resolve_dit_checkpoint, target_dtype
from ..checkpoints.lora_loader import LoraFold, block_factor_bytes, read_lora
from ..checkpoints.quantised import DEQUANTISED_DEFAULT_DTYPE
from ..checkpoints.text_encoder_loader import PHASE_SCOPED as TEXT_PHASE_SCOPED
from ..checkpoints.text_encoder_loader import STREAMED_LAYER_PREFIX as TEXT_STREAMED_LAYER_PREFIX
from ..checkpoints.text_encoder_loader import resolve_text_encoder_checkpoint
from ..checkpoints.video_vae_loader import VIDEO_PHASE_SCOPED, resolve_video_vae_checkpoint
from ..components import COMPONENTS
from ..errors import H3Error
from ..models.audio_vae import AudioVAE
from ..models.meta_models import meta_model
from ..models.video_vae import TilingOptions, split_tiles
from ..models.step_cache import step_cache_activation_bytes
from ..request.grid import (AUDIO_CHANNELS, AUDIO_LATENTS_PER_SECOND, AUDIO_SAMPLE_RATE, SPATIAL_COMPRESSION,
                           LatentShape, video_latent_frames)
from ..runtime.chunking import projection_elements_per_row
from ..runtime.host_store import PinBudget
from ..runtime.platform import Platform
from .memory_plan import ComponentEstimate, MemoryPlan, PhaseSpec, check_memory_budget_gib, fit_budget, format_bytes

# Text rows assumed before the prompt is tokenised (a long prompt; keyframes add about 64 rows per 256x256 image).
TEXT_ROWS_ESTIMATE = 512
# Hidden-wide rows per packed row the DiT holds beyond its counted buffers (calibrated, see `_dit_estimate`).
DIT_UNCOUNTED_ROW_WIDTHS = 24
# Sigma grid points assumed when the request does not say (the CLI's default for the released model).
DEFAULT_STEPS = 50
# What each phase runs, in order, when its component streams (`PhaseSpec.parts`): phase-scoped weight groups, the
# DiT's AdaLN plan pass, the block stack.
PHASE_PARTS = {"text encode": ("embeddings", "vision", "blocks"), "keyframe encode": ("encoder",),
               "reference encode": ("encoder",), "reference audio encode": ("encoder",),
               "sampling": ("text", "AdaLN plan", "blocks"), "video decode": ("blocks",),
               "audio decode": ("blocks",)}
# The staging ring's read-ahead the loaders use (`StagedReads`, `read_ahead=1`).
STAGING_READ_AHEAD = 1
# The phases of one generation, in order, and the component each one runs. The pipeline releases, when a phase
# starts, every loaded component the phase does not run unless it is kept; the plan sums what each phase holds.
PHASES = (("text encode", "text_encoder"), ("keyframe encode", "video_vae"), ("sampling", "transformer"),
          ("video decode", "video_vae"), ("audio decode", "audio_vae"))
# A Ref2VA request encodes its references instead of keyframes, between text encode and sampling: images and
# videos with the video VAE's encoder, audio references and soundtracks with the audio VAE's.
REFERENCE_PHASES = (("reference encode", "video_vae"), ("reference audio encode", "audio_vae"))


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _grouped(ckpt, sizes, unit_of, scoped: dict[str, tuple[str, ...]]) -> dict:
    """Per-spec sizes grouped: streamed units (and their sizes in pass order), phase-scoped groups, the rest."""
    units: dict = {}
    groups = {part: 0 for part in scoped}
    fixed = scratch = 0
    for spec in ckpt.specs:
        size = sizes(spec)
        unit = unit_of(spec.name)
        if unit is not None:
            units[unit] = units.get(unit, 0) + size
            if spec.combine is not None or len(spec.keys) > 1:  # read whole into the reader's scratch, then combined
                scratch = max(scratch, sum(-(-ckpt.files[k].nbytes(k) // 256) * 256 for k in spec.keys))
            continue
        fixed += size
        part = next((p for p, prefixes in scoped.items() if spec.name.startswith(prefixes)), None)
        if part is not None:
            groups[part] += size
    numbered = sorted((u for u in units if u.isdigit()), key=int)  # the pass order of the block stack
    return dict(units=units, fixed=fixed, scoped={p: b for p, b in groups.items() if b},
                total=fixed + sum(units.values()), scratch=scratch, sizes=tuple(units[u] for u in numbered))


def _weight_groups(ckpt, target, unit_of, scoped) -> tuple[dict, int, int]:
    """`_grouped` weights at their materialised dtype `target(spec)`, but streamed quantised units at their stored
    size (what the stores, rings and slots hold); with the largest quantised unit once dequantised (on the device
    beside the slots while it runs) and how much more a resident load holds (everything dequantised)."""
    def dequantised(spec):
        return ckpt.numel(spec) * _dtype_bytes(target(spec))

    def moved(spec):
        stored = ckpt.quantised_bytes(spec) if unit_of(spec.name) is not None else None
        return dequantised(spec) if stored is None else stored

    g = _grouped(ckpt, moved, unit_of, scoped)
    full = _grouped(ckpt, dequantised, unit_of, scoped)
    # A quantised phase-scoped group is dequantised a tensor at a time: the largest one's stored bytes (a GGUF token
    # embedding's 0.41 GiB at the released widths) sit beside the group's dequantised weights while it is decoded.
    g["scoped_stored"] = {}
    for spec in ckpt.specs:
        part = next((p for p, prefixes in scoped.items() if spec.name.startswith(prefixes)), None)
        stored = ckpt.quantised_bytes(spec) if part is not None and unit_of(spec.name) is None else None
        if stored:
            g["scoped_stored"][part] = max(g["scoped_stored"].get(part, 0), stored)
    quantised_units = {unit_of(spec.name) for spec in ckpt.specs if ckpt.quantised_bytes(spec)} - {None}
    return g, max((full["units"][u] for u in quantised_units), default=0), full["total"] - g["total"]


def packed_rows_estimate(shape: LatentShape, reference_rows: int = 0) -> int:
    """Rows of the DiT's packed sequence for a request, before the prompt is tokenised: `TEXT_ROWS_ESTIMATE` text
    rows, the audio latents of both channels and the 2x2-patched video latents (keyframe rows left out), plus a
    Ref2VA request's `reference_rows` (`reference_rows_estimate`)."""
    return (TEXT_ROWS_ESTIMATE + AUDIO_CHANNELS * shape.audio_latents
            + shape.latent_frames * (shape.latent_height // 2) * (shape.latent_width // 2) + int(reference_rows))


def guide_rows_estimate(guides, shape: LatentShape) -> int:
    """The DiT rows a request's placed guides (`request.guides.PlacedGuide`) add: each clip's or image's 2x2-patched
    latent rows on the target grid and 2 x its audio latents (guides do not enter the text encoder)."""
    rows = 0
    for guide in guides:
        if guide.num_frames:
            latent_frames = 1 if guide.num_frames == 1 else video_latent_frames(guide.num_frames)
            rows += latent_frames * (shape.latent_height // 2) * (shape.latent_width // 2)
        rows += AUDIO_CHANNELS * guide.audio_latents
    return rows


def reference_rows_estimate(references) -> int:
    """The rows a Ref2VA request's normalised references (`references.ReferenceRequest`) add: in the DiT, every
    image's and video's 2x2-patched latent rows and every audio's 2 x latents; in the text, each vision block's
    tokens (roughly a quarter of its 32-px cells) and the labels."""
    from ..request.references import sample_video_for_text_encoder

    rows = 0
    for ref in references.references:
        if ref.kind == "image":
            width, height = ref.image.size
            rows += (height // 32) * (width // 32) * 2  # DiT rows and about as many vision tokens
        elif ref.kind == "video":
            frames, height, width = ref.frames.shape[:3]
            count = max(1, (frames - 5) // 17) * 17 + 5
            latent_frames = (count - 5) // 17 * 5 + 2
            rows += latent_frames * (height // 32) * (width // 32)
            _, blocks = sample_video_for_text_encoder(ref.frames, ref.label)
            rows += len(blocks) * (2 + (height // 32) * (width // 32))
        if ref.has_audio:
            rows += AUDIO_CHANNELS * -(-ref.audio.shape[-1] // (AUDIO_SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND))
        rows += 8  # the labels
    return rows


def _dit_estimate(source, shape: LatentShape, dtype, *, steps: int = DEFAULT_STEPS,
                  keyframes: bool = False, reference_rows: int = 0,
                  reference_audio: bool = False, step_cache: bool = False) -> tuple[ComponentEstimate, object, int]:
    ckpt = resolve_dit_checkpoint(source)
    c = ckpt.config
    main = ckpt.main_dtype(is_fp32_island)
    targets = {spec.name: target_dtype(spec.name, DEQUANTISED_DEFAULT_DTYPE if ckpt.quantised_bytes(spec) else
                                       ckpt.files[spec.keys[0]].dtype(spec.keys[0]), dtype, main)
               for spec in ckpt.specs}
    residual_dtype = targets.get("condition_proj.weight", torch.float32)

    def unit_of(name):
        return (name.split(".")[1] if name.startswith("blocks.") and ".adaln_proj." not in name else
                (f"adaln.{name.split('.')[1]}" if name.startswith("blocks.") else None))

    g, dequantised_unit, dequantised_extra = _weight_groups(ckpt, lambda spec: targets[spec.name], unit_of,
                                                            DIT_PHASE_SCOPED)
    blocks = {u: b for u, b in g["units"].items() if not u.startswith("adaln.")}
    adaln = {u: b for u, b in g["units"].items() if u.startswith("adaln.")}
    rows = packed_rows_estimate(shape, reference_rows)
    element = _dtype_bytes(residual_dtype)
    # Full-length buffers every block keeps: residual in and out, K and V, the attention output, per-row modulation.
    full_length = rows * element * (3 * c.hidden_size + 2 * c.inner_dim + 6 * c.hidden_size // 3)
    # Per-row buffers the count above misses, measured at the released widths on the CPU (both residencies,
    # benchmarks/pipeline_phases.py: about 24 hidden-wide rows): the packed inputs and outputs, the RoPE tables, the
    # attention kernel's work buffers. Not chunked away.
    full_length += rows * element * DIT_UNCOUNTED_ROW_WIDTHS * c.hidden_size
    fused_temporaries = rows * element * projection_elements_per_row(c)
    if step_cache:  # its two cached residuals and, while a call decides and runs the middle blocks, two more
        full_length += step_cache_activation_bytes(rows, c.hidden_size, 1, residual_dtype)
    # The step-invariant precompute's AdaLN tables (host memory through the steps): every block's projection output for each
    # distinct timestep of every call (text and video, audio, visual condition rows (keyframes, reference images and
    # videos), reference audio rows).
    adaln_spec = next((spec for spec in ckpt.specs if spec.name == "blocks.0.adaln_proj.linear.weight"), None)
    tables = 0
    if adaln_spec is not None:
        calls = max(1, steps - 1)
        tables = (c.num_layers * calls * (2 + int(keyframes) + int(reference_audio)) * adaln_spec.shapes[0][0]
                  * _dtype_bytes(targets[adaln_spec.name]))
    estimate = ComponentEstimate("transformer", g["total"], max(blocks.values(), default=0), g["fixed"],
                                 full_length + fused_temporaries, streamable=True, scoped_bytes=g["scoped"], scoped_stored_bytes=g["scoped_stored"],
                                 companion_unit_bytes=max(adaln.values(), default=0), host_table_bytes=tables,
                                 scratch_bytes=g["scratch"], unit_sizes=g["sizes"],
                                 dequantised_unit_bytes=dequantised_unit, dequantised_extra_bytes=dequantised_extra,
                                 passes=max(1, steps - 1))
    return estimate, c, rows


def _dit_part_activations(config, dtype) -> tuple[tuple[str, int], ...]:
    """The text refiner's part of sampling: the text rows through the condition projection and the refiner blocks
    (residual, its normalised copy, fused QKV and the SwiGLU's two halves), float32 states in."""
    rows = TEXT_ROWS_ESTIMATE
    element = 2 if (dtype or torch.bfloat16) in (torch.bfloat16, torch.float16) else 4
    h = config.hidden_size
    return (("text", rows * (4 * config.text_dim + element * (6 * h + 3 * config.ffn_dim))),)


def _text_encoder_estimate(source, layer: int, dtype=None) -> ComponentEstimate:
    ckpt = resolve_text_encoder_checkpoint(source, layer)

    def target(spec):  # the loader keeps the stored dtype by default (a quantised weight: bf16)
        return dtype or (DEQUANTISED_DEFAULT_DTYPE if ckpt.quantised_bytes(spec) else
                         ckpt.files[spec.keys[0]].dtype(spec.keys[0]))

    prefix = TEXT_STREAMED_LAYER_PREFIX
    g, dequantised_unit, dequantised_extra = _weight_groups(
        ckpt, target, lambda n: n[len(prefix):].split(".")[0] if n.startswith(prefix) else None, TEXT_PHASE_SCOPED)
    hidden = ckpt.config.language.hidden_size
    activations = TEXT_ROWS_ESTIMATE * 4 * (8 * hidden + 2 * ckpt.config.language.intermediate_size)
    return ComponentEstimate("text_encoder", g["total"], max(g["units"].values(), default=0), g["fixed"],
                             activations, streamable=True, scoped_bytes=g["scoped"], scoped_stored_bytes=g["scoped_stored"], scratch_bytes=g["scratch"],
                             unit_sizes=g["sizes"], dequantised_unit_bytes=dequantised_unit,
                             dequantised_extra_bytes=dequantised_extra)


def _vae_estimates(video_source, audio_source, shape: LatentShape) -> list[ComponentEstimate]:
    out = []
    for name, ckpt in (("video_vae", resolve_video_vae_checkpoint(video_source)),
                       ("audio_vae", resolve_audio_vae_checkpoint(audio_source))):
        if name == "video_vae":
            unit_of = lambda n: n.split(".")[2] if n.startswith("decoder.transformer_blocks.") else None  # noqa: E731
        else:
            decoder = meta_model(AudioVAE, ckpt.config).decoder
            stages = [tuple(f"decoder.{p}" for p in decoder.stage_prefixes(i)) for i in range(len(decoder.ups))]
            unit_of = lambda n: next((str(i) for i, p in enumerate(stages) if n.startswith(p)), None)  # noqa: E731
        g, dequantised_unit, dequantised_extra = _weight_groups(
            ckpt, lambda spec: torch.float32, unit_of,  # VAEs always run in float32
            VIDEO_PHASE_SCOPED if name == "video_vae" else AUDIO_PHASE_SCOPED)
        if name == "video_vae":
            c = ckpt.config
            # One 17-frame clip of pixels on the device, the decoder's tokens for one tile (256 px -> 16x16 latents
            # over 7 latent frames) with their fused QKV and MLP temporaries.
            clip_pixels = 17 * shape.height * shape.width * 3 * 4
            # A tile is at most 256 px (16 latents) a side, over a clip's 7 latent frames (a shorter video is padded
            # to a clip); a smaller canvas, a smaller tile, but counted as at least half a full one (measured: below
            # that the decoder's per-tile buffers the formula does not itemise dominate; the released widths at
            # 128x128 held 0.71 GiB streamed, 1.01 GiB planned with a full tile).
            tile_tokens = 7 * max(16 * 8, min(16, shape.latent_height) * min(16, shape.latent_width))
            width = c.decoder_num_heads * c.decoder_head_dim
            # Calibrated on the released widths (benchmarks/pipeline_phases.py): about 12 token-wide and 5 MLP-wide
            # float32 rows per token alive at a block's peak (attention q / k / v / output and norms, MLP in / out).
            activations = clip_pixels + tile_tokens * 4 * (12 * width + 5 * c.decoder_ffn_dim) \
                + tile_tokens * 4 * 16 * 16 * 3 * 4
        else:
            c = ckpt.config
            # Largest stage of the upsampler: channels halve as the length grows by the rate; x2 anti-alias resampling.
            samples = 800 * shape.audio_latents * AUDIO_CHANNELS
            activations = 6 * 4 * samples * max(8, c.decoder_dim // 2 ** len(c.decoder_rates)) * 2
            # On the CPU every Conv1d / ConvTranspose1d call has oneDNN reorder its float32 weight into a temporary
            # of the same size (measured per call at the released widths); the largest is conv_pre's
            # (latent_dim x decoder_dim x 7, 56 MiB), held beside that stage's activations.
            activations += max(m.weight.numel() for m in decoder.modules()
                               if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))) * 4
        if name == "video_vae":  # one decoder pass per tile of every 7-latent-frame clip
            tiling = TilingOptions()
            tiles = [len(split_tiles(side, tiling.tile_size, tiling.min_overlap, SPATIAL_COMPRESSION)[0])
                     for side in (shape.height, shape.width)]
            passes = -(-shape.latent_frames // 7) * tiles[0] * tiles[1]
        else:
            passes = 1
        out.append(ComponentEstimate(name, g["total"], max(g["units"].values(), default=0), g["fixed"], activations,
                                     streamable=bool(g["units"]), scoped_bytes=g["scoped"], scoped_stored_bytes=g["scoped_stored"],
                                     scratch_bytes=g["scratch"], unit_sizes=g["sizes"],
                                     dequantised_unit_bytes=dequantised_unit,
                                     dequantised_extra_bytes=dequantised_extra, passes=passes))
    return out


def _keyframe_activations(video_source, shape: LatentShape) -> int:
    """Encoding one keyframe (they are encoded one at a time): its pixels twice (as given and normalised) and one
    encoder tile at the first level's width over the causal convolution's 3 padded frames, about 4 such tensors
    (measured at the released widths: benchmarks/pipeline_phases.py). On a small canvas that count falls below what
    does not shrink with it: at 128x128 the released encoder held 0.36 GiB beside its 0.67 GiB of float32 weights
    (benchmarks/whole_model.py; oneDNN's blocked copies of the conv weights, per-level buffers), so at least half the
    encoder's float32 weights is counted."""
    ckpt = resolve_video_vae_checkpoint(video_source)
    c = ckpt.config
    tile = min(256, shape.height) * min(256, shape.width)
    encoder = sum(ckpt.numel(spec) for spec in ckpt.specs if spec.name.startswith(("encoder.", "quant_conv."))) * 4
    return max(2 * shape.height * shape.width * 3 * 4 + 4 * 3 * tile * c.block_out_channels[0] * 4, encoder // 2)


def _reference_activations(video_source, references) -> int:
    """Encoding the largest visual reference (one at a time): its frames twice (as given and normalised), and one
    encoder tile per frame of a 17-frame clip, as `_keyframe_activations` counts one frame."""
    c = resolve_video_vae_checkpoint(video_source).config
    largest = 0
    for ref in references.references:
        if ref.kind == "image":
            frames, (width, height) = 1, ref.image.size
        elif ref.kind == "video":
            frames, height, width = ref.frames.shape[:3]
        else:
            continue
        tile = min(256, height) * min(256, width)
        # A clip of up to 17 frames plus the causal convolution's 2 padded ones (a keyframe: 1 + 2).
        largest = max(largest, 2 * frames * height * width * 3 * 4
                      + 4 * (min(frames, c.clip_length) + 2) * tile * c.block_out_channels[0] * 4)
    return largest


def _guide_activations(video_source, shape: LatentShape, guides) -> int:
    """Encoding the longest guide clip on the canvas (one at a time), as `_reference_activations` counts a clip."""
    c = resolve_video_vae_checkpoint(video_source).config
    tile = min(256, shape.height) * min(256, shape.width)
    return max((2 * g.num_frames * shape.height * shape.width * 3 * 4
                + 4 * (min(g.num_frames, c.clip_length) + 2) * tile * c.block_out_channels[0] * 4
                for g in guides if g.num_frames), default=0)


def check_keep(keep) -> tuple[str, ...]:
    """The components to keep loaded through every phase, checked against `COMPONENTS`."""
    keep = tuple(keep)
    unknown = sorted(set(keep) - set(COMPONENTS))
    if unknown:
        raise H3Error(f"unknown component(s) {unknown} to keep; use {list(COMPONENTS)}.")
    return keep


def plan_for_budget(sources, *, device="cpu", budget_bytes: int, width: int, height: int, num_frames: int,
                    dtype: torch.dtype | None = None, chunk_size: int | None = None, loras=(), keep=(),
                    keyframes: bool = False, staging_read_ahead: int | None = STAGING_READ_AHEAD,
                    host_budget_bytes: int | None = None, steps: int = DEFAULT_STEPS,
                    residency: str | Mapping[str, str] | None = None, references=None,
                    step_cache: bool = False, host_memory_bytes: int | None = None, guides=()) -> MemoryPlan:
    """Choose residency per component and the DiT's chunk budget so that every phase fits `budget_bytes`, or refuse
    naming the phase over budget and its biggest items.

    `keep` names components the pipeline keeps loaded (its `keep_*` options): they count in every phase.
    `keyframes`: the request has first / last keyframes, so the keyframe-encode phase runs (and the text encoder's
    vision tower). `steps` (sigma grid points) sizes the precomputed AdaLN tables. `staging_read_ahead`: the
    layerwise staging ring's read-ahead (the loaders' 1 by default; None: no ring); `host_budget_bytes`: on a
    discrete device (CUDA), the host memory the stores and rings may take (None: reported, not checked);
    `host_memory_bytes`: the host's RAM, whose pin budget share (`PinBudget.DEFAULT_FRACTION`) caps the pinned
    slabs a streamed component packs on CUDA (None: this process's pin budget).
    `residency` ("resident" / "layerwise") fixes every streamable component's residency instead of choosing it; a
    mapping fixes each named component's (those of a pipeline already built). See `runtime.memory_plan.fit_budget`.

    `loras` ((file, strength), ...) are read and checked against the transformer here; the device bytes of their
    largest fold step count with the transformer's activations, and on CUDA a streamed transformer's copy of its
    blocks' factors (`CachedFold`) with its host memory; elsewhere the factors stay memory-mapped.

    `references` (a normalised `references.ReferenceRequest`): a Ref2VA request; its rows count in the
    transformer's activations and the chunk-size choice, and its reference-encode phases are planned.
    `step_cache`: the request runs the step cache, whose residuals count in the transformer's activations.
    `guides` (a request's `placed_guides`): their rows count in the transformer's activations, their clips in the
    keyframe-encode phase, their audio in a reference-audio-encode phase."""
    if budget_bytes <= 0:
        raise H3Error(f"memory budget must be positive, got {budget_bytes} bytes.")
    keep = check_keep(keep)
    shape = LatentShape.for_request(width, height, num_frames)
    reference_rows = (reference_rows_estimate(references) if references else 0) + guide_rows_estimate(guides, shape)
    guide_frames = any(g.num_frames for g in guides)  # the keyframe-encode phase; no vision tower (not in Qwen)
    guide_audio = any(g.audio is not None for g in guides)
    dit, config, rows = _dit_estimate(sources.transformer, shape, dtype, steps=steps,
                                      keyframes=keyframes or guide_frames or bool(references) and any(
                                          r.kind != "audio" for r in references.references),
                                      reference_rows=reference_rows, reference_audio=guide_audio or bool(references)
                                      and any(r.has_audio for r in references.references), step_cache=step_cache)
    text = _text_encoder_estimate(sources.text_encoder, sources.text_encoder_layer, dtype)
    components = [text, dit, *_vae_estimates(sources.video_vae, sources.audio_vae, shape)]
    # The planned per-row temporaries are those of the requested dtype (bf16 unless given).
    element = 2 if (dtype or torch.bfloat16) in (torch.bfloat16, torch.float16) else 4
    notes = []
    if loras:
        fold = LoraFold([(read_lora(path, config), float(strength)) for path, strength in loras])
        fold_bytes = fold.peak_temporary_bytes(dtype or torch.bfloat16)
        dit.activation_bytes += fold_bytes
        dit.fold_cache_bytes = block_factor_bytes(fold, dtype or torch.bfloat16)
        files = sum(lora.nbytes for lora, _ in fold.loras)
        notes.append(f"{len(fold.loras)} LoRA file(s), {format_bytes(files)} memory-mapped; their fold adds up to "
                     f"{format_bytes(fold_bytes)} to the transformer phase"
                     + (f", and a streamed transformer holds its blocks' factors in page-locked host memory "
                        f"({format_bytes(dit.fold_cache_bytes)})" if Platform.for_device(device).asynchronous_copies
                        else ""))
    phases = [PhaseSpec(name, component,
                        max(_keyframe_activations(sources.video_vae, shape),
                            _guide_activations(sources.video_vae, shape, guides))
                        if name == "keyframe encode" else None,
                        parts=tuple(p for p in PHASE_PARTS[name] if keyframes or references or p != "vision"),
                        part_activations=_dit_part_activations(config, dtype) if component == "transformer" else ())
              for name, component in PHASES if keyframes or guide_frames or name != "keyframe encode"]
    if guide_audio and not references:  # the guides' audio is encoded after their frames, before sampling
        phases.insert(next(i for i, p in enumerate(phases) if p.name == "sampling"),
                      PhaseSpec("reference audio encode", "audio_vae", None,
                                parts=PHASE_PARTS["reference audio encode"]))
    if references:
        reference_phases = [(n, c) for n, c in REFERENCE_PHASES if n == "reference encode"
                            and any(r.kind != "audio" for r in references.references)
                            or n == "reference audio encode" and any(r.has_audio for r in references.references)]
        phases[1:1] = [PhaseSpec(name, component, _reference_activations(sources.video_vae, references)
                                 if component == "video_vae" else None, parts=PHASE_PARTS[name])
                       for name, component in reference_phases]
    return fit_budget(components, budget_bytes, Platform.for_device(device), dit=dit, rows=rows,
                      row_bytes=element * projection_elements_per_row(config), chunk_size=chunk_size, notes=notes,
                      phases=phases, keep=keep, staging_read_ahead=staging_read_ahead,
                      host_budget_bytes=host_budget_bytes, residency=residency,
                      pin_budget_bytes=pin_budget_for(host_memory_bytes))


def pin_budget_for(host_memory_bytes: int | None) -> int:
    """The pin budget of a host with that much RAM, or this process's own (None)."""
    if host_memory_bytes is None:
        return PinBudget.shared().limit_bytes
    return int(host_memory_bytes * PinBudget.DEFAULT_FRACTION)


def plan_components(sources, *, device="cpu", residency: str = "auto", chunk_size: int | None = None,
                    memory_budget_gb: float | None = None, width: int, height: int, num_frames: int,
                    loras=(), keep=(), keyframes: bool = False, steps: int = DEFAULT_STEPS,
                    dtype: torch.dtype | None = None, log: Callable[[str], None] | None = None,
                    references=None, step_cache: bool = False, guides=()) -> dict:
    """Loader options per component from the user's settings; with a memory budget (GiB), the preflight decides
    (its per-phase breakdown goes to `log`), counting the components in `keep` in every phase, at the run's `dtype`
    and `steps`, with its `residency` unless "auto".

    `residency` applies to all four components: "resident", "layerwise", or "auto" (layerwise on Apple MPS, where the
    admission rules require it for every component; resident elsewhere). `chunk_size` (rows per chunk of attention
    queries and MLP) goes to the transformer and the text encoder, and `loras` ((file, strength), ...) to the
    transformer's loader, either way.
    """
    if memory_budget_gb is not None:
        memory_budget_gb = check_memory_budget_gib(memory_budget_gb)
        plan = plan_for_budget(sources, device=device, budget_bytes=int(memory_budget_gb * 2**30), width=width,
                               height=height, num_frames=num_frames, dtype=dtype, chunk_size=chunk_size,
                               loras=loras, keep=keep, keyframes=keyframes, steps=steps,
                               residency=None if residency == "auto" else residency, references=references,
                               step_cache=step_cache, guides=guides)
        if log:
            log(plan.describe())
        options = {name: dict(plan.component_options.get(name, {})) for name in COMPONENTS}
    else:
        if residency == "auto":
            residency = Platform.for_device(device).default_residency
        options = {name: ({"residency": residency} if residency != settings.RESIDENT else {}) for name in COMPONENTS}
        if chunk_size is not None:
            options["transformer"]["chunk_size"] = chunk_size
    if chunk_size is not None:  # the plan sets the transformer's; the text encoder takes the same rows per chunk
        options["text_encoder"]["chunk_size"] = chunk_size
    if loras:
        options.setdefault("transformer", {})["loras"] = [(path, float(strength)) for path, strength in loras]
    return options
