"""Placing loaded tensors into a module built on the meta device, and handing streamed ones to a residency: the
plumbing every component loader shares."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn as nn

from ..runtime.admission import ComponentPlan, check_admission
from ..runtime.host_store import HostTensor
from ..runtime.layerwise import LayerwiseOffloadManager, layerwise_manager
from ..runtime.offload_backends import SynchronousBackend, offload_backend
from ..runtime.phase_scoped import PhaseScopedWeights
from ..runtime.platform import Platform
from ..runtime.residency import Residency


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter (or buffer) `name` of `model` by `tensor`; parameters never require grad (inference)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._buffers:
        owner._buffers[leaf] = tensor
    else:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def residency_manager(component: str, device: torch.device, residency: Residency | str, prefetch: int | None,
                      resident_blocks) -> LayerwiseOffloadManager | None:
    """Check the residency setting against the platform's admission rules before anything is read; the manager
    for a layerwise load, None for a resident one."""
    mode = Residency.parse(residency)
    check_admission({component: ComponentPlan(mode, str(device))}, Platform.for_device(device))
    if mode is Residency.RESIDENT:
        return None
    # The transformer runs one pass per sampling step and the video decoder one per tile: reading the next pass's
    # head during this one's tail pays. The text encoder and the audio decoder run once per request; their staging
    # buffers are freed between requests instead.
    repeated = component in ("transformer", "video_vae")
    return layerwise_manager(device, prefetch=prefetch, resident_blocks=resident_blocks,
                             prefetch_next_pass=None if repeated else False)


def companion_manager(manager: LayerwiseOffloadManager, *, prefetch: int = 0,
                      prefetch_next_pass: bool = False) -> LayerwiseOffloadManager:
    """A second manager on `manager`'s device for units split off its blocks (`attach_layerwise(split=)`): no
    resident units, `prefetch` units ahead, and the same pin budget where the backend pins (one host bound for both).
    """
    # Its units are read once per request (the precompute's pass): their pages leave the page cache once read, so
    # it keeps the blocks that every step reads again.
    options = {"cache_budget_bytes": 0}
    budget = getattr(manager.backend, "pin_budget", None)
    if budget is not None:
        options["pin_budget"] = budget
    return LayerwiseOffloadManager(offload_backend(manager.backend.device, platform=manager.backend.platform,
                                                   **options), prefetch=prefetch,
                                   prefetch_next_pass=prefetch_next_pass)


def attach_layerwise(model: nn.Module, recipes: Mapping[str, HostTensor], manager: LayerwiseOffloadManager, *,
                     blocks: Sequence[tuple[str, ...]], phases: Mapping[str, tuple[str, ...]] | None = None,
                     device: torch.device | str,
                     split: tuple[LayerwiseOffloadManager, Sequence[tuple[str, ...]]] | None = None,
                     ) -> tuple[LayerwiseOffloadManager, PhaseScopedWeights]:
    """Hand a loaded model's parameters to `manager` and to phase-scoped weights, grouped by name prefix.

    Unit i of `manager` is every parameter whose name starts with one of `blocks[i]`; phase p holds those under
    `phases[p]` (phases without parameters are left out). `recipes[name]` says how each such parameter is made from
    host tensors (the loader's memory maps). Phase weights are materialised synchronously on `device`.
    `split=(other, units)`: unit i of the manager `other` is every parameter under `units[i]`, and those parameters
    are left out of `manager`'s units (the DiT's AdaLN projections, which a cached sampling loop never fetches).
    `manager` is attached first, so it has the first claim on a shared pin budget.
    """
    params = dict(model.named_parameters())
    apart = tuple(prefix for prefixes in (split[1] if split else ()) for prefix in prefixes)

    def unit(prefixes: tuple[str, ...], exclude: tuple[str, ...] = ()) -> dict[str, nn.Parameter]:
        return {name: p for name, p in params.items() if name.startswith(prefixes) and not name.startswith(exclude)}

    block_units = [unit(prefixes, apart) for prefixes in blocks]
    manager.attach(block_units, [{n: recipes[n] for n in u} for u in block_units])
    if split is not None:
        other, other_blocks = split
        other_units = [unit(prefixes) for prefixes in other_blocks]
        other.attach(other_units, [{n: recipes[n] for n in u} for u in other_units])
    phase_units = {name: unit(prefixes) for name, prefixes in (phases or {}).items()}
    phase_units = {name: u for name, u in phase_units.items() if u}
    # Phases read through the memory maps (checked before use): they run once per forward, out of stack order.
    weight_phases = PhaseScopedWeights(SynchronousBackend(device, read_ahead=None, platform=manager.backend.platform),
                                       phase_units,
                                       {name: {n: recipes[n] for n in u} for name, u in phase_units.items()})
    return manager, weight_phases
