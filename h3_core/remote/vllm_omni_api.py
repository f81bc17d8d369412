"""vLLM-Omni's videos API for MiniMax H3, as vLLM-Omni 0.30.0's own server code defines it.

Read from the wheel (`pip download vllm-omni==0.30.0 --no-deps`), under `vllm_omni/`:
`entrypoints/openai/api_server.py` and `entrypoints/openai/video/generation/helpers.py` (`POST /v1/videos` takes a
multipart form only — a JSON body is refused — of `prompt`, `width`, `height`, `aspect_ratio`, `seed`,
`num_inference_steps`, `flow_shift` (the video shift), repeated `input_references` uploads (mixed kinds, in order) and
`extra_params`, a JSON object merged into the request's `extra_args`; unknown fields are dropped silently; a failed
job answers `GET /v1/videos/{id}` with its HTTP code and the job as the body; `DELETE` aborts the job in the engine
and answers `{"id", "deleted": true}`, or 409 while the abort is under way; results are local files, never URLs;
`progress` is 0 until the job is done), `entrypoints/openai/serving_video.py` (the lowering), and
`model_executor/models/minimax_h3/encoder_processing.py`, `preprocessing.py`, `reference_video.py` (H3's checks:
duration 4 to 15 s read from `extra_args.duration_seconds`, fps 24, `width` / `height` replace the canvas (multiples
of 32, 1:4 to 4:1) while t2va still needs a named `aspect_ratio`; keyframes `frame_indices` [0], [-1] or [0, -1];
reference and keyframe images 256 to 5760 px a side, 0.4 to 2.5 wide per high, sized to a 2048-px short edge (its
only rule); reference videos the same sides and ratios, 23.976 to 60 fps, 2 to 15 s, H.264 in MP4 (a video that
does not meet them is sent as a local run normalised it: 24 fps on its canvas); reference audios
2 to 15 s each and 15 s in all; a ref2va request of images only names its task in `extra_params`). The model card
(`GET /v1/models`, no `/models`) is owned by "vllm" and names neither the task nor the partition: a task the loaded
checkpoint lacks fails the job ("checkpoint partition 'fl2va' supports [...], got task='ref2va'"). `--api-key`
guards `/v1/*` with a Bearer token. A LoRA on the server goes per request as the `lora` form field, a JSON object of
`name`, `path` and `scale` (`entrypoints/openai/utils.py` `parse_lora_request`).

Start it for H3 (all three tasks from one server: `--task-type auto`, the default, loads both partitions):
    vllm serve MiniMaxAI/MiniMax-H3 --omni --port 30010
"""

from __future__ import annotations

import json

from ..errors import H3Error
from ..request.generation_request import GenerationRequest
from ..request.grid import FPS
from ..request.keyframes import _to_pil
from . import protocol, serving_rules
from .materials import Material, request_materials, source_video
from .videos_client import Multipart

NAME = "vLLM-Omni"
VERSION_READ = "vllm-omni 0.30.0"
OWNED_BY = "vllm"
CAN_ABORT = True
START_COMMAND = "vllm serve MiniMaxAI/MiniMax-H3 --omni --task-type {partition} --port 30010"
PARTITION_REFUSAL = "checkpoint partition"
MAX_STEPS = 200  # num_inference_steps, model calls
IMAGE_SIDES = (256, 5760)
IMAGE_RATIOS = (0.4, 2.5)
REFERENCE_SECONDS = (2.0, 15.0)
VIDEO_RATES = (23.976, 60.0)
AUDIO_TOTAL_SECONDS = 15.0
UPLOAD_LIMITS = {"image": 30 << 20, "video": 50 << 20, "video_audio": 50 << 20, "audio": 15 << 20}


def _image_problem(width: int, height: int) -> str | None:
    if not IMAGE_SIDES[0] <= min(width, height) or max(width, height) > IMAGE_SIDES[1]:
        return f"is {width}x{height}; {NAME} takes images of {IMAGE_SIDES[0]} to {IMAGE_SIDES[1]} px a side"
    if not IMAGE_RATIOS[0] <= width / height <= IMAGE_RATIOS[1]:
        return f"is {width}x{height}; {NAME} takes images from 2:5 to 5:2"
    return None


def _reference_image(request: GenerationRequest, index: int, normalised):
    """What goes for reference image `index`: the user's image when the server takes it (it resizes by the same
    rule), else the one resized for a local run; None when neither fits."""
    for image in (_to_pil(request.reference_images[index], "reference"), normalised):
        if _image_problem(*image.size) is None:
            return image
    return None


def _video_fits(frames, fps: float) -> bool:
    height, width = frames.shape[1:3]
    return (_image_problem(width, height) is None and VIDEO_RATES[0] <= fps <= VIDEO_RATES[1]
            and REFERENCE_SECONDS[0] <= frames.shape[0] / fps <= REFERENCE_SECONDS[1])


def _reference_videos(request: GenerationRequest, references) -> list:
    """What goes for each reference video: the user's, cut to the generated duration, when the server takes it, else
    the one normalised for a local run (24 fps on its canvas, which meets the server's sizes and rates)."""
    chosen = []
    videos = [reference for reference in references.references if reference.kind == "video"]
    for index, reference in enumerate(videos):
        frames, fps = source_video(request, index, reference.label)
        chosen.append((frames, fps) if _video_fits(frames, fps) else (reference.frames, float(FPS)))
    return chosen


