"""Memory figures for the badge and the report, read through h3_core's platform object (`Platform`: CUDA keeps a
true peak of allocated bytes, Apple MPS only reports what its driver holds now, the CPU has no device allocator) and
its process peak RSS, so no device or OS test lives in the nodes."""

from __future__ import annotations

import torch

from h3_core.runtime.platform import Platform, peak_rss_bytes


class DevicePeak:
    """Device memory over one node's run: started (peak counter reset) when created, read with `bytes()`."""

    def __init__(self, device: torch.device | str):
        self.ops = Platform.for_device(device)
        self.ops.reset_peak()

    def bytes(self) -> int | None:
        peak = self.ops.peak_allocated_bytes()
        return peak if peak is not None else self.ops.driver_bytes()


def host_peak_bytes() -> int | None:
    """Peak resident set of this process since it started."""
    return peak_rss_bytes()


def block_counts(transformer) -> tuple[int, int]:
    """(blocks kept on the device, all blocks) of a loaded transformer."""
    stats = transformer.block_residency.stats()
    return len(stats.resident_blocks), len(transformer.blocks)
