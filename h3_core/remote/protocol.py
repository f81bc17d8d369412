"""The facts h3-stream relies on that both H3 serving engines share: the OpenAI-style videos API's paths, the job
object, its statuses, error bodies and model cards. What each engine adds or refuses is in `sglang_api.py` and
`vllm_omni_api.py`; what H3 requests they accept is in `serving_rules.py`. Read from the engines' own code (SGLang
0.5.23, vLLM-Omni 0.30.0); when a server changes, these modules are the ones to update.
"""

from __future__ import annotations

from ..errors import H3Error

# ---- paths ------------------------------------------------------------------------------------------------------------
MODELS_PATH = "/v1/models"
LEGACY_MODELS_PATH = "/models"  # SGLang's older card, deprecated there; vLLM-Omni has none
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


def check_api_key(api_key, where: str) -> str | None:
    """An API key as an HTTP header carries it: one line of printable ASCII. A line break (a key pasted with its
    newline) would be refused by http.client in a traceback that shows the key, a non-Latin character fails to
    encode; the message says where the key came from (`where`) and never shows it."""
    if api_key is None or api_key == "":
        return None
    if not isinstance(api_key, str):
        raise H3Error(f"{where}: the API key must be text, got {type(api_key).__name__}.")
    for position, character in enumerate(api_key, 1):
        if not " " < character <= "~":
            what = "a line break" if character in "\r\n" else ("a space" if character.isspace() else
                                                                "a character that is not printable ASCII")
            raise H3Error(f"{where}: the API key holds {what} at character {position} of {len(api_key)}; a key is "
                          "one line of printable ASCII without spaces. Set it again (without the trailing newline "
                          "or quotes).")
    return api_key


# ---- job statuses ---------------------------------------------------------------------------------------------------
# SGLang sets queued / completed / failed; OpenAI's Videos API adds in_progress; MiniMax's poll script accepts these.
COMPLETED = frozenset({"completed", "success", "succeeded", "finished", "done"})
FAILED = frozenset({"failed", "failure", "fail", "error", "cancelled", "canceled", "expired", "deleted"})
RUNNING = frozenset({"queued", "queueing", "preparing", "processing", "running", "pending", "in_progress",
                     "in-progress"})

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


def job_url(job: dict) -> str | None:
    """Where the server stored the result when it uploaded it (SGLang's cloud storage), else None."""
    value = job.get("url") if isinstance(job, dict) else None
    return value if isinstance(value, str) and value.startswith(("http://", "https://")) else None


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
        if isinstance(parsed.get("error"), str) and parsed["error"]:  # vllm's auth middleware
            return parsed["error"]
        if parsed.get("detail"):
            detail = parsed["detail"]
            if isinstance(detail, list) and all(isinstance(item, dict) and "msg" in item for item in detail):
                # FastAPI's validation errors (422): where and what
                return "; ".join(f"{'.'.join(str(p) for p in item.get('loc', ()))}: {item['msg']}"
                                 for item in detail)
            return detail if isinstance(detail, str) else json.dumps(detail)
        if parsed.get("message"):
            return str(parsed["message"])
    return text[:500]


# ---- GET /v1/models ---------------------------------------------------------------------------------------------
# `{"object": "list", "data": [card, ...]}`; a card has `id` (the served model name), `owned_by` (the engine) and,
# on SGLang, `task_type`, `pipeline_name`, `pipeline_class`, `num_gpus`, `dit_precision`. SGLang's deprecated
# `GET /models` answers one card-like object (`model_path` instead of `id`). No card names H3's partition.
PARTITIONS = ("fl2va", "ref2va")


def model_card(answer: dict) -> dict:
    """The first model card of a `/v1/models` answer (or the legacy `/models` object itself); {} when none."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if isinstance(data, list):
        return next((card for card in data if isinstance(card, dict)), {})
    return answer if isinstance(answer, dict) else {}


def card_names(card: dict) -> str:
    return " ".join(str(card.get(key) or "") for key in ("id", "root", "model_path", "pipeline_name",
                                                          "pipeline_class")).strip()


def served_partition(card: dict) -> str | None:
    """The partition a card names (`model_variant`, or a name with fl2va / ref2va in it), None when it names none."""
    variant = str(card.get("model_variant") or "").lower()
    if variant in PARTITIONS:
        return variant
    found = [partition for partition in PARTITIONS if partition in card_names(card).lower()]
    return found[0] if len(found) == 1 else None


def serves_h3(card: dict) -> bool | None:
    """True when the card's pipeline is H3's, False when it is another one, None when the card names no pipeline
    (vLLM-Omni's: its `id` / `root` may be any local path, so a name without "h3" proves nothing)."""
    pipeline = " ".join(str(card.get(key) or "") for key in ("pipeline_name", "pipeline_class")).strip().lower()
    if not pipeline:
        return None
    return "h3" in pipeline


def card_engine(card: dict) -> str:
    return str(card.get("owned_by") or "").strip().lower()
