"""Peak memory figures for the memory badge, read the way each device and OS reports them.

The platform differences live here and nowhere else in the pack: CUDA tracks a true peak of allocated bytes, Apple MPS
only reports what its driver holds now, the CPU has no device allocator; host RSS is in KiB on Linux and in bytes on
macOS.
"""

from __future__ import annotations

import sys

import torch


class DeviceMemoryProbe:
    """The CPU as the device: no separate device memory to report."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sampled_peak: int | None = None

    @staticmethod
    def for_device(device: torch.device) -> "DeviceMemoryProbe":
        probe = {"cuda": CudaMemoryProbe, "mps": MpsMemoryProbe}.get(torch.device(device).type, DeviceMemoryProbe)
        return probe(torch.device(device))

    def reset(self) -> None:
        self.sampled_peak = None

    def sample(self) -> None:
        """Record the current figure (for devices without a peak counter)."""

    def peak_bytes(self) -> int | None:
        return self.sampled_peak


class CudaMemoryProbe(DeviceMemoryProbe):
    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))


class MpsMemoryProbe(DeviceMemoryProbe):
    def sample(self) -> None:
        now = int(torch.mps.driver_allocated_memory())
        self.sampled_peak = now if self.sampled_peak is None else max(self.sampled_peak, now)

    def peak_bytes(self) -> int | None:
        self.sample()
        return self.sampled_peak


def host_peak_bytes() -> int | None:
    """Peak resident set of this process since it started (the OS keeps no resettable counter everywhere)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def block_counts(transformer) -> tuple[int, int]:
    """(blocks kept on the device, all blocks) of a loaded transformer. Without a residency manager every block is
    resident."""
    total = len(transformer.blocks)
    residency = getattr(transformer, "block_residency", None)
    stats = residency.stats() if residency is not None and hasattr(residency, "stats") else None
    if stats is None:
        return total, total
    return len(stats.resident_blocks), total
