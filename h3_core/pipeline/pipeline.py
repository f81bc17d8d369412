"""End-to-end generation: prompt (+ keyframes) -> text encoder -> packed sampling loop -> video and audio VAEs.

Components are loaded lazily, one phase at a time (`planning.PHASES`: text encode, keyframe encode, sampling, video
decode, audio decode). When a phase starts, every loaded component it does not run is released unless the pipeline
keeps it (`keep_*`), and the text encoder goes as soon as it has encoded: the keyframe encoder (the video VAE) before
sampling, the transformer before decoding. Peak memory is that of the largest phase, not the sum of the components.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..checkpoints.audio_vae_loader import load_audio_vae
from ..checkpoints.dit_loader import load_dit
from ..checkpoints.lora_loader import has_loras, set_loras
from ..checkpoints.text_encoder_gguf import vision_missing
from ..checkpoints.text_encoder_loader import load_text_encoder
from ..checkpoints.video_vae_loader import load_video_vae
from ..components import COMPONENTS
from ..errors import H3Error
from ..models.step_cache import StepCacheStats
from ..planning.phase_plans import PHASES, REFERENCE_PHASES
from ..request.generation_request import MAX_PROMPT_TOKENS, GenerationRequest
from ..request.generation_result import GenerationResult
from ..request.grid import LatentShape, audio_samples_for_frames
from ..request.keyframes import pil_to_frames, prepare_keyframes
from ..request.references import ReferenceRequest, sample_video_for_text_encoder
from ..runtime.chunking import ChunkingPolicy
from ..runtime.file_reads import available_memory_bytes, read_ahead_files
from ..runtime.held_memory import HeldMemory, held_memory
from ..runtime.platform import Platform, device_problem
from ..runtime.residency import Residency
from ..sources.model_sources import (ModelSources, canvas_rules, check_components_match, safetensors_files,
                                     transformer_partition)
from ..request.audio_health import check_audio, raise_audio_errors, warning_line
from ..request.guides import prepare_guide_frames
from .layout import (GuideBlock, ReferenceBlock, audio_to_rows, build_packed_layout, build_ref2va_layout, patchify,
                     rows_to_audio, unpatchify)
from .preview import StepEstimate
from .sampler import Schedule, denoise, initial_noise, noise_condition, non_finite_error


def _step_estimate(preview, video_shape, patch_size, step, total, video_rows, audio_rows) -> None:
    """The sampling loop's x0 rows as a `StepEstimate` for a `sample(preview=...)` callback."""
    preview(StepEstimate(step, total, video_rows, audio_rows, video_shape, patch_size))


# ---- the pipeline ---------------------------------------------------------------------------------------------------


@dataclass
class Conditioning:
    """What the text encoder produced for one request, plus the keyframes it saw."""

    states: torch.Tensor  # [L, text_dim]
    tags: torch.Tensor  # [L]
    keyframes: list = field(default_factory=list)  # prepared PIL images, in packed order
    anchors: tuple[str, ...] = ()
    references: ReferenceRequest | None = None  # Ref2VA references, normalised, in request order
    request: GenerationRequest | None = None  # what was encoded: its canvas and duration are the sample's
    guides: tuple = ()  # request.guides.PlacedGuide: guides at any frame, checked against the encoded request


@dataclass
class Latents:
    video: torch.Tensor  # [1, 24, T, H/16, W/16], normalised
    audio: torch.Tensor  # [1, 32, 2, Ta], normalised
    shape: LatentShape
    step_cache: StepCacheStats | None = None  # what the sampler's step cache did (None: off)


@dataclass(frozen=True)
class ResidencySummary:
    """Where a loaded component's blocks live: `resident_blocks` of its `total_blocks` stay on the device, the
    others stream from host memory (`residency` "resident" or "layerwise"). For the transformer, its LoRAs: files
    applied, factor bytes the folds have read onto the device so far, and the largest fold step's temporary."""

    residency: str
    resident_blocks: int
    total_blocks: int
    lora_files: int = 0
    lora_bytes_moved: int = 0
    lora_fold_peak_bytes: int = 0


def compute_dtype(model) -> torch.dtype | None:
    """The dtype a component computes in: the transformer's residual stream, else its first float parameter."""
    dtype = getattr(model, "residual_dtype", None)
    if dtype is not None:
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def all_finite(tensor: torch.Tensor, check_interrupt: Callable[[], None] | None = None, *, step: int = 16) -> bool:
    """`torch.isfinite(tensor).all()`, `step` entries of the first dimension at a time with `check_interrupt()`
    between: 15 s of decoded 1920x1088 frames are 8.4 GiB, seconds to scan in one call."""
    for start in range(0, tensor.shape[0], step):
        if check_interrupt is not None:
            check_interrupt()
        if not torch.isfinite(tensor[start:start + step]).all():
            return False
    return True


