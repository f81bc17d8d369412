"""The memory report each node sends after it ran (the web extension's badge, and the log for headless runs)."""

from __future__ import annotations

import contextlib

from . import comfy_runtime
from .memory_probe import DevicePeak, block_counts, host_peak_bytes

GIB = 1 << 30


@contextlib.contextmanager
def memory_report(node_id, handle, phase: str):
    """Measure the device peak over the body and send the report when it finishes. `report["transformer"]` may be
    set by the body to add the transformer's block counts."""
    device_peak = DevicePeak(handle.pipeline.device)
    report: dict = {"phase": phase}
    yield report
    transformer = report.pop("transformer", None)
    report.update(device=str(handle.pipeline.device), peak_device_bytes=device_peak.bytes(),
                  peak_host_bytes=host_peak_bytes())
    if transformer is not None:
        report["resident_blocks"], report["total_blocks"] = block_counts(transformer)
    comfy_runtime.send_memory_report(node_id, report, summary(report))


def _gib(value) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f} GiB"


def summary(report: dict) -> str:
    """One line for the node's progress text: shown under the node by every frontend renderer."""
    parts = [f"device peak {_gib(report['peak_device_bytes'])}", f"host peak {_gib(report['peak_host_bytes'])}"]
    if "total_blocks" in report:
        parts.append(f"{report['resident_blocks']}/{report['total_blocks']} blocks resident")
    return f"{report['phase']}: " + ", ".join(parts)
