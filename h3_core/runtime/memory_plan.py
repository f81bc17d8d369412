"""The memory plan: given each component's bytes, which components stream (layerwise residency) and how large the
transformer's per-chunk temporaries may be so that every phase fits a budget, or a refusal with the numbers.

Pure arithmetic on estimates the caller made (the pipeline reads them from checkpoint headers). Phases run one after
the other; each phase holds the component it uses plus every component the caller keeps loaded, so the plan checks
each phase's sum: weights on the device, host stores, staging rings and the active component's activations. Where
the device is the host's memory (the CPU) or shares it (Apple MPS) one budget covers all of them; on a discrete
device (CUDA) the budget is the device's and host stores and staging count against `host_budget_bytes` when given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..errors import H3Error
from .platform import Platform

GiB = 1 << 30
# Smallest chunk the planner considers: below this per-chunk overhead dominates.
MIN_CHUNK_ROWS = 64


class MemoryBudgetError(H3Error):
    """The request cannot fit the memory budget even with every component streamed."""


def format_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


@dataclass
class ComponentEstimate:
    """One component's bytes; `residency` is the plan's choice for it, `prefetch` its streamed units loaded ahead."""

    name: str
    total_bytes: int  # all weights
    unit_bytes: int  # largest streamed unit (block / layer); 0 if the component has none
    fixed_bytes: int  # weights that stay on the device when streamed
    activation_bytes: int
    streamable: bool
    residency: str = "resident"
    prefetch: int = 0

    def weight_bytes(self, prefetch: int | None = None) -> int:
        """Weights on the device: all of them, or (layerwise) the fixed ones plus `prefetch + 1` streamed units."""
        if self.residency == "layerwise":
            ahead = self.prefetch if prefetch is None else prefetch
            return self.fixed_bytes + (ahead + 1) * self.unit_bytes
        return self.total_bytes

    def device_bytes(self, prefetch: int | None = None) -> int:
        return self.weight_bytes(prefetch) + self.activation_bytes

    def host_store_bytes(self, copying_store: bool) -> int:
        """Host memory of the streamed units: a copy where the store packs them (CUDA's pinned slabs), nothing
        where it holds the checkpoint's memory maps (CPU, MPS)."""
        return self.total_bytes - self.fixed_bytes if self.residency == "layerwise" and copying_store else 0

    def staging_bytes(self, read_ahead: int | None) -> int:
        """One staging ring of a streamed component: `(read_ahead + 1)` x its largest unit; None: no ring."""
        if self.residency != "layerwise" or read_ahead is None:
            return 0
        return (read_ahead + 1) * self.unit_bytes


@dataclass(frozen=True)
class PhaseSpec:
    """A phase of a generation: its name, the component it runs, and its activations when they differ from the
    component's estimate (the video VAE encodes keyframes with other temporaries than it decodes with)."""

    name: str
    component: str
    activation_bytes: int | None = None


@dataclass(frozen=True)
class PhaseItem:
    """One thing alive during a phase. `on_host`: host memory (stores, staging); `kept`: an idle kept component."""

    component: str
    what: str  # "weights", "activations", "host store", "staging", "pinned staging"
    nbytes: int
    on_host: bool = False
    kept: bool = False

    @property
    def label(self) -> str:
        return f"{self.component} {self.what}" + (" (kept)" if self.kept else "")


@dataclass
class PhaseEstimate:
    name: str
    component: str
    items: list[PhaseItem]

    @property
    def device_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if not i.on_host)

    @property
    def host_bytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.on_host)

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    @property
    def components(self) -> list[str]:
        return list(dict.fromkeys(i.component for i in self.items))

    def biggest(self, count: int = 3, *, on_host: bool | None = None) -> list[PhaseItem]:
        items = [i for i in self.items if on_host is None or i.on_host == on_host]
        return sorted(items, key=lambda i: -i.nbytes)[:count]


def phase_estimates(components: Sequence[ComponentEstimate], phases: Sequence[PhaseSpec], *,
                    keep: Iterable[str] = (), copying_store: bool = False, staging_read_ahead: int | None = None,
                    pinned_ring: bool = False) -> list[PhaseEstimate]:
    """What coexists in each phase: the phase's component (weights, activations, host store, staging) and every
    kept component (the same minus activations: a kept component stays loaded through every phase, also between
    generations). `pinned_ring` adds a second, page-locked ring of the staging ring's size (CUDA)."""
    keep = set(keep)
    out = []
    for spec in phases:
        items = []
        for c in components:
            active = c.name == spec.component
            if not active and c.name not in keep:
                continue
            idle = not active
            items.append(PhaseItem(c.name, "weights", c.weight_bytes(), kept=idle))
            if active:
                activations = c.activation_bytes if spec.activation_bytes is None else spec.activation_bytes
                items.append(PhaseItem(c.name, "activations", activations))
            items.append(PhaseItem(c.name, "host store", c.host_store_bytes(copying_store), on_host=True, kept=idle))
            ring = c.staging_bytes(staging_read_ahead)
            items.append(PhaseItem(c.name, "staging", ring, on_host=True, kept=idle))
            if pinned_ring:
                items.append(PhaseItem(c.name, "pinned staging", ring, on_host=True, kept=idle))
        out.append(PhaseEstimate(spec.name, spec.component, [i for i in items if i.nbytes]))
    return out


