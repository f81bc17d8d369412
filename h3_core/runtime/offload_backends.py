"""Device backends of the layerwise offload manager; what differs per device is asked of the `Platform`.

* `SynchronousBackend` (MPS; the CPU used as the device): a load copies the unit's host tensors to the device
  and returns when they are there; releases drop them and, every `reclaim_every` releases, synchronise and empty
  the allocator cache (MPS frees are deferred until the command buffers drain, so a release alone returns nothing).
* `AsyncBackend` (CUDA): `prefetch + 1` fixed device slots sized for the largest unit and allocated once; a copy
  stream; per-slot `ready` (copy stream) and `free` (compute stream) events; one non-blocking copy per unit from
  its pinned slab. Nothing in steady state synchronises the host and nothing uses `record_stream`: a slot is
  rewritten only after the copy stream has waited on the compute stream's `free` event for it. On a device
  without streams (the CPU) its streams and events are inline no-ops, so the tests run the same slot code.

The manager (`residency.LayerwiseOffloadManager`) owns the slot ledger and parameter binding; a backend only moves
bytes into numbered slots and orders streams.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .host_store import HeldTensors, HostPinner, PinBudget, PinnedSlab, UnitRecipes
from .platform import Platform
from .residency import ResidencyError


# ---- backends ----------------------------------------------------------------------------------------------------


class OffloadBackend:
    """Moves units between a host store and numbered device slots. See the two implementations below."""

    asynchronous = False
    default_prefetch = 0

    def __init__(self, device: torch.device | str):
        self.platform = Platform.for_device(device)
        self.device = self.platform.device
        self.store = None

    def build_store(self, recipes: list[UnitRecipes | None], streamed: Sequence[int]):
        """The host store of this backend; may consume `recipes` (entries set to None once stored)."""
        raise NotImplementedError

    def prepare(self, store, streamed: Sequence[int], num_slots: int) -> None:
        raise NotImplementedError

    def load(self, slot: int, unit: int) -> int:
        """Start moving `unit` into `slot`; returns the bytes copied host-to-device."""
        raise NotImplementedError

    def wait_ready(self, slot: int, unit: int) -> dict[str, torch.Tensor]:
        """The unit's device tensors, valid for work queued on the compute stream from now on."""
        raise NotImplementedError

    def unload(self, slot: int) -> None:
        """The slot's tensors are no longer bound; they may be reused after the work already queued."""
        raise NotImplementedError

    def discard(self, slot: int) -> None:
        """Forget a loaded slot that no compute work ever read."""
        raise NotImplementedError

    def materialise_persistent(self, unit: int) -> tuple[dict[str, torch.Tensor], int]:
        """Device tensors of a unit that stays resident (its own allocation, outside the slots), and bytes copied."""
        raise NotImplementedError

    def slot_bytes(self) -> int:
        """Device bytes held by the slots whatever they contain (fixed slots); 0 when slots allocate per load."""
        return 0

    def close(self) -> None:
        raise NotImplementedError


class SynchronousBackend(OffloadBackend):
    """Synchronous copies; for MPS (no exposed copy queue, so nothing to overlap) and for the CPU as the device.

    `reclaim_every`: synchronise and empty the device cache every N releases (default: 1 on MPS, never elsewhere).
    """

    def __init__(self, device: torch.device | str, *, reclaim_every: int | None = None):
        super().__init__(device)
        self.reclaim_every = self.platform.default_reclaim_every if reclaim_every is None else int(reclaim_every)
        if self.reclaim_every < 0:
            raise ResidencyError(f"reclaim_every must be >= 0 (0 = never), got {reclaim_every}.")
        self._slots: list[dict[str, torch.Tensor] | None] = []
        self.releases = 0
        self.reclaims = 0

    def build_store(self, recipes: list[UnitRecipes | None], streamed: Sequence[int]) -> HeldTensors:
        return HeldTensors(recipes)

    def prepare(self, store, streamed: Sequence[int], num_slots: int) -> None:
        self.store = store
        self._slots = [None] * num_slots

    def load(self, slot: int, unit: int) -> int:
        tensors = self.store.materialise(unit, self.device)
        self._slots[slot] = tensors
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def wait_ready(self, slot: int, unit: int) -> dict[str, torch.Tensor]:
        return self._slots[slot]

    def unload(self, slot: int) -> None:
        self._slots[slot] = None
        self.releases += 1
        if self.reclaim_every and self.releases % self.reclaim_every == 0:
            self.reclaim()

    def discard(self, slot: int) -> None:
        self.unload(slot)

    def reclaim(self) -> None:
        # Frees are deferred until queued work completes: synchronise first or empty_cache returns little.
        self.platform.synchronize()
        self.platform.empty_cache()
        self.reclaims += 1

    def materialise_persistent(self, unit: int) -> tuple[dict[str, torch.Tensor], int]:
        tensors = self.store.materialise(unit, self.device)
        return tensors, sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        self._slots = [None] * len(self._slots)
        self.platform.synchronize()
        self.platform.empty_cache()


