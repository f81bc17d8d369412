"""H3 Long Video and H3 Extend: videos longer than 15 s, and a clip continued, made window by window by
`h3_core.pipeline.long_video` and streamed into one mp4 in ComfyUI's temp folder. The output is core's VIDEO backed by
that file (`VideoFromFile`): Save Video copies its packets, so no node holds the whole clip's frames (an IMAGE
batch of a 60 s 1344x768 clip would be 17 GiB of float32). H3 Sampler makes one window of at most 15 s: its latents
are one request's, decoded by the decode nodes; beyond 15 s the windows are stitched in pixels and samples, here."""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from . import comfy_runtime
from .request_inputs import NODE_NAMES, canvas_inputs, sampler_inputs
from .sockets import H3Model
from .telemetry import phase

SCHEDULE_TOOLTIP = ("Optional: a prompt per window, one 'SECONDS: PROMPT' per line (or separated by ';'), the first "
                    "at 0, e.g. '0: a beach at dawn' and '15: the same beach at noon'. Each window takes the prompt in "
                    "force at its first new frame. Empty: the prompt above for every window.")
WINDOWS_NOTE = ("H3 makes at most 15 s at a time: longer videos are windows of up to 15 s, each after the first "
                "guided by the previous window's last 22 frames and their soundtrack, cross-faded over them.")


def _long_sampler_inputs() -> list:
    """The sampler's widgets without chunk_size (each window runs with the loader's memory settings)."""
    return [widget for widget in sampler_inputs() if widget.id != "chunk_size"]


def _seconds_input(default: float, what: str) -> io.Float.Input:
    from h3_core.request.windows import MAX_LONG_SECONDS

    return io.Float.Input("seconds", default=default, min=0.1, max=MAX_LONG_SECONDS, step=0.1,
                          tooltip=f"{what} Up to {MAX_LONG_SECONDS:g} s; beyond 15 s in windows (the node says how "
                                  "many).")


def _schedule_input() -> io.String.Input:
    return io.String.Input("prompt_schedule", multiline=True, default="", optional=True, tooltip=SCHEDULE_TOOLTIP)


class H3StreamLongVideo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamLongVideo",
            display_name="H3 Long Video",
            category="H3 Stream/sampling",
            description="A video of any length up to 10 minutes, with 32 kHz stereo audio, from a prompt. " + WINDOWS_NOTE
                        + " Each window is decoded when done and written at once, so memory is one window's whatever "
                        "the length; the VIDEO output is that file (connect Save Video).",
            search_aliases=["minimax h3", "long video", "continuation", "60 seconds"],
            inputs=[H3Model.Input("h3_model"),
                    io.String.Input("prompt", multiline=True, default="",
                                    tooltip="Shots, camera and the sound (dialogue, effects, music) in one text."),
                    *canvas_inputs(), _seconds_input(30.0, "Duration: round(seconds x 24) frames on the 17n + 5 "
                                                           "grid."),
                    *_long_sampler_inputs(), _schedule_input()],
            outputs=[io.Video.Output(display_name="video")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, h3_model, prompt, width, height, seconds, steps, seed, video_shift, audio_shift,
                step_cache="off", prompt_schedule="") -> io.NodeOutput:
        from h3_core.request.windows import long_frame_count

        frames = long_frame_count(seconds, "seconds")
        request = _request(prompt, width, height, steps, seed, video_shift, audio_shift, step_cache)
        return run_windows(cls.hidden.unique_id, h3_model, request, frames, prompt_schedule, clip=None)


