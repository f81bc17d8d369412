"""H3StreamSampler: the denoising loop, video and audio together, from the text encoder's states to latents."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .request_inputs import canvas_error, canvas_inputs, frame_count_error, sampler_inputs, shift_error
from .sockets import H3Cond, H3Latent, H3Model
from .telemetry import memory_report


class H3StreamSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamSampler",
            display_name="H3 Sampler (video + audio)",
            category="H3 Stream",
            description="Denoises video and stereo audio latents together with H3's flow-matching Euler sampler. "
                        "Cancel stops within one transformer block.",
            inputs=[
                H3Model.Input("h3_model"),
                H3Cond.Input("h3_cond"),
                *canvas_inputs(),
                *sampler_inputs(),
            ],
            outputs=[H3Latent.Output(display_name="h3_latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, frames) -> bool | str:
        # ComfyUI reports a failed check here under every input this takes, and skips its own range checks for them:
        # only the frame grid (no widget limit can say it) is checked here, so a mistake is one error, on its input.
        # The canvas is H3 Text Encode's to validate (both nodes take it); this node checks it again when it runs.
        return frame_count_error(None, frames) or True

    @classmethod
    def execute(cls, h3_model, h3_cond, width, height, seconds, frames, steps, seed, video_shift, audio_shift,
                chunk_size) -> io.NodeOutput:
        from h3_core.errors import H3Error
        from h3_core.request.grid import LatentShape, frames_for_seconds
        from h3_core.runtime.chunking import EveryNChunks
        from h3_core.runtime.platform import Platform

        error = (canvas_error(width, height) or frame_count_error(seconds, frames)
                 or shift_error(video_shift=video_shift, audio_shift=audio_shift))
        if error:
            raise H3Error(error)
        if h3_cond.has_keyframes and (h3_cond.width, h3_cond.height) != (width, height):
            raise H3Error(f"the keyframes were fitted to {h3_cond.width}x{h3_cond.height} by H3 Text Encode but the "
                          f"sampler makes {width}x{height}; set the same width and height on both nodes.")
        num_frames = frames if frames > 0 else frames_for_seconds(seconds)
        has_references = bool(getattr(h3_cond.conditioning, "references", None))
        if has_references and h3_cond.reference_frames != num_frames:
            raise H3Error(f"the references were cut to {h3_cond.reference_frames} frames by H3 References but the "
                          f"sampler makes {num_frames}; set the same seconds / frames on both nodes.")
        shape = LatentShape.for_request(width, height, num_frames)
        pipeline, settings = h3_model.pipeline, h3_model.settings
        sources = pipeline.sources
        needed = {"transformer": sources.transformer}
        if h3_cond.has_keyframes or has_references:
            needed["video_vae"] = sources.video_vae
        if has_references:
            needed["audio_vae"] = sources.audio_vae
        comfy_runtime.free_memory_for(needed, settings, pipeline.device)
        unique_id = cls.hidden.unique_id
        memory_budget = None
        if settings.profile_budget_bytes is not None and chunk_size == 0:
            memory_budget = request_chunk_budget(h3_model, shape, keyframes=h3_cond.has_keyframes, steps=steps,
                                                 node_id=unique_id)
        # Synchronised first: MPS frees are deferred until the queued work completes.
        reclaim = (EveryNChunks(settings.mps_reclaim_every,
                                Platform.for_device(pipeline.device).reclaim_action(comfy_runtime.soft_empty_cache))
                   if settings.mps_reclaim_every > 0 else None)
        with memory_report(unique_id, h3_model, "sampling", blocks_of="transformer"):
            comfy_runtime.check_interrupt()
            bar = comfy_runtime.progress_bar(max(1, steps - 1), node_id=unique_id)
            latents = pipeline.sample(h3_cond.conditioning, shape, steps=steps, seed=seed, video_shift=video_shift,
                                      audio_shift=audio_shift,
                                      progress=lambda step, total: bar.update_absolute(step, total),
                                      check_interrupt=comfy_runtime.check_interrupt,
                                      chunk_size=chunk_size if chunk_size > 0 else None,
                                      memory_budget=memory_budget, between_chunks=reclaim,
                                      loras=h3_model.loras)
        comfy_runtime.soft_empty_cache()
        return io.NodeOutput(latents)


def request_chunk_budget(h3_model, shape, *, keyframes: bool, steps: int, node_id) -> int | None:
    """The loader's memory profile, planned for this request before the transformer loads: the bytes one row
    chunk's temporaries may take (None: fused), or one error in this node's words when the request does not fit."""
    from h3_core.errors import H3Error
    from h3_core.planning.memory_plan import MemoryBudgetError
    from h3_core.planning.memory_profiles import request_plan

    settings, pipeline = h3_model.settings, h3_model.pipeline
    resident = tuple(name for name, _ in settings.residency if settings.keeps(name))
    try:
        plan = request_plan(pipeline.sources, budget_bytes=settings.profile_budget_bytes, device=settings.device,
                            residencies=settings.core_residencies(), width=shape.width, height=shape.height,
                            num_frames=shape.num_frames, keyframes=keyframes, steps=steps,
                            dtype=settings.torch_dtype, loras=h3_model.loras, keep=resident)
    except MemoryBudgetError as error:
        why = error.args[0].splitlines()[0].rstrip(".")
        raise H3Error(f"width {shape.width}, height {shape.height}, {shape.num_frames} frames do not fit the "
                      f"loader's memory_profile {settings.profile!r}: {why}. Set a smaller width / height / seconds, "
                      "or a larger memory_profile on the loader.") from None
    chunks = ("fused" if plan.dit_chunk_budget is None else
              f"row chunks of {plan.dit_chunk_budget / 2**20:.0f} MiB temporaries")
    comfy_runtime.send_progress_text(node_id, f"memory_profile {settings.profile}: this request needs about "
                                              f"{plan.peak_bytes / 2**30:.2f} GiB at its peak "
                                              f"({plan.peak_phase.name}); transformer {chunks}.")
    return plan.dit_chunk_budget
