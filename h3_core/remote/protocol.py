"""Every fact h3-stream relies on about the OpenAI-style videos API of an SGLang diffusion server, in one place.

Read on 2026-12-01 from:

* SGLang's "SGLang Diffusion OpenAI API" page, `docs/diffusion/api/openai_api.md` (sgl-project/sglang at commit
  11f22d993083efd12466bd3f84a89ae766755741): `GET /models`, `POST /v1/videos`, `GET /v1/videos`,
  `GET /v1/videos/{video_id}/content`, `Authorization: Bearer <key>`, the LoRA endpoints;
* its server code, `python/sglang/multimodal_gen/runtime/entrypoints/openai/video_api.py` and `protocol.py`: the job
  object (`id`, `status`, `progress` 0-100, `error.message`), the statuses it sets (`queued` -> `completed` |
  `failed`), `DELETE /v1/videos/{video_id}` (it drops the job; the code says "TODO: support aborting a job", so the
  server may go on computing a deleted job), FastAPI's `{"detail": ...}` error bodies, the request model accepting
  extra fields (`extra="allow"`);
* MiniMax's H3 README and its request scripts (MiniMax-AI/MiniMax-H3 `scripts/readme/reproducible-768p-*-request.sh`
  at commit 4cf34d283d170d56aee870e5a4dcbcb64f69dc8d): one server per partition (`sglang serve --model-path
  MiniMaxAI/MiniMax-H3 --model-variant fl2va|ref2va ...`), the H3 request fields `task` ("t2va", "fl2va") and
  `conditions` (`{"type": "image", "uri": ..., "role": "keyframe", "frame_index": 0}`), and the poll statuses its
  script treats as done, failed or still running.

Not documented anywhere read (so the client sends them and says so in the README): keyframe `uri`s as `data:` URIs
(the scripts use https URLs), `frame_index` -1 for the last frame, and the audio sigma shift (`audio_flow_shift`, the
name MiniMax H3 extensions use elsewhere). When the server changes, this module is the one to update.
"""

from __future__ import annotations

DOCS_READ = ("SGLang docs/diffusion/api/openai_api.md @ 11f22d99 and multimodal_gen/runtime/entrypoints/openai "
             "(video_api.py, protocol.py); MiniMax-H3 scripts/readme @ 4cf34d28; read 2026-12-01")

# ---- paths ------------------------------------------------------------------------------------------------------------
MODELS_PATH = "/models"
VIDEOS_PATH = "/v1/videos"


def video_path(video_id: str) -> str:
    return f"{VIDEOS_PATH}/{video_id}"


def content_path(video_id: str) -> str:
    return f"{VIDEOS_PATH}/{video_id}/content"


# ---- authentication -----------------------------------------------------------------------------------------------
# The environment variable h3-stream reads the server's API key from (the key is sent as a Bearer token; SGLang's
# docs show `Authorization: Bearer sk-...`). It is never written into a workflow, a log line or an error message.
API_KEY_ENV = "H3_STREAM_API_KEY"
AUTHORIZATION_HEADER = "Authorization"


def authorization_value(api_key: str) -> str:
    return f"Bearer {api_key}"


# ---- job statuses ---------------------------------------------------------------------------------------------------
# SGLang sets queued / completed / failed; OpenAI's Videos API adds in_progress; MiniMax's poll script accepts these.
COMPLETED = frozenset({"completed", "success", "succeeded", "finished", "done"})
FAILED = frozenset({"failed", "failure", "fail", "error", "cancelled", "canceled", "expired", "deleted"})
RUNNING = frozenset({"queued", "queueing", "preparing", "processing", "running", "pending", "in_progress",
                     "in-progress"})

# ---- the request body -------------------------------------------------------------------------------------------------
TASK_TEXT = "t2va"  # text -> video + audio (no keyframe), served by the FL2VA partition
TASK_KEYFRAMES = "fl2va"  # first / last keyframe -> video + audio
KEYFRAME_INDEX = {"first": 0, "last": -1}


def keyframe_condition(uri: str, anchor: str) -> dict:
    return {"type": "image", "uri": uri, "role": "keyframe", "frame_index": KEYFRAME_INDEX[anchor]}


def create_video_body(*, prompt: str, width: int, height: int, num_frames: int, fps: int, steps: int, seed: int,
                      video_shift: float, audio_shift: float, keyframes: dict | None = None,
                      model: str | None = None) -> dict:
    """The JSON body of `POST /v1/videos` for one H3 request. `steps` counts sigma grid points including the final 0
    (as everywhere in h3-stream); the server's `num_inference_steps` counts model calls, so it is `steps - 1`.
    `keyframes` maps "first" / "last" to an image URI."""
    keyframes = keyframes or {}
    body = {
        "prompt": prompt,
        "task": TASK_KEYFRAMES if keyframes else TASK_TEXT,
        "conditions": [keyframe_condition(uri, anchor) for anchor, uri in keyframes.items()],
        "size": f"{width}x{height}",
        "width": width,
        "height": height,
        "num_frames": num_frames,
        "fps": fps,
        "num_inference_steps": steps - 1,
        "seed": seed,
        "flow_shift": video_shift,
        "audio_flow_shift": audio_shift,
    }
    if model:
        body["model"] = model
    return body


# ---- the job object ---------------------------------------------------------------------------------------------------
def job_id(job: dict) -> str | None:
    value = job.get("id") if isinstance(job, dict) else None
    return value if isinstance(value, str) and value else None


def job_status(job: dict) -> str:
    return str(job.get("status") or "").strip().lower()


def job_progress(job: dict) -> float | None:
    """The server's progress in percent (0-100), or None when it does not report one."""
    value = job.get("progress")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return max(0.0, min(100.0, float(value)))


def job_error(job: dict) -> str | None:
    error = job.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or "") or None
    return str(error) if error else None


def error_body_message(body: bytes) -> str:
    """The readable part of an error response: FastAPI's {"detail": ...}, OpenAI's {"error": {"message": ...}}, or
    the text itself."""
    import json

    text = body.decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(parsed, dict):
        if isinstance(parsed.get("error"), dict) and parsed["error"].get("message"):
            return str(parsed["error"]["message"])
        if parsed.get("detail"):
            detail = parsed["detail"]
            return detail if isinstance(detail, str) else json.dumps(detail)
        if parsed.get("message"):
            return str(parsed["message"])
    return text[:500]


# ---- GET /models ------------------------------------------------------------------------------------------------------
# Documented response fields: model_path, task_type, pipeline_name, pipeline_class, num_gpus, dit_precision,
# vae_precision. H3's partition is not a documented field: it is read from `model_variant` when the server sends one,
# else from the names (a Ref2VA server's pipeline or task names it).
MODEL_INFO_FIELDS = ("model_path", "task_type", "pipeline_name", "pipeline_class", "num_gpus", "dit_precision",
                     "vae_precision")
PARTITIONS = ("fl2va", "ref2va")


def served_partition(info: dict) -> str | None:
    variant = str(info.get("model_variant") or "").lower()
    if variant in PARTITIONS:
        return variant
    names = " ".join(str(info.get(key) or "") for key in ("task_type", "pipeline_name", "pipeline_class",
                                                           "model_path")).lower()
    found = [partition for partition in PARTITIONS if partition in names]
    return found[0] if len(found) == 1 else None


def serves_h3(info: dict) -> bool | None:
    """True when the server names an H3 pipeline or model, False when it names another one, None when it names none."""
    names = " ".join(str(info.get(key) or "") for key in ("model_path", "pipeline_name", "pipeline_class")).lower()
    if not names.strip():
        return None
    return "h3" in names
