"""The large-request preflight: what a request costs (memory from the checkpoint headers, transformer work), and the
thresholds past which the CLI asks for --yes-large."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoints.dit_loader import resolve_dit_checkpoint
from ..request.grid import LatentShape
from .memory_plan import format_bytes
from .phase_plans import guide_rows_estimate, packed_rows_estimate, plan_for_budget, reference_rows_estimate

# Large-request thresholds: past any of them the CLI prints the estimate and runs only with --yes-large.
LARGE_CANVAS_PIXELS = 1920 * 1088  # 1080p on the 32-pixel grid; the released model works at 1344x768


LARGE_STEPS = 200  # the sampler widget's maximum; the released model uses 50


# The throughput the time estimate assumes: a fast GPU sustaining 100 TFLOP/s in bf16.
ASSUMED_FLOPS = 100e12


@dataclass(frozen=True)
class RequestEstimate:
    """What a request costs, estimated from the checkpoint headers before anything loads."""

    peak_bytes: int  # the largest phase's memory (`plan_for_budget` with an unlimited budget)
    peak_phase: str
    shared_memory: bool  # the peak is host and device together (CPU, MPS), not device memory alone
    transformer_flops: float  # every model call's matmuls and attention, the rest of the pipeline left out
    model_calls: int

    @property
    def seconds_at_assumed_flops(self) -> float:
        return self.transformer_flops / ASSUMED_FLOPS


def estimate_request(sources, *, device, width: int, height: int, num_frames: int, steps: int, dtype=None,
                     chunk_size=None, loras=(), keep=(), keyframes: bool = False,
                     residency: str | None = None, references=None, step_cache: bool = False,
                     guides=()) -> RequestEstimate:
    """Memory from the planner's estimates (`planning.plan_for_budget`, weights exact from the headers, activations
    counted per phase) and transformer work from its parameter count and the packed rows: 2 x parameters x rows per
    call for the matmuls plus 4 x rows^2 x attention width per block for attention."""

    plan = plan_for_budget(sources, device=device, budget_bytes=1 << 62, width=width, height=height,
                           num_frames=num_frames, dtype=dtype, chunk_size=chunk_size, loras=loras, keep=keep,
                           keyframes=keyframes, steps=steps, residency=residency, references=references,
                           step_cache=step_cache, guides=guides)
    ckpt = resolve_dit_checkpoint(sources.transformer)
    c = ckpt.config
    shape = LatentShape.for_request(width, height, num_frames)
    rows = packed_rows_estimate(shape, (reference_rows_estimate(references) if references else 0)
                                + guide_rows_estimate(guides, shape))
    params = sum(ckpt.numel(spec) for spec in ckpt.specs)
    calls = steps - 1
    flops = calls * (2.0 * params * rows + 4.0 * rows * rows * c.inner_dim * c.num_layers)
    peak = plan.peak_phase
    return RequestEstimate(plan.peak_bytes, peak.name if peak else "", plan.shared_memory, flops, calls)


def large_request_reasons(width: int, height: int, steps: int, estimate: RequestEstimate,
                          memory_bytes: int | None, *, size_name: str = "size", steps_name: str = "steps") -> list[str]:
    """Which large-request thresholds the request passes: canvas area, steps, and (where host and device share one
    memory and `memory_bytes`, the machine's, is known) an estimated peak beyond the machine's memory."""
    reasons = []
    if width * height > LARGE_CANVAS_PIXELS:
        reasons.append(f"{size_name} {width}x{height} is {width * height / 1e6:.1f} megapixels, past the "
                       f"{LARGE_CANVAS_PIXELS / 1e6:.1f}-megapixel (1920x1088) threshold")
    if steps > LARGE_STEPS:
        reasons.append(f"{steps_name} {steps} is past the {LARGE_STEPS}-step threshold")
    if estimate.shared_memory and memory_bytes and estimate.peak_bytes > memory_bytes:
        reasons.append(f"the estimated peak memory {format_bytes(estimate.peak_bytes)} is more than this machine's "
                       f"{format_bytes(memory_bytes)}")
    return reasons


def describe_estimate(estimate: RequestEstimate) -> str:
    where = "" if estimate.shared_memory else " of device memory"
    return (f"Estimated peak memory {format_bytes(estimate.peak_bytes)}{where} ({estimate.peak_phase} phase) and "
            f"{format_flops(estimate.transformer_flops)} of transformer work over {estimate.model_calls} model "
            f"calls, about {format_duration(estimate.seconds_at_assumed_flops)} at a sustained "
            f"{ASSUMED_FLOPS / 1e12:.0f} TFLOP/s (a fast GPU; a CPU is 100 to 1000 times slower). Both are rough "
            "estimates")


def format_flops(flops: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12)):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops / 1e9:,.1f} GFLOP"


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.0f} days"


def describe_windowed_estimate(sources, windows, *, device, width: int, height: int, steps: int, guides=(),
                               **options) -> str:
    """The preflight of a long video or an extension: every window is an ordinary request (planned and estimated
    on its own, memory included: the peak is the largest window's, whatever the number of windows), and the time is
    the sum over the windows, plus their decodes and the mp4 encode as they stream (left out of the figure: the
    estimate counts the transformer's work). `guides`: the overlap guide a guided window carries
    (`pipeline.long_video.planned_guides`)."""
    by_window: dict[tuple[int, bool], RequestEstimate] = {}
    for window in windows:
        key = (window.num_frames, bool(window.overlap))
        if key not in by_window:
            by_window[key] = estimate_request(sources, device=device, width=width, height=height,
                                              num_frames=window.num_frames, steps=steps,
                                              guides=guides if window.overlap else (), **options)
    estimates = [by_window[(window.num_frames, bool(window.overlap))] for window in windows]
    peak = max(estimates, key=lambda e: e.peak_bytes)
    flops = sum(e.transformer_flops for e in estimates)
    per_window = estimates[0].seconds_at_assumed_flops
    where = "" if peak.shared_memory else " of device memory"
    return (f"preflight: {len(windows)} window{'s' * (len(windows) > 1)}, each planned as its own request: peak "
            f"memory {format_bytes(peak.peak_bytes)}{where} ({peak.peak_phase} phase) whatever the length; "
            f"{format_flops(flops)} of transformer work in all, about {format_duration(flops / ASSUMED_FLOPS)} at a "
            f"sustained {ASSUMED_FLOPS / 1e12:.0f} TFLOP/s ({len(windows)} x about {format_duration(per_window)}; a "
            "CPU is 100 to 1000 times slower), plus each window's VAE decode and the mp4 encode as it streams")
