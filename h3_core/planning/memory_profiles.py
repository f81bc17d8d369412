"""Memory profiles: named budgets ("24 GB GPU", "64 GB Mac", or what is free now) that the preflight turns into
settings, so a user picks their machine instead of five residency and chunking values.

Two plans, because the loader does not know the request (size and length come later, on the sampler):
- `residency_plan`, when the model is chosen: `plan_for_budget` at the released default request (`DEFAULT_REQUEST`,
  1344x768, 5 s, with keyframes) where the budget holds it, else at the smallest one (`RESIDENCY_REQUEST`: what the
  weights alone need). It fixes each component's residency.
- `request_plan`, when a request is sampled: `plan_for_budget` at that request with those residencies, which sizes
  the transformer's row chunks for what the rest of the phase leaves, or refuses before anything loads.

Prefetch stays the device's default and no transformer block is kept resident: the plans count neither, and what the
weights leave goes to the activation chunks of the larger requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import settings
from ..errors import H3Error
from ..runtime.file_reads import total_memory_bytes
from ..runtime.platform import Platform
from .memory_plan import MemoryBudgetError, MemoryPlan, format_bytes
from .phase_plans import plan_for_budget

GIB = 1 << 30
AUTO = "auto (from free memory)"
CUSTOM = "custom"
# The smallest request (one latent frame at 256x256, with keyframes so the vision tower counts): what the weights
# alone need. A request's own activations are planned by `request_plan`.
RESIDENCY_REQUEST = {"width": 256, "height": 256, "num_frames": 5, "keyframes": True}
# The request the released model is made for (its default canvas, 5 s at 24 fps on the 17n + 5 grid).
DEFAULT_REQUEST = {"width": 1344, "height": 768, "num_frames": 124, "keyframes": True}
# Of the nominal size, what a run may plan for: a CUDA context, the display and allocator slack take about a tenth
# of a GPU; macOS lets the GPU wire about three quarters of unified memory and the system needs the rest.
GPU_USABLE = 0.9
MAC_USABLE = 0.75
FREE_USABLE = 0.9
# Of a PC's RAM beside a discrete GPU, what the stores, pinned blocks and rings may take: the system, ComfyUI itself
# and its other nodes need the rest.
HOST_USABLE = 0.8


def host_budget_bytes(platform: Platform, host_memory_bytes: int | None) -> int | None:
    """The host memory a plan on a discrete device may use (`HOST_USABLE` of the RAM: `host_memory_bytes`, or this
    machine's); None where one budget covers host and device (CPU, MPS) or the RAM is unknown."""
    if platform.host_is_device or platform.unified_memory:
        return None
    ram = host_memory_bytes if host_memory_bytes is not None else total_memory_bytes()
    return None if ram is None else int(ram * HOST_USABLE)


@dataclass(frozen=True)
class MemoryProfile:
    # Named as the machines are sold ("24 GB GPU"): their memory is counted in GiB (a 24 GB card has 24 GiB).
    name: str
    nominal_gib: int | None = None  # None: the free memory of the device when the model is chosen
    machine: str | None = None  # "GPU" (a discrete device's memory) or "Mac" (unified memory); None: any

    def budget_bytes(self, free_bytes: int | None = None) -> int:
        if self.nominal_gib is None:
            if not free_bytes or free_bytes <= 0:
                raise H3Error(f"memory_profile {self.name!r}: the free memory of the device is unknown; choose a "
                              "profile with a size, or custom.")
            return int(free_bytes * FREE_USABLE)
        return int(self.nominal_gib * GIB * (GPU_USABLE if self.machine == "GPU" else MAC_USABLE))

    def platform_error(self, platform: Platform) -> str | None:
        """A GPU profile on unified memory, or a Mac one on a discrete device, in the loader's words; the CPU takes
        either (a budget of host memory)."""
        if self.machine == "GPU" and platform.unified_memory:
            return (f"memory_profile {self.name!r} is for a discrete GPU, but device is {platform.device_type}; choose a "
                    f"Mac profile, {AUTO!r} or {CUSTOM!r}.")
        if self.machine == "Mac" and not (platform.unified_memory or platform.host_is_device):
            return (f"memory_profile {self.name!r} is for Apple unified memory, but device is {platform.device_type}; "
                    f"choose a GPU profile, {AUTO!r} or {CUSTOM!r}.")
        return None


PROFILES: dict[str, MemoryProfile] = {p.name: p for p in (
    MemoryProfile(AUTO),
    MemoryProfile("12 GB GPU", 12, "GPU"),
    MemoryProfile("16 GB GPU", 16, "GPU"),
    MemoryProfile("24 GB GPU", 24, "GPU"),
    MemoryProfile("32 GB Mac", 32, "Mac"),
    MemoryProfile("64 GB Mac", 64, "Mac"),
    MemoryProfile("128 GB Mac", 128, "Mac"),
)}


def profile_named(name: str) -> MemoryProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise H3Error(f"memory_profile {name!r} is not one of {[*PROFILES, CUSTOM]}.") from None


@dataclass(frozen=True)
class ResidencyPlan:
    """A profile's plan and the request it was made at (`DEFAULT_REQUEST` or `RESIDENCY_REQUEST`)."""

    profile: MemoryProfile
    plan: MemoryPlan
    request: dict

    def residencies(self) -> dict[str, str]:
        return residencies(self.plan)

    def describe(self) -> str:
        """The preflight the loader shows, in plain words: the budget, what stays loaded and what streams, the
        estimated peak and the request it was planned at."""
        plan, profile = self.plan, self.profile
        size = (f"{format_bytes(plan.budget_bytes)} free" if profile.nominal_gib is None else
                f"{format_bytes(plan.budget_bytes)} of {profile.nominal_gib} GiB")
        groups: dict[str, list[str]] = {}
        for c in plan.components:
            groups.setdefault(c.residency, []).append(PLAIN_NAMES.get(c.name, c.name))
        if list(groups) == [settings.RESIDENT]:
            placed = "all weights stay loaded"
        else:
            placed = "; ".join(f"{_joined(names)} {PLAIN_RESIDENCY.get(residency, residency)}"
                               for residency, names in groups.items())
        at = (f"{self.request['width']}x{self.request['height']}, {self.request['num_frames']} frames"
              if self.request is DEFAULT_REQUEST else "the weights alone (1344x768, 5 s does not fit)")
        return (f"memory_profile {profile.name}, planned for {size}: {placed}. Estimated peak "
                f"{format_bytes(plan.peak_bytes)} ({plan.peak_phase.name}) at {at}; each run is planned again for "
                "its own size.")


# The components and residencies as the loader's text names them (h3_core's names are for code and logs).
PLAIN_NAMES = {"text_encoder": "text encoder", "transformer": "transformer", "video_vae": "video VAE",
               "audio_vae": "audio VAE"}
PLAIN_RESIDENCY = {settings.RESIDENT: "stay loaded", settings.LAYERWISE: "stream block by block"}


def _joined(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def residency_plan(sources, profile: MemoryProfile, *, device, free_bytes: int | None = None,
                   dtype: torch.dtype | None = None, resident_kept: bool = True,
                   host_memory_bytes: int | None = None) -> ResidencyPlan:
    """The plan that fixes each component's residency for `profile` on `device` (`free_bytes`: for the auto
    profile). Raises `H3Error` for a profile of another kind of machine, `MemoryBudgetError` when even the weights
    do not fit. On a discrete GPU the host side (pinned blocks, staging rings) is checked against `HOST_USABLE` of
    the RAM (`host_memory_bytes`, default this machine's), with the pin budget such a host has.

    `resident_kept`: a resident component stays loaded through every phase (ComfyUI keeps the pipeline across
    prompts), so the plan counts it in every phase: chosen without, then checked again with it kept (streaming more
    when that no longer fits)."""
    platform = Platform.for_device(device)
    problem = profile.platform_error(platform)
    if problem:
        raise H3Error(problem)
    budget = profile.budget_bytes(free_bytes)
    for request in (DEFAULT_REQUEST, RESIDENCY_REQUEST):
        try:
            plan = _plan_keeping_resident(sources, resident_kept, device=device, budget_bytes=budget, dtype=dtype,
                                          host_budget_bytes=host_budget_bytes(platform, host_memory_bytes),
                                          host_memory_bytes=host_memory_bytes, **request)
        except MemoryBudgetError:
            if request is RESIDENCY_REQUEST:
                raise
            continue  # the default request does not fit this budget at all: plan what the weights need
        return ResidencyPlan(profile, plan, request)


def _plan_keeping_resident(sources, resident_kept: bool, **request) -> MemoryPlan:
    plan = plan_for_budget(sources, **request)
    resident = resident_names(plan)
    if not (resident_kept and resident):
        return plan
    try:
        plan = plan_for_budget(sources, keep=resident, **request)
        if resident_names(plan) != resident:  # fewer resident now: the fixed choice, with just those kept
            plan = plan_for_budget(sources, keep=resident_names(plan), residency=residencies(plan), **request)
        return plan
    except MemoryBudgetError:  # what stays resident would not fit beside the other phases: stream everything
        return plan_for_budget(sources, residency=settings.LAYERWISE, **request)


def resident_names(plan: MemoryPlan) -> tuple[str, ...]:
    return tuple(c.name for c in plan.components if c.residency == settings.RESIDENT)


def residencies(plan: MemoryPlan) -> dict[str, str]:
    return {c.name: c.residency for c in plan.components}


def request_plan(sources, *, budget_bytes: int, device, residencies: dict[str, str], width: int, height: int,
                 num_frames: int, keyframes: bool, steps: int, dtype: torch.dtype | None = None, loras=(),
                 keep=(), references=None, step_cache: bool = False,
                 host_memory_bytes: int | None = None) -> MemoryPlan:
    """The plan of one request with the residencies a pipeline was built with: its transformer chunk budget
    (`dit_chunk_budget`, None: fused), or `MemoryBudgetError` naming the phase over budget (on a discrete GPU, the
    host side too: see `residency_plan`)."""
    return plan_for_budget(sources, device=device, budget_bytes=budget_bytes, width=width, height=height,
                           num_frames=num_frames, keyframes=keyframes, steps=steps, dtype=dtype, loras=loras,
                           keep=keep, residency=residencies, references=references, step_cache=step_cache,
                           host_budget_bytes=host_budget_bytes(Platform.for_device(device), host_memory_bytes),
                           host_memory_bytes=host_memory_bytes)
