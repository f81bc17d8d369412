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
