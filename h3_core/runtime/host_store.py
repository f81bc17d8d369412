"""Host-side stores for weights that live off the device between uses (layerwise offload).

A store holds, for every unit (one transformer block, or one phase's weights), the host tensors its parameters are
made from, and materialises them on a device on request. Two stores:

* `HeldTensors` keeps the loader's tensors exactly as loaded (safetensors memory maps stay file-backed and
  evictable), so it costs no host memory, and reads mapped ones explicitly when a unit is materialised; the store of
  phase-scoped weights and of units that are not made from files.
* `PinnedSlab` packs each unit into one contiguous host slab (every tensor on a 256-byte boundary, strides kept),
  page-locked in place at its exact size while a `PinBudget` allows, pageable past it; the CUDA store, so a block
  moves with one asynchronous DMA.

All stores implement `HostStore`. A third, `StagedReads` (staged_store.py), reads units made from checkpoint files
explicitly, ahead of use, into a ring of staging buffers: the store of streamed blocks on every backend.

A parameter's recipe (`HostTensor`) may combine several checkpoint tensors or permute rows (the native fused QKV
is stored per-head interleaved); the recipe runs when the parameter is materialised, so nothing is copied at load.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, Sequence

import torch

from .file_reads import FileReader, read_private, segment_of, total_memory_bytes

# Every tensor of a slab starts on this boundary: covers the 16/32-byte base-pointer contracts of fused kernels.
SLAB_ALIGNMENT = 256


def _page_size() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
        return 4096


PAGE_SIZE = _page_size()


@dataclass(frozen=True)
class HostTensor:
    """How one parameter is made: `combine(*(s.to(device, dtype) for s in sources))`, or the single source cast.

    `sources` are host tensors (usually memory-mapped checkpoint views) that are never written.
    """

    sources: tuple[torch.Tensor, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    combine: Callable[..., torch.Tensor] | None = None
    # A quantised parameter: `sources` are the stored payloads (quantised bytes and scales), moved and stored as
    # they are (never cast), and `decode(*payloads)` dequantises them where they are, into `dtype`. Stores lay the
    # payloads out (see `payload_layouts`), so streaming moves the quantised size.
    decode: Callable[..., torch.Tensor] | None = None
    # A quantised parameter whose payloads are dequantised on the host and moved as materialised: the device cannot
    # hold a payload's dtype (fp8 on MPS), or its decoder runs on the host only (`decode.host_only`: gguf's NumPy
    # types), where moving the payloads would send them device -> host -> device. Set by `placed_for`.
    decode_on_host: bool = False

    @classmethod
    def held(cls, tensor: torch.Tensor) -> "HostTensor":
        """The tensor itself, unchanged."""
        return cls((tensor,), tensor.dtype, tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of the materialised parameter."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def source_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.sources)

    @property
    def moves_payloads(self) -> bool:
        """Quantised and dequantised where it is materialised: stores lay out and move the stored payloads."""
        return self.decode is not None and not self.decode_on_host

    def decodes_on(self, platform) -> bool:
        """Whether `platform`'s device can hold every payload's dtype and run the decoder."""
        return not getattr(self.decode, "host_only", False) and all(platform.holds(s.dtype) for s in self.sources)

    def placed_for(self, platform) -> "HostTensor":
        """This recipe as `platform` runs it: a quantised one its device cannot decode is dequantised on the host."""
        if not self.moves_payloads or self.decodes_on(platform):
            return self
        return replace(self, decode_on_host=True)

    def materialise(self, device: torch.device, reader: FileReader | None = None) -> torch.Tensor:
        """A fresh copy on `device` (never an alias of the host source, even when `device` is the CPU). With a
        `reader`, memory-mapped sources are read explicitly (`read_private`) instead of faulting the map's pages."""
        sources = self.sources if reader is None else tuple(read_private(s, reader) for s in self.sources)
        if self.moves_payloads:  # payloads to the device as stored, dequantised there
            return self.decode(*(s.to(device=device) for s in sources))
        if self.decode is not None:  # dequantised on the host, moved in the compute dtype (`placed_for`)
            return self.decode(*sources).to(device=device)
        if self.combine is None:
            return sources[0].to(device=device, dtype=self.dtype, copy=sources[0] is self.sources[0])
        # Copy the sources as stored, then combine on the device: the host side stays file-backed (no temporaries).
        return self.combine(*(s.to(device=device, dtype=self.dtype) for s in sources))

    def host_value(self) -> torch.Tensor:
        """The parameter on the host: the source tensor itself when no combine or cast is needed."""
        return self._made(self.sources)

    def private_value(self, reader: FileReader) -> torch.Tensor:
        """The parameter on the host in the process's own memory: memory-mapped sources are read explicitly, so a
        resident weight never depends on its file after the load (truncating or rewriting it cannot SIGBUS or
        change the weight)."""
        return self._made(tuple(read_private(s, reader) for s in self.sources))

    def resident_value(self, device: torch.device, reader: FileReader) -> torch.Tensor:
        """A resident weight on `device`, read into the process's own memory: a quantised one as its stored payloads,
        dequantised on the device; any other made on the host and moved."""
        if self.decode is not None:
            return self.materialise(device, reader)  # no private host copy of the dequantised weight
        return self.private_value(reader).to(device)

    def _made(self, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.decode is not None:
            return self.decode(*sources)
        if self.combine is None:
            source = sources[0]
            return source if source.dtype == self.dtype else source.to(self.dtype)
        return self.combine(*(s.to(self.dtype) for s in sources))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


UnitRecipes = Mapping[str, HostTensor]

# Names of a quantised parameter's payload entries in a slab / staging layout: "<parameter>#<index>".
PAYLOAD_MARK = "#"


def payload_layouts(name: str, recipe: HostTensor, stride=None) -> list[tuple[str, torch.dtype, tuple, tuple]]:
    """The (name, dtype, shape, stride) entries a unit layout holds for one parameter: the parameter itself as
    materialised, or, quantised, each stored payload as it is stored. `stride(shape)` gives a contiguous stride."""
    if not recipe.moves_payloads:
        return [(name, recipe.dtype, tuple(recipe.shape), stride(recipe.shape))]
    return [(f"{name}{PAYLOAD_MARK}{i}", s.dtype, tuple(s.shape), stride(tuple(s.shape)))
            for i, s in enumerate(recipe.sources)]


def decoded(views: dict[str, torch.Tensor], decoders: Mapping[str, Callable[..., torch.Tensor]],
            names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The parameters of a unit from its layout's views: quantised ones dequantised from their payload views."""
    out = {}
    for name in names:
        if name in decoders:
            count = sum(1 for key in views if key.startswith(name + PAYLOAD_MARK))
            out[name] = decoders[name](*(views[f"{name}{PAYLOAD_MARK}{i}"] for i in range(count)))
        else:
            out[name] = views[name]
    return out


def stored_bytes(recipes: UnitRecipes) -> int:
    """Bytes a unit moves host-to-device: each parameter as materialised, or, quantised, its payloads as stored."""
    return sum(r.source_bytes if r.moves_payloads else r.nbytes for r in recipes.values())


def source_bytes(units: Sequence[UnitRecipes]) -> int:
    """Bytes of the distinct host tensors the units' recipes are made from (a tensor shared by two counts once)."""
    seen: dict[int, int] = {}
    for recipes in units:
        for recipe in recipes.values():
            for s in recipe.sources:
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.numel() * s.element_size())
    return sum(seen.values())


class HostStore(Protocol):
    """What every host store offers the layerwise manager and its backends."""

    kind: str

    def __len__(self) -> int: ...

    def names(self, unit: int) -> list[str]: ...

    def unit_bytes(self, unit: int) -> int: ...  # bytes of the unit as materialised

    @property
    def host_bytes(self) -> int: ...  # bytes of the host storages the units are made from

    @property
    def pinned_bytes(self) -> int: ...

    def materialise(self, unit: int, device: torch.device) -> dict[str, torch.Tensor]: ...  # fresh device tensors

    def original(self, unit: int, name: str) -> torch.Tensor: ...  # the parameter's host tensor, to restore it

    def close(self) -> None: ...


# ---- held tensors ------------------------------------------------------------------------------------------------


class HeldTensors:
    """Keeps every unit's host tensors as given: no copy, so memory-mapped weights stay file-backed."""

    kind = "held_tensors"

    def __init__(self, recipes: Sequence[UnitRecipes]):
        self._recipes = [dict(r) for r in recipes]
        # Memory-mapped sources are read explicitly when a unit is materialised, never by faulting the map's pages:
        # a file truncated or rewritten in place since the load is a clear error instead of a SIGBUS.
        self._reader = FileReader()
        # Opened now: a file later replaced by a rename is still read from the inode that was loaded.
        segments = {seg.path: seg for recipes in self._recipes for recipe in recipes.values()
                    for source in recipe.sources if (seg := segment_of(source)) is not None}
        for segment in segments.values():  # one descriptor and identity check per file
            self._reader.check(segment)

    def __len__(self) -> int:
        return len(self._recipes)

    def names(self, unit: int) -> list[str]:
        return list(self._recipes[unit])

    def unit_bytes(self, unit: int) -> int:
        return sum(r.nbytes for r in self._recipes[unit].values())

    @property
    def host_bytes(self) -> int:
        """Bytes of the distinct host storages referenced (file-backed when they are memory maps)."""
        return source_bytes(self._recipes)

    @property
    def anonymous_bytes(self) -> int:
        """Bytes of the distinct host storages referenced that are not a checkpoint's file-backed pages."""
        seen: dict[int, int] = {}
        for recipes in self._recipes:
            for recipe in (recipes or {}).values():
                for s in recipe.sources:
                    if segment_of(s) is None:
                        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.numel() * s.element_size())
        return sum(seen.values())

    @property
    def pinned_bytes(self) -> int:
        return 0

    def materialise(self, unit: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {name: r.materialise(device, self._reader) for name, r in self._recipes[unit].items()}

    def original(self, unit: int, name: str) -> torch.Tensor:
        return self._recipes[unit][name].host_value()

    def close(self) -> None:
        self._recipes = [{} for _ in self._recipes]
        self._reader.close()


# ---- pinned slab -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlabEntry:
    """Where one tensor lives inside a unit's slab."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # bytes from the slab start, a multiple of SLAB_ALIGNMENT
    storage_nbytes: int  # bytes spanned by the (possibly strided) tensor


def storage_span(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes a strided tensor spans from its first to its last element."""
    if math.prod(shape) == 0:
        return 0
    return (sum((size - 1) * step for size, step in zip(shape, stride)) + 1) * itemsize


TensorLayout = tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...]]  # name, dtype, shape, stride


