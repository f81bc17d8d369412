"""The pack's memory telemetry: the figures (read through h3_core's `Platform`: CUDA keeps a true peak of allocated
bytes, Apple MPS only reports what its driver holds now, the CPU has no device allocator; the process peak RSS), the
report each node sends after it ran (the web extension's badge, and the log for headless runs) and its wording. No
device or OS test lives in the nodes."""

from __future__ import annotations

import contextlib

import torch

from h3_core.runtime.platform import Platform, peak_rss_bytes

from . import comfy_runtime

GIB = 1 << 30


class DevicePeak:
    """Device memory over one node's run, read with `bytes()`. The process-wide peak counter is never reset (other
    nodes and ComfyUI read it too): when it rose during the run, that is the run's peak; otherwise the run stayed
    under an earlier peak and the larger of the allocations at its start and end is reported (a lower bound)."""

    def __init__(self, device: torch.device | str):
        self.ops = Platform.for_device(device)
        self.start_peak, self.start_allocated = self.ops.peak_allocated_bytes(), self.ops.allocated_bytes()

    def bytes(self) -> int | None:
        peak = self.ops.peak_allocated_bytes()
        if peak is None:
            return self.ops.driver_bytes()
        if self.start_peak is None or peak > self.start_peak:
            return peak
        return max(self.start_allocated or 0, self.ops.allocated_bytes() or 0)


def host_peak_bytes() -> int | None:
    """Peak resident set of this process since it started."""
    return peak_rss_bytes()


def gib(value) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f} GiB"


@contextlib.contextmanager
def memory_report(node_id, handle, phase: str, *, blocks_of: str | None = None):
    """Measure the device peak over the body and send the report when it finishes. `blocks_of` names a component
    whose block placement (resident / total blocks) the report adds, read from the pipeline once the body ran. The
    body gets a dict: what it puts there (e.g. `step_cache_report`) goes into the same report, so the badge and the
    progress text stay one message."""
    pipeline = handle.pipeline
    device_peak = DevicePeak(pipeline.device)
    extra = {}
    yield extra
    report = dict(phase=phase, device=str(pipeline.device), peak_device_bytes=device_peak.bytes(),
                  peak_host_bytes=host_peak_bytes())
    placement = pipeline.residency_summary(blocks_of) if blocks_of else None
    if placement is not None:
        report["resident_blocks"], report["total_blocks"] = placement.resident_blocks, placement.total_blocks
        if placement.lora_files:
            report.update(lora_files=placement.lora_files, lora_bytes_moved=placement.lora_bytes_moved,
                          lora_fold_peak_bytes=placement.lora_fold_peak_bytes)
    report.update(extra)
    comfy_runtime.send_memory_report(node_id, report, summary(report))


@contextlib.contextmanager
def phase(node_id, handle, name: str, phases, plan, *, blocks_of: str | None = None):
    """One node's run of pipeline phases (`phases`, names of the request's memory `plan`): room made in ComfyUI's
    model management for what they allocate, a cancel seen before they start, the memory report sent when they end
    (the body's dict adds to it: see `memory_report`), the loaded components' sizes in ComfyUI's model management
    measured again, the device cache emptied after."""
    pipeline = handle.pipeline
    comfy_runtime.free_memory_for(handle, phases, plan)
    try:
        with memory_report(node_id, handle, name, blocks_of=blocks_of) as extra:
            comfy_runtime.check_interrupt()
            yield extra
    finally:
        comfy_runtime.refresh_registered(pipeline)
    comfy_runtime.soft_empty_cache()


def summary(report: dict) -> str:
    """One line for the node's progress text (the one place the frontend shows a node's figures, in every renderer),
    in plain words: a figure the device cannot give (a CPU has no device allocator) is left out, not shown as n/a."""
    parts = []
    if report["peak_device_bytes"] is not None:
        parts.append(f"peak GPU memory {gib(report['peak_device_bytes'])}")
    if report["peak_host_bytes"] is not None:
        parts.append(f"peak RAM {gib(report['peak_host_bytes'])}")
    if "total_blocks" in report:
        kept, total = report["resident_blocks"], report["total_blocks"]
        parts.append(f"all {total} blocks kept loaded" if kept == total else
                     f"{kept} of {total} blocks kept loaded, the rest streamed")
    if report.get("lora_files"):
        count = report["lora_files"]
        changed = report["lora_bytes_moved"] / 2**20
        parts.append(f"{count} LoRA{'s' if count > 1 else ''} applied"
                     + (f" ({changed:.1f} MiB of weights changed)" if changed >= 0.05 else ""))
    if report.get("step_cache"):
        parts.append(report["step_cache"])
    text = f"{report['phase']}: " + ", ".join(parts)
    # The audio health warnings come first: the frontend shows the progress text's first line (the memory figures
    # stay in the badge).
    return "\n".join([*report.get("audio_warnings", ()), text])


def audio_health_report(warnings) -> dict:
    """The report's field for the audio health check's warnings (`AudioFinding`s): one line each, put before the
    memory figures in the progress text (none: no field)."""
    from h3_core.request.audio_health import warning_line

    return {"audio_warnings": [warning_line(finding) for finding in warnings]} if warnings else {}


def step_cache_report(stats) -> dict:
    """The report's fields for what the step cache did in a run (`StepCacheStats`): its summary for the progress
    text, the hits and calls for the badge."""
    return dict(step_cache=stats.summary(), step_cache_hits=stats.hits, step_cache_calls=len(stats.decisions))


def step_cache_line(stats, total_calls: int) -> str:
    """The progress text after one transformer call with the step cache on: that call's outcome and the run so
    far (the summary replaces it when the phase's report comes)."""
    call = len(stats.decisions)
    outcome = "cached" if stats.decisions[-1] else "computed"
    text = (f"step {call}/{total_calls}: {outcome} ({stats.hits} of {call} cached so far), "
            f"{stats.blocks_run[-1]} of {stats.num_blocks} blocks run")
    read = stats.bytes_read[-1] if stats.bytes_read else 0
    if read:  # only a streamed transformer reads weights during a call
        # MiB under a GiB: one block of a small model reads well under 0.01 GiB, which would print as nothing.
        text += f", {gib(read) if read >= GIB else f'{read / 2**20:.1f} MiB'} read"
    return text
