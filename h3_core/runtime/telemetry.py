"""What a residency reports about its passes: bytes moved, waits, peaks, loads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PassStats:
    """Telemetry of one pass (begin_pass .. end_pass) or of the pass in progress.

    `peak_device_bytes`: CUDA max allocated; MPS the largest sampled current allocation; for the CPU as the device,
    the bytes of weights bound to (or loaded for) device parameters. `peak_held_bytes` is the latter everywhere.
    `wait_s` is host time spent in acquire(): the copies themselves on the synchronous backend, launch overhead
    only on CUDA (there the wait is a device-side event wait).

    No pass resets a process-wide counter: `peak_device_bytes` is the largest allocation sampled at the pass's block
    boundaries (plus, on CUDA, the process peak when it rose during the pass). Reads, for stores that read from
    files: `bytes_read` (explicit reads), `read_s` (reader time), `read_wait_s` (time the pass waited for reads),
    `disk_read_bytes` (what the process read from storage during the pass, /proc/self/io; None where unknown).
    """

    peak_device_bytes: int = 0
    peak_driver_bytes: int | None = None
    peak_held_bytes: int = 0
    host_store_bytes: int = 0
    bytes_h2d: int = 0
    wait_s: float = 0.0
    loads: int = 0
    unprefetched_loads: int = 0  # acquire() found its block not loaded (first block, out-of-order traversal)
    peak_streamed_blocks: int = 0
    aborted: bool = False  # the pass ended with a block still acquired (an exception inside a block)
    bytes_read: int = 0
    read_s: float = 0.0
    read_wait_s: float = 0.0
    disk_read_bytes: int | None = None
    seconds: float = 0.0  # wall time from begin_pass to end_pass

    @property
    def read_gb_per_s(self) -> float | None:
        """Explicit-read throughput of the pass's reader, in GB/s (1e9 bytes)."""
        return self.bytes_read / self.read_s / 1e9 if self.read_s > 0 else None


@dataclass
class ResidencyStats:
    residency: str  # a `Residency` (a str enum; residency.py imports this module, not the other way)
    passes: int
    last_pass: PassStats | None
    current: PassStats
    total_bytes_h2d: int
    host_store_bytes: int
    pinned_bytes: int
    resident_blocks: frozenset[int]
    streamed_blocks: tuple[int, ...]
    slots: int
    store: str = ""
    extra: dict = field(default_factory=dict)