def _items(items: Sequence[PhaseItem]) -> str:
    return ", ".join(f"{i.label} {format_bytes(i.nbytes)}" for i in items)


@dataclass
class MemoryPlan:
    """The estimates, the loader options per component they lead to, the DiT's chunk budget (None: fused) and what
    each phase holds. `shared_memory`: the budget covers host items too (CPU, MPS); otherwise host items count
    against `host_budget_bytes` (None: reported, not checked)."""

    budget_bytes: int
    components: list[ComponentEstimate]
    component_options: dict = field(default_factory=dict)
    dit_chunk_budget: int | None = None
    notes: list[str] = field(default_factory=list)  # what else the estimates include (e.g. LoRA fold temporaries)
    phases: list[PhaseEstimate] = field(default_factory=list)
    shared_memory: bool = True
    host_budget_bytes: int | None = None
    keep: tuple[str, ...] = ()

    def budgeted_bytes(self, phase: PhaseEstimate) -> int:
        """What of `phase` counts against `budget_bytes`."""
        return phase.total_bytes if self.shared_memory else phase.device_bytes

    def phase(self, name: str) -> PhaseEstimate:
        return next(p for p in self.phases if p.name == name)

    @property
    def peak_phase(self) -> PhaseEstimate | None:
        return max(self.phases, key=self.budgeted_bytes, default=None)

    @property
    def peak_bytes(self) -> int:
        if not self.phases:
            return max(c.device_bytes() for c in self.components)
        return self.budgeted_bytes(self.peak_phase)

    @property
    def host_peak_bytes(self) -> int:
        """The largest phase's host memory (stores and staging); on a shared memory it is part of `peak_bytes`."""
        return max((p.host_bytes for p in self.phases), default=0)

    def over_budget(self) -> list[tuple[PhaseEstimate, bool]]:
        """(phase, on_host) for every phase over its budget, the worst excess first."""
        over = [(p, False, self.budgeted_bytes(p) - self.budget_bytes) for p in self.phases
                if self.budgeted_bytes(p) > self.budget_bytes]
        if not self.shared_memory and self.host_budget_bytes is not None:
            over += [(p, True, p.host_bytes - self.host_budget_bytes) for p in self.phases
                     if p.host_bytes > self.host_budget_bytes]
        return [(p, on_host) for p, on_host, _ in sorted(over, key=lambda entry: -entry[2])]

    def describe(self) -> str:
        if self.shared_memory:
            scope = "weights, host stores, staging and activations share this one memory"
        else:
            host = format_bytes(self.host_budget_bytes) if self.host_budget_bytes is not None else "not checked"
            scope = f"device memory; host stores and staging are host memory (host budget {host})"
        lines = [f"memory preflight (budget {format_bytes(self.budget_bytes)}: {scope}):"]
        for c in self.components:
            lines.append(f"  {c.name:<13} weights {format_bytes(c.total_bytes):>10}  activations "
                         f"{format_bytes(c.activation_bytes):>10}  -> {c.residency}")
        if self.phases:
            lines.append("  per phase, everything alive in it:")
        for p in self.phases:
            needs = (format_bytes(p.total_bytes) if self.shared_memory else
                     f"device {format_bytes(p.device_bytes)} + host {format_bytes(p.host_bytes)}")
            lines.append(f"    {p.name:<16} {needs:>10} = {_items(p.biggest(len(p.items)))}")
        if self.dit_chunk_budget is not None:
            lines.append(f"  transformer chunks sized for {format_bytes(self.dit_chunk_budget)} of temporaries")
        lines.extend(f"  {note}" for note in self.notes)
        peak = self.peak_phase
        lines.append(f"  estimated peak {format_bytes(self.peak_bytes)}" + (f" ({peak.name})" if peak else ""))
        return "\n".join(lines)

    def refusal(self) -> str | None:
        """One message naming the worst phase over budget and its biggest items; None when every phase fits."""
        over = self.over_budget()
        if not over:
            return None
        phase, on_host = over[0]
        if on_host:
            needs, budget = f"{format_bytes(phase.host_bytes)} of host memory", self.host_budget_bytes
            biggest = phase.biggest(on_host=True)
        else:
            needs, budget = format_bytes(self.budgeted_bytes(phase)), self.budget_bytes
            biggest = phase.biggest(on_host=None if self.shared_memory else False)
        what = "host budget" if on_host else "budget"
        also = sorted({p.name for p, _ in over[1:]} - {phase.name})
        kept = sorted({i.component for i in phase.items if i.kept})
        advice = ["use a smaller size or fewer seconds"]
        if kept:
            advice.append(f"do not keep {' / '.join(kept)}")
        advice.append("raise the budget")
        return (f"this request does not fit a {format_bytes(budget)} {what}: the {phase.name} phase needs about "
                f"{needs} with the residency and chunks below; most of it is {_items(biggest)}"
                + (f" (also over: {', '.join(also)})" if also else "") + f".\n{self.describe()}\n"
                + ", ".join(advice[:-1]).capitalize() + f", or {advice[-1]}.")


