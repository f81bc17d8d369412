"""The widgets of one request, shared by H3 Text Encode and H3 Sampler: the canvas, the duration and the sampler's
settings, with their tooltips and the validation messages in the widgets' own words (the rules are h3_core's)."""

from __future__ import annotations

from comfy_api.latest import io

# The same limits as the CLI's (--size, --seconds, --frames): one definition in h3_core.
from h3_core.request.generation_request import MAX_CANVAS, MAX_FRAMES, MAX_SECONDS

# The smallest sigma shift a widget takes: the schedule needs a shift above 0.
MIN_SHIFT = 0.1
# The shortest duration the widget takes (any duration above 0 snaps up to the 5-frame minimum); ComfyUI checks it.
MIN_SECONDS = 0.1
# Rows per chunk: chunks exist to bound a pass's temporaries, and 64k rows is more than a 15 s 768p sequence (~50k).
MAX_CHUNK_SIZE = 1 << 16
CANVAS_TOOLTIP = ("Canvas {what} in pixels (multiple of 32). Keyframes are fitted to it before the vision encoder "
                  "sees them, so it must equal the sampler's {what} when a keyframe is connected.")


def canvas_inputs() -> list:
    return [io.Int.Input("width", default=1344, min=32, max=MAX_CANVAS, step=32,
                         tooltip=CANVAS_TOOLTIP.format(what="width")),
            io.Int.Input("height", default=768, min=32, max=MAX_CANVAS, step=32,
                         tooltip=CANVAS_TOOLTIP.format(what="height"))]


def sampler_inputs() -> list:
    """The sampler's widgets after the canvas."""
    return [
        io.Float.Input("seconds", default=5.0, min=MIN_SECONDS, max=MAX_SECONDS, step=0.1,
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
        io.Float.Input("video_shift", default=12.0, min=MIN_SHIFT, max=100.0, step=0.1,
                       tooltip="Sigma shift of the video schedule (12 for the released model)."),
        io.Float.Input("audio_shift", default=3.0, min=MIN_SHIFT, max=100.0, step=0.1,
                       tooltip="Sigma shift of the audio schedule (3 for the released model)."),
        io.Int.Input("chunk_size", default=0, min=0, max=MAX_CHUNK_SIZE,
                     tooltip="Packed rows per chunk for this run only. 0: the loader's setting."),
    ]


def canvas_error(width, height) -> str | None:
    from h3_core.errors import H3Error
    from h3_core.request.grid import check_canvas

    if width is None or height is None:
        return None  # linked: checked when the node runs
    for name, value in (("width", width), ("height", height)):
        if not 32 <= value <= MAX_CANVAS:
            return f"{name} must be between 32 and {MAX_CANVAS} pixels, got {value}."
    try:
        check_canvas(width, height)
    except H3Error as error:
        return str(error)
    return None


def frame_count_error(seconds, frames) -> str | None:
    from h3_core.request.grid import align_num_frames, is_aligned_num_frames

    if frames is not None and frames != 0:
        if not 5 <= frames <= MAX_FRAMES:
            return f"frames must be 0 (use seconds) or between 5 and {MAX_FRAMES}, got {frames}."
        if not is_aligned_num_frames(frames):
            return (f"frames must be on the 17n + 5 grid (5, 22, 39, ...), got {frames}; use "
                    f"{align_num_frames(frames)} or set frames to 0 and give seconds.")
    if seconds is not None and frames == 0 and not 0 < seconds <= MAX_SECONDS:
        return f"seconds must be above 0 and at most {MAX_SECONDS:g}, got {seconds}."
    return None


def shift_error(**shifts) -> str | None:
    """`video_shift` / `audio_shift` in the widgets' names, when the node runs (ComfyUI refuses a value below the
    widget minimum at validation; a linked value arrives unchecked)."""
    from h3_core.errors import H3Error
    from h3_core.request.generation_request import check_shift

    for name, value in shifts.items():
        if value is None:
            continue  # linked: checked when the node runs
        try:
            check_shift(value, name)
        except H3Error as error:
            return str(error)
    return None
