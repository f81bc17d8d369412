"""The platform object: every device-dependent fact and operation of h3_core, in one place.

Every other module asks a `Platform` instead of testing a device type:

* copy semantics: `asynchronous_copies` (CUDA: pinned slabs, a copy stream and events, prefetch 1 by default),
  streams and events (inline no-ops where the device has none), the host page-locker;
* reclaim policy: `default_reclaim_every` (MPS frees are deferred until the command buffers drain, so every release
  synchronises and empties the cache), `synchronize()`, `empty_cache()`, and `trim_host_heap()` (the CPU computes in
  the C heap, whose allocator keeps freed buffers: returned to the system between blocks of many mid-size ones);
* chunk caps: `chunking`, how the device's attention behaves as far as row chunk sizes are concerned;
* autocast: `decode_autocast_dtype()`, the video decoder's autocast recipe (fp16 on CUDA only);
* admission facts: `unified_memory` (Apple MPS: a resident component is a second copy of weights already mapped
  from disk, so every component must stream), `default_residency`, `device_key()`;
* memory counters: `allocated_bytes()`, `driver_bytes()`, `reset_peak()`, `peak_allocated_bytes()`, and the host's
  `peak_rss_bytes()`.

A `Platform` is cheap and immutable; `Platform("mps")` describes MPS on any machine (the admission rules and chunk
caps are testable everywhere); its device operations touch the device only when called.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import settings
from ..errors import H3Error

GiB = 1 << 30


# ---- what a device's attention allows, for chunk sizing ----------------------------------------------------------


@dataclass(frozen=True)
class ChunkingBackend:
    """How a device's attention behaves, as far as chunk sizing is concerned.

    `materializes_scores`: SDPA builds the whole `[heads, query rows, key rows]` score matrix (MPS) instead of
    running a fused kernel whose workspace does not grow with the key rows (CUDA flash / memory-efficient, CPU flash).
    `max_buffer_bytes`: no single temporary may be larger (MPS: about 4 GiB per Metal buffer).
    `long_sequence_rows` / `max_long_sequence_query_rows`: above that many rows, at most that many query rows per
    chunk (MPS SDPA silently corrupts long non-causal attention with larger query blocks).
    `min_query_rows`: the attention query pass of a chunked forward takes at least this many rows per call, when
    the kernel is slower on fewer (its workspace does not grow with them, so only q and the output rows do).
    `max_attention_work`: the most query rows x key rows x inner dim (x batch) one attention call may multiply,
    and `max_chunk_rows` the most rows a chunk of a derived size (no explicit chunk size) holds, so that an interrupt
    check (or Ctrl-C) between calls lands in a fraction of a second; None sets no bound.
    """

    name: str
    materializes_scores: bool = False
    max_buffer_bytes: int | None = None
    long_sequence_rows: int | None = None
    max_long_sequence_query_rows: int | None = None
    min_query_rows: int = 1
    max_attention_work: int | None = None
    max_chunk_rows: int | None = None


# ---- streams and events of a device that runs work in issue order ------------------------------------------------


class InlineStream:
    """The stream of a device that runs work in issue order (the CPU, MPS as exposed): waits are already satisfied."""

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class InlineEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_INLINE_STREAM = InlineStream()


# ---- per-kind device operations (private: callers go through Platform) -------------------------------------------


def _glibc_malloc_trim():
    """glibc's `malloc_trim`, or None where the C library is another one (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _glibc_malloc_trim()


class _HostOps:
    """The CPU as the device: nothing to wait for, no device allocator to read."""

    def __init__(self, device: torch.device):
        self.device = device

    def trim_host_heap(self) -> None:
        # glibc keeps freed buffers below its (adaptive, up to 32 MiB) mmap threshold in the heap; a decoder whose
        # every conv call frees a weight reorder and mid-size activations fragments it, so the process's resident
        # memory grows several times past what is alive (the audio decoder: 58 MiB alive, 150-320 MiB resident).
        # Trimming between blocks returns the free pages; releasing everything as freed (a fixed low mmap
        # threshold) costs a page fault per buffer instead (several times slower in an exploratory run).
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def allocated_bytes(self) -> int | None:
        return None

    def driver_bytes(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        pass

    def peak_allocated_bytes(self) -> int | None:
        return None

    def new_stream(self):
        return InlineStream()

    def current_stream(self):
        return _INLINE_STREAM

    def on_stream(self, stream):
        return contextlib.nullcontext()

    def new_event(self):
        return InlineEvent()

    def host_pinner(self):
        return None

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def name(self) -> str:
        return self.device.type


class _MpsOps(_HostOps):
    def trim_host_heap(self) -> None:
        pass  # the work's temporaries are in the device allocator

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def allocated_bytes(self) -> int | None:
        return int(torch.mps.current_allocated_memory())

    def driver_bytes(self) -> int | None:
        return int(torch.mps.driver_allocated_memory())


class _CudaOps(_HostOps):
    def trim_host_heap(self) -> None:
        pass  # the work's temporaries are in the device allocator

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def allocated_bytes(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.device))

    def driver_bytes(self) -> int | None:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def on_stream(self, stream):
        return torch.cuda.stream(stream)

    def new_event(self):
        return torch.cuda.Event()

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def host_pinner(self):
        from .host_store import CudaHostPinner

        return CudaHostPinner()