def fit_budget(components: list[ComponentEstimate], budget_bytes: int, platform: Platform, *,
               dit: ComponentEstimate, rows: int, row_bytes: int, chunk_size: int | None,
               notes: list[str] | None = None, phases: Sequence[PhaseSpec] | None = None, keep: Iterable[str] = (),
               staging_read_ahead: int | None = None, host_budget_bytes: int | None = None) -> MemoryPlan:
    """Choose residency per component and the transformer's chunk budget so that every phase fits `budget_bytes`;
    raise `MemoryBudgetError` with the plan when a phase does not.

    `phases` (default: one phase per component) and `keep` (components loaded through every phase) decide what
    coexists. Components stream (largest first) while a phase they are alive in is over budget and streaming makes
    it smaller; where the platform's memory is unified every streamable component streams (see admission.py).
    `dit` (one of `components`) counts `rows * row_bytes` of fused per-row temporaries in its activations; a chunk
    budget (what the rest of its phase leaves), or the given `chunk_size`, replaces them by one chunk's.
    `staging_read_ahead` models the streaming staging ring: `(read_ahead + 1)` x the largest unit of host memory
    per streamed component, plus an equal pinned ring where copies are asynchronous (CUDA); None: no ring.
    The estimates are updated in place.
    """
    phases = list(phases) if phases is not None else [PhaseSpec(c.name, c.name) for c in components]
    keep = tuple(name for name in (c.name for c in components) if name in set(keep))
    shared = platform.host_is_device or platform.unified_memory
    copying = platform.asynchronous_copies  # CUDA packs streamed units into pinned host slabs

    def estimate() -> list[PhaseEstimate]:
        return phase_estimates(components, phases, keep=keep, copying_store=copying,
                               staging_read_ahead=staging_read_ahead, pinned_ring=copying)

    def budgeted(phase: PhaseEstimate) -> int:
        return phase.total_bytes if shared else phase.device_bytes

    for c in components:
        c.prefetch = platform.default_prefetch
        if c.streamable and platform.unified_memory:
            c.residency = "layerwise"
    by_name = {c.name: c for c in components}
    for index in range(len(phases)):
        tried: set[str] = set()
        while budgeted(phase := estimate()[index]) > budget_bytes:
            candidates = [by_name[n] for n in phase.components
                          if n not in tried and by_name[n].streamable and by_name[n].residency == "resident"]
            if not candidates:
                break
            chosen = max(candidates, key=lambda c: c.total_bytes)
            tried.add(chosen.name)
            chosen.residency = "layerwise"
            if budgeted(estimate()[index]) >= budgeted(phase):  # streaming would not make this phase smaller
                chosen.residency = "resident"
    # The DiT's per-chunk temporaries get whatever the rest of its phase leaves.
    fused_temporaries = rows * row_bytes
    dit_phase = next((i for i, spec in enumerate(phases) if spec.component == dit.name), None)
    chunk_budget = None
    if chunk_size is None and dit_phase is not None and budgeted(estimate()[dit_phase]) > budget_bytes:
        chunk_budget = budget_bytes - (budgeted(estimate()[dit_phase]) - fused_temporaries)
        if chunk_budget < MIN_CHUNK_ROWS * row_bytes:
            chunk_budget = None  # reported below as not fitting
        else:
            dit.activation_bytes -= fused_temporaries - min(fused_temporaries, chunk_budget)
    elif chunk_size is not None:
        dit.activation_bytes -= fused_temporaries - min(rows, chunk_size) * row_bytes
    plan = MemoryPlan(budget_bytes, components, dit_chunk_budget=chunk_budget, notes=list(notes or []),
                      phases=estimate(), shared_memory=shared, host_budget_bytes=host_budget_bytes, keep=keep)
    refusal = plan.refusal()
    if refusal:
        raise MemoryBudgetError(refusal)
    options: dict = {}
    for c in components:
        opts = {}
        if c.residency == "layerwise":
            opts["residency"] = "layerwise"
        if c is dit:
            if chunk_size is not None:
                opts["chunk_size"] = chunk_size
            elif chunk_budget is not None:
                opts["memory_budget"] = int(chunk_budget)
        options[c.name] = opts
    plan.component_options = options
    return plan
