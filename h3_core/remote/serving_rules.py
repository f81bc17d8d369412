"""What an H3 serving engine accepts, checked here before anything is sent, and how a request is lowered onto it.

Both engines take MiniMax H3's own request schema (`minimax_h3.request/v1`): a `task`, ordered `conditions` and a
`target` of `short_edge`, `aspect_ratio` and `duration_seconds`. The server makes the canvas and the frame count
from the target; it takes no width, height or frame count. Read from SGLang 0.5.23's code
(`sglang/multimodal_gen/runtime/pipelines_core/stages/model_specific_stages/minimax_h3/`: `constants.py`,
`request_validation.py`, `task_profiles.py`, `resolved_plan.py`, `time_request.py`, `configs/sample/minimax_h3.py`)
and vLLM-Omni 0.30.0's (see `vllm_omni_api.py`).

What each engine accepts beyond text (read from the same code):
- SGLang 0.5.23: first / last keyframe images (`conditions` of role "keyframe", type "image", `frame_index` [0], [-1]
  or [0, -1], in that order: `MINIMAX_H3_FL2VA_KEYFRAME_SIGNATURES`; its task profiles admit no other keyframe type,
  though the schema names image | video | video_audio | audio), and references (role "reference": image, video,
  video_audio, audio) on ref2va, with one keyframe signature beside them.
- vLLM-Omni 0.30.0: the same keyframes (`extra_params.frame_indices`), and references; not both in one request.
So a request's guides (`request.guides`) go to either engine only as one image at the first or the last frame (the
keyframe they are); a guide in between, a clip, an audio or a clip with its soundtrack is refused before sending,
naming the engine (`server_keyframes`): such guides are a local run's.

Lowering keeps the request exact: the target is chosen so that the canvas and the frame count the server resolves are
the ones asked for, and a request the server cannot make exactly is refused here, saying what it would make instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import H3Error
from ..request.generation_request import GenerationRequest
from ..request.grid import CANVAS_MULTIPLE, FPS, align_num_frames
from ..request.references import CANVAS_MAX_PIXELS, resolve_canvas

TASK_TEXT, TASK_KEYFRAMES, TASK_REFERENCES = "t2va", "fl2va", "ref2va"
# The partition (`--model-variant`) each task is served by.
PARTITION_OF_TASK = {TASK_TEXT: "fl2va", TASK_KEYFRAMES: "fl2va", TASK_REFERENCES: "ref2va"}
MIN_SECONDS, MAX_SECONDS = 4.0, 15.0
# Seeds are signed 64-bit on the servers; h3-stream's go to 2**64 - 1.
SERVER_SEED_MAX = 2**63 - 1
# t2va and ref2va take these ratios only (or "auto", which is 16:9); fl2va takes any W:H from 1:4 to 4:1.
ASPECT_RATIOS = ("21:9", "16:9", "4:3", "1:1", "3:4", "9:16")
MIN_RATIO, MAX_RATIO = 0.25, 4.0
KEYFRAME_INDEX = {"first": 0, "last": -1}
# The reference image sizing rules, h3-stream's names -> the servers' `reference_resize_mode`.
REFERENCE_RESIZE_MODE = {"reference": "diffusers", "max": "max", "match": "match"}


@dataclass(frozen=True)
class ServerTarget:
    short_edge: int
    aspect_ratio: str
    duration_seconds: float

    def as_json(self) -> dict:
        return {"short_edge": self.short_edge, "aspect_ratio": self.aspect_ratio,
                "duration_seconds": self.duration_seconds}


def task_of(request: GenerationRequest) -> str:
    if request.has_references:
        return TASK_REFERENCES
    return TASK_KEYFRAMES if request.anchors or request.guides else TASK_TEXT


GUIDE_KINDS = {"image": "an image", "video": "a clip", "video_audio": "a clip with its soundtrack",
               "audio": "an audio"}


@dataclass(frozen=True)
class ServerKeyframe:
    """One keyframe condition: `frame_index` 0 or -1 (the servers' only two), the image as given, its label."""

    frame_index: int
    image: object
    label: str


def server_keyframes(request: GenerationRequest, engine: str) -> list[ServerKeyframe]:
    """The request's keyframes as both engines take them: first_frame / last_frame and the guides that are one image
    at the first or the last frame, ordered 0 then -1 (SGLang 0.5.23 and vLLM-Omni 0.30.0 take keyframe images at
    `frame_index` [0], [-1] or [0, -1] only: SGLang's `MINIMAX_H3_FL2VA_KEYFRAME_SIGNATURES`, its task profiles admit
    no other keyframe type; vLLM-Omni's `frame_indices`). Any other guide is refused naming the engine: a clip, an
    audio, or a frame in between is guided by a local run only."""
    names = request.names
    keyframes = [ServerKeyframe(KEYFRAME_INDEX[anchor], image,
                                names.first_frame if anchor == "first" else names.last_frame)
                 for anchor, image in zip(request.anchors, request.keyframe_images)]
    last = request.num_frames - 1
    # `placed_guides` were checked when the request was made (inside the video, no overlap with each other or with
    # first_frame / last_frame): what is left to refuse is what these engines cannot take.
    for placed in request.placed_guides:
        guide = placed.guide
        index = 0 if placed.frame == 0 else -1 if placed.frame == last else None
        if guide.kind != "image" or index is None:
            where = ("the first frame" if index == 0 else "the last frame" if index == -1 else
                     f"frame {guide.frame} (of {request.num_frames} frames)")
            raise H3Error(f"{placed.label}: {engine} takes guides only as one image at the first or the last frame "
                          f"(frame 0 or -1, its keyframes), and this is {GUIDE_KINDS[guide.kind]} at {where}; run "
                          "this request locally, where a guide may be an image, a clip or an audio at any frame.")
        keyframes.append(ServerKeyframe(index, guide.frames[0], placed.label))
    return sorted(keyframes, key=lambda keyframe: keyframe.frame_index == -1)


def server_canvas(short_edge: int, aspect_ratio: str) -> tuple[int, int]:
    """(width, height) the server makes for a short edge and an aspect ratio (`adapt_shape_v1`: the short edge scaled
    by the ratio, the area capped at 768 x 1344, each side rounded to the nearest multiple of 32)."""
    ratio_width, ratio_height = (int(part) for part in aspect_ratio.split(":"))
    height, width = resolve_canvas(ratio_width, ratio_height, short_edge=short_edge, max_pixels=CANVAS_MAX_PIXELS,
                                   multiple=CANVAS_MULTIPLE)
    return width, height


def server_frame_count(duration_seconds: float) -> int:
    return align_num_frames(max(1, round(duration_seconds * FPS)))


def _ratio_text(width: int, height: int) -> str:
    divisor = math.gcd(width, height)
    return f"{width // divisor}:{height // divisor}"


def _nearest_ratios(width: int, height: int) -> list[str]:
    wanted = math.log(width / height)
    def distance(ratio: str) -> float:
        ratio_width, ratio_height = (int(part) for part in ratio.split(":"))
        return abs(math.log(ratio_width / ratio_height) - wanted)

    return sorted(ASPECT_RATIOS, key=distance)


def choose_aspect(request: GenerationRequest, task: str, engine: str, *, any_canvas: bool = False
                  ) -> tuple[int, str]:
    """(short_edge, aspect_ratio) for which the server makes exactly the request's canvas, or an H3Error naming the
    canvases it would make instead. `any_canvas`: the server takes the canvas itself (vLLM-Omni's width / height)
    and the named ratio nearest to it."""
    width, height, names = request.width, request.height, request.names
    if not MIN_RATIO <= width / height <= MAX_RATIO:
        raise H3Error(f"{names.width} {width} / {names.height} {height}: {engine} takes canvases from 1:4 to 4:1.")
    short_edge = min(width, height)
    if any_canvas:
        return short_edge, _nearest_ratios(width, height)[0]
    candidates = [_ratio_text(width, height)] if task == TASK_KEYFRAMES else []
    candidates += [ratio for ratio in ASPECT_RATIOS if ratio not in candidates]
    for ratio in candidates:
        if server_canvas(short_edge, ratio) == (width, height):
            return short_edge, ratio
    if task == TASK_KEYFRAMES:
        made = server_canvas(short_edge, _ratio_text(width, height))
        raise H3Error(f"{names.width} {width} / {names.height} {height}: {engine} caps the canvas at "
                      f"{CANVAS_MAX_PIXELS:,} pixels (768 x 1344) and would make {made[0]}x{made[1]} for short edge "
                      f"{short_edge} at {_ratio_text(width, height)}; set width {made[0]} and height {made[1]}, or "
                      "run locally.")
    offers = []
    for ratio in _nearest_ratios(width, height)[:2]:
        made = server_canvas(short_edge, ratio)
        offers.append(f"{made[0]}x{made[1]} ({ratio} at short edge {short_edge})")
    raise H3Error(f"{names.width} {width} / {names.height} {height}: {engine} makes a {task} canvas from a short "
                  f"edge and one of the aspect ratios {', '.join(ASPECT_RATIOS)}, and cannot make {width}x{height}; "
                  f"it would make {' or '.join(offers)}. Set width and height to one of these, or run locally.")


def choose_duration(request: GenerationRequest, engine: str, *, whole_seconds: bool = False) -> float:
    """The `duration_seconds` for which the server makes exactly the request's frame count (or an H3Error)."""
    frames, name = request.num_frames, request.names.num_frames
    low, high = server_frame_count(MIN_SECONDS), server_frame_count(MAX_SECONDS)
    candidates = [min(max(frames / FPS, MIN_SECONDS), MAX_SECONDS)]
    if whole_seconds:
        candidates = [float(s) for s in range(int(MIN_SECONDS), int(MAX_SECONDS) + 1)]
    for seconds in candidates:
        if server_frame_count(seconds) == frames:
            return seconds
    if whole_seconds:
        served = sorted({server_frame_count(s) for s in candidates})
        raise H3Error(f"{name}: {frames} frames ({frames / FPS:.2f} s) cannot be asked of {engine}, which takes whole "
                      f"seconds from {MIN_SECONDS:g} to {MAX_SECONDS:g} and makes one of {served} frames; ask for "
                      f"one of those, or run locally.")
    raise H3Error(f"{name}: {frames} frames ({frames / FPS:.2f} s) is outside what {engine} makes: "
                  f"{MIN_SECONDS:g} to {MAX_SECONDS:g} s, {low} to {high} frames on the 17n+5 grid. Ask for at least "
                  f"{low} frames ({low / FPS:.2f} s), or run locally.")


def check_seed(request: GenerationRequest, engine: str) -> int:
    if request.seed > SERVER_SEED_MAX:
        raise H3Error(f"{request.names.seed} {request.seed}: {engine} takes seeds up to 2**63 - 1 "
                      f"({SERVER_SEED_MAX}); use a smaller seed.")
    return request.seed


def server_target(request: GenerationRequest, engine: str, *, whole_seconds: bool = False) -> ServerTarget:
    short_edge, ratio = choose_aspect(request, task_of(request), engine)
    return ServerTarget(short_edge, ratio, choose_duration(request, engine, whole_seconds=whole_seconds))


def check_partition(task: str, served: str | None, asked: str | None, url: str, start_command: str) -> None:
    """Refuse a task the server's (or the user's stated) partition does not serve. `start_command` has a
    `{partition}` field: how the engine is started for one."""
    partition = served or asked
    needed = PARTITION_OF_TASK[task]
    if partition and partition != needed:
        what = {TASK_TEXT: "a text-to-video request", TASK_KEYFRAMES: "keyframes",
                TASK_REFERENCES: "references"}[task]
        who = f"the server at {url} serves" if served else "partition is"
        raise H3Error(f"{what} need H3's {needed.upper()} partition but {who} {partition.upper()}; point at a "
                      f"server started with {start_command.format(partition=needed)}"
                      + ("" if served else f", and set partition {needed}") + ".")


@dataclass(frozen=True)
class ServerLora:
    """A LoRA already on the server: its path there (never read here) and strength. `name` is what the server's
    adapter cache calls it: the file's stem."""

    path: str
    strength: float = 1.0

    @property
    def name(self) -> str:
        stem = self.path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
        return stem.rsplit(".", 1)[0] if "." in stem else stem


def parse_server_lora(value, name: str = "server_lora") -> ServerLora | None:
    """`PATH[:STRENGTH]` (a str), a (path, strength) pair, a `ServerLora` or None / "" (none); `name` is how the
    surface calls it in messages (--server-lora in the CLI)."""
    if value is None or isinstance(value, ServerLora):
        return value
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        path, strength = text, 1.0
        head, colon, tail = text.rpartition(":")
        if colon and head:
            try:
                path, strength = head, float(tail)
            except ValueError:
                path = text
    else:
        try:
            path, strength = value
        except (TypeError, ValueError):
            raise H3Error(f"{name}: give the LoRA's path on the server, optionally :STRENGTH (e.g. "
                          f"/models/loras/turbo.safetensors:0.8), got {value!r}.") from None
    if not isinstance(path, str) or not path.strip():
        raise H3Error(f"{name}: give the LoRA's path on the server, e.g. /models/loras/turbo.safetensors.")
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise H3Error(f"{name} {value!r}: the strength must be a finite number.")
    return ServerLora(path.strip(), float(strength))
