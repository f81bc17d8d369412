"""Placing loaded tensors into a module built on the meta device, and handing streamed ones to a residency: the
plumbing every component loader shares."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn as nn

from ..runtime.admission import ComponentPlan, check_admission
from ..runtime.host_store import HostTensor
from ..runtime.layerwise import LayerwiseOffloadManager, layerwise_manager
from ..runtime.offload_backends import SynchronousBackend
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
    return layerwise_manager(device, prefetch=prefetch, resident_blocks=resident_blocks)


def attach_layerwise(model: nn.Module, recipes: Mapping[str, HostTensor], manager: LayerwiseOffloadManager, *,
                     blocks: Sequence[tuple[str, ...]], phases: Mapping[str, tuple[str, ...]] | None = None,
                     device: torch.device | str) -> tuple[LayerwiseOffloadManager, PhaseScopedWeights]:
    """Hand a loaded model's parameters to `manager` and to phase-scoped weights, grouped by name prefix.

    Unit i of `manager` is every parameter whose name starts with one of `blocks[i]`; phase p holds those under
    `phases[p]` (phases without parameters are left out). `recipes[name]` says how each such parameter is made from
    host tensors (the loader's memory maps). Phase weights are materialised synchronously on `device`.
    """
    params = dict(model.named_parameters())

    def unit(prefixes: tuple[str, ...]) -> dict[str, nn.Parameter]:
        return {name: p for name, p in params.items() if name.startswith(prefixes)}

    block_units = [unit(prefixes) for prefixes in blocks]
    manager.attach(block_units, [{n: recipes[n] for n in u} for u in block_units])
    phase_units = {name: unit(prefixes) for name, prefixes in (phases or {}).items()}
    phase_units = {name: u for name, u in phase_units.items() if u}
    weight_phases = PhaseScopedWeights(SynchronousBackend(device), phase_units,
                                       {name: {n: recipes[n] for n in u} for name, u in phase_units.items()})
    return manager, weight_phases
