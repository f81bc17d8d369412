"""The memory plan: given each component's bytes, which components stream (layerwise residency) and how large the
transformer's per-chunk temporaries may be so that every phase fits a budget, or a refusal with the numbers.

Pure arithmetic on estimates the caller made (the pipeline reads them from checkpoint headers). Phases run one after
the other, so the peak is that of the largest phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """One component's bytes on the device; `residency` is the plan's choice for it."""

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
    """The estimates, the loader options per component they lead to, and the DiT's chunk budget (None: fused)."""

    budget_bytes: int
    components: list[ComponentEstimate]
    component_options: dict = field(default_factory=dict)
    dit_chunk_budget: int | None = None
    notes: list[str] = field(default_factory=list)  # what else the estimates include (e.g. LoRA fold temporaries)

    @property
    def peak_bytes(self) -> int:
        return max(c.device_bytes() for c in self.components)

    def describe(self) -> str:
        lines = [f"memory preflight (budget {format_bytes(self.budget_bytes)}):"]
        for c in self.components:
            lines.append(f"  {c.name:<13} weights {format_bytes(c.total_bytes):>10}  activations {format_bytes(c.activation_bytes):>10}"
                         f"  -> {c.residency:<9} peak {format_bytes(c.device_bytes())}")
        if self.dit_chunk_budget is not None:
            lines.append(f"  transformer chunks sized for {format_bytes(self.dit_chunk_budget)} of temporaries")
        lines.extend(f"  {note}" for note in self.notes)
        lines.append(f"  estimated peak {format_bytes(self.peak_bytes)}")
        return "\n".join(lines)


def fit_budget(components: list[ComponentEstimate], budget_bytes: int, platform: Platform, *,
               dit: ComponentEstimate, rows: int, row_bytes: int, chunk_size: int | None,
               notes: list[str] | None = None) -> MemoryPlan:
    """Choose residency per component and the transformer's chunk budget so that every phase fits `budget_bytes`;
    raise `MemoryBudgetError` with the plan when nothing does.

    `dit` (one of `components`) counts `rows * row_bytes` of fused per-row temporaries in its activations; a chunk
    budget, or the given `chunk_size`, replaces them by one chunk's. Where the platform's memory is unified every
    streamable component streams (see admission.py). The estimates are updated in place.
    """
    for c in components:
        if c.streamable and (platform.unified_memory or c.device_bytes() > budget_bytes):
            c.residency = "layerwise"
    # The DiT's per-chunk temporaries get whatever the weights and full-length buffers leave.
    fused_temporaries = rows * row_bytes
    fixed_part = dit.device_bytes() - fused_temporaries
    chunk_budget = None
    if chunk_size is None and fixed_part + fused_temporaries > budget_bytes:
        chunk_budget = budget_bytes - fixed_part
        if chunk_budget < MIN_CHUNK_ROWS * row_bytes:
            chunk_budget = None  # reported below as not fitting
        else:
            dit.activation_bytes -= fused_temporaries - min(fused_temporaries, chunk_budget)
    elif chunk_size is not None:
        dit.activation_bytes -= fused_temporaries - min(rows, chunk_size) * row_bytes
    plan = MemoryPlan(budget_bytes, components, dit_chunk_budget=chunk_budget, notes=list(notes or []))
    too_big = [c for c in components if c.device_bytes() > budget_bytes]
    if too_big:
        worst = max(too_big, key=lambda c: c.device_bytes())
        raise MemoryBudgetError(
            f"this request does not fit a {format_bytes(budget_bytes)} budget: the {worst.name} phase needs about "
            f"{format_bytes(worst.device_bytes())} even with {'layerwise residency' if worst.streamable else 'the weights'} "
            f"and the smallest chunks.\n{plan.describe()}\nUse a smaller size or fewer seconds, or raise the budget."
        )
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
