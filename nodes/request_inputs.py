"""The widgets of one request and their names in h3_core's messages: the canvas and the duration (H3 Text Encode),
the sampler's settings (H3 Sampler). The rules are h3_core's (`GenerationRequest`); this module only says how a
node names each field."""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from h3_core.errors import H3Error
from h3_core.request.generation_request import (AUDIO_SHIFT, MAX_SHIFT, SEED_MAX, VIDEO_SHIFT, RequestNames,
                                                frames_for_duration)
from h3_core.request.grid import CANVAS_MULTIPLE, MAX_CANVAS, MAX_FRAMES, MAX_SECONDS
from h3_core.step_cache_settings import STEP_CACHE_OFF, STEP_CACHE_PRESETS

# The request's fields as the nodes' widgets and sockets name them.
NODE_NAMES = RequestNames(num_frames="frames", reference_images="ref_image", reference_videos="ref_video",
                          reference_audios="ref_audio", reference_image_size="ref_image_size")

# The smallest sigma shift a widget takes: the schedule needs a shift above 0.
MIN_SHIFT = 0.1
# The shortest duration the widget takes (any duration above 0 snaps up to the 5-frame minimum); ComfyUI checks it.
MIN_SECONDS = 0.1
# Rows per chunk: chunks exist to bound a pass's temporaries, and 64k rows is more than a 15 s 768p sequence (~50k).
MAX_CHUNK_SIZE = 1 << 16
STEP_CACHE_TOOLTIP = (
    "Skips most of the transformer on steps where the output of its first block barely changes from the step "
    "before, reusing what the skipped blocks added last time; the node shows how many steps were cached. off: exactly "
    "the uncached output. quality: the setting SGLang and vLLM-Omni use for H3's quality=\"high\" (about 1.35-1.40x "
    "faster on their GPUs; vLLM-Omni measured SSIM 0.971 / PSNR 34.98 dB against the uncached output). fast: SGLang's "
    "generic Cache-DiT default: more steps skipped, lower fidelity.")
CANVAS_TOOLTIP = ("Canvas {what} in pixels (a multiple of 32). The sampler makes this canvas; keyframes and "
                  "references are fitted to it.")


def canvas_inputs() -> list:
    return [io.Int.Input("width", default=1344, min=CANVAS_MULTIPLE, max=MAX_CANVAS, step=CANVAS_MULTIPLE,
                         tooltip=CANVAS_TOOLTIP.format(what="width")),
            io.Int.Input("height", default=768, min=CANVAS_MULTIPLE, max=MAX_CANVAS, step=CANVAS_MULTIPLE,
                         tooltip=CANVAS_TOOLTIP.format(what="height"))]


def duration_inputs() -> list:
    return [
        io.Float.Input("seconds", default=5.0, min=MIN_SECONDS, max=MAX_SECONDS, step=0.1,
                       tooltip="Duration; the frame count is round(seconds x 24) snapped up to the 17n + 5 "
                               "grid (5 s -> 124 frames). At most 15 s in one request: longer videos, and a clip "
                               "continued, are made in windows by H3 Long Video and H3 Extend."),
        io.Int.Input("frames", default=0, min=0, max=MAX_FRAMES, step=1,
                     tooltip="Frame count at 24 fps on the 17n + 5 grid (5, 22, 39, ...); 0 uses seconds."),
    ]


def sampler_inputs() -> list:
    """The sampler's own widgets (the canvas and the duration come with the conditioning)."""
    return [
        io.Int.Input("steps", default=30, min=2, max=200,
                     tooltip="Points of the sigma schedule, the final 0 included: steps - 1 transformer "
                             "calls."),
        io.Int.Input("seed", default=0, min=0, max=SEED_MAX, control_after_generate=True,
                     tooltip="Initial noise (diffusers' recipe: the same seed gives other noise in core "
                             "ComfyUI or sglang)."),
        io.Float.Input("video_shift", default=VIDEO_SHIFT, min=MIN_SHIFT, max=MAX_SHIFT, step=0.1,
                       tooltip=f"Sigma shift of the video schedule ({VIDEO_SHIFT:g} for the released model)."),
        io.Float.Input("audio_shift", default=AUDIO_SHIFT, min=MIN_SHIFT, max=MAX_SHIFT, step=0.1,
                       tooltip=f"Sigma shift of the audio schedule ({AUDIO_SHIFT:g} for the released model)."),
        io.Int.Input("chunk_size", default=0, min=0, max=MAX_CHUNK_SIZE,
                     tooltip="Packed rows per chunk for this run only. 0: the loader's setting."),
        # Optional, and last: a prompt or workflow saved before the cache existed has no value for it and samples
        # as it always did ("off"; ComfyUI refuses a prompt that lacks a required input).
        io.Combo.Input("step_cache", options=list(STEP_CACHE_PRESETS), default=STEP_CACHE_OFF, optional=True,
                       tooltip=STEP_CACHE_TOOLTIP),
    ]


def num_frames(seconds, frames) -> int:
    """The seconds / frames widgets -> the frame count (frames wins unless 0), in the widgets' words."""
    return frames_for_duration(seconds, frames or None)[0]


def names_for(frames) -> RequestNames:
    """The request's names when the duration came from `frames` (not 0) or from `seconds`."""
    return NODE_NAMES if frames else dataclasses.replace(NODE_NAMES, num_frames="seconds")


def frame_count_error(frames) -> str | None:
    """validate_inputs' check of the frames widget alone (no widget limit can say the grid): one error, on it."""
    if not frames:
        return None  # 0 uses seconds; linked (None): checked when the node runs
    try:
        frames_for_duration(None, frames)
    except H3Error as error:
        return str(error)
    return None
