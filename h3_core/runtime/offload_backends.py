"""Device backends of the layerwise offload manager; what differs per device is asked of the `Platform`.

Units made from checkpoint files are read by a `StagedReads` store (explicit reads, `read_ahead` units ahead on a
background thread, see `staged_store.py`); units of tensors already in memory use `HeldTensors` / `PinnedSlab`.

* `SynchronousBackend` (MPS; the CPU used as the device): a load copies the unit to the device (on the CPU, binds
  the staging buffer itself) and returns when it is there; releases drop them and, every `reclaim_every` releases, synchronise and empty
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

from ..errors import ResidencyError
from .host_store import HeldTensors, HostPinner, PinBudget, PinnedSlab, UnitRecipes
from .platform import Platform
from .staged_store import StagedReads, any_file_backed


def _check_read_ahead(read_ahead) -> int | None:
    if read_ahead is None:
        return None
    if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
        raise ResidencyError(
            f"read_ahead={read_ahead!r} must be an integer >= 0 (units read from disk ahead of the one in use; each "
            "costs one staging buffer of host memory), or None to read through the memory map.")
    return read_ahead


# ---- backends ----------------------------------------------------------------------------------------------------


class OffloadBackend:
    """Moves units between a host store and numbered device slots. See the two implementations below."""

    asynchronous = False
    default_prefetch = 0

    def __init__(self, device: torch.device | str, platform: Platform | None = None):
        # `platform`: the device's platform when it is not the one `device` names (a test's simulated device).
        self.platform = platform if platform is not None else Platform.for_device(device)
        self.device = self.platform.device
        self.store = None

    def build_store(self, recipes: list[UnitRecipes | None], streamed: Sequence[int], *, repeated: bool = True):
        """The host store of this backend; may consume `recipes` (entries set to None once stored). `repeated`: the
        units are used by more than one pass per load (worth packing into pinned memory where the backend pins)."""
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

    def bind_transform(self, transform, dtypes: dict[str, torch.dtype]):
        """The transform this backend runs on its streamed units' tensors (`dtypes`: their parameters and dtypes):
        `transform` itself, or a version that keeps what it adds in host memory of this backend's (see AsyncBackend).
        A bound transform with a `close()` is closed when replaced and when the manager closes."""
        return transform

    def close(self) -> None:
        raise NotImplementedError


class SynchronousBackend(OffloadBackend):
    """Synchronous copies; for MPS (no exposed copy queue, so nothing to overlap) and for the CPU as the device.

    `reclaim_every`: synchronise and empty the device cache every N releases (default: 1 on MPS, never elsewhere).
    `read_ahead`: units read from disk ahead of use (default 1; None reads through the memory maps, no staging);
    `cache_budget_bytes`: see `StagedReads`.
    """

    def __init__(self, device: torch.device | str, *, reclaim_every: int | None = None, read_ahead: int | None = 1,
                 cache_budget_bytes: int | None = None, platform: Platform | None = None):
        super().__init__(device, platform)
        self.read_ahead = _check_read_ahead(read_ahead)
        self.cache_budget_bytes = cache_budget_bytes
        self.reclaim_every = self.platform.default_reclaim_every if reclaim_every is None else int(reclaim_every)
        if self.reclaim_every < 0:
            raise ResidencyError(f"reclaim_every must be >= 0 (0 = never), got {reclaim_every}.")
        self._slots: list[dict[str, torch.Tensor] | None] = []
        self._lent: list = []
        self.releases = 0
        self.reclaims = 0

    def build_store(self, recipes: list[UnitRecipes | None], streamed: Sequence[int], *, repeated: bool = True):
        if self.read_ahead is not None and streamed and any_file_backed(recipes):
            return StagedReads(recipes, streamed, read_ahead=self.read_ahead, hand_over=self.platform.host_is_device,
                               cache_budget_bytes=self.cache_budget_bytes)
        return HeldTensors(recipes)

    def prepare(self, store, streamed: Sequence[int], num_slots: int) -> None:
        self.store = store
        self._slots = [None] * num_slots
        self._lent = [None] * num_slots
        if isinstance(store, StagedReads) and store.hand_over:
            store.reserve_consumer_buffers(num_slots)

    def load(self, slot: int, unit: int) -> int:
        store = self.store
        if isinstance(store, StagedReads) and unit not in store.slabs:
            staged = store.take(unit)
            if store.hand_over:  # the staging buffer is the device memory: lend it until the slot is unloaded
                self._lent[slot] = staged
                tensors = store.views(unit, staged.buffer)
            else:
                try:
                    copy = self.platform.empty(store.buffer_bytes(unit))
                    self.platform.copy_to_device(copy, staged.buffer[: store.buffer_bytes(unit)])
                finally:
                    store.give_back(staged)
                tensors = store.views(unit, copy)
            self._slots[slot] = tensors
            return store.stored_bytes(unit)
        tensors = store.materialise(unit, self.device)
        self._slots[slot] = tensors
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def wait_ready(self, slot: int, unit: int) -> dict[str, torch.Tensor]:
        return self._slots[slot]

    def unload(self, slot: int) -> None:
        self._slots[slot] = None
        if self._lent and self._lent[slot] is not None:
            self.store.give_back(self._lent[slot])
            self._lent[slot] = None
        self.releases += 1
        if self.reclaim_every and self.releases % self.reclaim_every == 0:
            self.reclaim()

    def discard(self, slot: int) -> None:
        self.unload(slot)

    def reclaim(self) -> None:
        self.platform.reclaim()  # synchronise, then empty the cache
        self.reclaims += 1

    def materialise_persistent(self, unit: int) -> tuple[dict[str, torch.Tensor], int]:
        store = self.store
        if isinstance(store, StagedReads) and not store.hand_over:  # the copy goes through the platform
            staged = store.take(unit) if unit not in store.slabs else None
            data = store.slabs[unit].data if staged is None else staged.buffer[: store.buffer_bytes(unit)]
            try:
                buffer = self.platform.empty(data.numel())
                self.platform.copy_to_device(buffer, data)
            finally:
                if staged is not None:
                    store.give_back(staged)
            tensors = store.views(unit, buffer)
        else:
            tensors = store.materialise(unit, self.device)
        return tensors, sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        self._slots = [None] * len(self._slots)
        self._lent = [None] * len(self._lent)
        self.platform.synchronize()
        self.platform.empty_cache()


class AsyncBackend(OffloadBackend):
    """Fixed device slots filled from pinned slabs on a copy stream, ordered by per-slot events only.

    `pin_budget` caps page-locked host bytes (default: the one budget of the process, 40 % of RAM, shared by every
    component); `pinner` overrides the device's page-locker. Units from checkpoint files are read `read_ahead`
    ahead into a pinned staging ring, and the leading ones packed into pinned slabs while the budget allows.
    """

    asynchronous = True
    default_prefetch = 1

    def __init__(self, device: torch.device | str = "cuda", *, pin_budget: PinBudget | None = None,
                 pinner: HostPinner | None = None, read_ahead: int | None = 1,
                 cache_budget_bytes: int | None = None, platform: Platform | None = None):
        super().__init__(device, platform)
        self.pin_budget = pin_budget if pin_budget is not None else PinBudget.shared()
        self.read_ahead = _check_read_ahead(read_ahead)
        self.cache_budget_bytes = cache_budget_bytes
        self._pinner = pinner if pinner is not None else self.platform.host_pinner()
        self.copy_stream = None
        self.buffers: list[torch.Tensor] = []
        self.ready_events: list = []
        self.free_events: list = []
        self._free_recorded: list[bool] = []
        self._slot_nbytes = 0
        self._repeated = True

    def build_store(self, recipes: list[UnitRecipes | None], streamed: Sequence[int], *, repeated: bool = True):
        self._repeated = repeated
        if self.read_ahead is not None and streamed and any_file_backed(recipes):
            store = StagedReads(recipes, streamed, read_ahead=max(1, self.read_ahead), pin_budget=self.pin_budget,
                                pinner=self._pinner, cache_budget_bytes=self.cache_budget_bytes,
                                before_unpin=self.platform.synchronize)
            try:
                store.pack_pinned(pack_units=repeated)
            except BaseException:
                store.close()
                raise
            return store
        return PinnedSlab(recipes, budget=self.pin_budget, pinner=self._pinner, pin_units=streamed,
                          before_unpin=self.platform.synchronize)

    def prepare(self, store, streamed: Sequence[int], num_slots: int) -> None:
        self.store = store
        self.copy_stream = self.platform.new_stream()
        # Slots are sized for the largest streamed unit and allocated once: stable pointers, a deterministic peak,
        # no allocator churn; they are never freed before close(), so the allocator never reuses them early.
        self._slot_nbytes = max((store.buffer_bytes(u) for u in streamed), default=0)
        self.buffers = [self.platform.empty(self._slot_nbytes) for _ in range(num_slots)]
        self.ready_events = [self.platform.new_event() for _ in range(num_slots)]
        self.free_events = [self.platform.new_event() for _ in range(num_slots)]
        self._free_recorded = [False] * num_slots
        # The slots come from the caching allocator, which may hand over memory that work already queued on the
        # compute stream still uses (the allocator orders reuse for that stream only): the first copy into each
        # slot waits for everything queued before them.
        allocated = self.platform.new_event()
        allocated.record(self.platform.current_stream())
        self.copy_stream.wait_event(allocated)

    def _host_unit(self, unit: int):
        """(bytes to copy, staging buffer lent or None) of `unit`: a packed slab, or a staging buffer read ahead."""
        store = self.store
        if isinstance(store, StagedReads):
            if unit in store.slabs:
                return store.slabs[unit].data, None
            staged = store.take(unit)  # its read started a unit ago; this waits only when disk is the bottleneck
            return staged.buffer[: store.buffer_bytes(unit)], staged
        return store.slab(unit).data, None

    def load(self, slot: int, unit: int) -> int:
        data, staged = self._host_unit(unit)
        try:
            with self.platform.on_stream(self.copy_stream):
                if self._free_recorded[slot]:
                    # Overwrite only after the compute work that read this slot's previous unit.
                    self.copy_stream.wait_event(self.free_events[slot])
                self.platform.copy_to_device(self.buffers[slot][: data.numel()], data, non_blocking=True)
                self.ready_events[slot].record(self.copy_stream)
                copied = None
                if staged is not None:
                    copied = self.platform.new_event()
                    copied.record(self.copy_stream)
        except BaseException:
            if staged is not None:  # the reader may refill it once whatever the copy stream took from it is done
                self.copy_stream.synchronize()
                self.store.give_back(staged)
            raise
        if staged is not None:
            # Refilled by the reader only once this copy is done (it waits on the event, the host here does not).
            self.store.give_back(staged, after=copied)
        return data.numel()

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
        if isinstance(self.store, StagedReads):
            # Resident units are read once and copied synchronously (on the compute stream): the staging buffer can
            # go back to the reader as soon as the copy returns.
            data, staged = self._host_unit(unit)
            try:
                buffer = self.platform.empty(data.numel())
                self.platform.copy_to_device(buffer, data)
            finally:
                if staged is not None:
                    self.store.give_back(staged)
            return self.store.views(unit, buffer), data.numel()
        slab = self.store.slab(unit)
        buffer = self.platform.empty(slab.nbytes)
        # On the compute stream: ordered before every use.
        self.platform.copy_to_device(buffer, slab.data, non_blocking=True)
        return self.store.views(unit, buffer), slab.nbytes

    def slot_bytes(self) -> int:
        return self._slot_nbytes * len(self.buffers)

    def bind_transform(self, transform, dtypes: dict[str, torch.dtype]):
        """A transform that offers `cached(dtypes, platform=, pin_budget=, pinner=)` (a LoRA fold) reads what it
        adds once into host memory page-locked in this backend's pin budget and copies it non-blocking on the
        compute stream, so its folds make no file read and no host wait; only for units used by more than one pass
        per load (as packing: a component run once per request keeps nothing between requests)."""
        cached = getattr(transform, "cached", None)
        if cached is None or not self._repeated or not dtypes:
            return transform
        return cached(dtypes, platform=self.platform, pin_budget=self.pin_budget, pinner=self._pinner)

    def close(self) -> None:
        # The only host synchronisation: a pending DMA may still read a slab that is about to be unpinned (the
        # stores synchronise again before unpinning, for a store closed or dropped without this).
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self.platform.current_stream().synchronize()
        self.buffers = []
        self.ready_events = []
        self.free_events = []
        self._free_recorded = []
        self.copy_stream = None


def offload_backend(device: torch.device | str, *, platform: Platform | None = None, **options) -> OffloadBackend:
    """The backend for `device` (or `platform`, a simulated one): asynchronous with pinned slabs where the platform
    has asynchronous copies (CUDA), synchronous with held tensors elsewhere."""
    platform = platform if platform is not None else Platform.for_device(device)
    if platform.asynchronous_copies:
        return AsyncBackend(device, platform=platform, **options)
    return SynchronousBackend(device, platform=platform, **options)
