"""What a loaded component holds in memory now: the bytes a host application (ComfyUI's model management) is told
it frees by unloading the component.

Counted from the tensors themselves, not from a plan: every distinct storage of the module's parameters and buffers
(resident weights, a streamed stack's placeholders), the device slots of each streamed stack (`LayerwiseOffloadManager`,
phase-scoped weights included) and the host memory of their stores that is the process's own (staging rings, pinned
slabs, held copies; not the checkpoint's file-backed pages, which the kernel reclaims on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .layerwise import LayerwiseOffloadManager
from .phase_scoped import PhaseScopedWeights
from .platform import Platform


@dataclass(frozen=True)
class HeldMemory:
    """`device_bytes`: on the component's device (when the device is the CPU, all of it: the host is the device);
    `host_bytes`: host memory besides (a discrete device's staging rings and pinned slabs)."""

    device_bytes: int
    host_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes


def stacks_of(module: nn.Module) -> list[LayerwiseOffloadManager]:
    """Every attached streaming manager of `module` and its submodules (block stacks, the DiT's AdaLN stack,
    phase-scoped weights), each once."""
    found: dict[int, LayerwiseOffloadManager] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, PhaseScopedWeights):
                value = value._manager
            if isinstance(value, LayerwiseOffloadManager) and value.attached:
                found.setdefault(id(value), value)
    return list(found.values())


def store_host_bytes(store) -> int:
    """Host memory a streamed stack's store holds itself: its staging ring and slabs (`StagedReads`), its slabs
    (`PinnedSlab`), the copies it holds (`HeldTensors`); file-backed pages are not counted."""
    own = getattr(store, "anonymous_bytes", None)
    return int(own) if own is not None else int(getattr(store, "staging_bytes", 0))


def held_memory(module: nn.Module, device: torch.device | str) -> HeldMemory:
    """The bytes `module` (a loaded component on `device`) holds now, by where they are."""
    device = torch.empty(0, device=device).device  # with its index, as storages report it ("cuda" -> "cuda:0")
    host_is_device = Platform.for_device(device).host_is_device
    storages: dict[tuple[str, int], int] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_meta or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        storages[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    on_device = sum(n for (where, _), n in storages.items() if torch.device(where) == device)
    on_host = sum(n for (where, _), n in storages.items() if torch.device(where) != device)
    for stack in stacks_of(module):
        on_device += stack.slot_device_bytes()
        on_host += store_host_bytes(stack.store)
    if host_is_device:
        return HeldMemory(on_device + on_host, 0)
    return HeldMemory(on_device, on_host)
