"""The loader's memory settings, and what they mean for h3_core: loader keyword arguments per component and the plan
the platform's admission rules judge.

Pure Python (no ComfyUI import), so the mapping is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3_core import settings
from h3_core.components import COMPONENTS

RESIDENT = "RESIDENT"
LAYERWISE_OFFLOAD = "LAYERWISE_OFFLOAD"
RESIDENCIES = (RESIDENT, LAYERWISE_OFFLOAD)
# The widgets' labels (saved workflows hold them) -> h3_core's one spelling (h3_core.settings).
_CORE_RESIDENCY = {RESIDENT: settings.RESIDENT, LAYERWISE_OFFLOAD: settings.LAYERWISE}
_CORE_DTYPE = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
DTYPES = tuple(_CORE_DTYPE)


def torch_dtype(label: str) -> torch.dtype | None:
    """The dtype widget's label as a torch dtype (None: the checkpoint's own)."""
    return settings.dtype_named(_CORE_DTYPE[label])
MIB = 1 << 20


@dataclass(frozen=True)
class MemorySettings:
    """How the four components are placed and how the transformer bounds its activations.

    `prefetch` -1 and `chunk_size` / `memory_budget_mib` 0 mean "h3_core's default" (prefetch: 1 on CUDA, 0 elsewhere;
    chunking: fused unless a budget is set; no budget). `mps_reclaim_every` (0 = never) empties the device cache every
    that many row chunks; it only helps where freed memory is not reused by the allocator (Apple MPS).
    """

    residency: tuple[tuple[str, str], ...]  # (component, RESIDENT | LAYERWISE_OFFLOAD) for the four components
    prefetch: int = -1
    resident_blocks: int = 0
    chunk_size: int = 0
    memory_budget_mib: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    mps_reclaim_every: int = 0
    profile: str | None = None  # the memory profile these settings came from (None: set by hand)
    profile_budget_bytes: int | None = None  # its budget: H3 Sampler plans each request's chunks within it

    @classmethod
    def build(cls, *, transformer: str, text_encoder: str, video_vae: str, audio_vae: str,
              **values) -> "MemorySettings":
        residency = (("transformer", transformer), ("text_encoder", text_encoder), ("video_vae", video_vae),
                     ("audio_vae", audio_vae))
        return cls(residency=residency, **values)

    @classmethod
    def from_plan(cls, plan, *, profile: str, dtype: str, device: str) -> "MemorySettings":
        """A memory profile's settings: each component's residency from its residency plan (prefetch the device's
        default, no resident blocks: the plan counts none); the budget goes to H3 Sampler's request plans."""
        chosen = {c.name: (LAYERWISE_OFFLOAD if c.residency == settings.LAYERWISE else RESIDENT)
                  for c in plan.components}
        return cls.build(**chosen, dtype=dtype, device=device, profile=profile,
                         profile_budget_bytes=plan.budget_bytes)

    @classmethod
    def from_profile_widgets(cls, memory_profile: dict, sources, *, dtype: str, device, free_bytes):
        """H3 Loader's `memory_profile` dynamic combo -> (settings, the preflight shown on the node, the plan's details
        for the log): a named profile planned from the checkpoint headers (`auto` within what `free_bytes(device)`
        reports), or every value by hand (`custom`); refused in the widgets' words where the platform's admission
        rules refuse it."""
        from h3_core.errors import H3Error
        from h3_core.planning.memory_profiles import CUSTOM, profile_named, residency_plan

        values = {k: v for k, v in memory_profile.items() if k != "memory_profile"}
        name = memory_profile["memory_profile"]
        if name == CUSTOM:
            settings = cls.build(transformer=values.pop("transformer_residency"),
                                 text_encoder=values.pop("text_encoder_residency"),
                                 video_vae=values.pop("video_vae_residency"),
                                 audio_vae=values.pop("audio_vae_residency"), dtype=dtype, device=str(device),
                                 **values)
            preflight, details = f"memory_profile custom: {settings.plain_description()}", settings.describe()
        else:
            profile = profile_named(name)
            free = free_bytes(device) if profile.nominal_gib is None else None
            planned = residency_plan(sources, profile, device=str(device), free_bytes=free,
                                     dtype=torch_dtype(dtype))
            settings = cls.from_plan(planned.plan, profile=name, dtype=dtype, device=str(device))
            preflight, details = planned.describe(), planned.plan.describe()
        refused = settings.admission_error()
        if refused:
            raise H3Error(f"memory_profile {name}: {refused}")
        return settings, preflight, details

    def plain_description(self) -> str:
        """The custom profile's values as H3 Loader shows them: what stays loaded, what streams, the chunk size and
        the budget, in words (`describe` is the log's line)."""
        from h3_core.planning.memory_profiles import PLAIN_NAMES, _joined

        groups: dict[str, list[str]] = {}
        for name, value in self.residency:
            groups.setdefault(value, []).append(PLAIN_NAMES.get(name, name))
        parts = [f"{_joined(names)} {'stream block by block' if value == LAYERWISE_OFFLOAD else 'stay loaded'}"
                 for value, names in groups.items()]
        if self.offloaded("transformer") and self.resident_blocks:
            parts.append(f"{self.resident_blocks} transformer blocks kept loaded")
        parts.append(f"chunk size {self.chunk_size or 'automatic'}")
        parts.append(f"memory budget {self.memory_budget_mib} MiB" if self.memory_budget_mib else "no memory budget")
        return "; ".join(parts) + "."

    def core_residencies(self) -> dict[str, str]:
        """Each component's residency in h3_core's spelling (a request plan fixes them)."""
        return {name: _CORE_RESIDENCY[value] for name, value in self.residency}

    def residency_of(self, component: str) -> str:
        return dict(self.residency)[component]

    def offloaded(self, component: str) -> bool:
        return self.residency_of(component) == LAYERWISE_OFFLOAD

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return torch_dtype(self.dtype)

    @property
    def memory_budget_bytes(self) -> int | None:
        return self.memory_budget_mib * MIB if self.memory_budget_mib > 0 else None

    def keeps(self, component: str) -> bool:
        """What "keep" means in ComfyUI, where the graph caches the H3_MODEL handle (the pipeline) across prompts:
        a RESIDENT component stays loaded through every phase and prompt (the user gave it the device memory); a
        LAYERWISE_OFFLOAD one is released, device copies and host store, when a phase that does not run it starts
        (the text encoder right after encoding) and loaded again from its files when the handle next needs it."""
        return not self.offloaded(component)

    @property
    def keep_text_encoder(self) -> bool:
        """An offloaded text encoder is released right after encoding, before the transformer loads (like every
        offloaded component, also when a phase that does not run it starts)."""
        return self.keeps("text_encoder")

    def keep_options(self) -> dict[str, bool]:
        """The pipeline's `keep_*` keyword arguments."""
        return {f"keep_{name}": self.keeps(name) for name in COMPONENTS}

    def component_options(self) -> dict[str, dict]:
        """Keyword arguments of each component's h3_core loader. Only settings that differ from the loaders' defaults
        are passed (every loader is resident by default). `prefetch` applies to every offloaded component;
        `resident_blocks` counts transformer blocks (about 1.2 GiB each in bf16) and chunking is the transformer's."""
        options: dict[str, dict] = {name: {} for name in COMPONENTS}
        for name in COMPONENTS:
            if self.offloaded(name):
                options[name]["residency"] = _CORE_RESIDENCY[LAYERWISE_OFFLOAD]
                if self.prefetch >= 0:
                    options[name]["prefetch"] = self.prefetch
        transformer = options["transformer"]
        if self.offloaded("transformer") and self.resident_blocks > 0:
            transformer["resident_blocks"] = self.resident_blocks
        if self.chunk_size > 0:
            transformer["chunk_size"] = self.chunk_size
        if self.memory_budget_bytes is not None:
            transformer["memory_budget"] = self.memory_budget_bytes
        return {name: value for name, value in options.items() if value}

    def reclaim_between_chunks(self, empty_cache):
        """What runs after every row chunk of a sampling pass: the device cache emptied every `mps_reclaim_every`
        chunks (synchronised first on MPS, where frees are deferred until the queued work completes), or None."""
        if self.mps_reclaim_every <= 0:
            return None
        from h3_core.runtime.chunking import EveryNChunks
        from h3_core.runtime.platform import Platform

        return EveryNChunks(self.mps_reclaim_every, Platform.for_device(self.device).reclaim_action(empty_cache))

    def admission_plan(self) -> dict:
        """The plan `h3_core.runtime.admission.check_admission` judges: every component's residency, on the one device."""
        from h3_core.runtime.admission import ComponentPlan

        return {name: ComponentPlan(_CORE_RESIDENCY.get(value, value), self.device) for name, value in self.residency}

    def admission_error(self) -> str | None:
        """The admission verdict in the loader's own words (its widget names and values), None when admitted."""
        from h3_core.runtime.admission import Platform, admission_violations

        violations = admission_violations(self.admission_plan(), Platform.for_device(self.device))
        if not violations:
            return None
        platform = Platform.for_device(self.device).device_type.upper()
        resident = [name for name, _, _ in violations if self.residency_of(name) == RESIDENT]
        lines = [f"set {name}_residency to {LAYERWISE_OFFLOAD} (it is {RESIDENT})" for name in resident]
        lines += [f"{name}: {problem}" for name, problem, _ in violations if name not in resident]
        why = (" (on unified memory a resident component is a second copy of weights already mapped from disk)"
               if resident else "")
        return f"{platform} runs need every component to stream{why}: " + "; ".join(lines) + "."

    def describe(self) -> str:
        placed = ", ".join(f"{name} {value.lower()}" for name, value in self.residency)
        if self.profile is not None:
            return (f"{self.device}, {self.dtype}: {placed}; memory profile {self.profile} "
                    f"({self.profile_budget_bytes / 2**30:.1f} GiB)")
        extra = []
        if self.offloaded("transformer"):
            extra.append(f"prefetch {'auto' if self.prefetch < 0 else self.prefetch}")
            extra.append(f"{self.resident_blocks} resident blocks")
        extra.append(f"chunk {self.chunk_size or 'auto'}")
        if self.memory_budget_mib:
            extra.append(f"budget {self.memory_budget_mib} MiB")
        return f"{self.device}, {self.dtype}: {placed}; {', '.join(extra)}"
