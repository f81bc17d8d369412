"""`LayerwiseOffloadManager`: streams a stack of blocks through at most `prefetch + 1` device slots (see
`residency.py` for the protocol, `offload_backends.py` for the device work)."""

from __future__ import annotations

import time
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from .file_reads import disk_read_bytes
from .host_store import HostTensor, UnitRecipes
from .offload_backends import OffloadBackend, offload_backend
from .residency import BlockResidency, Residency, ResidencyError
from .slots import SlotState, SlotTable
from .telemetry import PassStats, ResidencyStats


def resolve_resident_blocks(resident_blocks: int | Iterable[int] | None, num_blocks: int) -> frozenset[int]:
    """None -> no block; an int N -> the first N blocks; indices -> those blocks (negative count from the end)."""
    if resident_blocks is None:
        return frozenset()
    if isinstance(resident_blocks, bool):
        raise ResidencyError(f"resident_blocks must be a count or a list of block indices, got {resident_blocks!r}.")
    if isinstance(resident_blocks, int):
        if not 0 <= resident_blocks <= num_blocks:
            raise ResidencyError(
                f"resident_blocks={resident_blocks} must be between 0 and the number of blocks ({num_blocks}): the "
                "first N blocks stay on the device."
            )
        return frozenset(range(resident_blocks))
    out = set()
    for index in resident_blocks:
        if isinstance(index, bool) or not isinstance(index, int) or not -num_blocks <= index < num_blocks:
            raise ResidencyError(
                f"resident_blocks lists {index!r}, which is not a block index of a {num_blocks}-block stack; give "
                f"integers in [0, {num_blocks - 1}] (or a count N for the first N blocks)."
            )
        out.add(index % num_blocks)
    return frozenset(out)


def _check_prefetch(prefetch) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ResidencyError(
            f"prefetch={prefetch!r} must be an integer >= 0: the number of blocks loaded ahead of the running one "
            "(0 on MPS, 1 is enough on CUDA whenever compute takes longer than the copy)."
        )
    return prefetch


Unit = nn.Module | Mapping[str, nn.Parameter]


def _unit_parameters(unit: Unit) -> dict[str, nn.Parameter]:
    if isinstance(unit, nn.Module):
        return dict(unit.named_parameters())
    return dict(unit)


