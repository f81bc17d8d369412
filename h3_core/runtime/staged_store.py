"""`StagedReads`: the host store of streamed units whose weights live in checkpoint files — read explicitly, ahead
of use, into a small ring of staging buffers.

The pass order is known (a stack of blocks runs in order), so while unit i computes, one background reader thread
brings the next `read_ahead` units from disk: it `pread`s their bytes (no page faults of a map, so a file truncated
under us is a short read and a clear error, never a SIGBUS), casts them to the compute dtype and de-interleaves
them into a staging buffer laid out like the device slot (every tensor on a 256-byte boundary). The consumer then

* on the CPU as the device, binds the parameters to views of the staging buffer itself (no copy at all);
* on MPS, copies the buffer to the device synchronously;
* on CUDA, copies it on the copy stream; the buffer is refilled only after that copy's event.

Anonymous host memory is the ring (`read_ahead + 1` buffers, + the device slots held on the CPU) and one scratch
buffer for the raw bytes of casted tensors, whatever the model size. On CUDA the ring is page-locked, and while the
process-wide pin budget allows, leading units are packed once into pinned slabs (no disk read and no staging per
pass: the RAM-rich path). When the streamed files are bigger than the memory available, the pages of units past a
cache budget are dropped after they are read (`POSIX_FADV_DONTNEED`): the leading units then stay cached across
passes instead of everything being evicted in LRU order and read again.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from .file_reads import FileReader, FileSegment, available_memory_bytes, segment_of, total_memory_bytes
from ..errors import ResidencyError
from .host_store import (PAYLOAD_MARK, HostPinner, HostTensor, PinBudget, SlabEntry, UnitRecipes, UnitSlab,
                         decoded, page_aligned_bytes, payload_layouts, plan_slab, source_bytes, stored_bytes, view_in)
from .platform import Platform

GiB = 1024 ** 3
# Bytes read per piece of a tensor cast as it is read (small enough to stay in the CPU's caches).
CAST_PIECE_BYTES = 4 * 1024 * 1024
# Memory left to everything else when choosing which units stay in the page cache: 2 GiB + 10 % of the RAM (the
# activations, other processes; the kernel itself starts reclaiming before the memory is all used).
CACHE_MARGIN_BYTES = 2 * GiB
CACHE_MARGIN_FRACTION = 0.10


def any_file_backed(recipes: Sequence[UnitRecipes | None]) -> bool:
    """Whether some unit reads at least one tensor from a checkpoint file (so explicit reads apply)."""
    return any(segment_of(s) is not None for unit in recipes if unit for r in unit.values() for s in r.sources)


@dataclass
class Staged:
    """A staging buffer holding one unit, lent to the consumer until `StagedReads.give_back`."""

    unit: int
    index: int
    buffer: torch.Tensor


@dataclass
class ReadCounters:
    """Cumulative reader figures (a pass reports their difference)."""

    bytes_read: int = 0
    read_s: float = 0.0  # reader time spent reading and casting
    wait_s: float = 0.0  # consumer time blocked waiting for a unit's read
    reads: int = 0
    misses: int = 0  # a unit was asked for that no read-ahead had started


class StagedReads:
    """Streamed units read explicitly from their files ahead of use; see the module docstring.

    `streamed` is the pass order; `read_ahead` how many units are read ahead of the one in use; `hand_over` lends
    the staging buffers themselves as the device tensors (the CPU as the device); `cache_budget_bytes` how many
    source bytes of leading units stay in the page cache when the files do not fit (None: from the memory available
    now; a negative value never drops). `pin_budget` / `pinner` (CUDA): page-lock the ring, then pack leading units.
    """

    kind = "staged_reads"

    def __init__(self, recipes: Sequence[UnitRecipes], streamed: Sequence[int], *, read_ahead: int = 1,
                 hand_over: bool = False, cache_budget_bytes: int | None = None, pin_budget: PinBudget | None = None,
                 pinner: HostPinner | None = None, before_unpin=None):
        self._recipes = [dict(r) for r in recipes]
        # Synchronises the device before anything is unpinned (see PinnedSlab): the backend's platform.synchronize.
        self._before_unpin = before_unpin
        self.streamed = tuple(streamed)
        self.read_ahead = int(read_ahead)
        self.hand_over = hand_over
        self._layouts: list[tuple[list[SlabEntry], int]] = []
        for unit in self._recipes:
            # Quantised parameters are laid out as their stored payloads: read, staged and copied at that size.
            self._layouts.append(plan_slab([entry for n, r in unit.items()
                                            for entry in payload_layouts(n, r, _contiguous_stride)]))
        self._decoders = [{n: r.decode for n, r in unit.items() if r.moves_payloads} for unit in self._recipes]
        self._reader = FileReader()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3-unit-reader")
        # Asks the kernel for the pages of the unit being read and of the one after it (WILLNEED may block while it
        # queues the I/O, so not on the reader): the disk streams ahead while the reader copies and casts.
        self._advisor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3-disk-advice")
        self._advised: set[int] = set()
        self.counters = ReadCounters()
        self._ring: list[torch.Tensor] = []
        self._ring_pinned: list[bool] = []
        self._ring_size = self.read_ahead + 1
        self._free: list[int] = []
        self._after: dict[int, object] = {}  # buffer -> event to wait on before refilling it (a pending copy)
        self._staged: dict[int, tuple[int, Future]] = {}  # unit -> (buffer, its read), not yet taken
        self._last_taken: int | None = None
        self._planned: frozenset[int] | None = None  # `plan`: the units this pass will take (None: all)
        self._next_head: tuple[int, ...] = ()
        self._staged_after: dict[int, object] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._pin_budget = pin_budget if pin_budget is not None else PinBudget(0)
        self._pinner = pinner
        self._pinned_reserved = 0
        self.slabs: dict[int, UnitSlab] = {}
        self._cache_budget_request = cache_budget_bytes
        self._keep_cached = self._choose_cached(cache_budget_bytes)
        self._pending_drop: list[FileSegment] = []
        self._closed = False

    # ---- layout ------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._recipes)

    def names(self, unit: int) -> list[str]:
        return list(self._recipes[unit])

    def unit_bytes(self, unit: int) -> int:
        """Bytes of the unit's tensors as materialised."""
        return sum(r.nbytes for r in self._recipes[unit].values())

    def stored_bytes(self, unit: int) -> int:
        """Bytes of the unit as read and copied (quantised parameters at their stored size)."""
        return stored_bytes(self._recipes[unit])

    def buffer_bytes(self, unit: int) -> int:
        """Bytes of the unit laid out in a staging buffer or device slot (tensors on 256-byte boundaries)."""
        return self._layouts[unit][1]

    def views(self, unit: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's parameters in `buffer` (laid out like its staging buffer); quantised ones are dequantised
        from their payloads here, on the buffer's device."""
        views = {e.name: view_in(buffer, e) for e in self._layouts[unit][0]}
        if not self._decoders[unit]:
            return views
        return decoded(views, self._decoders[unit], self.names(unit))

    def unit_segments(self, unit: int) -> list[FileSegment]:
        return [seg for r in self._recipes[unit].values() for s in r.sources if (seg := segment_of(s)) is not None]

    @property
    def host_bytes(self) -> int:
        """Bytes of the stored tensors the units are made from (file-backed: the checkpoint's own bytes)."""
        return source_bytes(self._recipes)

    @property
    def staging_bytes(self) -> int:
        """Anonymous host memory of the ring, the scratch buffer and the packed slabs."""
        return (sum(b.numel() for b in self._ring) + self._scratch.numel()
                + sum(s.nbytes for s in self.slabs.values()))

    @property
    def pinned_bytes(self) -> int:
        return (sum(b.numel() for b, p in zip(self._ring, self._ring_pinned) if p)
                + sum(s.nbytes for s in self.slabs.values() if s.pinned))

    @property
    def ring_bytes(self) -> int:
        """Host bytes of the staging ring at its full size (each buffer holds the largest streamed unit)."""
        return self._ring_size * max((self.buffer_bytes(u) for u in self.streamed), default=0)

    @property
    def cached_units(self) -> frozenset[int]:
        """Streamed units whose file pages are left in the page cache after they are read."""
        return self._keep_cached

    def _choose_cached(self, budget: int | None) -> frozenset[int]:
        sizes = {u: sum(seg.nbytes for seg in self.unit_segments(u)) for u in self.streamed}
        if budget is None:
            available, total_ram = available_memory_bytes(), total_memory_bytes()
            if available is None or total_ram is None:
                return frozenset(self.streamed)
            # The ring not allocated yet will come out of the memory available now (what is allocated already has).
            pending = max(0, self.ring_bytes - sum(b.numel() for b in self._ring))
            budget = available - pending - CACHE_MARGIN_BYTES - int(CACHE_MARGIN_FRACTION * total_ram)
        elif budget < 0:  # asked never to drop
            return frozenset(self.streamed)
        if sum(sizes.values()) <= budget:
            return frozenset(self.streamed)
        kept, total = [], 0
        for unit in self.streamed:  # leading units: they are needed first again at the next pass
            if total + sizes[unit] > budget:
                break
            kept.append(unit)
            total += sizes[unit]
        return frozenset(kept)

    # ---- setup by the backend ---------------------------------------------------------------------------------

    def reserve_consumer_buffers(self, held: int) -> None:
        """The consumer keeps `held` buffers lent at once (its device slots, when buffers are handed over)."""
        self._ring_size = self.read_ahead + max(1, held)

    def pack_pinned(self, pack_units: bool = True) -> None:
        """CUDA: page-lock the ring, then (`pack_units`: a component that runs more than one pass per load) pack
        leading streamed units into pinned slabs while the budget allows. A single pass reads each unit once: it
        streams through the ring, and packing would only read ahead what the ring reads anyway, at a slab's cost."""
        if self._pinner is None:
            return
        self._grow_ring(self._ring_size)
        for i, buffer in enumerate(self._ring):
            if buffer.numel() and self._pin_budget.try_reserve(buffer.numel()):
                if self._pinner.register(buffer):
                    self._ring_pinned[i] = True
                    self._pinned_reserved += buffer.numel()
                else:
                    self._pin_budget.give_back(buffer.numel())
        if not pack_units:
            return
        for unit in self.units_to_pack(self._pin_budget.limit_bytes - self._pin_budget.used_bytes):
            nbytes = self.buffer_bytes(unit)
            self._pin_budget.try_reserve(nbytes)
            data = page_aligned_bytes(nbytes)
            self._fill_now(unit, data)
            pinned = self._pinner.register(data)
            if pinned:
                self._pinned_reserved += nbytes
            else:
                self._pin_budget.give_back(nbytes)
            self.slabs[unit] = UnitSlab(self._layouts[unit][0], data, pinned)

    def units_to_pack(self, room: int) -> list[int]:
        """The leading streamed units whose slabs fit `room` bytes of pin budget, in pass order, up to the first that
        does not fit: the leading ones are needed first again at every pass."""
        units, total = [], 0
        for unit in self.streamed:
            nbytes = self.buffer_bytes(unit)
            if not nbytes or total + nbytes > room:
                break
            units.append(unit)
            total += nbytes
        return units

    def _grow_ring(self, size: int) -> None:
        nbytes = max((self.buffer_bytes(u) for u in self.streamed if u not in self.slabs), default=0)
        while len(self._ring) < size:
            self._ring.append(page_aligned_bytes(nbytes))
            self._ring_pinned.append(False)
            self._free.append(len(self._ring) - 1)

    # ---- reading ----------------------------------------------------------------------------------------------

    def _fill(self, unit: int, buffer: torch.Tensor) -> None:
        """Read `unit` from its files into `buffer` in its slot layout (cast, then combined, as HostTensor does)."""
        self._drop_pending()
        self._advise(unit)
        entries = {e.name: e for e in self._layouts[unit][0]}
        for name, recipe in self._recipes[unit].items():
            if recipe.moves_payloads:  # quantised payloads: the stored bytes straight into place
                for i, source in enumerate(recipe.sources):
                    target = view_in(buffer, entries[f"{name}{PAYLOAD_MARK}{i}"])
                    segment = segment_of(source)
                    if segment is None:
                        target.copy_(source)
                    else:
                        self._reader.read_into(segment, target.reshape(-1).view(torch.uint8))
                continue
            entry = entries[name]
            target = view_in(buffer, entry)
            if recipe.decode is not None:  # dequantised here, on the host (`HostTensor.decode_on_host`)
                target.copy_(recipe.decode(*self._read_sources(recipe)))
                continue
            single = recipe.sources[0] if len(recipe.sources) == 1 else None
            segment = None if single is None else segment_of(single)
            if recipe.combine is None and segment is not None and single.dtype == recipe.dtype:
                self._reader.read_into(segment, target.view(-1).view(torch.uint8))  # straight into place
                continue
            if recipe.combine is None and segment is not None:
                self._read_cast(segment, single.dtype, target)
                continue
            raw = self._read_sources(recipe)
            into = getattr(recipe.combine, "into", None)
            if recipe.combine is None:
                target.copy_(raw[0])  # the cast happens in the copy: no full-size temporary
            elif into is not None:
                into(target, *raw)  # a rearrangement written in place, cast on the way
            else:  # arbitrary arithmetic: cast first, as HostTensor.materialise does, for the same numbers
                target.copy_(recipe.combine(*(value.to(recipe.dtype) for value in raw)))
        if unit not in self._keep_cached:
            self._pending_drop = self.unit_segments(unit)

    def _advise(self, unit: int) -> None:
        wanted = [unit] + self._following(unit, 1)
        for u in wanted:
            if u not in self._advised:
                self._advised.add(u)
                self._advisor.submit(self._will_need, u)
        self._advised &= set(wanted)  # a unit read again later (next pass) is advised again

    def _will_need(self, unit: int) -> None:
        for segment in self.unit_segments(unit):
            if self._reader.cancelled:
                return
            self._reader.will_need(segment)

    def _read_cast(self, segment: FileSegment, dtype: torch.dtype, target: torch.Tensor) -> None:
        """Read a stored tensor in pieces and cast each into its place: the pieces stay in the CPU's caches, and no
        full-size copy of the stored bytes is ever made."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        piece = CAST_PIECE_BYTES // itemsize * itemsize
        if self._scratch.numel() < min(piece, segment.nbytes):
            self._scratch = torch.empty(min(piece, segment.nbytes), dtype=torch.uint8)
        flat = target.view(-1)
        for start in range(0, segment.nbytes, piece):
            nbytes = min(piece, segment.nbytes - start)
            raw = self._scratch[:nbytes]
            self._reader.read_into(segment, raw, start)
            flat[start // itemsize: (start + nbytes) // itemsize].copy_(raw.view(dtype))

    def _drop_pending(self) -> None:
        # Dropped one read later: the kernel's own read-ahead for this range may still be landing in the cache.
        for segment in self._pending_drop:
            self._reader.drop_cached(segment)
        self._pending_drop = []

    def _fill_now(self, unit: int, buffer: torch.Tensor) -> None:
        """`_fill` on the reader thread (the only one that touches the scratch buffer), waiting for it."""
        self._executor.submit(self._fill, unit, buffer).result()

    def _read_sources(self, recipe: HostTensor) -> list[torch.Tensor]:
        sizes = [-(-(s.numel() * s.element_size()) // 256) * 256 for s in recipe.sources]
        if self._scratch.numel() < sum(sizes):
            self._scratch = torch.empty(sum(sizes), dtype=torch.uint8)
        values, offset = [], 0
        for source, size in zip(recipe.sources, sizes):
            segment = segment_of(source)
            if segment is None:
                values.append(source)  # a tensor in RAM (or an untagged view): use it as it is
            else:
                raw = self._scratch[offset: offset + segment.nbytes]
                self._reader.read_into(segment, raw)
                values.append(raw.view(source.dtype).view(source.shape))
            offset += size
        return values

    def _read_job(self, unit: int, buffer: torch.Tensor, after) -> None:
        # The buffer itself, not its ring index: `trim` may renumber the ring before this job runs.
        if after is not None:
            after.synchronize()  # a copy out of this buffer may still be running
        started = time.perf_counter()
        before = self._reader.bytes_read
        self._fill(unit, buffer)
        self.counters.read_s += time.perf_counter() - started
        self.counters.bytes_read += self._reader.bytes_read - before
        self.counters.reads += 1

    def _request(self, unit: int) -> bool:
        if self._closed or unit in self._staged or unit in self.slabs:
            return True
        self._grow_ring(self._ring_size)
        if not self._free:
            return False
        index = self._free.pop(0)
        after = self._after.pop(index, None)
        future = self._executor.submit(self._read_job, unit, self._ring[index], after)
        self._staged[unit] = (index, future)
        self._staged_after[unit] = after  # back to `_after` if `plan` cancels the read before it waits
        return True

    def plan(self, units, next_head=()) -> None:
        """The units this pass will still take (None: all, in `streamed` order): reads ahead follow them, and
        reads already staged for units left out are dropped (a pending one is cancelled, a running one awaited).
        `next_head`: units the next pass surely starts with, read ahead once this pass's last planned units are
        staged (a short pass then overlaps the next one's first reads with its own compute)."""
        self._planned = None if units is None else frozenset(units)
        self._next_head = () if units is None else tuple(u for u in next_head if u not in self.slabs)
        if self._planned is None:
            return
        for unit in [u for u in self._staged if u not in self._planned and u not in self._next_head]:
            index, future = self._staged.pop(unit)
            after = self._staged_after.pop(unit, None)
            if future.cancel():
                if after is not None:
                    self._after[index] = after  # the copy out of this buffer was never waited for
            else:
                try:
                    future.result()
                except Exception:
                    pass  # nobody needs it now; a real problem shows again when the unit is taken
            self._free.append(index)
        self._top_up()

    def _following(self, unit: int, count: int) -> list[int]:
        """The `count` units taken after `unit`: this pass's planned ones, then the `plan`'s next head (else the next
        pass's head waits for `prefetch_head`)."""
        planned, next_head = self._planned, self._next_head  # one snapshot (the reader thread asks too)
        order = [u for u in self.streamed if u not in self.slabs and (planned is None or u in planned or u == unit)]
        if unit not in order:
            return []
        at = order.index(unit)
        ahead = order[at + 1: at + 1 + count]
        if len(ahead) < count and next_head:
            ahead += [u for u in next_head if u not in ahead][: count - len(ahead)]
        return ahead

    def _upcoming(self, unit: int) -> list[int]:
        return self._following(unit, self.read_ahead) if self.read_ahead else []

    def _top_up(self) -> None:
        if self._last_taken is not None:
            for ahead in self._upcoming(self._last_taken):
                if not self._request(ahead):
                    break

    def take(self, unit: int) -> Staged:
        """The staging buffer holding `unit`, read now if no read-ahead started it; errors of its read raise here."""
        if unit not in self._staged:
            self.counters.misses += 1
            if not self._request(unit):
                self._evict_one()
                self._request(unit)
        index, future = self._staged.pop(unit)
        self._staged_after.pop(unit, None)
        started = time.perf_counter()
        try:
            future.result()
        except BaseException:
            self._free.append(index)
            raise
        finally:
            self.counters.wait_s += time.perf_counter() - started
        self._last_taken = unit
        self._top_up()
        return Staged(unit, index, self._ring[index])

    def _evict_one(self) -> None:
        if not self._staged:
            raise ResidencyError(
                f"every one of the {len(self._ring)} staging buffers is lent out; give one back before taking "
                "another unit (or raise read_ahead).")
        unit = next(reversed(self._staged))  # the read furthest ahead
        index, future = self._staged.pop(unit)
        self._staged_after.pop(unit, None)
        try:
            future.result()
        except Exception:
            pass  # nobody needs it now; a real problem shows again when the unit is taken
        self._free.append(index)

    def give_back(self, staged: Staged, after=None) -> None:
        """The consumer is done with `staged` (`after`: an event its last use completes with)."""
        if after is not None:
            self._after[staged.index] = after
        self._free.append(staged.index)
        self._top_up()

    def set_cache_budget(self, cache_budget_bytes: int | None) -> None:
        """Change the page-cache budget (None: from the memory available at each pass boundary; < 0: drop nothing;
        0: keep nothing)."""
        self._cache_budget_request = cache_budget_bytes
        self._keep_cached = self._choose_cached(cache_budget_bytes)

    def review_cache(self) -> None:
        """Choose again which units stay in the page cache, from the memory available now (between passes: the
        activations, the ring and other processes have taken their share by then)."""
        if self._cache_budget_request is None:
            self._keep_cached = self._choose_cached(None)

    def prefetch_head(self) -> None:
        """Start reading the first units of the next pass (called when a pass ends, and when one begins)."""
        order = [u for u in self.streamed if u not in self.slabs and (self._planned is None or u in self._planned)]
        for unit in order[: self.read_ahead]:
            if not self._request(unit):
                break

    def trim(self) -> None:
        """Free the staging buffers nothing holds (between passes of a component that runs once per request); the
        next pass allocates them again. Page-locked buffers are kept: unpinning costs a device synchronisation."""
        held = {index for index, _ in self._staged.values()}
        if len(held) + len(self._free) < len(self._ring):
            return  # a buffer is lent out: its index must stay valid
        keep = [i for i in range(len(self._ring)) if i in held or i not in self._free or self._ring_pinned[i]]
        if len(keep) == len(self._ring):
            return
        remap = {old: new for new, old in enumerate(keep)}
        self._ring = [self._ring[i] for i in keep]
        self._ring_pinned = [self._ring_pinned[i] for i in keep]
        self._free = [remap[i] for i in self._free if i in remap]
        self._after = {remap[i]: e for i, e in self._after.items() if i in remap}
        self._staged = {u: (remap[i], f) for u, (i, f) in self._staged.items()}
        self._scratch = torch.empty(0, dtype=torch.uint8)

    # ---- the host-store interface -----------------------------------------------------------------------------

    def materialise(self, unit: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Fresh device tensors of `unit` (an allocation of its own; the ring is not kept)."""
        if unit in self.slabs:
            return self.views(unit, self.slabs[unit].data.to(device=device, copy=True))
        if Platform.for_device(device).host_is_device:
            buffer = page_aligned_bytes(self.buffer_bytes(unit))
            self._fill_now(unit, buffer)
            return self.views(unit, buffer)
        staged = self.take(unit)
        try:
            return self.views(unit, staged.buffer[: self.buffer_bytes(unit)].to(device=device, copy=True))
        finally:
            self.give_back(staged)

    def original(self, unit: int, name: str) -> torch.Tensor:
        return self._recipes[unit][name].host_value()

    def close(self) -> None:
        """Stop the reader and unpin, after `before_unpin` (a device synchronisation: a pending copy may read a
        buffer)."""
        if self._closed:
            return
        self._closed = True
        self._reader.cancelled = True
        self._executor.shutdown(wait=True)
        self._advisor.shutdown(wait=True)
        self._drop_pending()
        self._staged = {}
        if self._before_unpin is not None and (any(self._ring_pinned) or any(s.pinned for s in self.slabs.values())):
            self._before_unpin()
        if self._pinner is not None:
            for buffer, pinned in zip(self._ring, self._ring_pinned):
                if pinned:
                    self._pinner.unregister(buffer)
            for slab in self.slabs.values():
                if slab.pinned:
                    self._pinner.unregister(slab.data)
                    slab.pinned = False
        self._pin_budget.give_back(self._pinned_reserved)
        self._pinned_reserved = 0
        self._ring, self._ring_pinned, self._free = [], [], []
        self._reader.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