class H3StreamExtend(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamExtend",
            display_name="H3 Extend",
            category="H3 Stream/sampling",
            description="Continues a 24 fps H.264 video: its last 22 frames and their soundtrack guide the new part; "
                        "the VIDEO output is the original, its frames copied unchanged, followed by the new part, at "
                        "the original's canvas (a multiple of 32 pixels). " + WINDOWS_NOTE + " A VIDEO from a file "
                        "(Load Video) keeps its frames bitwise; one made from IMAGE frames (Create Video) is encoded "
                        "once, as Save Video would.",
            search_aliases=["minimax h3", "extend video", "continue video", "continuation"],
            inputs=[H3Model.Input("h3_model"),
                    io.Video.Input("video", tooltip="The clip to continue (24 fps, H.264, a canvas on the 32-pixel "
                                                     "grid)."),
                    io.String.Input("prompt", multiline=True, default="",
                                    tooltip="What happens next: shots, camera and the sound in one text."),
                    _seconds_input(5.0, "Seconds added after the clip: round(seconds x 24) frames rounded up to a "
                                        "multiple of 17."),
                    *_long_sampler_inputs(), _schedule_input()],
            outputs=[io.Video.Output(display_name="video")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, h3_model, video, prompt, seconds, steps, seed, video_shift, audio_shift, step_cache="off",
                prompt_schedule="") -> io.NodeOutput:
        from h3_core.request.streamed_mp4 import ClipToExtend
        from h3_core.request.windows import OVERLAP_FRAMES, extension_frame_count

        frames = extension_frame_count(seconds, "seconds")
        clip = ClipToExtend.read(comfy_runtime.video_file(video), OVERLAP_FRAMES, "video")
        request = _request(prompt, clip.width, clip.height, steps, seed, video_shift, audio_shift, step_cache)
        return run_windows(cls.hidden.unique_id, h3_model, request, frames, prompt_schedule, clip=clip)


def _request(prompt, width, height, steps, seed, video_shift, audio_shift, step_cache):
    from h3_core.request.generation_request import GenerationRequest
    from h3_core.request.grid import MAX_FRAMES

    return GenerationRequest(prompt=prompt, width=width, height=height, num_frames=MAX_FRAMES, steps=steps,
                             seed=seed, video_shift=video_shift, audio_shift=audio_shift, step_cache=step_cache,
                             loras=None, names=dataclasses.replace(NODE_NAMES, num_frames="seconds"))


def run_windows(node_id, h3_model, request, frames: int, prompt_schedule: str, clip) -> io.NodeOutput:
    """Both nodes: the note on the node (how many windows), the plan of the longest window, the windows with one
    progress bar across them, the file-backed VIDEO."""
    from h3_core.pipeline.long_video import generate_long_video, planned_guides
    from h3_core.request.grid import FPS
    from h3_core.request.windows import parse_prompt_schedule, plan_windows

    request = request.replace(loras=h3_model.loras)
    schedule = parse_prompt_schedule(prompt_schedule, frames / FPS, "prompt_schedule") \
        if prompt_schedule and prompt_schedule.strip() else None
    windows = plan_windows(frames, guided_first=clip is not None)
    pipeline = h3_model.pipeline
    count, calls = len(windows), max(1, request.steps - 1)
    if clip is not None:
        note = (f"extending {clip.num_frames} frames ({clip.num_frames / FPS:.2f} s) by {frames} frames "
                f"({frames / FPS:.2f} s) in {count} window{'s' * (count > 1)}; the clip's frames are copied unchanged"
                + ("" if clip.has_audio else "; the clip has no audio track: guided by its frames alone, silent "
                                             "under the clip"))
    else:
        note = (f"{frames} frames ({frames / FPS:.2f} s) in {count} window{'s' * (count > 1)} of at most 15 s" +
                (", each after the first guided by the previous one's last 22 frames and their soundtrack, "
                 "cross-faded" if count > 1 else ""))
    guides = planned_guides(request, windows)  # the overlap guide a guided window carries
    note += "\n" + windowed_preflight(h3_model, windows, request, guides)
    comfy_runtime.send_progress_text(node_id, note)
    plan = pipeline.plan(width=request.width, height=request.height, num_frames=max(w.num_frames for w in windows),
                         steps=request.steps, loras=request.loras, step_cache=request.step_cache is not None,
                         keyframes=bool(request.anchors), guides=guides)
    bar = comfy_runtime.progress_bar(count * calls, node_id=node_id)
    current = {"window": 0}

    def on_window(window, total):
        current["window"] = window.index
        comfy_runtime.send_progress_text(node_id, f"{note}\nwindow {window.index + 1} of {total}")

    def progress(done, total):
        bar.update_absolute(current["window"] * calls + min(done, calls), count * calls)

    out = comfy_runtime.temp_video_path("h3_long_video")
    # Room made for the largest phase of a window (every window is an ordinary request, the longest planned).
    with phase(node_id, h3_model, "long video", tuple(p.name for p in plan.phases), plan, blocks_of="transformer"):
        result = generate_long_video(pipeline, request, out, total_frames=None if clip else frames, extend=clip,
                                     new_frames=frames if clip else None, schedule=schedule, progress=progress,
                                     on_window=on_window, check_interrupt=comfy_runtime.check_interrupt)
    if result.audio_warnings:
        from h3_core.request.audio_health import warning_line

        note += "\n" + "\n".join(warning_line(f) for f in result.audio_warnings)
    comfy_runtime.send_progress_text(node_id, f"{note}\ndone: {result.num_frames} frames ({result.seconds:.2f} s) at "
                                              "24 fps, 32 kHz stereo")
    return io.NodeOutput(comfy_runtime.video_from_file(result.path))


def windowed_preflight(h3_model, windows, request, guides=()) -> str:
    """The preflight of the windows (h3_core's: each window planned as its own request, the time summed)."""
    from h3_core.planning.request_estimate import describe_windowed_estimate

    settings = h3_model.settings
    return describe_windowed_estimate(h3_model.pipeline.sources, windows, device=h3_model.pipeline.device,
                                      width=request.width, height=request.height, steps=request.steps,
                                      dtype=settings.torch_dtype, loras=h3_model.loras,
                                      keyframes=bool(request.anchors), step_cache=request.step_cache is not None,
                                      guides=guides)
