"""The memory plan: given each component's bytes, which components stream (layerwise residency) and how large the
transformer's per-chunk temporaries may be so that every phase fits a budget, or a refusal with the numbers.

Pure arithmetic on estimates the caller made (the pipeline reads them from checkpoint headers). Phases run one after
the other; each phase holds the component it uses plus every component the caller keeps loaded, so the plan checks
each phase's sum: weights on the device, host stores, staging rings and the active component's activations. Where
the device is the host's memory (the CPU) or shares it (Apple MPS) one budget covers all of them; on a discrete
device (CUDA) the budget is the device's and host stores and staging count against `host_budget_bytes` when given.

A streamed (layerwise) component's phase runs in parts, one after the other, and its peak is the largest part's:
each phase-scoped weight group (the text encoder's embedding and vision tower, the DiT's text refiner, the VAE
encoders) is on the device only during its own part; the block stack runs in the "blocks" part, its device slots
fed from a staging ring (`staging_items`, per platform); the DiT's AdaLN projections, a second streamed stack, run
in an "AdaLN plan" part of their own before the steps, whose host tables stay through the steps.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .. import settings
from ..errors import H3Error
from ..runtime.platform import Platform

GiB = 1 << 30
# Components that run many passes per request and keep their staging ring between them, reading the next pass's
# head (`checkpoints.placement.residency_manager`); the others free it after each pass.
REPEATED_PASSES = ("transformer", "video_vae")
# Smallest chunk the planner considers: below this per-chunk overhead dominates.
MIN_CHUNK_ROWS = 64


class MemoryBudgetError(H3Error):
    """The request cannot fit the memory budget even with every component streamed."""


def format_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


@dataclass
class ComponentEstimate:
    """One component's bytes; `residency` is the plan's choice for it, `prefetch` its streamed units loaded ahead.

    `fixed_bytes` are the weights outside the streamed stack; of them, `scoped_bytes` (part name -> bytes) are
    phase-scoped: streamed, each group is on the device only during its part of a phase. `companion_unit_bytes`: the
    largest unit of a second stack split off the blocks (the DiT's AdaLN projections), streamed in a pass of its own;
    `unit_bytes` is then the largest block without it. Every weight on the device is the process's own memory (the
    loaders read resident weights explicitly, never using the checkpoint's memory maps in place).
    `host_table_bytes`: host memory the component's blocks part holds (the DiT's step-cache AdaLN tables).
    `scratch_bytes`: the staging reader's scratch, which holds the stored tensors a combined parameter is made from
    (the fused QKV's de-interleave) while the ring lives."""

    name: str
    total_bytes: int  # all weights
    unit_bytes: int  # largest streamed unit (block / layer); 0 if the component has none
    fixed_bytes: int  # weights outside the streamed units (resident ones and phase-scoped ones)
    activation_bytes: int
    streamable: bool
    residency: str = settings.RESIDENT
    prefetch: int = 0
    scoped_bytes: dict = field(default_factory=dict)
    # Quantised phase-scoped groups: the stored bytes of the largest tensor, beside the group while it is dequantised.
    scoped_stored_bytes: dict = field(default_factory=dict)
    passes: int = 1  # passes over the streamed units per request (the DiT's model calls, the video decode's tiles)
    companion_unit_bytes: int = 0
    host_table_bytes: int = 0
    scratch_bytes: int = 0  # the staging reader's scratch: the stored bytes of its largest combined tensor (QKV)
    unit_sizes: tuple[int, ...] = ()  # every streamed unit's bytes in pass order (empty: all `unit_bytes`)
    # Quantised checkpoints: the unit sizes above are the stored (quantised) bytes the stores and slots hold; the
    # largest unit once dequantised is on the device beside them while it runs, and a resident load holds every
    # weight dequantised (`dequantised_extra_bytes` more than `total_bytes`).
    dequantised_unit_bytes: int = 0
    dequantised_extra_bytes: int = 0
    # Host memory a streamed component's weight transform keeps on an asynchronous-copy device (CUDA): the DiT's
    # LoRA factors of its blocks (`lora_loader.CachedFold`), page-locked from the pin budget its store left.
    fold_cache_bytes: int = 0

    @property
    def slots(self) -> int:
        return self.prefetch + 1

    @property
    def resident_fixed_bytes(self) -> int:
        """Weights on the device through every phase of a streamed load: the fixed ones not phase-scoped."""
        return self.fixed_bytes - sum(self.scoped_bytes.values())

    def weight_bytes(self, prefetch: int | None = None) -> int:
        """Weights on the device at the component's peak: all of them, or (layerwise) the resident fixed ones plus
        the largest of its phase-scoped groups, its `prefetch + 1` streamed units and its companion unit."""
        if self.residency == settings.LAYERWISE:
            ahead = self.prefetch if prefetch is None else prefetch
            return self.resident_fixed_bytes + max((ahead + 1) * self.unit_bytes, self.companion_unit_bytes,
                                                   *self.scoped_bytes.values()) + self.dequantised_unit_bytes
        return self.total_bytes + self.dequantised_extra_bytes

    def device_bytes(self, prefetch: int | None = None) -> int:
        return self.weight_bytes(prefetch) + self.activation_bytes

    def host_store_bytes(self, copying_store: bool, read_ahead: int | None = None,
                         pin_room: int | None = None) -> int:
        """Host memory of the streamed units beyond the staging ring: nothing where the store holds the checkpoint's
        memory maps (CPU, MPS); on CUDA (`copying_store`) with a staging ring (`read_ahead` not None), the leading
        units packed into pinned slabs while `pin_room` (the pin budget left after the ring) lasts, and only for a
        component that runs more than one pass per load (`StagedReads.pack_pinned`; a single pass streams through
        the ring); without a ring, a whole copy (`PinnedSlab`)."""
        if self.residency != settings.LAYERWISE or not copying_store:
            return 0
        streamed = self.total_bytes - self.fixed_bytes
        if read_ahead is None:
            return streamed
        if self.name not in REPEATED_PASSES or not pin_room or not self.unit_bytes:
            return 0
        sizes = self.unit_sizes or (self.unit_bytes,) * (streamed // self.unit_bytes)
        packed = 0
        for size in sizes:  # in pass order, stopping at the first that does not fit (as the store does)
            if packed + size > pin_room:
                break
            packed += size
        return packed

    def pinned_ring_bytes(self, read_ahead: int | None) -> int:
        """CUDA's page-locked staging ring (`max(1, read_ahead) + 1` buffers of the largest unit); 0: no ring."""
        if self.residency != settings.LAYERWISE or read_ahead is None or not self.unit_bytes:
            return 0
        return (max(1, read_ahead) + 1) * self.unit_bytes

    def staging_bytes(self, read_ahead: int | None, platform: Platform | None = None) -> int:
        """The staging ring of a streamed component beyond its device slots; None: no ring. See `staging_items`."""
        return sum(i.nbytes for i in staging_items(self, self.unit_bytes, self.slots, read_ahead,
                                                   platform or Platform("cpu")) if not i.what.endswith("slots"))


@dataclass(frozen=True)
class PhaseSpec:
    """A phase of a generation: its name, the component it runs, and its activations when they differ from the
    component's estimate (the video VAE encodes keyframes with other temporaries than it decodes with).

    `parts`: what the phase runs, in order, when the component streams: names of its phase-scoped weight groups,
    "AdaLN plan" (the companion stack's pass) and "blocks" (its block stack, with the activations); None: the blocks,
    with every phase-scoped group on the device throughout. `part_activations`: other parts' activations."""

    name: str
    component: str
    activation_bytes: int | None = None
    parts: tuple[str, ...] | None = None
    part_activations: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class PhaseItem:
    """One thing alive during a phase. `on_host`: host memory (stores, staging); `kept`: an idle kept component."""

    component: str
    what: str  # "weights", "phase weights", "slots", "activations", "host store", "staging", "pinned staging", ...
    nbytes: int
    on_host: bool = False
    kept: bool = False
    during: str | None = None  # the part of the phase it lives in (None: all of it)

    @property
    def label(self) -> str:
        return (f"{self.component} {self.what}" + (f" [{self.during}]" if self.during else "")
                + (" (kept)" if self.kept else ""))


@dataclass
class PhaseEstimate:
    name: str
    component: str
    items: list[PhaseItem]

    @property
    def parts(self) -> list[str | None]:
        """The parts the phase runs one after the other ([None]: one part)."""
        return list(dict.fromkeys(i.during for i in self.items if i.during is not None)) or [None]

    def part_bytes(self, part: str | None, *, on_host: bool | None = None) -> int:
        """What is alive during `part`: the items of the whole phase and those of that part."""
        return sum(i.nbytes for i in self.items if (i.during is None or i.during == part)
                   and (on_host is None or i.on_host == on_host))

    @property
    def device_bytes(self) -> int:
        return max(self.part_bytes(p, on_host=False) for p in self.parts)

    @property
    def host_bytes(self) -> int:
        return max(self.part_bytes(p, on_host=True) for p in self.parts)

    @property
    def total_bytes(self) -> int:
        """The peak of the phase: its largest part (device and host memory together)."""
        return max(self.part_bytes(p) for p in self.parts)

    @property
    def peak_part(self) -> str | None:
        return max(self.parts, key=self.part_bytes)

    @property
    def components(self) -> list[str]:
        return list(dict.fromkeys(i.component for i in self.items))

    def biggest(self, count: int = 3, *, on_host: bool | None = None) -> list[PhaseItem]:
        items = [i for i in self.items if on_host is None or i.on_host == on_host]
        return sorted(items, key=lambda i: -i.nbytes)[:count]


def touched_ring_bytes(unit_sizes: Sequence[int], buffers: int) -> int:
    """Resident bytes of a ring of `buffers` pageable buffers that units of `unit_sizes` (in pass order) take in
    turn: each buffer holds the pages of the largest unit that went through it."""
    return sum(max(unit_sizes[b::buffers], default=0) for b in range(buffers))


def staging_items(c: ComponentEstimate, unit: int, slots: int, read_ahead: int | None, platform: Platform, *,
                  during: str | None = None, stack: str = "", scratch: int = 0) -> list[PhaseItem]:
    """The device slots of a streamed stack (`slots` units of `unit` bytes) and its staging ring, per platform:

    * the CPU as the device: the ring's buffers are the device tensors (`read_ahead + slots` buffers): the slots,
      plus `read_ahead` staging buffers;
    * Apple MPS: the slots are device allocations, the ring `read_ahead + 1` host buffers besides them;
    * CUDA: fixed device slots, and one page-locked ring of `max(1, read_ahead) + 1` buffers.

    `read_ahead` None: no ring (units are materialised from the memory maps). `stack` prefixes the labels ("AdaLN"
    for the DiT's second stack); `scratch`: the reader's scratch (host memory beside the ring)."""
    prefix = f"{stack} " if stack else ""
    items = [PhaseItem(c.name, f"{prefix}slots", slots * unit, during=during)]
    if read_ahead is None or not unit:
        return items
    # Pageable ring buffers (CPU, MPS) are sized for the largest unit but hold only the pages ever written; units
    # take them in turn, so each holds the largest unit that went through it. Page-locked ones are whole.
    sizes = c.unit_sizes if unit == c.unit_bytes and c.unit_sizes else (unit,) * (read_ahead + slots + 1)
    if platform.host_is_device:
        touched = touched_ring_bytes(sizes, read_ahead + slots)
        items[0] = dataclasses.replace(items[0], nbytes=min(slots * unit, touched))
        ring, label = touched - items[0].nbytes, "staging"
    elif platform.asynchronous_copies:
        ring, label = (max(1, read_ahead) + 1) * unit, "pinned staging"
    else:
        ring, label = touched_ring_bytes(sizes, read_ahead + 1), "staging"
    items.append(PhaseItem(c.name, f"{prefix}{label}", ring, on_host=True, during=during))
    items.append(PhaseItem(c.name, f"{prefix}reader scratch", scratch, on_host=True, during=during))
    return items


def _component_items(c: ComponentEstimate, spec: PhaseSpec | None, *, kept: bool, platform: Platform,
                     read_ahead: int | None, pin_room: int | None = None) -> list[PhaseItem]:
    """What `c` holds during the phase `spec` runs it (None: an idle kept component); `pin_room`: the pin budget
    its store may still draw on (CUDA)."""
    copying = platform.asynchronous_copies
    if c.residency != settings.LAYERWISE:
        items = [PhaseItem(c.name, "weights", c.total_bytes + c.dequantised_extra_bytes)]
        if spec is not None:
            activations = c.activation_bytes if spec.activation_bytes is None else spec.activation_bytes
            items += [PhaseItem(c.name, "activations", activations),
                      PhaseItem(c.name, "AdaLN tables", c.host_table_bytes, on_host=True)]
        return items
    # Streamed: the resident fixed weights always; the stack's ring where it outlives a pass (CUDA rings and slots
    # stay allocated; on the CPU / MPS only the transformer's, which reads the next pass's head, when kept).
    items = [PhaseItem(c.name, "weights", c.resident_fixed_bytes)]
    items.append(PhaseItem(c.name, "pinned blocks" if copying and read_ahead is not None else "host store",
                           c.host_store_bytes(copying, read_ahead, pin_room), on_host=True))
    if copying:
        items.append(PhaseItem(c.name, "LoRA factors", c.fold_cache_bytes, on_host=True))
    repeated = c.name in REPEATED_PASSES
    persistent = copying or (kept and repeated and read_ahead is not None)
    if spec is None:
        if persistent:
            ring = staging_items(c, c.unit_bytes, c.slots, read_ahead, platform, scratch=c.scratch_bytes)
            items += ring if copying or platform.host_is_device else ring[1:]
        if copying and c.companion_unit_bytes:
            items += staging_items(c, c.companion_unit_bytes, 1, read_ahead, platform, stack="AdaLN")
        return items
    parts = spec.parts if spec.parts is not None else ("blocks",)
    single = len(parts) == 1
    extra = dict(spec.part_activations)
    activations = c.activation_bytes if spec.activation_bytes is None else spec.activation_bytes
    if spec.parts is None:  # every phase-scoped group on the device throughout
        items.append(PhaseItem(c.name, "phase weights", sum(c.scoped_bytes.values())))
    for part in parts:
        during = None if single else part
        if part == "blocks":
            ring = staging_items(c, c.unit_bytes, c.slots, read_ahead, platform, during=during,
                                 scratch=c.scratch_bytes)
            if persistent:  # alive through the whole phase
                ring = [dataclasses.replace(i, during=None) for i in ring]
            items += ring + [PhaseItem(c.name, "activations", activations, during=during),
                             PhaseItem(c.name, "AdaLN tables", c.host_table_bytes, on_host=True, during=during),
                             PhaseItem(c.name, "dequantised block", c.dequantised_unit_bytes, during=during)]
        elif part == "AdaLN plan":
            ring = staging_items(c, c.companion_unit_bytes, 1, read_ahead, platform, during=during, stack="AdaLN")
            if copying:
                ring = [dataclasses.replace(i, during=None) for i in ring]
            items += ring + [PhaseItem(c.name, "AdaLN tables", c.host_table_bytes, on_host=True, during=during),
                             PhaseItem(c.name, "activations", extra.get(part, 0), during=during),
                             PhaseItem(c.name, "dequantised block", c.dequantised_unit_bytes, during=during)]
        else:
            items += [PhaseItem(c.name, "phase weights", c.scoped_bytes.get(part, 0), during=during),
                      PhaseItem(c.name, "phase staging", c.scoped_stored_bytes.get(part, 0), during=during),
                      PhaseItem(c.name, "activations", extra.get(part, activations if "blocks" not in parts else 0),
                                during=during)]
    return items


def phase_estimates(components: Sequence[ComponentEstimate], phases: Sequence[PhaseSpec], *,
                    keep: Iterable[str] = (), platform: Platform | None = None,
                    staging_read_ahead: int | None = None, pin_budget_bytes: int = 0) -> list[PhaseEstimate]:
    """What coexists in each phase: the phase's component (weights, activations, host store, staging, by part) and
    every kept component (its weights, store and whatever staging outlives a pass: a kept component stays loaded
    through every phase, also between generations). `platform` (default the CPU) decides the ring's shape and where
    it lives (`staging_items`). `pin_budget_bytes`: the process's one pin budget (CUDA), drawn on by the kept
    components' stores first (they were loaded before), then by the phase's own: each store pins its ring, then
    packs leading units while the budget lasts."""
    platform = platform or Platform("cpu")
    keep = set(keep)
    out = []
    for spec in phases:
        items = []
        alive = [c for c in components if c.name in keep and c.name != spec.component]
        alive += [c for c in components if c.name == spec.component]
        rooms: dict[str, int | None] = {c.name: None for c in alive}
        if platform.asynchronous_copies:
            pin_room = pin_budget_bytes
            for c in alive:
                ring = c.pinned_ring_bytes(staging_read_ahead)
                pin_room -= ring if ring <= pin_room else 0
                rooms[c.name] = pin_room
                pin_room -= min(pin_room, c.host_store_bytes(True, staging_read_ahead, pin_room))
                if c.residency == settings.LAYERWISE and c.fold_cache_bytes <= pin_room:
                    pin_room -= c.fold_cache_bytes  # pinned after the store, when it fits (else pageable)
        for c in components:
            if c.name not in rooms:
                continue
            active = c.name == spec.component
            found = _component_items(c, spec if active else None, kept=c.name in keep, platform=platform,
                                     read_ahead=staging_read_ahead, pin_room=rooms[c.name])
            items += [dataclasses.replace(i, kept=not active) for i in found]
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
            peak = f" (peak: {p.peak_part})" if p.parts != [None] else ""
            lines.append(f"    {p.name:<16} {needs:>10}{peak} = {_items(p.biggest(len(p.items)))}")
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
        # One line each: the problem, its fix, then the plan they were computed from under its own heading; a
        # surface that shows only the first line (a node, which gives its own advice) still reads as a whole.
        return (f"this request does not fit a {format_bytes(budget)} {what}: the {phase.name} phase needs about "
                f"{needs}; most of it is {_items(biggest)}"
                + (f" (also over: {', '.join(also)})" if also else "") + ".\n"
                + ", ".join(advice[:-1]).capitalize() + f", or {advice[-1]}.\nThe plan this was checked against:\n"
                + self.describe())


# Where the device is the host, a component used in one pass per request streams from this size on (fit_budget).
STREAM_SINGLE_PASS_BYTES = 256 << 20


def fit_budget(components: list[ComponentEstimate], budget_bytes: int, platform: Platform, *,
               dit: ComponentEstimate, rows: int, row_bytes: int, chunk_size: int | None,
               notes: list[str] | None = None, phases: Sequence[PhaseSpec] | None = None, keep: Iterable[str] = (),
               staging_read_ahead: int | None = None, host_budget_bytes: int | None = None,
               residency: str | Mapping[str, str] | None = None, pin_budget_bytes: int = 0) -> MemoryPlan:
    """Choose residency per component and the transformer's chunk budget so that every phase fits `budget_bytes`;
    raise `MemoryBudgetError` with the plan when a phase does not.

    `phases` (default: one phase per component) and `keep` (components loaded through every phase) decide what
    coexists. Components stream (largest first) while a phase they are alive in is over budget and streaming makes
    it smaller; where the platform's memory is unified every streamable component streams (see admission.py).
    `dit` (one of `components`) counts `rows * row_bytes` of fused per-row temporaries in its activations; a chunk
    budget (what the rest of its phase leaves), or the given `chunk_size`, replaces them by one chunk's.
    `staging_read_ahead` models the streaming staging ring (`staging_items`: on the CPU `read_ahead` buffers beyond
    the slots, which are ring buffers themselves; on MPS `read_ahead + 1` host buffers; on CUDA one pinned ring of
    `max(1, read_ahead) + 1`, with leading units packed into pinned slabs while `pin_budget_bytes` lasts); None: no
    ring. `residency` ("resident" / "layerwise") fixes every streamable
    component's residency instead of choosing it; a mapping fixes each named component's (a loaded pipeline's). The estimates are updated in place.
    """
    phases = list(phases) if phases is not None else [PhaseSpec(c.name, c.name) for c in components]
    keep = tuple(name for name in (c.name for c in components) if name in set(keep))
    shared = platform.host_is_device or platform.unified_memory

    def estimate() -> list[PhaseEstimate]:
        return phase_estimates(components, phases, keep=keep, platform=platform,
                               staging_read_ahead=staging_read_ahead, pin_budget_bytes=pin_budget_bytes)

    def budgeted(phase: PhaseEstimate) -> int:
        return phase.total_bytes if shared else phase.device_bytes

    fixed = dict(residency) if isinstance(residency, Mapping) else (
        {c.name: residency for c in components} if residency is not None else None)
    bad = sorted({value for value in (fixed or {}).values()} - {settings.RESIDENT, settings.LAYERWISE}, key=str)
    if bad:
        raise H3Error(f"residency must be 'resident' or 'layerwise' (or None to choose), got {bad[0]!r}.")
    for c in components:
        c.prefetch = platform.default_prefetch
        if c.streamable and fixed is not None and c.name in fixed:
            c.residency = fixed[c.name]
        elif c.streamable and platform.unified_memory:
            c.residency = settings.LAYERWISE
    by_name = {c.name: c for c in components}
    for index in range(len(phases) if fixed is None else 0):
        tried: set[str] = set()
        while budgeted(phase := estimate()[index]) > budget_bytes:
            candidates = [by_name[n] for n in phase.components
                          if n not in tried and by_name[n].streamable and by_name[n].residency == settings.RESIDENT]
            if not candidates:
                break
            chosen = max(candidates, key=lambda c: c.total_bytes)
            tried.add(chosen.name)
            chosen.residency = settings.LAYERWISE
            if budgeted(estimate()[index]) >= budgeted(phase):  # streaming would not make this phase smaller
                chosen.residency = settings.RESIDENT
    if fixed is None and platform.host_is_device:
        # Where the device is the host (the CPU), a resident component is read and cast whole before its phase
        # computes, while a streamed one reads its next unit during the current one's compute: for a component
        # whose units are each used once per request that reads the same bytes in less time and less memory (the
        # released video VAE's 9.7 GiB load took 7-10 s of a 23 s decode, not overlapped, benchmarks/whole_model.py).
        # Small components load in a moment either way and stay resident.
        for c in components:
            if (c.streamable and c.residency == settings.RESIDENT and c.passes == 1 and c.name not in keep
                    and c.total_bytes >= STREAM_SINGLE_PASS_BYTES):
                before = [budgeted(p) for p in estimate()]
                c.residency = settings.LAYERWISE
                if any(b > a for a, b in zip(before, (budgeted(p) for p in estimate()))):
                    c.residency = settings.RESIDENT
    # The DiT's per-chunk temporaries get whatever the rest of its phase leaves.
    fused_temporaries = rows * row_bytes
    dit_phase = next((i for i, spec in enumerate(phases) if spec.component == dit.name), None)
    chunk_budget = None
    if chunk_size is None and dit_phase is not None and budgeted(estimate()[dit_phase]) > budget_bytes:
        phase = estimate()[dit_phase]
        part = "blocks" if "blocks" in phase.parts else None  # the part the per-chunk temporaries live in
        blocks = phase.part_bytes(part) if shared else phase.part_bytes(part, on_host=False)
        chunk_budget = budget_bytes - (blocks - fused_temporaries)
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
        if c.residency == settings.LAYERWISE:
            opts["residency"] = settings.LAYERWISE
        if c is dit:
            if chunk_size is not None:
                opts["chunk_size"] = chunk_size
            elif chunk_budget is not None:
                opts["memory_budget"] = int(chunk_budget)
        options[c.name] = opts
    plan.component_options = options
    return plan


# No machine has a pebibyte of memory; above it a budget is a typo (1e300 overflowed the conversion to bytes).
MAX_MEMORY_BUDGET_GIB = 2 ** 20


def check_memory_budget_gib(value, name: str = "memory budget") -> float:
    """A budget in GiB, as the CLI's --memory-budget takes it: a finite number above 0 (not a bool), at most
    `MAX_MEMORY_BUDGET_GIB`."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
            or value > MAX_MEMORY_BUDGET_GIB):
        raise H3Error(f"{name} {value!r}: must be a finite number of GiB above 0 and at most "
                      f"{MAX_MEMORY_BUDGET_GIB:,}, e.g. 24.")
    return float(value)