class LayerwiseOffloadManager(BlockResidency):
    """Streams a stack of blocks through at most `prefetch + 1` device slots.

    `backend` does the device work (`SynchronousBackend` or `AsyncBackend`); `prefetch` (default: the
    backend's, 0 synchronous, 1 CUDA) is how many streamed blocks `acquire(i)` loads ahead; `resident_blocks`
    (a count of leading blocks, or indices) stay on the device. `prefetch_next_pass` (default: on for asynchronous
    backends) loads the head of the next pass at the end of a completed one, so its copies overlap the tail; a store
    that reads ahead reads that head from disk then, unless `prefetch_next_pass=False` (components that run one pass
    per request), in which case its staging buffers are freed between passes.
    """

    residency = Residency.LAYERWISE_OFFLOAD

    def __init__(self, backend: OffloadBackend, *, prefetch: int | None = None,
                 resident_blocks: int | Iterable[int] | None = None, prefetch_next_pass: bool | None = None):
        self.backend = backend
        self.prefetch_depth = _check_prefetch(backend.default_prefetch if prefetch is None else prefetch)
        self._resident_request = resident_blocks
        self._prefetch_next_pass_request = prefetch_next_pass
        self.prefetch_next_pass = backend.asynchronous if prefetch_next_pass is None else bool(prefetch_next_pass)
        self._attached = False
        self._in_pass = False
        self._passes = 0
        self._last_pass: PassStats | None = None
        self._current = PassStats()
        self._total_h2d = 0
        self._transform = None  # as bound by the backend (`bind_transform`)
        self._transform_request = None  # as given to `set_transform`
        self._planned: frozenset[int] | None = None  # `set_order`: the blocks this pass will acquire (None: all)
        self._last_acquired: int | None = None

    # ---- setup / teardown ----------------------------------------------------------------------------------

    def attach(self, units: Sequence[Unit], recipes: Sequence[UnitRecipes] | None = None) -> "LayerwiseOffloadManager":
        """Take over the parameters of `units` (blocks, or name -> Parameter mappings).

        `recipes[i][name]` says how each parameter is made from host tensors (a loader's memory maps); without
        them the parameters' current tensors are the host store (moved to the CPU first if they are elsewhere).
        Streamed parameters are bound to a shared one-element placeholder; resident blocks are materialised.
        """
        if self._attached:
            raise ResidencyError("this manager is already attached; close() it before attaching other blocks.")
        params = [_unit_parameters(u) for u in units]
        restore_devices: list[dict[str, torch.device | None]] = []
        if recipes is None:
            recipes = []
            for unit in params:
                recipes.append({name: HostTensor.held(p.data.to("cpu"))  # no copy when already there
                                for name, p in unit.items()})
            restore_devices = [{name: p.device for name, p in unit.items()} for unit in params]
        else:
            # Quantised weights the device cannot decode (fp8 on MPS) are dequantised on the host, and laid out
            # and moved in the compute dtype.
            platform = self.backend.platform
            recipes = [{name: recipe.placed_for(platform) for name, recipe in r.items()} for r in recipes]
            if len(recipes) != len(params):
                raise ResidencyError(f"got recipes for {len(recipes)} units but {len(params)} units to attach.")
            for i, (unit, unit_recipes) in enumerate(zip(params, recipes)):
                if set(unit) != set(unit_recipes):
                    missing = sorted(set(unit) ^ set(unit_recipes))
                    raise ResidencyError(f"unit {i}: parameters and recipes differ at {missing[:3]}.")
            restore_devices = [{name: None for name in unit} for unit in params]

        self._params = params
        self._restore_devices = restore_devices
        self.num_blocks = len(params)
        self.resident = resolve_resident_blocks(self._resident_request, self.num_blocks)
        self.streamed = tuple(i for i in range(self.num_blocks) if i not in self.resident)
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        # Placeholders first: then the recipes are the only references to the original tensors, and a store that
        # copies (pinned slabs) can free each unit's originals as soon as it is packed.
        for i in range(self.num_blocks):
            self._bind_placeholders(i)
        try:
            # A component told there is no next pass (one pass per request) streams through the ring unpacked.
            self._store = self.backend.build_store(recipes, self.streamed,
                                                   repeated=self._prefetch_next_pass_request is not False)
        except BaseException:
            for i, unit in enumerate(params):
                for name, p in unit.items():
                    if recipes[i] is not None:
                        p.data = recipes[i][name].host_value()
            raise
        del recipes
        # Stores that read ahead read the next pass's head during this pass's tail, unless told there is no next pass.
        self.read_next_pass = self._prefetch_next_pass_request is not False and bool(getattr(self._store,
                                                                                              "read_ahead", 0))
        num_slots = min(self.prefetch_depth + 1, len(self.streamed))
        self.backend.prepare(self._store, self.streamed, num_slots)
        self._slots = SlotTable(num_slots)
        self._slot_bytes = [0] * num_slots
        self._persistent_bytes = 0
        self._attached = True
        for i in sorted(self.resident):
            tensors, nbytes = self.backend.materialise_persistent(i)
            self._bind(i, tensors)
            self._persistent_bytes += nbytes
            self._total_h2d += nbytes
        return self

    def close(self, restore: bool = True) -> None:
        """Give every parameter back its host tensor (same Parameter objects); free slots, events and pins.

        `restore=False` leaves the parameters bound to placeholders, for a model that is being dropped: giving them
        back would make every cast or combined tensor (fp16 -> fp32, de-interleaved QKV) in host memory at once."""
        if not self._attached:
            return
        if self._in_pass:
            self.end_pass()
        for slot, state in enumerate(self._slots.states):
            if state is SlotState.READY:
                self._slots.discard(slot)
                self.backend.discard(slot)
        self.backend.close()
        self._close_transform()
        for i, unit in enumerate(self._params if restore else ()):
            for name, p in unit.items():
                original = self._store.original(i, name)
                device = self._restore_devices[i][name]
                p.data = original if device is None or device == original.device else original.to(device)
        self._store.close()
        self._params = []
        self._placeholders = {}
        self._attached = False

    # ---- binding -------------------------------------------------------------------------------------------

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.zeros(1, dtype=dtype, device=self.backend.device)
        return self._placeholders[dtype]

    def _bind(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        if self._transform is not None:
            self._transform(tensors)  # fresh device tensors (a copy or a slot), never the host store
        for name, p in self._params[index].items():
            p.data = tensors[name]

    def managed_parameters(self) -> frozenset[str]:
        """Names of the parameters this manager binds (as its units name them)."""
        self._require_attached()
        return frozenset(name for unit in self._params for name in unit)

    def set_transform(self, transform) -> None:
        """`transform(tensors)` edits a unit's freshly materialised device tensors (parameter name -> tensor) in place
        before they are bound, e.g. to fold a LoRA in; None removes it. Blocks kept on the device are materialised
        again, so they get the change too; streamed blocks get it at their next load. The backend may bind it to
        its streamed units (`OffloadBackend.bind_transform`: a LoRA fold's factors held in pinned memory on CUDA);
        the previous binding is closed first, so its host memory is given back before the new one takes some."""
        self._require_attached()
        self._close_transform()
        self._transform = self._transform_request = transform
        if transform is not None:
            dtypes = {name: p.dtype for i in self.streamed for name, p in self._params[i].items()}
            self._transform = self.backend.bind_transform(transform, dtypes)
        for i in sorted(self.resident):
            tensors, nbytes = self.backend.materialise_persistent(i)
            self._bind(i, tensors)
            self._total_h2d += nbytes

    def _close_transform(self) -> None:
        if self._transform is not self._transform_request and hasattr(self._transform, "close"):
            self._transform.close()
        self._transform = self._transform_request

    def _bind_placeholders(self, index: int) -> None:
        for p in self._params[index].values():
            p.data = self._placeholder(p.dtype)

    # ---- the pass protocol ---------------------------------------------------------------------------------

    def _require_attached(self) -> None:
        if not self._attached:
            raise ResidencyError("the offload manager is not attached (closed, or attach() was never called).")

    def _check_index(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < self.num_blocks:
            raise ResidencyError(f"block index {index!r} is out of range for a {self.num_blocks}-block stack.")

    def begin_pass(self) -> None:
        self._require_attached()
        if self._in_pass:  # the previous pass never ended (its caller had no `finally`): end it now
            self.end_pass()
        self._in_pass = True
        self._current = PassStats(host_store_bytes=self._store.host_bytes)
        # Counters are read, never reset: other components and the caller keep their own view of the process peak.
        self._pass_start = (time.perf_counter(), self._read_counters(), disk_read_bytes(),
                            self.backend.platform.peak_allocated_bytes())
        if getattr(self._store, "read_ahead", 0):
            # Start reading the first blocks now: they arrive while the pass's non-block work runs (a no-op when the
            # previous pass already read them).
            self._store.prefetch_head()
        self._sample()

    def set_order(self, blocks, next_head=()) -> None:
        """See `BlockResidency.set_order`. Prefetched blocks left out are dropped, and the host store's reads
        ahead follow the new set (`StagedReads.plan`), then `next_head` when the next pass's head is read ahead."""
        self._require_attached()
        planned = None
        if blocks is not None:
            planned = frozenset(blocks)
            for index in planned:
                self._check_index(index)
        self._planned = planned
        if hasattr(self._store, "plan"):
            self._store.plan(None if planned is None else [i for i in self.streamed if i in planned],
                             next_head=[i for i in next_head if i in self.streamed] if self.read_next_pass else ())
        if not self._in_pass:
            return
        for slot, state in enumerate(self._slots.states):
            if state is SlotState.READY and planned is not None and self._slots.units[slot] not in planned:
                self._drop(slot)
        if self._last_acquired is not None:
            for ahead in self._next_streamed(self._last_acquired):
                self.prefetch(ahead)

    def end_pass(self) -> None:
        self._require_attached()
        self._planned, self._last_acquired = None, None
        if hasattr(self._store, "plan"):
            self._store.plan(None)
        in_use = self._slots.holding(SlotState.IN_USE)
        for index in in_use:
            self.release(index)
        # Keep only the next pass's head (when asked to and the pass completed); drop other prefetched blocks.
        head = set(self.streamed[: self.prefetch_depth]) if self.prefetch_next_pass and not in_use else set()
        for slot, state in enumerate(self._slots.states):
            if state is SlotState.READY and self._slots.units[slot] not in head:
                self._drop(slot)
        for index in sorted(head):
            self.prefetch(index)
        if hasattr(self._store, "review_cache"):
            self._store.review_cache()
        if self.read_next_pass and not in_use:
            self._store.prefetch_head()  # host-side reads ahead (staged stores)
        elif hasattr(self._store, "trim"):
            self._store.trim()  # one pass per request: give the staging memory back until the next one
        self._current.aborted = bool(in_use)
        self._sample()
        self._close_pass_figures()
        self._last_pass = self._current
        self._passes += 1
        self._in_pass = False

    def _read_counters(self):
        counters = getattr(self._store, "counters", None)
        return None if counters is None else (counters.bytes_read, counters.read_s, counters.wait_s)

    def _close_pass_figures(self) -> None:
        started, reads, disk, peak_before = self._pass_start
        c = self._current
        c.seconds = time.perf_counter() - started
        now = self._read_counters()
        if reads is not None and now is not None:
            c.bytes_read, c.read_s, c.read_wait_s = (b - a for a, b in zip(reads, now))
        disk_now = disk_read_bytes()
        c.disk_read_bytes = None if disk is None or disk_now is None else disk_now - disk
        peak = self.backend.platform.peak_allocated_bytes()
        if peak is not None and peak_before is not None and peak > peak_before:
            c.peak_device_bytes = max(c.peak_device_bytes, peak)  # the process peak rose during this pass

    def acquire(self, index: int) -> None:
        """Make block `index`'s weights valid for the compute stream, then load up to `prefetch` blocks ahead."""
        self._require_attached()
        self._check_index(index)
        if index in self.resident:
            return
        started = time.perf_counter()
        slot = self._slots.slot_of(index)
        if slot is None:
            slot = self._load(index, evict=True)
            self._current.unprefetched_loads += 1
        tensors = self.backend.wait_ready(slot, index)
        self._slots.take(slot)  # raises if the block is already acquired
        self._bind(index, tensors)
        self._last_acquired = index
        for ahead in self._next_streamed(index):
            self.prefetch(ahead)
        self._current.wait_s += time.perf_counter() - started
        self._sample()

    def release(self, index: int) -> None:
        """Unbind block `index`; a no-op for resident blocks and for blocks that are not acquired."""
        self._require_attached()
        self._check_index(index)
        if index in self.resident:
            return
        slot = self._slots.slot_of(index)
        if slot is None or self._slots.states[slot] is not SlotState.IN_USE:
            return
        self._bind_placeholders(index)
        self._slots.give_back(slot)
        self.backend.unload(slot)
        self._slots.mark_free(slot)
        self._slot_bytes[slot] = 0
        self._sample()

    def prefetch(self, index: int) -> None:
        """Start loading block `index` if a slot is free; idempotent, and never evicts for a hint."""
        self._require_attached()
        self._check_index(index)
        if index in self.resident or self._slots.slot_of(index) is not None:
            return
        if self._slots.first(SlotState.EMPTY) is None:
            return
        self._load(index, evict=False)

    def _next_streamed(self, index: int) -> list[int]:
        if not self.prefetch_depth:
            return []
        later = [i for i in self.streamed if i > index and (self._planned is None or i in self._planned)]
        return later[: self.prefetch_depth]

    def _load(self, index: int, *, evict: bool) -> int:
        slot = self._slots.first(SlotState.EMPTY)
        if slot is None and evict:
            slot = self._slots.first(SlotState.READY)  # a prefetched block nobody asked for yet
            if slot is not None:
                self._drop(slot)
        if slot is None:
            raise ResidencyError(
                f"cannot load block {index}: all {len(self._slots)} device slots hold acquired blocks "
                f"{self._slots.holding(SlotState.IN_USE)}. Release a block before acquiring another, or raise "
                "prefetch (slots = prefetch + 1)."
            )
        self._slots.start_loading(slot, index)
        try:
            nbytes = self.backend.load(slot, index)
        except BaseException:
            # Out of memory in the copy, a read error or a changed file in the staging reader, Ctrl-C while a read
            # is awaited: this pass fails, the slot is empty again, and the next pass loads the block anew.
            self.backend.discard(slot)
            self._slots.abandon(slot)
            self._slot_bytes[slot] = 0
            raise
        self._slots.mark_ready(slot)
        self._slot_bytes[slot] = nbytes
        self._current.bytes_h2d += nbytes
        self._current.loads += 1
        self._total_h2d += nbytes
        self._sample()
        return slot

    def _drop(self, slot: int) -> None:
        self._slots.discard(slot)
        self.backend.discard(slot)
        self._slot_bytes[slot] = 0

    # ---- introspection -------------------------------------------------------------------------------------

    @property
    def store(self):
        """The host store (`StagedReads`, `HeldTensors` or `PinnedSlab`) holding every block between uses."""
        self._require_attached()
        return self._store

    @property
    def bytes_read(self) -> int:
        counters = getattr(self._store, "counters", None) if self._attached else None
        return counters.bytes_read if counters is not None else 0

    def materialised_streamed(self) -> list[int]:
        """Streamed blocks whose weights are on the device now (loaded, prefetched or acquired)."""
        return sorted(self._slots.holding(SlotState.LOADING, SlotState.READY, SlotState.IN_USE))

    def resident_set(self) -> frozenset[int]:
        return self.resident | frozenset(self.materialised_streamed())

    def held_device_bytes(self) -> int:
        """Bytes of weights this manager holds on the device now (fixed slots count whole)."""
        return self._persistent_bytes + self.slot_device_bytes()

    def slot_device_bytes(self) -> int:
        """Bytes the streamed blocks' slots hold on the device now (fixed slots count whole; 0 once closed)."""
        if not self._attached:
            return 0
        return max(self.backend.slot_bytes(), sum(self._slot_bytes))

    @property
    def attached(self) -> bool:
        return self._attached

    def _sample(self) -> None:
        c = self._current
        held = self.held_device_bytes()
        c.peak_held_bytes = max(c.peak_held_bytes, held)
        c.peak_streamed_blocks = max(c.peak_streamed_blocks, len(self.materialised_streamed()))
        allocated = self.backend.platform.allocated_bytes()
        c.peak_device_bytes = max(c.peak_device_bytes, held if allocated is None else allocated)
        driver = self.backend.platform.driver_bytes()
        if driver is not None:
            c.peak_driver_bytes = max(c.peak_driver_bytes or 0, driver)

    def stats(self) -> ResidencyStats:
        self._require_attached()
        return ResidencyStats(
            residency=self.residency,
            passes=self._passes,
            last_pass=self._last_pass,
            current=self._current,
            total_bytes_h2d=self._total_h2d,
            host_store_bytes=self._store.host_bytes,
            pinned_bytes=self._store.pinned_bytes,
            resident_blocks=self.resident,
            streamed_blocks=self.streamed,
            slots=len(self._slots),
            store=self._store.kind,
            extra={"reclaims": getattr(self.backend, "reclaims", 0),
                   "staging_bytes": getattr(self._store, "staging_bytes", 0),
                   "cached_units": len(getattr(self._store, "cached_units", ())),
                   # host memory the bound transform keeps (a LoRA fold's factors on CUDA), and how much is pinned
                   "transform_host_bytes": getattr(self._transform, "host_bytes", 0),
                   "transform_pinned_bytes": getattr(self._transform, "pinned_bytes", 0)},
        )


def layerwise_manager(device: torch.device | str, *, prefetch: int | None = None,
                      resident_blocks: int | Iterable[int] | None = None, prefetch_next_pass: bool | None = None,
                      **backend_options) -> LayerwiseOffloadManager:
    """A manager with the backend for `device` (CUDA: asynchronous; else synchronous); units made from checkpoint
    files are read ahead into staging buffers (`read_ahead=`, see `staged_store.py`)."""
    return LayerwiseOffloadManager(offload_backend(device, **backend_options), prefetch=prefetch,
                                   resident_blocks=resident_blocks, prefetch_next_pass=prefetch_next_pass)