@dataclass(frozen=True)
class _Facts:
    ops: type
    chunking: ChunkingBackend
    unified_memory: bool = False
    asynchronous_copies: bool = False
    default_reclaim_every: int = 0  # releases between synchronize + empty_cache; 0 = never
    decode_autocast: torch.dtype | None = None  # the video decoder's default autocast dtype
    has_index: bool = True  # devices are told apart by an index (cuda:0, cuda:1)
    # Dtypes a tensor on the device cannot have (MPS has no float64 and no float8 storage: creating or casting
    # one raises), so quantised payloads stored in them are decoded on the host (`Platform.holds`).
    missing_dtypes: frozenset = frozenset()


_FACTS = {
    # ATen's CPU flash attention tiles queries by 256 rows from 768 query rows up, by 64 (or 32) below, and streams
    # all of K and V once per tile: 256-row calls at 12,432 keys were 14 % slower than 768-row calls (same work).
    # One fused attention call over 220k rows (1920x1088, 15 s) took 5 minutes on 2 cores, uninterruptible; at
    # about 16e9 multiplied products a second there, 2**32 of them is a quarter-second call. A block's row passes
    # (norms, modulation, projections, MLP) took about 9 us a row at the tiny model's widths: 32,768 rows, 0.3 s.
    "cpu": _Facts(_HostOps, ChunkingBackend("cpu", min_query_rows=768, max_attention_work=2**32,
                                            max_chunk_rows=32_768), has_index=False),
    # The reference decodes under fp16 autocast on CUDA only (sglang `autocast_enabled_for_device`).
    "cuda": _Facts(_CudaOps, ChunkingBackend("cuda"), asynchronous_copies=True, decode_autocast=torch.float16),
    "mps": _Facts(_MpsOps, ChunkingBackend("mps", materializes_scores=True, max_buffer_bytes=4 * GiB,
                                           long_sequence_rows=12_288, max_long_sequence_query_rows=2048),
                  unified_memory=True, default_reclaim_every=1,
                  missing_dtypes=frozenset({torch.float64, torch.float8_e4m3fn, torch.float8_e5m2})),
}


SUPPORTED_DEVICE_TYPES = tuple(_FACTS)


class PlatformError(H3Error):
    """A setting asks for something the platform cannot do (e.g. fp16 decode autocast off CUDA)."""