def plan_slab(tensors: Sequence[TensorLayout]) -> tuple[list[SlabEntry], int]:
    """Lay out (name, dtype, shape, stride) tensors back to back on SLAB_ALIGNMENT boundaries; returns entries, size."""
    entries = []
    offset = 0
    for name, dtype, shape, stride in tensors:
        offset = -(-offset // SLAB_ALIGNMENT) * SLAB_ALIGNMENT
        span = storage_span(shape, stride, _itemsize(dtype))
        entries.append(SlabEntry(name, dtype, tuple(shape), tuple(stride), offset, span))
        offset += span
    return entries, offset


def view_in(buffer: torch.Tensor, entry: SlabEntry) -> torch.Tensor:
    """The typed, strided tensor `entry` inside a uint8 `buffer` laid out like its slab (host slab or device slot)."""
    if entry.storage_nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype, device=buffer.device)
    typed = buffer[entry.offset: entry.offset + entry.storage_nbytes].view(entry.dtype)
    return typed.as_strided(entry.shape, entry.stride)


def page_aligned_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of pageable host memory starting on a page boundary, so it can be page-locked in place exactly."""
    raw = torch.empty(nbytes + PAGE_SIZE, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % PAGE_SIZE
    return raw[shift: shift + nbytes]


class PinLedger(Protocol):
    """The pinned-memory ledger of a host application that page-locks memory itself (ComfyUI): the process's pins
    under one limit. `limit_bytes()` is its limit for every pin of the process (<= 0: pin nothing), `pinned_bytes()`
    what it counts as locked now (ours included, as `add` reported them), `add(nbytes)` is told of every reservation
    of ours (negative: given back)."""

    def limit_bytes(self) -> int: ...

    def pinned_bytes(self) -> int: ...

    def add(self, nbytes: int) -> None: ...


class PinBudget:
    """How many bytes of host memory may be page-locked; pinned pages cannot be reclaimed, so overbooking gets the
    process killed instead of swapped.

    Inside a host application that pins memory too, `share_with(ledger)` makes the two one budget: a reservation
    also needs room under the ledger's limit after what the ledger counts (its own pins and ours), and every
    reservation and give-back is reported to it, so neither side's pins push the sum over the host's limit.
    `limit_bytes` is then what this budget may hold now: its own limit, or less where the ledger has less room."""

    # ComfyUI pins at most 40 % of RAM on Windows; the same share is a safe default everywhere.
    DEFAULT_FRACTION = 0.4

    def __init__(self, limit_bytes: int):
        if limit_bytes < 0:
            from ..errors import H3Error

            raise H3Error(f"pin budget must be >= 0 bytes, got {limit_bytes}; pass 0 to never pin.")
        self.own_limit_bytes = int(limit_bytes)
        self.used_bytes = 0
        self.ledger: PinLedger | None = None

    @property
    def limit_bytes(self) -> int:
        if self.ledger is None:
            return self.own_limit_bytes
        room = max(0, int(self.ledger.limit_bytes()) - int(self.ledger.pinned_bytes()))
        return min(self.own_limit_bytes, self.used_bytes + room)

    @limit_bytes.setter
    def limit_bytes(self, value: int) -> None:
        self.own_limit_bytes = int(value)

    def share_with(self, ledger: PinLedger | None) -> None:
        """Count against a host application's pinned-memory ledger from now on (None: stop). What is already
        reserved is moved onto the new ledger."""
        if self.ledger is not None and self.used_bytes:
            self.ledger.add(-self.used_bytes)
        self.ledger = ledger
        if ledger is not None and self.used_bytes:
            ledger.add(self.used_bytes)

    @classmethod
    def shared(cls) -> "PinBudget":
        """The one budget of this process (40 % of RAM), drawn on by every component's store: pins of the text
        encoder and of the transformer add up, so together they never lock more than the budget."""
        global _SHARED_BUDGET
        if _SHARED_BUDGET is None:
            _SHARED_BUDGET = cls.default()
        return _SHARED_BUDGET

    @classmethod
    def default(cls) -> "PinBudget":
        ram = total_memory_bytes() or 0  # Windows too (its os has no sysconf): else nothing would be pinned there
        return cls(int(ram * cls.DEFAULT_FRACTION))

    def try_reserve(self, nbytes: int) -> bool:
        if self.used_bytes + nbytes > self.limit_bytes:
            return False
        self.used_bytes += nbytes
        if self.ledger is not None and nbytes:
            self.ledger.add(nbytes)
        return True

    def give_back(self, nbytes: int) -> None:
        returned = min(self.used_bytes, max(0, nbytes))
        self.used_bytes -= returned
        if self.ledger is not None and returned:
            self.ledger.add(-returned)


_SHARED_BUDGET: PinBudget | None = None


class HostPinner(Protocol):
    """Page-locks existing host memory in place (no copy, no power-of-two rounding)."""

    def register(self, buffer: torch.Tensor) -> bool: ...

    def unregister(self, buffer: torch.Tensor) -> bool: ...


class PinWarning(RuntimeWarning):
    """Page-locking or unlocking host memory failed in a way the run survives (reported, never swallowed)."""


class CudaHostPinner:
    """`cudaHostRegister` at the buffer's exact size; torch's pinned caching allocator would round up to a power of
    two (1.67x measured for 1.2 GiB blocks).

    A refused registration is normal (the budget or the locked-memory limit): the buffer stays pageable. But the
    refusal leaves the CUDA runtime's last error set, which torch would report as the next kernel's failure, so it is
    reset; where that is impossible a `PinWarning` says so and no further registration is tried."""

    PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context

    def __init__(self):
        self.registration_disabled = False

    def register(self, buffer: torch.Tensor) -> bool:
        if self.registration_disabled:
            return False
        cudart = torch.cuda.cudart()
        status = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), self.PORTABLE))
        if status == 0:
            return True
        if not _clear_cuda_last_error():
            self.registration_disabled = True
            warnings.warn(f"cudaHostRegister refused to page-lock a {buffer.numel():,}-byte host buffer "
                          f"({_cuda_error_text(cudart, status)}) and the CUDA runtime's last error could not be "
                          "reset here (its library was not found among the loaded ones), so a later CUDA error may "
                          "be reported with this cause. Host memory stays pageable for the rest of the run "
                          "(slower copies).", PinWarning, stacklevel=2)
        return False

    def unregister(self, buffer: torch.Tensor) -> bool:
        """Unlock `buffer`; False (with a `PinWarning`) when the runtime refuses: its pages stay locked."""
        cudart = torch.cuda.cudart()
        status = int(cudart.cudaHostUnregister(buffer.data_ptr()))
        if status == 0:
            return True
        _clear_cuda_last_error()
        warnings.warn(f"cudaHostUnregister failed for a {buffer.numel():,}-byte host buffer "
                      f"({_cuda_error_text(cudart, status)}); its pages stay page-locked until the process exits.",
                      PinWarning, stacklevel=2)
        return False


def _cuda_error_text(cudart, status: int) -> str:
    try:
        return f"status {status}: {cudart.cudaGetErrorString(status)}"
    except Exception:  # the binding has no cudaGetErrorString: the number alone
        return f"status {status}"


def _loaded_cudart_libraries() -> list[str]:
    """Paths of the CUDA runtime libraries this process loaded (torch loads it before any registration).

    Linux: /proc/self/maps. Elsewhere (Windows): the cudart64 DLLs next to torch's own libraries, which is where
    the wheels put the one torch loads; loading an already loaded DLL by path returns that same module."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        pass
    from pathlib import Path

    lib = Path(torch.__file__).parent / "lib"
    return sorted(str(p) for p in lib.glob("cudart64*.dll"))