class AsyncBackend(OffloadBackend):
    """Fixed device slots filled from pinned slabs on a copy stream, ordered by per-slot events only.

    `pin_budget` caps page-locked host bytes (default 40 % of RAM); `pinner` overrides the device's page-locker.
    """

    asynchronous = True
    default_prefetch = 1

    def __init__(self, device: torch.device | str = "cuda", *, pin_budget: PinBudget | None = None,
                 pinner: HostPinner | None = None):
        super().__init__(device)
        self.pin_budget = pin_budget if pin_budget is not None else PinBudget.default()
        self._pinner = pinner if pinner is not None else self.platform.host_pinner()
        self.copy_stream = None
        self.buffers: list[torch.Tensor] = []
        self.ready_events: list = []
        self.free_events: list = []
        self._free_recorded: list[bool] = []
        self._slot_nbytes = 0

    def build_store(self, recipes: list[UnitRecipes | None], streamed: Sequence[int]) -> PinnedSlab:
        return PinnedSlab(recipes, budget=self.pin_budget, pinner=self._pinner, pin_units=streamed)

    def prepare(self, store: PinnedSlab, streamed: Sequence[int], num_slots: int) -> None:
        self.store = store
        self.copy_stream = self.platform.new_stream()
        # Slots are sized for the largest streamed unit and allocated once: stable pointers, a deterministic peak,
        # no allocator churn; they are never freed before close(), so the allocator never reuses them early.
        self._slot_nbytes = max((store.unit_bytes(u) for u in streamed), default=0)
        self.buffers = [torch.empty(self._slot_nbytes, dtype=torch.uint8, device=self.device)
                        for _ in range(num_slots)]
        self.ready_events = [self.platform.new_event() for _ in range(num_slots)]
        self.free_events = [self.platform.new_event() for _ in range(num_slots)]
        self._free_recorded = [False] * num_slots

    def load(self, slot: int, unit: int) -> int:
        slab = self.store.slab(unit)
        with self.platform.on_stream(self.copy_stream):
            if self._free_recorded[slot]:
                # Overwrite only after the compute work that read this slot's previous unit.
                self.copy_stream.wait_event(self.free_events[slot])
            self.buffers[slot][: slab.nbytes].copy_(slab.data, non_blocking=True)
            self.ready_events[slot].record(self.copy_stream)
        return slab.nbytes

    def wait_ready(self, slot: int, unit: int) -> dict[str, torch.Tensor]:
        self.platform.current_stream().wait_event(self.ready_events[slot])  # a device-side wait; the host goes on
        return self.store.views(unit, self.buffers[slot])

    def unload(self, slot: int) -> None:
        self.free_events[slot].record(self.platform.current_stream())
        self._free_recorded[slot] = True

    def discard(self, slot: int) -> None:
        # No compute work read the slot; the next copy into it is ordered after this one on the copy stream.
        pass

    def materialise_persistent(self, unit: int) -> tuple[dict[str, torch.Tensor], int]:
        slab = self.store.slab(unit)
        buffer = torch.empty(slab.nbytes, dtype=torch.uint8, device=self.device)
        buffer.copy_(slab.data, non_blocking=True)  # on the compute stream: ordered before every use
        return self.store.views(unit, buffer), slab.nbytes

    def slot_bytes(self) -> int:
        return self._slot_nbytes * len(self.buffers)

    def close(self) -> None:
        # The only host synchronisation: a pending DMA may still read a slab that is about to be unpinned.
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self.platform.current_stream().synchronize()
        self.buffers = []
        self.ready_events = []
        self.free_events = []
        self._free_recorded = []
        self.copy_stream = None


def offload_backend(device: torch.device | str, **options) -> OffloadBackend:
    """The backend for `device`: asynchronous with pinned slabs where the platform has asynchronous copies (CUDA),
    synchronous with held tensors elsewhere."""
    if Platform.for_device(device).asynchronous_copies:
        return AsyncBackend(device, **options)
    return SynchronousBackend(device, **options)
