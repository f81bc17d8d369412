"""H3StreamSampler: the denoising loop, video and audio together, from the text encoder's states to latents."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .node_report import memory_report
from .sampling_session import sampling_session
from .sockets import H3Cond, H3Latent, H3Model
from .text_encode import canvas_error, canvas_inputs

MAX_FRAMES = 17 * 64 + 5


def frame_count_error(seconds, frames) -> str | None:
    from h3_core.pipeline.layout import align_num_frames, is_aligned_num_frames

    if frames is not None and frames != 0:
        if not 5 <= frames <= MAX_FRAMES:
            return f"frames must be 0 (use seconds) or between 5 and {MAX_FRAMES}, got {frames}."
        if not is_aligned_num_frames(frames):
            return (f"frames must be on the 17n + 5 grid (5, 22, 39, ...), got {frames}; use "
                    f"{align_num_frames(frames)} or set frames to 0 and give seconds.")
    if seconds is not None and frames == 0 and not 0 < seconds <= MAX_FRAMES / 24:
        return f"seconds must be above 0 and at most {MAX_FRAMES / 24:.1f}, got {seconds}."
    return None


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
                io.Float.Input("seconds", default=5.0, min=0.0, max=round(MAX_FRAMES / 24, 2), step=0.1,
                               tooltip="Duration; the frame count is round(seconds x 24) snapped up to the 17n + 5 "
                                       "grid (5 s -> 124 frames)."),
                io.Int.Input("frames", default=0, min=0, max=MAX_FRAMES, step=1,
                             tooltip="Frame count at 24 fps on the 17n + 5 grid (5, 22, 39, ...); 0 uses seconds."),
                io.Int.Input("steps", default=30, min=2, max=200,
                             tooltip="Points of the sigma schedule, the final 0 included: steps - 1 transformer "
                                     "calls."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Initial noise (diffusers' recipe: the same seed gives other noise in core "
                                     "ComfyUI or sglang)."),
                io.Float.Input("video_shift", default=12.0, min=0.0, max=100.0, step=0.1,
                               tooltip="Sigma shift of the video schedule (12 for the released model)."),
                io.Float.Input("audio_shift", default=3.0, min=0.0, max=100.0, step=0.1,
                               tooltip="Sigma shift of the audio schedule (3 for the released model)."),
                io.Int.Input("chunk_size", default=0, min=0, max=1 << 20,
                             tooltip="Packed rows per chunk for this run only. 0: the loader's setting."),
            ],
            outputs=[H3Latent.Output(display_name="h3_latent")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, width, height, seconds, frames) -> bool | str:
        return canvas_error(width, height) or frame_count_error(seconds, frames) or True

    @classmethod
    def execute(cls, h3_model, h3_cond, width, height, seconds, frames, steps, seed, video_shift, audio_shift,
                chunk_size) -> io.NodeOutput:
        from h3_core.errors import H3Error
        from h3_core.pipeline.layout import LatentShape, frames_for_seconds

        error = canvas_error(width, height) or frame_count_error(seconds, frames)
        if error:
            raise H3Error(error)
        if h3_cond.has_keyframes and (h3_cond.width, h3_cond.height) != (width, height):
            raise H3Error(f"the keyframes were fitted to {h3_cond.width}x{h3_cond.height} by H3 Text Encode but the "
                          f"sampler makes {width}x{height}; set the same width and height on both nodes.")
        num_frames = frames if frames > 0 else frames_for_seconds(seconds)
        shape = LatentShape.for_request(width, height, num_frames)
        pipeline, settings = h3_model.pipeline, h3_model.settings
        sources = pipeline.sources
        needed = {"transformer": sources.transformer}
        if h3_cond.has_keyframes:
            needed["video_vae"] = sources.video_vae
        comfy_runtime.free_memory_for(needed, settings, pipeline.device)
        unique_id = cls.hidden.unique_id
        with memory_report(unique_id, h3_model, "sampling") as report:
            comfy_runtime.check_interrupt()
            # Loaded before the loop (the loop would load it first thing anyway) so this run's chunking can be set.
            transformer = pipeline.component("transformer")
            report["transformer"] = transformer
            bar = comfy_runtime.progress_bar(max(1, steps - 1), node_id=unique_id)
            with sampling_session(transformer, chunk_size=chunk_size, reclaim=comfy_runtime.soft_empty_cache,
                                  reclaim_every=settings.mps_reclaim_every):
                latents = pipeline.sample(h3_cond.conditioning, shape, steps=steps, seed=seed,
                                          video_shift=video_shift, audio_shift=audio_shift,
                                          progress=lambda step, total: bar.update_absolute(step, total),
                                          check_interrupt=comfy_runtime.check_interrupt)
        comfy_runtime.soft_empty_cache()
        return io.NodeOutput(latents)
