"""SGLang diffusion's videos API for MiniMax H3, as SGLang 0.5.23's own server code defines it.

Read from the wheel (`pip download sglang==0.5.23 --no-deps`), under `sglang/multimodal_gen/`:
`runtime/entrypoints/openai/video_api.py` (`POST /v1/videos` takes JSON or multipart; JSON extra fields are kept;
`DELETE` pops the job record and answers it with status "deleted" — "TODO: support aborting a job", so the job runs
to its end on the GPUs; `/content` answers 400 naming the cloud URL when the result was uploaded, which the job
carries as `url`), `runtime/entrypoints/openai/common_api.py` (`GET /v1/models`: `{"object": "list", "data":
[card]}`, `owned_by` "sglang"; `/models` is deprecated), `.../minimax_h3/video_adapter.py` (`num_frames` and `fps`
are refused, `guidance_scale` / `negative_prompt` too; the H3 fields are `task`, `conditions`, `target`,
`audio_flow_shift`, `reference_resize_mode`) and `request_validation.py` (conditions of `type`, `uri`, `role`,
`frame_index`; `data:` URIs are read, see `material_io.py`). A LoRA is the whole server's (`--lora-path`,
`/v1/set_lora`): the videos API takes none per request. The server has no API key of its own; a key is sent as a
Bearer token for a gateway in front of it. Neither the card nor any endpoint names the partition (`--model-variant`):
a task of the other partition is accepted, then failed by the GPU pipeline ("task 'ref2va' is not served by MiniMax
H3 partition 'fl2va'").

Start it for H3 (MiniMax's README):
    sglang serve --model-path MiniMaxAI/MiniMax-H3 --model-variant fl2va --port 30010 [--num-gpus 4 ...]
"""

from __future__ import annotations

from ..errors import H3Error
from ..request.generation_request import GenerationRequest
from . import protocol, serving_rules
from .materials import Material, request_materials

NAME = "SGLang"
VERSION_READ = "sglang 0.5.23"
OWNED_BY = "sglang"
CAN_ABORT = False
START_COMMAND = "sglang serve --model-path MiniMaxAI/MiniMax-H3 --model-variant {partition} --port 30010"
PARTITION_REFUSAL = "is not served by MiniMax H3 partition"


def check(request: GenerationRequest, server_lora=None) -> None:
    """Every limit the server enforces, before anything is encoded or sent."""
    if server_lora is not None:
        raise H3Error(f"{request.names.server_lora} {server_lora.path}: SGLang applies LoRAs to the whole server, not per request "
                      "(sglang serve --lora-path PATH, or its POST /v1/set_lora endpoint); set it there and drop "
                      f"{request.names.server_lora}, or use a vLLM-Omni server.")
    serving_rules.server_target(request, NAME)
    serving_rules.check_seed(request, NAME)


def materials(request: GenerationRequest) -> list[Material]:
    return request_materials(request, engine=NAME)


def post_video(client, request: GenerationRequest, materials: list[Material], model: str | None,
               server_lora=None) -> dict:
    return client.post_json(protocol.VIDEOS_PATH, create_video_body(request, materials, model))


def create_video_body(request: GenerationRequest, materials: list[Material], model: str | None = None) -> dict:
    """The JSON body of `POST /v1/videos`. `num_inference_steps` counts model calls: steps - 1 (h3-stream's steps
    count sigma grid points including the final 0)."""
    target = serving_rules.server_target(request, NAME)
    conditions = []
    for material in materials:
        condition = {"type": material.kind, "uri": material.data_uri(), "role": material.role}
        if material.frame_index is not None:
            condition["frame_index"] = material.frame_index
        conditions.append(condition)
    body = {
        "prompt": request.prompt,
        "task": serving_rules.task_of(request),
        "conditions": conditions,
        "target": target.as_json(),
        "num_inference_steps": request.steps - 1,
        "seed": serving_rules.check_seed(request, NAME),
        "flow_shift": request.video_shift,
        "audio_flow_shift": request.audio_shift,
    }
    if request.reference_images:
        body["reference_resize_mode"] = serving_rules.REFERENCE_RESIZE_MODE[request.reference_image_size]
    if model:
        body["model"] = model
    return body