def check_finite_latents(latent: torch.Tensor, kind: str) -> None:
    if not torch.isfinite(latent).all():
        raise H3Error(f"the {kind} latents given to decode contain NaN or Inf values, so there is nothing to decode: "
                      "the decoder's input is not finite. Sample them again (the sampler checks its own outputs, so "
                      "they were changed or made elsewhere).")


def serialised(method):
    """Run `method` holding the pipeline's lock: the components are shared, mutable state (streamed weights bound to
    device slots, the loaded set, the LoRA set), so a second thread's call waits for the first to finish (the lock is
    re-entrant: `generate` holds it across its phases)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


# The module that runs each component's block loop (it holds the `block_residency`).
_BLOCK_LOOP = {"text_encoder": lambda model: model.language_model, "transformer": lambda model: model,
               "video_vae": lambda model: model.decoder, "audio_vae": lambda model: model.decoder}


class H3Pipeline:
    """Holds the model sources and the memory settings; loads each component when its phase needs it.

    `component_options` maps a component name ("transformer", "text_encoder", "video_vae", "audio_vae") to extra
    keyword arguments of its loader (residency, chunk size, ...).

    Phases hold only what they need: when a phase starts, the loaded components it does not run are released (and
    loaded again from their files when a later phase needs them); the text encoder is released right after each
    prompt. `keep_text_encoder`, `keep_transformer`, `keep_video_vae` and `keep_audio_vae` keep that component
    loaded through every phase once loaded (until `release` / `release_all`): faster for repeated runs, and counted
    in every phase by the memory plan (`plan_for_budget(keep=...)`).

    Calls from several threads are serialised (one lock per pipeline): a second `generate` waits for the first.
    """

    COMPONENTS = COMPONENTS
    PHASES = PHASES
    REFERENCE_PHASES = REFERENCE_PHASES

    def __init__(self, sources: ModelSources, *, device="cpu", dtype: torch.dtype | None = None,
                 component_options: dict | None = None, keep_text_encoder: bool = False,
                 keep_transformer: bool = False, keep_video_vae: bool = False, keep_audio_vae: bool = False,
                 log: Callable[[str], None] | None = None):
        self.sources = sources
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise H3Error(f"device {device!r} is not a device; use cpu, cuda, cuda:N or mps.") from None
        Platform.for_device(self.device)  # an unsupported device type is refused here, before any loading
        problem = device_problem(self.device)
        if problem:  # a missing GPU is one message here, not a torch error from the first tensor moved there
            raise H3Error(f"device {str(self.device)!r}: {problem}.")
        self.dtype = dtype
        self.component_options = {k: dict(v) for k, v in (component_options or {}).items()}
        unknown = set(self.component_options) - set(self.COMPONENTS)
        if unknown:
            raise H3Error(f"unknown component(s) {sorted(unknown)} in component_options; use {self.COMPONENTS}.")
        # From the headers, before anything loads: four components that do not belong together fail here.
        check_components_match(sources, self.component_options.get("text_encoder", {}).get("config"))
        self.keep_text_encoder = keep_text_encoder
        self.keep_transformer = keep_transformer
        self.keep_video_vae = keep_video_vae
        self.keep_audio_vae = keep_audio_vae
        self.log = log or (lambda message: None)
        self._loaded: dict[str, object] = {}
        self._listeners: list[Callable[[str, bool], None]] = []
        # One call at a time: two threads generating on one pipeline would drive the same residency managers.
        self._lock = threading.RLock()

    # -- components ----------------------------------------------------------------------------------------------

    @serialised
    def component(self, name: str):
        if name in self._loaded:
            return self._loaded[name]
        options = dict(self.component_options.get(name, {}))
        started = time.perf_counter()
        if name == "text_encoder":
            loaded = load_text_encoder(self.sources.text_encoder, tokenizer=self.sources.tokenizer,
                                               layer=self.sources.text_encoder_layer, device=self.device,
                                               dtype=self.dtype, **options)
        elif name == "transformer":
            loaded = load_dit(self.sources.transformer, device=self.device, dtype=self.dtype, **options)
        elif name == "video_vae":
            loaded = load_video_vae(self.sources.video_vae, device=self.device, **options)
        elif name == "audio_vae":
            loaded = load_audio_vae(self.sources.audio_vae, device=self.device, **options)
        else:
            raise H3Error(f"unknown component {name!r}; use one of {self.COMPONENTS}.")
        self.log(f"loaded {name} in {time.perf_counter() - started:.1f} s")
        self._loaded[name] = loaded
        self._tell(name, True)
        return loaded

    @serialised
    def release(self, name: str) -> None:
        """Drop a component (its memory maps, device copies, slots and pinned host buffers go with it); the next
        phase that runs it loads it again from its files."""
        component = self._loaded.pop(name, None)
        if component is not None:
            close = getattr(component, "close", None)
            if callable(close):
                close(restore=False)  # dropped: giving streamed weights back would only copy them to host memory
            del component
            gc.collect()
            self._tell(name, False)

    @serialised
    def release_all(self) -> None:
        for name in list(self._loaded):
            self.release(name)

    def try_release(self, name: str) -> bool:
        """`release(name)` unless another thread is running a call of this pipeline (False then: nothing released),
        for a host application that frees memory from a thread of its own and must not wait for a whole phase."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self.release(name)
            return True
        finally:
            self._lock.release()

    def loaded_component(self, name: str):
        """The component if it is loaded now, else None (nothing is loaded here)."""
        return self._loaded.get(name)

    @property
    def loaded(self) -> tuple[str, ...]:
        """The components loaded now, in phase order."""
        return tuple(name for name in self.COMPONENTS if name in self._loaded)

    @property
    def kept(self) -> frozenset[str]:
        """The components kept loaded across phases (the `keep_*` options)."""
        return frozenset(name for name in self.COMPONENTS if getattr(self, f"keep_{name}"))

    @serialised
    def enter_phase(self, phase: str) -> None:
        """Start `phase` (one of `PHASES`): release every loaded component it does not run, unless kept."""
        runs = dict(self.PHASES + self.REFERENCE_PHASES).get(phase)
        if runs is None:
            raise H3Error(f"unknown phase {phase!r}; use one of "
                          f"{[name for name, _ in self.PHASES + self.REFERENCE_PHASES]}.")
        kept = self.kept
        for name in self.loaded:
            if name != runs and name not in kept:
                self.log(f"{phase}: releasing {name} (not kept)")
                self.release(name)

    def read_ahead(self, name: str):
        """Read component `name`'s files into the page cache in the background while the current phase computes, when
        it is not loaded and its files take at most half the available memory: the next phase's load then reads from
        memory instead of waiting for the disk (a resident video VAE's 4.9 GiB took 10 s after sampling, not
        overlapped). The kernel may evict the pages again under memory pressure; returns the reading thread, or
        None."""
        if name in self._loaded:
            return None
        available = available_memory_bytes()
        return read_ahead_files(safetensors_files(getattr(self.sources, name)),
                                limit_bytes=None if available is None else available // 2)

    @serialised
    def residency_summary(self, name: str) -> ResidencySummary | None:
        """The block placement of a loaded component; None when it is not loaded (nothing is loaded here)."""
        if name not in self.COMPONENTS:
            raise H3Error(f"unknown component {name!r}; use one of {self.COMPONENTS}.")
        if name not in self._loaded:
            return None
        stats = _BLOCK_LOOP[name](self._loaded[name]).block_residency.stats()
        resident = len(stats.resident_blocks)
        summary = ResidencySummary(str(stats.residency.value), resident, resident + len(stats.streamed_blocks))
        fold = getattr(self._loaded[name], "lora_fold", None)
        if fold is not None and fold.loras:
            dtype = self._loaded[name].residual_dtype
            summary = replace(summary, lora_files=len(fold.loras), lora_bytes_moved=fold.factor_bytes_moved,
                              lora_fold_peak_bytes=fold.peak_temporary_bytes(dtype))
        return summary

    def add_listener(self, listener: Callable[[str, bool], None]) -> None:
        """`listener(name, loaded)` is called after a component is loaded (True) and after it is released (False),
        under the pipeline's lock: a host application's registry of loaded models follows the pipeline with it."""
        self._listeners.append(listener)

    def _tell(self, name: str, loaded: bool) -> None:
        for listener in list(self._listeners):
            listener(name, loaded)

    @serialised
    def held_memory(self, name: str) -> HeldMemory | None:
        """What the loaded component holds in memory now, on the device and on the host besides
        (`runtime.held_memory`); None when it is not loaded."""
        if name not in self.COMPONENTS:
            raise H3Error(f"unknown component {name!r}; use one of {self.COMPONENTS}.")
        component = self._loaded.get(name)
        return None if component is None else held_memory(component, self.device)

    def residencies(self) -> dict[str, str]:
        """Each component's residency as the pipeline loads it (`settings.RESIDENT` / `settings.LAYERWISE`)."""
        return {name: Residency.parse(self.component_options.get(name, {}).get("residency", Residency.RESIDENT)).value
                for name in self.COMPONENTS}

    def plan(self, *, width: int, height: int, num_frames: int, steps: int | None = None, loras=(),
             step_cache: bool = False, keyframes: bool = False, references=None, chunk_size: int | None = None,
             budget_bytes: int | None = None, guides=()):
        """The memory plan of a request as this pipeline runs it (its device, dtype, residencies, kept components,
        the transformer's chunk size unless `chunk_size` is given): what each phase holds (`MemoryPlan.phase`).
        Within `budget_bytes` (None: unbounded, so nothing is refused and the transformer is planned fused unless
        it has a chunk size; a budget plans its row chunks as `plan_for_budget` does)."""
        from ..planning.memory_plan import MAX_MEMORY_BUDGET_GIB
        from ..planning.phase_plans import DEFAULT_STEPS, plan_for_budget

        if chunk_size is None:
            chunk_size = self.component_options.get("transformer", {}).get("chunk_size")
        return plan_for_budget(
            self.sources, device=self.device, budget_bytes=budget_bytes or MAX_MEMORY_BUDGET_GIB * 2**30,
            width=width, height=height, num_frames=num_frames, dtype=self.dtype, chunk_size=chunk_size,
            loras=loras or (), keep=tuple(name for name in self.COMPONENTS if name in self.kept),
            keyframes=keyframes, steps=steps or DEFAULT_STEPS, residency=self.residencies(), references=references,
            step_cache=step_cache, guides=guides)

    def plan_request(self, request: GenerationRequest, cond: Conditioning | None = None, *,
                     chunk_size: int | None = None, budget_bytes: int | None = None):
        """`plan` of a request: its keyframes and references from `cond` when it was encoded (as `sample` uses
        them), else from the request itself."""
        if cond is not None:
            keyframes, references, guides = bool(cond.keyframes), cond.references, cond.guides
        else:
            keyframes, guides = bool(request.keyframe_images), request.placed_guides
            references = request.normalised_references(canvas_rules(self.sources))
        return self.plan(width=request.width, height=request.height, num_frames=request.num_frames,
                         steps=request.steps, loras=request.loras, step_cache=request.step_cache is not None,
                         keyframes=keyframes, references=references, chunk_size=chunk_size, budget_bytes=budget_bytes,
                         guides=guides)

    @serialised
    def room_needed(self, plan, phases) -> int:
        """Bytes a host application's model management must have free on the device before `phases` (names of
        `plan`'s phases, run one after the other) start: the largest over them of what the phase allocates for
        its own component at its largest part (weights, slots, the AdaLN slot, phase-scoped weights, activations;
        on a device that is the host (the CPU) or shares its memory, its host stores and staging too), less what
        that component already holds if it is loaded, less what the loaded components the phase releases hold now.
        Idle kept components are already allocated, so they are not counted."""
        runs = dict(self.PHASES + self.REFERENCE_PHASES)
        needed = 0
        for name in phases:
            estimate = plan.phase(name)
            own = max(sum(i.nbytes for i in estimate.items if not i.kept and (i.during is None or i.during == part)
                          and (plan.shared_memory or not i.on_host)) for part in estimate.parts)
            component = runs[name]
            freed = [other for other in self.loaded if other == component
                     or (other not in self.kept and other != component)]
            for other in freed:
                held = self.held_memory(other)
                own -= held.total_bytes if plan.shared_memory else held.device_bytes
            needed = max(needed, own)
        return needed

    # -- phases --------------------------------------------------------------------------------------------------

    @serialised
    def encode_prompt(self, request: GenerationRequest | str, /, *, check_interrupt: Callable[[], None] | None = None,
                      **fields) -> Conditioning:
        """The text-encode phase of a request (`GenerationRequest`, or a prompt and its fields as keywords). With
        references (and the Ref2VA transformer) it is the Ref2VA presentation: a label per reference in request
        order, the vision blocks of images and videos. `check_interrupt()` runs between the encoder's layers and
        row chunks and may raise to stop (the encoder is released as after a finished encode, unless kept)."""
        request = GenerationRequest.of(request, fields)
        for note in request.notes:
            self.log(note)
        references = request.normalised_references(canvas_rules(self.sources))
        if references:
            self.check_ref2va_transformer()
        keyframes = prepare_keyframes(request.keyframe_images, request.width, request.height)
        if keyframes or (references and any(r.kind in ("image", "video") for r in references.references)):
            self.check_text_encoder_vision()
        self.enter_phase("text encode")
        if request.anchors:  # the keyframe encode comes next
            self.read_ahead("video_vae")
        encoder = self.component("text_encoder")
        tokens = len(encoder.tokenizer.tokenize(request.prompt))
        if tokens > MAX_PROMPT_TOKENS:
            raise H3Error(f"the prompt is {tokens} tokens ({len(request.prompt)} characters); at most "
                          f"{MAX_PROMPT_TOKENS} are accepted (H3 was trained on prompts of a few hundred tokens). "
                          "Shorten it.")
        try:
            if references:
                states, tags = encoder.encode_references(request.prompt, self._text_encoder_view(references),
                                                         check_interrupt=check_interrupt)
            else:
                states, tags = encoder.encode(request.prompt, keyframes, check_interrupt=check_interrupt)
        finally:  # an interrupted encode leaves no more loaded than a finished one
            if not self.keep_text_encoder:
                self.release("text_encoder")
        if not torch.isfinite(states).all():
            raise non_finite_error("the text encoder", safetensors_files(self.sources.text_encoder),
                                   "its output (the prompt's hidden states)", dtype=compute_dtype(encoder),
                                   config=getattr(encoder, "config", None))
        return Conditioning(states.detach(), tags.detach(), keyframes, request.anchors, references, request,
                            guides=request.placed_guides)

    @staticmethod
    def _text_encoder_view(references: ReferenceRequest) -> list[tuple]:
        """What the text encoder reads of each reference: an image, a video's 2 fps frames and block times, or an
        audio's label only."""
        view = []
        for ref in references.references:
            if ref.kind == "image":
                view.append(("image", ref.image))
            elif ref.kind == "video":
                frames, seconds = sample_video_for_text_encoder(ref.frames, ref.label)
                view.append(("video", frames, seconds, ref.has_audio))
            else:
                view.append(("audio",))
        return view

    @serialised
    def sample(self, cond: Conditioning, request: GenerationRequest | None = None, /, *, progress=None,
               check_interrupt=None, chunk_size: int | None = None, memory_budget: int | None = None,
               between_chunks: Callable[[], None] | None = None, step_report=None, preview=None,
               **fields) -> Latents:
        """The sampling loop of the request `cond` was encoded for, or of `request`, or of that request with `fields`
        changed (`num_frames`, `steps`, `seed`, `video_shift`, `audio_shift`, `loras`; e.g. H3 Sampler's widgets).
        Its canvas must be the one keyframes were fitted to, its duration the one references were cut to.

        `chunk_size` (packed rows per chunk), `memory_budget` (bytes one row chunk's temporaries may take, when
        `chunk_size` is None: e.g. a request plan's `dit_chunk_budget`) and `between_chunks` (run after every row
        chunk, e.g. a device-cache reclaim) apply to this call only; None keeps the transformer's loaded setting.
        None of them changes the model. The request's `loras` becomes the transformer's LoRA set before sampling
        (`set_loras`, no reload; `()` is the base model) and stays until another call changes it; None keeps it.
        `check_interrupt()` runs in the keyframe / reference encoding too. The request's `step_cache` runs in the
        sampling loop; `step_report(stats)` gets its `StepCacheStats` after each call, `Latents.step_cache` at the
        end. `preview(estimate)` (None: off, at no cost) gets the x0 estimate after each model call (a
        `preview.StepEstimate`), before `progress` hears of that step."""
        if request is None:
            if cond.request is None:
                raise H3Error("this conditioning carries no request: give the request to sample.")
            request = cond.request.replace(**fields) if fields else cond.request
        elif fields:
            request = GenerationRequest.of(request, fields)
        self._check_sampled_as_encoded(cond, request)
        shape = request.shape
        steps, seed, loras = request.steps, request.seed, request.loras
        video_shift, audio_shift = request.video_shift, request.audio_shift
        schedule = Schedule.build(steps, video_shift, audio_shift)
        guide_blocks = []
        if cond.references:
            condition_latents, reference_audio = self.encode_reference_latents(cond, check_interrupt=check_interrupt)
        else:
            condition_latents, reference_audio = self.encode_keyframes(cond, check_interrupt=check_interrupt), []
            if cond.guides:
                guide_video, guide_audio = self.encode_guides(cond, check_interrupt=check_interrupt)
                guide_blocks = [GuideBlock(g.frame, 0 if v is None else int(v.shape[2]),
                                           0 if a is None else int(a.shape[0]) // 2)
                                for g, v, a in zip(cond.guides, guide_video, guide_audio)]
                # Condition rows in packed order: keyframes, then each guide's video (its audio rows are clean).
                condition_latents = condition_latents + [v for v in guide_video if v is not None]
                reference_audio = [a for a in guide_audio if a is not None]
        self.enter_phase("sampling")
        self.read_ahead("video_vae")
        dit = self.component("transformer")
        if loras is not None and not has_loras(dit, loras):
            set_loras(dit, list(loras))
        # The setup below takes about a second at 1920x1088, 15 s (220k rows): checked between its steps too.
        if check_interrupt is not None:
            check_interrupt()
        config = dit.config
        if cond.states.shape[-1] != config.text_dim:
            raise H3Error(f"the text encoder gives {cond.states.shape[-1]}-wide states but the transformer expects "
                          f"{config.text_dim}; the two checkpoints do not belong together.")
        if cond.references:
            layout = build_ref2va_layout(cond.tags, self._reference_blocks(cond.references, condition_latents,
                                                                           reference_audio),
                                         shape.latent_frames, shape.latent_height, shape.latent_width,
                                         shape.audio_latents, config.patch_size)
        else:
            layout = build_packed_layout(cond.tags, shape.latent_frames, shape.latent_height, shape.latent_width,
                                         shape.audio_latents, cond.anchors, config.patch_size, guides=guide_blocks)
        # One CPU stream: the visual conditions' noises (request order), the video noise, the audio noise.
        noises, video_noise, audio_noise = initial_noise(
            shape.video, 2 * shape.audio_latents, shape.audio_latent_channels, seed,
            [c.shape for c in condition_latents])
        if check_interrupt is not None:
            check_interrupt()
        condition_rows = [patchify(noise_condition(c, n), config.patch_size)[0]
                          for c, n in zip(condition_latents, noises)]
        video_rows = torch.cat(condition_rows + [patchify(video_noise, config.patch_size)[0]])
        audio_rows = torch.cat(reference_audio + [audio_noise])  # reference / guide audio rows are clean (t = 1)
        result = denoise(dit, cond.states, layout, schedule, video_rows, audio_rows,
                         num_condition_video_rows=layout.num_condition_video_rows,
                         num_condition_audio_rows=layout.num_condition_audio_rows, progress=progress,
                         check_interrupt=check_interrupt, chunking=self._chunking(dit, chunk_size, between_chunks, memory_budget),
                         step_cache=request.step_cache, step_report=step_report,
                         step_cache_name=request.names.step_cache,
                         denoised=None if preview is None else functools.partial(
                             _step_estimate, preview, tuple(shape.video[1:]), tuple(config.patch_size)))
        video = unpatchify(result.video_rows[None].cpu(), shape.video[1:], config.patch_size)
        audio = rows_to_audio(result.audio_rows[None].cpu())
        return Latents(video, audio, shape, result.step_cache)

    def sampling_phases(self, cond: Conditioning) -> tuple[str, ...]:
        """The phases `sample(cond)` runs, in order: the keyframe encode (keyframes) or the reference encodes (image /
        video references, then audio), then sampling."""
        refs = cond.references.references if cond.references else ()
        guides = () if refs else cond.guides
        phases = ["keyframe encode"] if (cond.keyframes or any(g.num_frames for g in guides)) and not refs else []
        if any(ref.kind != "audio" for ref in refs):
            phases.append("reference encode")
        if any(ref.has_audio for ref in refs) or any(g.audio is not None for g in guides):
            phases.append("reference audio encode")
        return (*phases, "sampling")

    @serialised
    def encode_keyframes(self, cond: Conditioning, *,
                         check_interrupt: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """The keyframe-encode phase: the video VAE's latent [1, 24, 1, H/16, W/16] of each keyframe, on the CPU
        (none without keyframes, and then the phase does not run). `sample` calls it. `check_interrupt()` runs
        between the encoder's levels of every tile and may raise to stop."""
        if not cond.keyframes:
            return []
        self.enter_phase("keyframe encode")
        vae = self.component("video_vae")
        latents = []
        for index, image in enumerate(cond.keyframes):
            latent = vae.encode(pil_to_frames(image).to(self.device), check_interrupt=check_interrupt).float().cpu()
            if not torch.isfinite(latent).all():
                which = cond.anchors[index] if index < len(cond.anchors) else str(index + 1)
                raise non_finite_error("the video VAE's encoder", safetensors_files(self.sources.video_vae),
                                       f"keyframe encode (the {which} keyframe's latent)", dtype=compute_dtype(vae),
                                       config=getattr(vae, "config", None))
            latents.append(latent)
        return latents

    @serialised
    def encode_guides(self, cond: Conditioning, *, check_interrupt: Callable[[], None] | None = None,
                      ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The guides' latents, per guide in request order: the video VAE's latent `[1, 24, T, H/16, W/16]` of its
        frames fitted to the canvas (`prepare_guide_frames`, core's rule; encoded as keyframes are, the posterior
        mean), or None for audio alone; and the audio VAE's clean rows `[2 * Ta, 32]` (posterior mean,
        channel-major) of its audio, cropped to the end of the target's audio track as core does, or None. Runs in
        the keyframe-encode phase (video VAE), then the reference-audio-encode phase (audio VAE). `sample` calls
        it."""
        canvas = cond.request
        video: list[torch.Tensor | None] = [None] * len(cond.guides)
        audio: list[torch.Tensor | None] = [None] * len(cond.guides)
        if any(g.num_frames for g in cond.guides):
            self.enter_phase("keyframe encode")
            vae = self.component("video_vae")
            for index, guide in enumerate(cond.guides):
                if not guide.num_frames:
                    continue
                frames = prepare_guide_frames(guide.frames, canvas.width, canvas.height)[None]
                latent = vae.encode(frames.to(self.device), check_interrupt=check_interrupt).float().cpu()
                if not torch.isfinite(latent).all():
                    raise non_finite_error("the video VAE's encoder", safetensors_files(self.sources.video_vae),
                                           f"keyframe encode ({guide.label}'s latent)", dtype=compute_dtype(vae),
                                           config=getattr(vae, "config", None))
                video[index] = latent
        if any(g.audio is not None for g in cond.guides):
            self.enter_phase("reference audio encode")
            vae = self.component("audio_vae")
            for index, guide in enumerate(cond.guides):
                if guide.audio is None:
                    continue
                latent = vae.encode(guide.audio[None].to(self.device), check_interrupt=check_interrupt).float().cpu()
                rows = audio_to_rows(latent[..., :guide.max_audio_latents])[0]
                if not torch.isfinite(rows).all():
                    raise non_finite_error("the audio VAE's encoder", safetensors_files(self.sources.audio_vae),
                                           f"reference audio encode ({guide.label}'s latent)",
                                           dtype=compute_dtype(vae), config=getattr(vae, "config", None))
                audio[index] = rows
        return video, audio

    @serialised
    def encode_reference_latents(
            self, cond: Conditioning, *,
            check_interrupt: Callable[[], None] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The reference-encode phases: the video VAE's latent of every image and video reference (request order;
        images `[1, 24, 1, h, w]`, videos cut down to 17k + 5 frames), with the reference's condition recipe (the
        posterior sampled with seed 42, rounded to float16); then the audio VAE's clean rows `[2 * Ta, 32]`
        (posterior mean, channel-major) of every audio reference and soundtrack. The encoders are released when
        sampling starts (unless kept). `sample` calls it. `check_interrupt()` runs between the encoders' layers and
        may raise to stop."""
        refs = cond.references.references
        visual = []
        if any(ref.kind != "audio" for ref in refs):
            self.enter_phase("reference encode")
            vae = self.component("video_vae")
            for ref in refs:
                if ref.kind == "image":
                    frames = pil_to_frames(ref.image)
                elif ref.kind == "video":
                    count = max(1, (ref.frames.shape[0] - 5) // 17) * 17 + 5  # 17k + 5, encoded without padding
                    frames = torch.from_numpy(ref.frames[:count].astype("float32") / 255.0)[None]
                else:
                    continue
                latent = vae.encode(frames.to(self.device), posterior="sample",
                                    check_interrupt=check_interrupt).float().cpu()
                if not torch.isfinite(latent).all():
                    raise non_finite_error("the video VAE's encoder", safetensors_files(self.sources.video_vae),
                                           f"reference encode ({ref.label}'s latent)", dtype=compute_dtype(vae),
                                           config=getattr(vae, "config", None))
                visual.append(latent)
        audio = []
        if any(ref.has_audio for ref in refs):
            self.enter_phase("reference audio encode")
            vae = self.component("audio_vae")
            for ref in refs:
                if not ref.has_audio:
                    continue
                waveform = ref.audio[None].to(self.device)
                rows = audio_to_rows(vae.encode(waveform, check_interrupt=check_interrupt).float().cpu())[0]
                if not torch.isfinite(rows).all():
                    raise non_finite_error("the audio VAE's encoder", safetensors_files(self.sources.audio_vae),
                                           f"reference audio encode ({ref.label}'s latent)",
                                           dtype=compute_dtype(vae), config=getattr(vae, "config", None))
                audio.append(rows)
        return visual, audio

    @staticmethod
    def _reference_blocks(references: ReferenceRequest, visual, audio) -> list[ReferenceBlock]:
        """Each reference block's geometry, from what its encoders produced."""
        visual, audio = iter(visual), iter(audio)
        blocks = []
        for ref in references.references:
            frames = height = width = 0
            if ref.kind != "audio":
                _, _, frames, height, width = next(visual).shape
            audio_latents = next(audio).shape[0] // 2 if ref.has_audio else 0
            blocks.append(ReferenceBlock(ref.kind, frames, height, width, audio_latents))
        return blocks

    @staticmethod
    def _chunking(dit, chunk_size, between_chunks, memory_budget=None) -> ChunkingPolicy | None:
        """This call's chunking: the transformer's policy with the call's overrides (None when there are none)."""
        if chunk_size is None and between_chunks is None and memory_budget is None:
            return None
        overrides = {"chunk_size": chunk_size} if chunk_size is not None else {}
        if chunk_size is None and memory_budget is not None:
            overrides.update(chunk_size=None, memory_budget=memory_budget)
        if between_chunks is not None:
            overrides["between_chunks"] = between_chunks
        return dataclasses.replace(dit.chunking, **overrides)  # validated again by ChunkingPolicy

    @staticmethod
    def _check_sampled_as_encoded(cond: Conditioning, request: GenerationRequest) -> None:
        """Keyframes were fitted to the encoded canvas and references cut to the encoded duration: a sample of
        another canvas or duration would misplace them."""
        encoded = cond.request
        if encoded is None:
            return
        n = request.names
        if (cond.keyframes or cond.guides) and (request.width, request.height) != (encoded.width, encoded.height):
            raise H3Error(f"{n.width} / {n.height} {request.width}x{request.height}: the keyframes were fitted to "
                          f"{encoded.width}x{encoded.height} when the prompt was encoded; sample at that canvas, or "
                          "encode again at this one.")
        if cond.guides and request.num_frames != encoded.num_frames:
            raise H3Error(f"{n.num_frames} {request.num_frames}: the guides were placed on {encoded.num_frames} "
                          "frames when the prompt was encoded; sample that many, or encode again with this duration.")
        if cond.references and request.num_frames != encoded.num_frames:
            raise H3Error(f"{n.num_frames} {request.num_frames}: the references were cut to {encoded.num_frames} "
                          "frames when the prompt was encoded; sample that many, or encode again with this duration.")

    def check_text_encoder_vision(self) -> None:
        """Keyframes and reference images / videos need the vision tower: a GGUF language file without its mmproj
        beside it is refused here, before the encoder loads (its headers only)."""
        missing = vision_missing(self.sources.text_encoder)
        if missing:
            raise H3Error(missing)

    def check_ref2va_transformer(self) -> None:
        """References need the Ref2VA transformer; the FL2VA one would ignore what they mean."""
        if transformer_partition(self.sources.transformer) == "fl2va":
            raise H3Error(f"references need the Ref2VA transformer, but {self.sources.transformer} is the FL2VA "
                          "one: load the model with partition='ref2va' (CLI: --partition ref2va).")

    @serialised
    def decode_video(self, latents: Latents, *, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Video latents -> frames [F, H, W, 3] float32 in [0, 1] on the CPU; NaN/Inf output names its cause.
        `check_interrupt()` runs before every decoder block of every tile and may raise to stop."""
        check_finite_latents(latents.video, "video")
        self.enter_phase("video decode")
        self.read_ahead("audio_vae")
        vae = self.component("video_vae")
        frames = vae.decode(latents.video.to(self.device), check_interrupt=check_interrupt)[0].float().cpu()
        if not all_finite(frames, check_interrupt):
            raise non_finite_error("the video VAE", safetensors_files(self.sources.video_vae), "decoding",
                                   dtype=compute_dtype(vae), config=getattr(vae, "config", None))
        return frames.contiguous()

    @serialised
    def decode_audio(self, latents: Latents, *, check_interrupt: Callable[[], None] | None = None,
                     audio_warnings: list | None = None) -> torch.Tensor:
        """Audio latents -> waveform [2, N] float32 at 32 kHz on the CPU, trimmed to the video's length.
        `check_interrupt()` runs between the decoder's stages and blocks and may raise to stop.

        The waveform's health is checked (`audio_health`: non-finite, constant or near-constant, silent, DC offset,
        clipped): an error raises `AudioHealthError` naming the symptom, its likely cause and the fix, before anything
        can be saved; warnings (audio that may still be usable) are logged, one line each, and appended to
        `audio_warnings` when a list is given."""
        check_finite_latents(latents.audio, "audio")
        self.enter_phase("audio decode")
        vae = self.component("audio_vae")
        waveform = vae.decode(latents.audio.to(self.device), check_interrupt=check_interrupt)[0].float().cpu()
        if not torch.isfinite(waveform).all():
            raise non_finite_error("the audio VAE", safetensors_files(self.sources.audio_vae), "decoding",
                                   dtype=compute_dtype(vae), config=getattr(vae, "config", None))
        waveform = waveform[:, : audio_samples_for_frames(latents.shape.num_frames)].contiguous()
        warnings = raise_audio_errors(check_audio(waveform),
                                      f"the audio decoded by {self.sources.audio_vae}")
        for finding in warnings:
            self.log(warning_line(finding))
        if audio_warnings is not None:
            audio_warnings.extend(warnings)
        return waveform

    @serialised
    def decode(self, latents: Latents, *, check_interrupt: Callable[[], None] | None = None,
               audio_warnings: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.decode_video(latents, check_interrupt=check_interrupt),
                self.decode_audio(latents, check_interrupt=check_interrupt, audio_warnings=audio_warnings))

    @serialised
    def generate(self, request: GenerationRequest | str, /, *, progress=None, check_interrupt=None,
                 step_report=None, preview=None, **fields) -> GenerationResult:
        """Text encode, sample and decode one request: a `GenerationRequest`, or a prompt and the request's fields as
        keywords (`width`, `height`, `num_frames`, `steps`, `seed`, `first_frame`, `reference_images`, ...: see
        `GenerationRequest`). The request is checked before any component loads (the CLI's large-request preflight,
        `planning.request_estimate.estimate_request`, is left to the caller). References need the Ref2VA
        transformer (`partition="ref2va"`). `check_interrupt()` runs in every phase (between layers, blocks, row
        chunks, attention query calls and decoder tiles) and may raise to stop; the components stay usable.
        `step_report(stats)`: the step cache's figures after each model call, `preview(estimate)`: the x0 estimate
        after each model call (see `sample`)."""
        request = GenerationRequest.of(request, fields)
        timings = {}
        started = time.perf_counter()
        cond = self.encode_prompt(request, check_interrupt=check_interrupt)
        timings["text_encoder"] = time.perf_counter() - started
        started = time.perf_counter()
        latents = self.sample(cond, progress=progress, check_interrupt=check_interrupt, step_report=step_report,
                              preview=preview)
        timings["sampling"] = time.perf_counter() - started
        started = time.perf_counter()
        audio_warnings = []
        frames, waveform = self.decode(latents, check_interrupt=check_interrupt, audio_warnings=audio_warnings)
        timings["decode"] = time.perf_counter() - started
        return GenerationResult(frames, waveform, timings=timings, step_cache=latents.step_cache,
                                audio_warnings=tuple(audio_warnings))