@dataclass(frozen=True)
class Platform:
    """One device kind (`device_type`: "cuda", "mps" or "cpu") and its index. Other kinds are refused
    (`PlatformError`): their chunk caps, copy and reclaim rules are unknown, and the CPU's could be silently wrong.

    Two platforms are equal when their kinds are: the rules and caps are per kind.
    """

    device_type: str
    index: int | None = field(default=None, compare=False)
    # Tests only (tests/fake_cuda.py): the device operations of a simulated device of this kind. Its `device` is
    # where its tensors live (the CPU); every fact stays the kind's own.
    ops: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.device_type not in _FACTS:
            raise PlatformError(
                f"device {self.device_type!r} is not supported: h3_core runs on {', '.join(SUPPORTED_DEVICE_TYPES)} "
                f"(it has no chunk limits, copy or reclaim rules for {self.device_type!r}). Choose one of those.")

    @classmethod
    def for_device(cls, device: torch.device | str) -> "Platform":
        device = torch.device(device)
        return cls(device.type, device.index)

    @classmethod
    def detect(cls) -> "Platform":
        """The best accelerator of this machine."""
        if torch.cuda.is_available():
            return cls("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return cls("mps")
        return cls("cpu")

    # ---- facts ----------------------------------------------------------------------------------------------

    @property
    def _facts(self) -> _Facts:
        return _FACTS[self.device_type]

    @classmethod
    def simulated(cls, device_type: str, ops) -> "Platform":
        """A platform of kind `device_type` whose device operations are `ops` (a test's fake device)."""
        return cls(device_type, None, ops)

    @property
    def device(self) -> torch.device:
        """The torch device; a CUDA device without an index is the current one (so slots and streams agree)."""
        if self.ops is not None:
            return self.ops.device
        if self.index is None and self.device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type, self.index) if self.index is not None else torch.device(self.device_type)

    @property
    def host_is_device(self) -> bool:
        """The CPU computes: device memory is the process's own (its RSS), with no allocator to ask."""
        return self._facts.ops is _HostOps and self.ops is None

    def name(self) -> str:
        """The device as a person would name it (the GPU model on CUDA)."""
        return self._ops.name()

    @property
    def unified_memory(self) -> bool:
        """Host and device share one memory: a resident copy of mapped weights is a second copy (Apple MPS)."""
        return self._facts.unified_memory

    @property
    def default_residency(self) -> str:
        """What residency "auto" means here: layerwise where memory is unified (admission requires it)."""
        return settings.LAYERWISE if self.unified_memory else settings.RESIDENT

    @property
    def asynchronous_copies(self) -> bool:
        """Host-to-device copies can run on their own stream from page-locked memory (CUDA)."""
        return self._facts.asynchronous_copies

    @property
    def default_prefetch(self) -> int:
        return 1 if self.asynchronous_copies else 0

    @property
    def default_reclaim_every(self) -> int:
        return self._facts.default_reclaim_every

    @property
    def chunking(self) -> ChunkingBackend:
        return self._facts.chunking

    def holds(self, dtype: torch.dtype) -> bool:
        """Whether a tensor on this device can have `dtype` (a stored payload's dtype, e.g. fp8 on MPS: no)."""
        return dtype not in self._facts.missing_dtypes

    def decode_autocast_dtype(self, enabled: bool | None = None) -> torch.dtype | None:
        """The video decoder's autocast dtype: None (no autocast) or fp16 where the reference uses it (CUDA).

        `enabled=None` takes the platform's default; True where the recipe does not exist raises `PlatformError`.
        """
        recipe = self._facts.decode_autocast
        if enabled is None:
            return recipe
        if enabled and recipe is None:
            raise PlatformError(f"decode_autocast=True on {self.device_type}: fp16 autocast is a CUDA-only recipe (the "
                                "reference disables it on MPS and CPU). Leave decode_autocast unset.")
        return recipe if enabled else None

    def device_key(self, device: torch.device | str) -> str:
        """A name telling devices apart for "one device" rules: `mps:0`, `cuda:1`, `cpu`."""
        device = torch.device(device)
        if not _FACTS.get(device.type, _FACTS["cpu"]).has_index:
            return device.type
        return f"{device.type}:{device.index or 0}"

    def is_kind_of(self, device: torch.device | str) -> bool:
        """`device` is of this platform's kind."""
        return torch.device(device).type == self.device_type

    # ---- device operations ----------------------------------------------------------------------------------

    @property
    def _ops(self):
        return self.ops if self.ops is not None else self._facts.ops(self.device)

    def synchronize(self) -> None:
        self._ops.synchronize()

    def empty_cache(self) -> None:
        self._ops.empty_cache()

    def trim_host_heap(self) -> None:
        """Return the C heap's freed pages to the system where the device computes in it (the CPU, glibc)."""
        self._ops.trim_host_heap()

    def reclaim(self) -> None:
        """Give cached device memory back: synchronise, then empty the cache (MPS frees are deferred until the
        queued command buffers complete, so emptying the cache first returns little)."""
        self.reclaim_action()()

    def reclaim_action(self, empty_cache: Callable[[], None] | None = None) -> Callable[[], None]:
        """`reclaim` as a function of no arguments, with another `empty_cache` (a host application's own, e.g.
        ComfyUI's soft_empty_cache) called after the synchronisation."""
        empty = self.empty_cache if empty_cache is None else empty_cache

        def reclaim() -> None:
            self.synchronize()
            empty()

        return reclaim

    def allocated_bytes(self) -> int | None:
        """Bytes the device allocator holds for tensors now; None where there is no device allocator."""
        return self._ops.allocated_bytes()

    def driver_bytes(self) -> int | None:
        """Bytes the driver holds for this process (cached blocks included) where it reports it."""
        return self._ops.driver_bytes()

    def reset_peak(self) -> None:
        self._ops.reset_peak()

    def peak_allocated_bytes(self) -> int | None:
        """Peak tensor bytes since `reset_peak` where the allocator tracks it."""
        return self._ops.peak_allocated_bytes()

    def new_stream(self):
        return self._ops.new_stream()

    def current_stream(self):
        return self._ops.current_stream()

    def on_stream(self, stream):
        return self._ops.on_stream(stream)

    def new_event(self):
        return self._ops.new_event()

    def host_pinner(self):
        """Page-locks host memory for asynchronous copies; None where copies are synchronous anyway."""
        return self._ops.host_pinner()

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """`dst.copy_(src)` from host memory into a device buffer, on the current stream: the one operation every
        host-to-device copy of the offload backends goes through (a simulated device sees each)."""
        self._ops.copy_to_device(dst, src, non_blocking)

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised device buffer of `nbytes` bytes (uint8), from the device's allocator."""
        return self._ops.empty(nbytes)

    def device_copy(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A copy of the contiguous host tensor `src` in a fresh device buffer, made by `copy_to_device` on the
        current stream: with `non_blocking`, from page-locked memory, queued behind the stream's work without the
        host waiting (the source must then stay unchanged until the stream has run the copy)."""
        dst = self.empty(src.numel() * src.element_size()).view(src.dtype).view(src.shape)
        self.copy_to_device(dst, src, non_blocking)
        return dst


def peak_rss_bytes() -> int | None:
    """Peak resident set of this process since it started: Linux VmHWM, else getrusage (macOS reports ru_maxrss in
    bytes), else Windows' PeakWorkingSetSize (psapi); None where none of them exists."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        pass
    return _windows_peak_working_set()


def _windows_peak_working_set() -> int | None:
    try:
        import ctypes
        from ctypes import wintypes
    except (ImportError, ValueError):
        return None
    if not hasattr(ctypes, "WinDLL"):
        return None

    class Counters(ctypes.Structure):  # PROCESS_MEMORY_COUNTERS
        _fields_ = [("cb", wintypes.DWORD), ("PageFaultCount", wintypes.DWORD)] + [
            (name, ctypes.c_size_t) for name in (
                "PeakWorkingSetSize", "WorkingSetSize", "QuotaPeakPagedPoolUsage", "QuotaPagedPoolUsage",
                "QuotaPeakNonPagedPoolUsage", "QuotaNonPagedPoolUsage", "PagefileUsage", "PeakPagefileUsage")]

    try:
        counters = Counters(cb=ctypes.sizeof(Counters))
        kernel32 = ctypes.WinDLL("kernel32")
        kernel32.GetCurrentProcess.restype = wintypes.HANDLE
        get = ctypes.WinDLL("psapi").GetProcessMemoryInfo
        get.argtypes = [wintypes.HANDLE, ctypes.POINTER(Counters), wintypes.DWORD]
        if get(kernel32.GetCurrentProcess(), ctypes.byref(counters), counters.cb):
            return counters.PeakWorkingSetSize
    except (OSError, AttributeError):
        pass
    return None


def device_problem(device) -> str | None:
    """Why `device` (a string such as "cuda:1" or a torch.device) cannot run h3_core on this machine, in a few words
    the caller puts after the name of its own setting; None when it can. Checked before any work starts, so that a
    missing GPU is one message instead of a traceback from the first tensor moved there."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return "not a device; use cpu, cuda, cuda:N or mps"
    kind = device.type
    if kind not in _FACTS:
        return f"h3-stream runs on cpu, cuda, cuda:N or mps, not on {kind!r} devices"
    if kind == "cuda":
        if not torch.backends.cuda.is_built():
            return "this PyTorch build has no CUDA support (install a CUDA build of torch, or run on the CPU)"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return "PyTorch has CUDA support but finds no usable GPU (driver, CUDA_VISIBLE_DEVICES?)"
        if device.index is not None and device.index >= count:
            return f"there is no GPU {device.index}: this machine has {count} (cuda:0 to cuda:{count - 1})"
    elif kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return "Apple MPS is not available here (it needs an Apple-silicon Mac and a torch built with MPS)"
    elif device.index not in (None, 0):
        return f"the CPU is one device (cpu or cpu:0), not cpu:{device.index}"
    return None