def check(request: GenerationRequest, server_lora=None) -> None:
    """Every limit the server enforces, before anything is encoded or sent (a server LoRA is the server's to find)."""
    names = request.names
    serving_rules.choose_aspect(request, serving_rules.task_of(request), NAME, any_canvas=True)
    serving_rules.choose_duration(request, NAME)
    serving_rules.check_seed(request, NAME)
    if request.steps - 1 > MAX_STEPS:
        raise H3Error(f"{names.steps} {request.steps}: {NAME} takes at most {MAX_STEPS} model calls "
                      f"({MAX_STEPS + 1} steps).")
    keyframes = serving_rules.server_keyframes(request, NAME)
    if keyframes:
        problem = _image_problem(request.width, request.height)
        if problem:
            raise H3Error(f"{names.width} {request.width} / {names.height} {request.height}: keyframes are sent at "
                          f"the canvas size, which {problem}; choose a canvas within those limits, or run locally.")
    references = request.normalised_references()
    if not references:
        return
    if request.reference_images and request.reference_image_size != "reference":
        raise H3Error(f"{names.reference_image_size} {request.reference_image_size!r}: {NAME} sizes reference images "
                      "one way only (to a 2048-px short edge, h3-stream's 'reference'); set it to reference, or use "
                      "an SGLang server.")
    audio_seconds = 0.0
    for index, reference in enumerate(references.references):
        if reference.kind == "image" and _reference_image(request, index, reference.image) is None:
            source = _to_pil(request.reference_images[index], "reference")
            raise H3Error(f"{reference.label}: the image {_image_problem(*source.size)}.")
        if reference.kind == "video":
            height, width = reference.frames.shape[1:3]
            if not IMAGE_RATIOS[0] <= width / height <= IMAGE_RATIOS[1]:
                raise H3Error(f"{reference.label}: the video is {width}x{height}; {NAME} takes videos from 2:5 to "
                              "5:2.")
            seconds = reference.frames.shape[0] / FPS
            if seconds < REFERENCE_SECONDS[0]:
                raise H3Error(f"{reference.label}: the video is {seconds:.2f} s; {NAME} takes reference videos of "
                              f"{REFERENCE_SECONDS[0]:g} to {REFERENCE_SECONDS[1]:g} s.")
        if reference.kind == "audio":
            seconds = reference.audio.shape[1] / 32000
            audio_seconds += seconds
            if not REFERENCE_SECONDS[0] <= seconds <= REFERENCE_SECONDS[1]:
                raise H3Error(f"{reference.label}: the audio is {seconds:.2f} s; {NAME} takes reference audios of "
                              f"{REFERENCE_SECONDS[0]:g} to {REFERENCE_SECONDS[1]:g} s.")
    if audio_seconds > AUDIO_TOTAL_SECONDS:
        raise H3Error(f"{names.reference_audios}: {audio_seconds:.2f} s of audio references in all; {NAME} takes at "
                      f"most {AUDIO_TOTAL_SECONDS:g} s.")


def materials(request: GenerationRequest) -> list[Material]:
    """Keyframes as fitted; reference images as `_reference_image` picks, videos as `_reference_videos` does; audios
    as normalised for a local run (32 kHz stereo)."""
    references = request.normalised_references()
    if not references:
        return request_materials(request, engine=NAME)
    images = [_reference_image(request, i, r.image) for i, r in enumerate(references.references)
              if r.kind == "image"]
    return request_materials(request, images=images, videos=_reference_videos(request, references), engine=NAME)


def post_video(client, request: GenerationRequest, sent: list[Material], model: str | None,
               server_lora=None) -> dict:
    form = create_video_form(request, sent, model, server_lora)
    for material in sent:
        if len(material.data) > UPLOAD_LIMITS[material.kind]:
            raise H3Error(f"{material.label}: {len(material.data) / 2**20:.1f} MiB encoded; {NAME} takes uploads of "
                          f"at most {UPLOAD_LIMITS[material.kind] >> 20} MiB. Shorten or shrink it.")
    return client.post_form(protocol.VIDEOS_PATH, form)


def create_video_form(request: GenerationRequest, sent: list[Material], model: str | None,
                      server_lora=None) -> Multipart:
    """The multipart form of `POST /v1/videos`. `num_inference_steps` counts model calls: steps - 1. A server LoRA
    goes as the `lora` object (`name`, `path` on the server, `scale`)."""
    task = serving_rules.task_of(request)
    _, ratio = serving_rules.choose_aspect(request, task, NAME, any_canvas=True)
    extra = {"duration_seconds": serving_rules.choose_duration(request, NAME),
             "audio_flow_shift": request.audio_shift}
    if task == serving_rules.TASK_KEYFRAMES:
        extra["frame_indices"] = [m.frame_index for m in sent if m.role == "keyframe"]
    if task == serving_rules.TASK_REFERENCES:
        extra["task"] = task  # images alone would otherwise be read as fl2va keyframes
    form = Multipart()
    form.field("prompt", request.prompt)
    form.field("width", request.width).field("height", request.height).field("aspect_ratio", ratio)
    form.field("num_inference_steps", request.steps - 1)
    form.field("seed", serving_rules.check_seed(request, NAME))
    form.field("flow_shift", request.video_shift)
    form.field("extra_params", json.dumps(extra))
    if model:
        form.field("model", model)
    if server_lora is not None:
        form.field("lora", json.dumps({"name": server_lora.name, "path": server_lora.path,
                                       "scale": server_lora.strength}))
    for material in sent:
        form.file("input_references", material.data, material.filename, material.media_type)
    return form