def _clear_cuda_last_error() -> bool:
    """Reset the CUDA runtime's last error after a refused call; torch checks it after every kernel launch and would
    otherwise blame the next kernel. torch does not bind cudaGetLastError, so it is called in the runtime library
    this process loaded. False when no such library was found or none could be called."""
    import ctypes

    cleared = False
    for path in _loaded_cudart_libraries():
        try:
            ctypes.CDLL(path).cudaGetLastError()
            cleared = True
        except (OSError, AttributeError):
            continue
    return cleared


@dataclass
class UnitSlab:
    """One unit packed into one contiguous host buffer."""

    entries: list[SlabEntry]
    data: torch.Tensor  # uint8, exactly `nbytes` long
    pinned: bool

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class PinnedSlab:
    """Each unit packed into one page-aligned host slab, page-locked in place while the budget allows.

    Units are packed one at a time and a mutable `recipes` list is consumed (each entry set to None once packed),
    so when nothing else references the sources the host never holds a second copy beyond the unit being packed.
    Only the units in `pin_units` (default: all) are page-locked: units copied once (resident blocks) need no pin.
    """

    kind = "pinned_slab"

    def __init__(self, recipes: Sequence[UnitRecipes | None], *, budget: PinBudget | None = None,
                 pinner: HostPinner | None = None, pin_units: Sequence[int] | None = None,
                 before_unpin: Callable[[], None] | None = None):
        self.budget = budget if budget is not None else PinBudget(0)
        self._pinner = pinner
        # Synchronises the device before the first unpin (a store dropped without its backend's close() may still
        # be read by a pending copy): the backend's `platform.synchronize`.
        self._before_unpin = before_unpin
        pin_units = set(range(len(recipes)) if pin_units is None else pin_units)
        self.slabs: list[UnitSlab] = []
        self._names: list[list[str]] = []
        self._decoders: list[dict] = []  # per unit: quantised parameter -> its decode
        for unit in range(len(recipes)):
            self.slabs.append(self._pack(recipes[unit], pin=unit in pin_units))
            if isinstance(recipes, list):
                recipes[unit] = None

    def _pack(self, recipes: UnitRecipes, *, pin: bool) -> UnitSlab:
        values = {}
        self._names.append(list(recipes))
        self._decoders.append({})
        for name, recipe in recipes.items():
            if recipe.moves_payloads:  # quantised: the payloads as stored, dequantised on the device
                self._decoders[-1][name] = recipe.decode
                values.update((f"{name}{PAYLOAD_MARK}{i}", s) for i, s in enumerate(recipe.sources))
                continue
            values[name] = recipe.host_value()
        entries, nbytes = plan_slab([(n, v.dtype, tuple(v.shape), tuple(v.stride())) for n, v in values.items()])
        data = page_aligned_bytes(nbytes)
        for entry in entries:
            view_in(data, entry).copy_(values.pop(entry.name))  # drop each host value as soon as it is packed
        pinned = False
        if pin and self._pinner is not None and nbytes and self.budget.try_reserve(nbytes):
            pinned = self._pinner.register(data)
            if not pinned:
                self.budget.give_back(nbytes)
        return UnitSlab(entries, data, pinned)

    def __len__(self) -> int:
        return len(self.slabs)

    def slab(self, unit: int) -> UnitSlab:
        return self.slabs[unit]

    def names(self, unit: int) -> list[str]:
        return list(self._names[unit])

    def unit_bytes(self, unit: int) -> int:
        return self.slabs[unit].nbytes

    def buffer_bytes(self, unit: int) -> int:
        """Bytes of the unit's slab (and of a device slot that holds it)."""
        return self.slabs[unit].nbytes

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self.slabs)

    @property
    def anonymous_bytes(self) -> int:
        """The slabs are the store's own memory."""
        return self.host_bytes

    @property
    def pinned_bytes(self) -> int:
        return sum(s.nbytes for s in self.slabs if s.pinned)

    def views(self, unit: int, buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Typed views of `unit` inside `buffer` (a device slot laid out like the slab), or inside the slab itself."""
        slab = self.slabs[unit]
        target = slab.data if buffer is None else buffer
        return decoded({e.name: view_in(target, e) for e in slab.entries}, self._decoders[unit], self._names[unit])

    def materialise(self, unit: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Fresh device copies (the synchronous path: one copy of the whole slab, then typed views)."""
        slab = self.slabs[unit]
        buffer = slab.data.to(device=device, copy=True)
        return self.views(unit, buffer)

    def original(self, unit: int, name: str) -> torch.Tensor:
        slab = self.slabs[unit]
        if name in self._decoders[unit]:
            return self.views(unit)[name]
        entry = next(e for e in slab.entries if e.name == name)
        return view_in(slab.data, entry)

    def close(self) -> None:
        """Unpin every slab, after `before_unpin` (a device synchronisation: a pending DMA may still read a slab).
        A slab the runtime refuses to unlock (the pinner warns) stays counted in the budget: its pages are still
        locked."""
        if self._before_unpin is not None and any(s.pinned for s in self.slabs):
            self._before_unpin()
        for slab in self.slabs:
            if slab.pinned and self._pinner is not None:
                slab.pinned = False
                if self._pinner.unregister(slab.data) is not False:
                    self.budget.give_back(slab.nbytes)

    def __del__(self):
        # A store dropped without close(): its memory is about to be freed, so at least leave no registration behind.
        # A finaliser may not raise: a failure is reported as a warning (none at interpreter teardown, when even
        # the warnings machinery may be gone).
        try:
            self.close()
        except Exception as exc:
            try:
                warnings.warn(f"a pinned host store dropped without close() could not unpin its slabs: {exc!r}; "
                              "their pages may stay page-locked until the process exits.", PinWarning)
            except Exception:  # pragma: no cover - interpreter teardown
                pass
