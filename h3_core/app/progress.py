"""What the CLI shows while it works: a progress bar per sampling step, a download bar, the closing memory report."""

from __future__ import annotations

import sys
import time

import torch

from ..runtime.platform import Platform, peak_rss_bytes


class ProgressBar:
    def __init__(self, label: str, stream=None):
        self.label, self.stream, self.started = label, stream or sys.stderr, time.perf_counter()
        self.line_open = False  # the bar's line is not finished yet: anything printed next needs a newline first
        self.note = ""  # appended to the line (e.g. the step cache's hits so far)

    def __call__(self, done: int, total: int) -> None:
        if done == 0:  # sampling starts: time from here, not from the model loading before it
            self.started = time.perf_counter()
        width = 30
        filled = int(width * done / max(total, 1))
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (total - done) if done else 0.0
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                          f"{elapsed:.1f}s elapsed, ~{eta:.1f}s left{self.note}")
        self.line_open = done < total
        if not self.line_open:
            self.stream.write("\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (an error or an interrupt message then starts on a line of its own)."""
        if self.line_open:
            self.stream.write("\n")
            self.stream.flush()
            self.line_open = False


class DownloadBar:
    """A Hugging Face download's bar on stderr: `(done_bytes, total_bytes)`."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr

    def __call__(self, done: int, total: int) -> None:
        filled = int(30 * done / max(total, 1))
        self.stream.write(f"\rdownloading [{'#' * filled}{'.' * (30 - filled)}] {done / 2**20:.1f}/"
                          f"{total / 2**20:.1f} MiB" + ("\n" if done >= total else ""))
        self.stream.flush()


def memory_report(device: torch.device) -> str:
    lines = []
    rss = peak_rss_bytes()
    if rss is not None:
        lines.append(f"peak host memory (RSS): {rss / 2**30:.2f} GiB")
    platform = Platform.for_device(device)  # the per-device allocator queries live in the platform object
    peak, driver = platform.peak_allocated_bytes(), platform.driver_bytes()
    if peak is not None:
        lines.append(f"peak device memory: {peak / 2**30:.2f} GiB")
    elif driver is not None:
        lines.append(f"device memory now: {driver / 2**30:.2f} GiB (driver)")
    return "\n".join(lines)
