"""H3 Sampler: the denoising loop, video and audio together, from the text encoder's states to latents. The canvas
and the duration come with the conditioning (H3 Text Encode sets them); the legacy node still takes its own."""

from __future__ import annotations

from comfy_api.latest import io

from h3_core.step_cache_settings import STEP_CACHE_OFF

from . import comfy_runtime
from .request_inputs import (canvas_inputs, duration_inputs, frame_count_error, names_for, num_frames,
                             sampler_inputs)
from .sockets import H3Cond, H3Latent, H3Model
from .telemetry import phase, step_cache_line, step_cache_report

DESCRIPTION = ("Denoises video and stereo audio latents together with H3's flow-matching Euler sampler. Cancel "
               "stops within about a second on a CPU, at any size (between blocks and between the chunks of one).")


class H3StreamAVSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamAVSampler",
            display_name="H3 Sampler (video + audio)",
            category="H3 Stream/sampling",
            description=DESCRIPTION + " The canvas and duration are H3 Text Encode's.",
            search_aliases=["minimax h3", "h3 ksampler", "sampler"],
            inputs=[H3Model.Input("h3_model"), H3Cond.Input("h3_cond"), *sampler_inputs()],
            outputs=[H3Latent.Output(display_name="h3_latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, h3_model, h3_cond, steps, seed, video_shift, audio_shift, chunk_size,
                step_cache=STEP_CACHE_OFF) -> io.NodeOutput:
        request = h3_cond.request.replace(steps=steps, seed=seed, video_shift=video_shift, audio_shift=audio_shift,
                                          loras=h3_model.loras, step_cache=step_cache)
        return sample(cls.hidden.unique_id, h3_model, h3_cond, request, chunk_size)


class H3StreamSampler(io.ComfyNode):
    """The sampler as saved workflows have it: its own canvas and duration widgets (they must match what was
    encoded where keyframes or references need it)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamSampler",
            display_name="H3 Sampler (own canvas, legacy)",
            category="H3 Stream/sampling",
            description="Superseded by H3 Sampler (video + audio), which takes the canvas and duration from H3 Text "
                        "Encode; kept so that saved workflows still load and run. " + DESCRIPTION,
            inputs=[H3Model.Input("h3_model"), H3Cond.Input("h3_cond"), *canvas_inputs(), *duration_inputs(),
                    *sampler_inputs()],
            outputs=[H3Latent.Output(display_name="h3_latent")],
            hidden=[io.Hidden.unique_id],
            is_deprecated=True,  # hidden from the node search; saved workflows keep working
        )

    @classmethod
    def validate_inputs(cls, frames) -> bool | str:
        # ComfyUI reports a failed check under every input this takes: only the frame grid (no widget limit can say
        # it) is checked here, so a mistake is one error, on its input. The rest is the request's, when it runs.
        return frame_count_error(frames) or True

    @classmethod
    def execute(cls, h3_model, h3_cond, width, height, seconds, frames, steps, seed, video_shift, audio_shift,
                chunk_size, step_cache=STEP_CACHE_OFF) -> io.NodeOutput:
        request = h3_cond.request.replace(width=width, height=height, num_frames=num_frames(seconds, frames),
                                          steps=steps, seed=seed, video_shift=video_shift, audio_shift=audio_shift,
                                          loras=h3_model.loras, step_cache=step_cache, names=names_for(frames))
        return sample(cls.hidden.unique_id, h3_model, h3_cond, request, chunk_size)


def sample(node_id, h3_model, cond, request, chunk_size) -> io.NodeOutput:
    """Both samplers: make room, plan the request within the loader's memory profile, sample with progress."""
    pipeline, settings = h3_model.pipeline, h3_model.settings
    memory_budget = None
    if settings.profile_budget_bytes is not None and chunk_size == 0:
        memory_budget = request_chunk_budget(h3_model, cond, request, node_id=node_id)
    # What the phases allocate, planned as they run: the profile's row chunks, or the widget's chunk size.
    plan = pipeline.plan_request(request, cond, chunk_size=chunk_size if chunk_size > 0 else None,
                                 budget_bytes=settings.profile_budget_bytes if memory_budget is not None else None)
    calls = max(1, request.steps - 1)
    with phase(node_id, h3_model, "sampling", pipeline.sampling_phases(cond), plan,
               blocks_of="transformer") as report:
        bar = comfy_runtime.SamplerProgress(calls, node_id, pipeline.device)
        latents = pipeline.sample(cond, request, progress=bar.progress, preview=bar.preview,
                                  check_interrupt=comfy_runtime.check_interrupt,
                                  chunk_size=chunk_size if chunk_size > 0 else None, memory_budget=memory_budget,
                                  between_chunks=settings.reclaim_between_chunks(comfy_runtime.soft_empty_cache),
                                  step_report=lambda stats: comfy_runtime.send_progress_text(
                                      node_id, step_cache_line(stats, calls)))
        if latents.step_cache is not None:  # off: the report is today's
            report.update(step_cache_report(latents.step_cache))
    return io.NodeOutput(latents)


def request_chunk_budget(h3_model, cond, request, *, node_id) -> int | None:
    """The loader's memory profile, planned for this request before the transformer loads: the bytes one row
    chunk's temporaries may take (None: fused), or one error in the nodes' words when the request does not fit."""
    from h3_core.errors import H3Error
    from h3_core.planning.memory_profiles import request_plan
    from h3_core.planning.memory_plan import MemoryBudgetError

    settings, pipeline = h3_model.settings, h3_model.pipeline
    resident = tuple(name for name, _ in settings.residency if settings.keeps(name))
    try:
        plan = request_plan(pipeline.sources, budget_bytes=settings.profile_budget_bytes, device=settings.device,
                            residencies=settings.core_residencies(), width=request.width, height=request.height,
                            num_frames=request.num_frames, keyframes=bool(cond.keyframes), steps=request.steps,
                            dtype=settings.torch_dtype, loras=h3_model.loras, keep=resident,
                            references=cond.references, step_cache=request.step_cache is not None)
    except MemoryBudgetError as error:
        why = error.args[0].splitlines()[0].rstrip(".")
        n = request.names
        raise H3Error(f"{n.width} {request.width}, {n.height} {request.height}, {request.num_frames} frames do not "
                      f"fit the loader's memory_profile {settings.profile!r}: {why}. Set a smaller width / height / "
                      "seconds, or a larger memory_profile on the loader.") from None
    chunks = ("fused" if plan.dit_chunk_budget is None else
              f"row chunks of {plan.dit_chunk_budget / 2**20:.0f} MiB temporaries")
    comfy_runtime.send_progress_text(node_id, f"memory_profile {settings.profile}: this request needs about "
                                              f"{plan.peak_bytes / 2**30:.2f} GiB at its peak "
                                              f"({plan.peak_phase.name}); transformer {chunks}.")
    return plan.dit_chunk_budget
