"""Sampler math: per-modality shifted sigma schedules, per-row timesteps, the Euler update and seeded noise.

H3 is a rectified flow with `x_sigma = (1 - sigma) x0 + sigma eps`, model time `t = 1 - sigma` (t = 1 is clean), and
the DiT predicts the data-ward velocity `v = x0 - eps`. All sampler state is float32.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..errors import H3Error
from ..models.step_cache import StepCacheRun, StepCacheStats
from ..request.generation_request import AUDIO_SHIFT, VIDEO_SHIFT, check_shift
from ..step_cache_settings import StepCacheSettings
from .layout import PackedLayout

# Condition rows are noise-augmented to t = 0.999 once, then held; reference audio is clean (t = 1).
CONDITION_NOISE_AUG = 0.999
REFERENCE_AUDIO_T = 1.0


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """`num_steps` grid points from 1 to 0 (terminal 0 included), shifted: `s b / (1 + (s - 1) b)`, float32."""
    if int(num_steps) < 2:
        raise H3Error(f"steps must be at least 2 (grid points including the final 0), got {num_steps}.")
    if not shift > 0:
        raise H3Error(f"sigma shift must be positive, got {shift}.")
    base = torch.linspace(1.0, 0.0, int(num_steps), dtype=torch.float32)
    sigmas = float(shift) * base / (1 + (float(shift) - 1) * base)
    # float32 collisions near sigma = 1 at large shifts collapse to one grid point.
    return torch.unique_consecutive(sigmas)


@dataclass(frozen=True)
class Schedule:
    """Video and audio sigma grids of equal length N; `N - 1` model calls."""

    video_sigmas: torch.Tensor
    audio_sigmas: torch.Tensor

    @classmethod
    def build(cls, num_steps: int, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT) -> "Schedule":
        # inf passes `shift > 0` and makes every sigma NaN, which the transformer would be blamed for.
        video_shift, audio_shift = check_shift(video_shift, "video_shift"), check_shift(audio_shift, "audio_shift")
        video = sigma_schedule(num_steps, video_shift)
        audio = sigma_schedule(num_steps, audio_shift)
        if video.numel() != audio.numel():
            raise H3Error(
                f"with {num_steps} steps the shifted schedules collapse to {video.numel()} (video) and "
                f"{audio.numel()} (audio) distinct sigmas; use fewer steps or smaller shifts."
            )
        return cls(video, audio)

    @property
    def num_model_calls(self) -> int:
        return int(self.video_sigmas.numel()) - 1

    @property
    def video_timesteps(self) -> torch.Tensor:
        return 1.0 - self.video_sigmas[:-1]

    @property
    def audio_timesteps(self) -> torch.Tensor:
        return 1.0 - self.audio_sigmas[:-1]


def row_timesteps(layout: PackedLayout, t_video: float, t_audio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row timesteps reduced to `(distinct sorted timesteps [M], index of every row [S])`.

    Text and target video rows take `t_video`, target audio `t_audio`, video condition rows `max(t_video, 0.999)`,
    reference audio rows 1.0.
    """
    t = torch.full((layout.num_rows,), float(t_video), dtype=torch.float32)
    t[layout.video_indices[: layout.num_condition_video_rows]] = max(float(t_video), CONDITION_NOISE_AUG)
    t[layout.audio_indices[layout.num_condition_audio_rows:]] = float(t_audio)
    t[layout.audio_indices[: layout.num_condition_audio_rows]] = REFERENCE_AUDIO_T
    return torch.unique(t, sorted=True, return_inverse=True)


def denoised_estimate(sample: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The x0 estimate of one step in float32: `x0 = x_sigma + sigma v` with sigma recovered from the model time
    (`1 - t`), as the reference does (it differs from the stored grid in the last ulp below sigma 0.5)."""
    sample = sample.to(torch.float32)
    t = torch.as_tensor(t, dtype=torch.float32, device=sample.device)
    return sample + (1 - t) * velocity.to(torch.float32)


def euler_blend(sample: torch.Tensor, denoised: torch.Tensor, sigma: torch.Tensor,
                sigma_next: torch.Tensor) -> torch.Tensor:
    """The Euler update from the x0 estimate: the blend ratio is the stored grid's `sigma_next / sigma`."""
    sample = sample.to(torch.float32)
    ratio = sigma_next.to(sample.device, torch.float32) / sigma.to(sample.device, torch.float32)
    return ratio * sample + (1.0 - ratio) * denoised


def euler_step(sample: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> torch.Tensor:
    """One deterministic Euler step in float32 (`denoised_estimate`, then `euler_blend`)."""
    return euler_blend(sample, denoised_estimate(sample, velocity, t), sigma, sigma_next)


def noise_condition(clean: torch.Tensor, noise: torch.Tensor, t: float = CONDITION_NOISE_AUG) -> torch.Tensor:
    """Noise augmentation of a condition latent: `t * clean + (1 - t) * noise`."""
    t = torch.tensor(t, dtype=clean.dtype, device=clean.device)
    return t * clean + (1.0 - t) * noise


def initial_noise(video_shape, audio_rows: int, audio_channels: int, seed: int, condition_shapes=()):
    """Seeded noise, drawn from one CPU generator in the order condition noises, video latent, audio rows.

    This is the diffusers convention (one stream per request); sglang and ComfyUI use other recipes, so the same seed
    gives different noise there. Returns `(condition_noises, video [1, C, T, H, W], audio rows [2*Ta, C_a])`.
    """
    generator = torch.Generator("cpu").manual_seed(int(seed))
    conditions = [torch.randn(tuple(shape), generator=generator, dtype=torch.float32) for shape in condition_shapes]
    video = torch.randn(tuple(video_shape), generator=generator, dtype=torch.float32)
    audio = torch.randn((audio_rows, audio_channels), generator=generator, dtype=torch.float32)
    return conditions, video, audio


class Interrupted(H3Error):
    """Raised when the caller's interrupt check asks the sampling loop to stop."""


@dataclass
class DenoiseResult:
    video_rows: torch.Tensor  # target video rows [Tv*h*w, C*4], float32
    audio_rows: torch.Tensor  # target audio rows [2*Ta, C_a], float32
    precomputed_bytes: int = 0  # host bytes of the run's AdaLN plan (0 without the precompute)
    step_cache: StepCacheStats | None = None  # what the step cache did (None: off)


def denoise(model, text_states: torch.Tensor, layout: PackedLayout, schedule: Schedule, video_rows: torch.Tensor,
            audio_rows: torch.Tensor, *, num_condition_video_rows: int = 0, num_condition_audio_rows: int = 0,
            progress=None, check_interrupt=None, chunking=None, precompute: bool = True,
            step_cache: StepCacheSettings | None = None, step_report=None,
            step_cache_name: str = "step_cache", denoised=None) -> DenoiseResult:
    """The sampling loop: N - 1 DiT calls, each followed by the Euler update of the target rows.

    `video_rows` holds the (already noised) condition rows first, then the initial noise of the target rows;
    condition rows are never updated. `audio_rows` likewise holds the (clean) reference audio rows of a Ref2VA
    request first (`num_condition_audio_rows`), then the target noise. `text_states` is `[L, text_dim]`. `progress(step, total)` is called after each
    step (and with 0 before the first); `check_interrupt()`, called first, before each step and each block (the model's
    `before_block`) and after every row chunk and attention query call (this run's `ChunkingPolicy.check_interrupt`;
    the CPU bounds the work of one call), may raise to stop.
    `chunking` (a `ChunkingPolicy`) is this run's row chunking; None keeps the model's. Neither changes the model.

    `precompute` (default on) does the step-invariant work once, before the first step: the refined text
    (`model.refine_text`) and every block's AdaLN tables for every call's timesteps (`model.adaln_plan`, host memory,
    `DenoiseResult.precomputed_bytes`), so no step runs or fetches the text refiner or an AdaLN projection. Built per
    call, so it always has the model's current LoRAs. The outputs are bitwise those of `precompute=False`.

    `step_cache` (`StepCacheSettings`, None: off) skips the middle blocks on calls whose first blocks barely change
    (DBCache, see models/step_cache.py); `DenoiseResult.step_cache` says what it did, and `step_report(stats)` gets
    the `StepCacheStats` so far after each call (with the cache on); `step_cache_name` names the option in errors.

    `denoised(step, total, video_x0_rows, audio_x0_rows)` (None: off, and then nothing is computed for it) gets the
    x0 estimates of the target rows after each model call, before `progress(step, total)`: the same tensors the Euler
    update blends, so the samples are bitwise those of a run without it. It must not change them.
    """
    if check_interrupt is not None:
        check_interrupt()
    check_finite_inputs(text_states, schedule, video_rows, audio_rows)
    device = next(iter(model.parameters())).device
    kwargs = {k: v.to(device) for k, v in layout.model_kwargs().items()}
    before_block = None
    if check_interrupt is not None:
        before_block = kwargs["before_block"] = lambda index: check_interrupt()
        policy = chunking if chunking is not None else getattr(model, "chunking", None)
        if policy is not None:  # a copy for this run: the model's own policy never holds a caller's check
            chunking = dataclasses.replace(policy, check_interrupt=check_interrupt)
    if chunking is not None:
        kwargs["chunking"] = chunking
    text = text_states[None].to(device)
    video = video_rows.to(device, torch.float32).clone()
    audio = audio_rows.to(device, torch.float32).clone()
    nc = int(num_condition_video_rows)
    na = int(num_condition_audio_rows)
    total = schedule.num_model_calls
    calls = [row_timesteps(layout, float(schedule.video_timesteps[i]), float(schedule.audio_timesteps[i]))
             for i in range(total)]
    residency = getattr(model, "block_residency", None) if step_cache is not None else None
    cache_run = None
    if step_cache is not None:
        cache_run = kwargs["step_cache"] = StepCacheRun(step_cache, len(model.blocks), step_cache_name)
    if progress is not None:
        progress(0, total)
    plan = None
    with torch.no_grad():
        if precompute:
            if check_interrupt is not None:
                check_interrupt()
            kwargs["refined_text"] = model.refine_text(text)
            plan = model.adaln_plan([timestep for timestep, _ in calls], before_block=before_block)
        for i in range(total):
            if check_interrupt is not None:
                check_interrupt()
            t_video, t_audio = schedule.video_timesteps[i], schedule.audio_timesteps[i]
            timestep, timestep_indices = calls[i]
            if plan is not None:
                kwargs["modulation"] = plan.call(timestep)
            read_before = residency.bytes_read if residency is not None else 0
            v_video, v_audio = model(video[None], audio[None], text, timestep.to(device),
                                     timestep_indices.to(device), **kwargs)
            if cache_run is not None:
                # The reads finished during this call (the next call's first block's among them): the counter is
                # cumulative, so the calls add up to every byte read.
                cache_run.stats.bytes_read.append((residency.bytes_read if residency is not None else 0)
                                                  - read_before)
                if step_report is not None:
                    step_report(cache_run.stats)
            for name, velocity in (("video", v_video), ("audio", v_audio)):
                if not torch.isfinite(velocity).all():
                    raise non_finite_error("the transformer", getattr(model, "checkpoint_files", ()),
                                           f"step {i + 1} of {total} (its {name} velocity output)",
                                           dtype=getattr(model, "residual_dtype", None),
                                           config=getattr(model, "config", None), loras=getattr(model, "loras", ()))
            if denoised is None:
                video[nc:] = euler_step(video[nc:], v_video[0, nc:], t_video, schedule.video_sigmas[i],
                                        schedule.video_sigmas[i + 1])
                audio[na:] = euler_step(audio[na:], v_audio[0, na:], t_audio, schedule.audio_sigmas[i],
                                        schedule.audio_sigmas[i + 1])
            else:  # the same arithmetic, the x0 estimates shown to the caller between its two halves
                x0_video = denoised_estimate(video[nc:], v_video[0, nc:], t_video)
                x0_audio = denoised_estimate(audio[na:], v_audio[0, na:], t_audio)
                denoised(i + 1, total, x0_video, x0_audio)
                video[nc:] = euler_blend(video[nc:], x0_video, schedule.video_sigmas[i], schedule.video_sigmas[i + 1])
                audio[na:] = euler_blend(audio[na:], x0_audio, schedule.audio_sigmas[i], schedule.audio_sigmas[i + 1])
            if progress is not None:
                progress(i + 1, total)
    return DenoiseResult(video[nc:], audio[na:], plan.host_bytes if plan is not None else 0,
                         cache_run.stats if cache_run is not None else None)


def check_finite_inputs(text_states, schedule: Schedule, video_rows, audio_rows) -> None:
    """The sampling loop's inputs are finite; otherwise the error names the input (not the transformer)."""
    for name, sigmas in (("video", schedule.video_sigmas), ("audio", schedule.audio_sigmas)):
        if not torch.isfinite(sigmas).all():
            raise H3Error(f"the {name} sigma schedule contains NaN or Inf values (check {name}_shift): the sampler "
                          "input is not finite, so sampling cannot start.")
    for tensor, what in ((text_states, "the text states given to the sampler (the text encoder's conditioning)"),
                         (video_rows, "the initial video rows given to the sampler (noise and keyframe latents)"),
                         (audio_rows, "the initial audio rows given to the sampler (noise)")):
        if not torch.isfinite(tensor).all():
            raise H3Error(f"{what} contain NaN or Inf values: the sampler input is not finite, so sampling cannot "
                          "start. Encode the prompt (and keyframes) again.")


def overflow_advice(dtype: torch.dtype | None) -> str:
    """What to try when finite weights gave NaN/Inf, for the dtype the component ran in."""
    if dtype == torch.float16:
        return "the numbers overflowed float16's range. Set the dtype to bfloat16 or float32 rather than float16."
    if dtype == torch.bfloat16:
        return "the numbers overflowed or lost precision in bfloat16. Set the dtype to float32 to rule that out."
    if dtype == torch.float32:
        return ("the run is already float32, so this is not a precision problem: check the inputs of this stage and "
                "the component's config values (eps, scales), or report it with the request that caused it.")
    return "the numbers overflowed. Set the dtype to float32 rather than float16, or check the inputs."


def non_finite_config_value(config, prefix: str = "", depth: int = 0) -> tuple[str, object] | None:
    """The first NaN/Inf number of a config dataclass (nested configs and lists of numbers included)."""
    if config is None or depth > 3 or not dataclasses.is_dataclass(config):
        return None
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        name = f"{prefix}{field.name}"
        if isinstance(value, float) and not math.isfinite(value):
            return name, value
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, float) and not math.isfinite(item):
                    return f"{name}[{index}]", item
        nested = non_finite_config_value(value, f"{name}.", depth + 1)
        if nested is not None:
            return nested
    return None


def non_finite_error(component: str, checkpoint_files, where: str, *, dtype: torch.dtype | None = None,
                     config=None, loras=()) -> H3Error:
    """An output of `component` came out NaN/Inf at `where`: name the checkpoint tensor or config value responsible
    when there is one, else the LoRAs folded into it (`loras`: (file, strength), ...; their factors were checked
    finite when read, but their change can still overflow) and the advice that fits the dtype the component ran
    in."""
    from ..checkpoints.safetensors_io import first_non_finite

    culprit = first_non_finite(checkpoint_files)
    if culprit is not None:
        path, key = culprit
        return H3Error(f"{path}: tensor '{key}' contains NaN or Inf values, so {component} produced NaN/Inf at "
                       f"{where}. The file is corrupt; download it again.")
    value = non_finite_config_value(config)
    if value is not None:
        name, number = value
        return H3Error(f"{component} produced NaN/Inf at {where}: its config sets {name} = {number}. Give it a finite "
                       "value (the released config's) in the component's config.")
    folded = [(path, strength) for path, strength in loras if strength != 0]
    if folded:
        named = ", ".join(f"{path} at strength {strength:g}" for path, strength in folded)
        return H3Error(f"{component} produced NaN/Inf at {where} although its weights and LoRA factors are finite, "
                       f"with {'this LoRA' if len(folded) == 1 else 'these LoRAs'} folded in: {named}. A LoRA's change "
                       "can push the numbers out of range: run without it, or at a lower strength, to tell; if that "
                       f"runs clean, the LoRA does not suit this model. Otherwise {overflow_advice(dtype)}")
    return H3Error(f"{component} produced NaN/Inf at {where} although its weights are finite: {overflow_advice(dtype)}")
