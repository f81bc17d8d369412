"""One generation request: a frozen record of everything a front end asks for, checked once, when it is made.

Every front end builds one — the Python API (`H3Pipeline.generate`, `RemoteEngine.generate`), the CLI, the ComfyUI
nodes — and both engines take it. Each rule is written here (or, for the canvas and the frame grid, in `grid.py`) and
nowhere else; its message names the field the way the surface the user touched does (`RequestNames`: `--size` and
`--seed` in the CLI, `width` and `seed` on a node, the keyword in Python).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field

from ..errors import H3Error
from ..step_cache_settings import STEP_CACHE_OFF, STEP_CACHE_PRESETS, StepCacheSettings, step_cache_settings
from .grid import (FPS, MAX_SECONDS, LatentShape, align_num_frames, canvas_problem, frame_count_problem,
                   frames_for_seconds)
from .guides import place_guides
from .references import REFERENCE_IMAGE_SIZES, ReferenceRequest, build_references, check_reference_counts

# torch.Generator.manual_seed takes -2**63 to 2**64 - 1 and wraps negative seeds (-1 is 2**64 - 1): seeds are the
# unsigned 64-bit range, as in ComfyUI's seed widget, so that two spellings never name the same noise.
SEED_MAX = 2**64 - 1
# The released model's sigma shifts (the Python API's and the widgets' defaults).
VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
# The released model's request (1344x768, 124 frames = 5.2 s, 50 grid points).
DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_FRAMES, DEFAULT_STEPS = 1344, 768, 124, 50


@dataclass(frozen=True)
class RequestNames:
    """How one surface names each field in its messages."""

    prompt: str = "prompt"
    width: str = "width"
    height: str = "height"
    num_frames: str = "num_frames"
    steps: str = "steps"
    seed: str = "seed"
    video_shift: str = "video_shift"
    audio_shift: str = "audio_shift"
    first_frame: str = "first_frame"
    last_frame: str = "last_frame"
    guides: str = "guides"
    reference_images: str = "reference_images"
    reference_videos: str = "reference_videos"
    reference_audios: str = "reference_audios"
    reference_image_size: str = "reference_image_size"
    loras: str = "loras"
    step_cache: str = "step_cache"
    server_lora: str = "server_lora"  # the remote engine's LoRA already on the server (not a request field)
    job_timeout: str = "job_timeout"  # the remote engine's limit on a server job (not a request field)

    @property
    def references(self) -> tuple[str, str, str]:
        return self.reference_images, self.reference_videos, self.reference_audios


PYTHON_NAMES = RequestNames()


# ---- one value each -------------------------------------------------------------------------------------------------


def _whole(value) -> int | None:
    """`value` as an int when it is a whole number (int, numpy integer; not a bool or a float), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_seed(seed, name: str = "seed") -> int:
    whole = _whole(seed)
    if whole is None or not 0 <= whole <= SEED_MAX:
        raise H3Error(f"{name} {seed!r}: must be a whole number from 0 to 2**64 - 1 ({SEED_MAX}).")
    return whole


def check_steps(steps, name: str = "steps") -> int:
    whole = _whole(steps)
    if whole is None or whole < 2:
        raise H3Error(f"{name} {steps!r}: must be at least 2, a whole number (sigma grid points including the final "
                      "0: steps - 1 model calls).")
    return whole


# The largest sigma shift taken (the nodes' widgets too): the released model uses 12 and 3, published LoRAs single
# digits; far above, the float32 schedule overflows (1e308 gave NaN sigmas, blamed on the sampler input once the models
# had loaded) or its first grid points collide.
MAX_SHIFT = 100.0


def check_shift(value, name: str) -> float:
    """A sigma shift: a finite number above 0 and at most `MAX_SHIFT` (1 leaves the schedule unshifted)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
            or value > MAX_SHIFT):
        raise H3Error(f"{name} {value!r}: must be a finite number above 0 and at most {MAX_SHIFT:g} (the released "
                      f"model uses {VIDEO_SHIFT:g} for video and {AUDIO_SHIFT:g} for audio).")
    return float(value)


# Tokens a prompt may have (counted by the pipeline once the tokenizer is loaded).
MAX_PROMPT_TOKENS = 4096
# Characters a prompt may have, checked before it is tokenised: 64 per allowed token is far above any real prompt,
# and tokenising a 10 MB paste took 27 s before its refusal (after the text encoder had loaded).
MAX_PROMPT_CHARACTERS = 64 * MAX_PROMPT_TOKENS


def check_prompt(prompt, name: str = "prompt") -> str:
    """Text only: a str that encodes as UTF-8 (no lone surrogates, which is how undecodable command-line bytes
    arrive in Python), at most `MAX_PROMPT_CHARACTERS` long."""
    if not isinstance(prompt, str):
        raise H3Error(f"{name} must be a string, got {type(prompt).__name__}.")
    if len(prompt) > MAX_PROMPT_CHARACTERS:
        raise H3Error(f"{name}: {len(prompt):,} characters; at most {MAX_PROMPT_CHARACTERS:,} characters (and "
                      f"{MAX_PROMPT_TOKENS} tokens) are accepted (H3 was trained on prompts of a few hundred "
                      "tokens). Shorten it.")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = prompt[exc.start]
        if 0xDC80 <= ord(char) <= 0xDCFF:  # surrogateescape: a byte that was not UTF-8
            what = f"byte 0x{ord(char) - 0xDC00:02x}, which is not UTF-8"
        else:
            what = f"a lone surrogate U+{ord(char):04X}, which is not a character"
        raise H3Error(f"{name}: character {exc.start} is {what}; give the prompt as UTF-8 text.") from None
    return prompt


def frames_for_duration(seconds=None, frames=None, *, names: tuple[str, str] = ("seconds", "frames"),
                        round_up: bool = False) -> tuple[int, str | None]:
    """A surface's duration inputs -> (frame count on the grid, a note to show or None). `frames` wins when given
    (not None); `seconds` rounds up to the grid. `round_up` (the CLI) rounds an off-grid `frames` up with a note
    instead of refusing it (the nodes' widgets refuse)."""
    seconds_name, frames_name = names
    if frames is not None:
        whole = _whole(frames)
        if whole is None or whole < 1:
            raise H3Error(f"{frames_name} {frames!r}: must be a whole number of frames, at least 1.")
        aligned = align_num_frames(whole) if round_up else whole
        problem = frame_count_problem(aligned)
        if problem:
            grid = f" ({aligned} on the 17n + 5 grid)" if aligned != whole else ""
            raise H3Error(f"{frames_name} {whole}{grid} {problem}.")
        if aligned != whole:
            return aligned, (f"note: {whole} frames is off the 17n+5 grid the video VAE needs; rounding up to "
                             f"{aligned}.")
        return aligned, None
    if seconds is None:
        raise H3Error(f"give {seconds_name} or {frames_name}.")
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
        raise H3Error(f"{seconds_name} {seconds!r}: must be a number of seconds.")
    if not 0 < seconds <= MAX_SECONDS:
        raise H3Error(f"{seconds_name} {seconds:g}: must be more than 0 and at most {MAX_SECONDS:g} (H3 generates "
                      f"up to {MAX_SECONDS:g} s).")
    return frames_for_seconds(seconds), None


# ---- the request ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class GenerationRequest:
    """Everything one generation asks for. Made once by a front end and checked then (`__post_init__`, in
    `names`' words); `dataclasses.replace` makes a changed copy, checked again.

    `first_frame` / `last_frame`: FL2VA keyframes (PIL images, [H, W, 3] or [1, H, W, 3] tensors in [0, 1], paths).
    `guides`: `request.guides.Guide`s (an image, a clip, an audio or a clip with soundtrack at any target frame).
    `reference_images` (at most 9), `reference_videos` (at most 3: `(frames, waveform | None[, fps[, sample_rate]])`)
    and `reference_audios` (at most 3: a waveform [C, N] at 32 kHz or `(waveform, sample_rate)`): Ref2VA references,
    in request order images, videos, audios; `reference_image_size` "reference" / "max" / "match";
    `reference_labels` ((kind, index), label) pairs name single references in errors (file names in the CLI).
    `loras` ((file, strength), ...) is the transformer's LoRA set for this request (None keeps the one it has).
    `step_cache`: a preset name of `STEP_CACHE_PRESETS` ("off", the default, is the uncached path) or
    `StepCacheSettings`; normalised to the settings, or None for off."""

    prompt: str
    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    num_frames: int = DEFAULT_FRAMES
    steps: int = DEFAULT_STEPS
    seed: int = 0
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT
    first_frame: object = None
    last_frame: object = None
    guides: tuple = ()
    reference_images: tuple = ()
    reference_videos: tuple = ()
    reference_audios: tuple = ()
    reference_image_size: str = "reference"
    reference_labels: tuple = ()
    loras: tuple | None = None
    step_cache: object = STEP_CACHE_OFF
    names: RequestNames = field(default=PYTHON_NAMES, repr=False)
    # Normalised references per canvas rule (`normalised_references`): made once whoever asks first.
    _normalised: dict = field(default_factory=dict, init=False, repr=False)
    # The guides checked against the canvas and duration (`placed_guides`) and the notes they gave (`notes`).
    _placed_guides: tuple = field(default=(), init=False, repr=False)
    _notes: tuple = field(default=(), init=False, repr=False)

    def __post_init__(self):
        n = self.names
        set_ = object.__setattr__  # frozen: values are normalised once, here
        set_(self, "prompt", check_prompt(self.prompt, n.prompt))
        for name, label in (("width", n.width), ("height", n.height)):
            problem = canvas_problem(getattr(self, name))
            if problem:
                raise H3Error(f"{label} {getattr(self, name)!r} {problem}.")
            set_(self, name, operator.index(getattr(self, name)))
        problem = frame_count_problem(self.num_frames)
        if problem:
            raise H3Error(f"{n.num_frames} {self.num_frames!r} {problem}.")
        set_(self, "num_frames", operator.index(self.num_frames))
        set_(self, "steps", check_steps(self.steps, n.steps))
        set_(self, "seed", check_seed(self.seed, n.seed))
        set_(self, "video_shift", check_shift(self.video_shift, n.video_shift))
        set_(self, "audio_shift", check_shift(self.audio_shift, n.audio_shift))
        for name in ("guides", "reference_images", "reference_videos", "reference_audios", "reference_labels"):
            value = getattr(self, name)
            set_(self, name, tuple(value) if value is not None else ())
        if self.has_references:
            check_reference_counts(len(self.reference_images), len(self.reference_videos),
                                   len(self.reference_audios), n.references)
            if self.anchors:
                raise H3Error(f"{n.first_frame} / {n.last_frame} cannot be combined with {' / '.join(n.references)}"
                              ": the Ref2VA layout with keyframes is not implemented; give keyframes (FL2VA) or "
                              "references (Ref2VA), not both.")
        if self.guides:
            if self.has_references:
                raise H3Error(f"{n.guides} cannot be combined with {' / '.join(n.references)}: the Ref2VA layout "
                              "with guides is not implemented; give guides (FL2VA) or references (Ref2VA), not both.")
            shape = self.shape
            anchors = tuple((name, frame) for anchor, name, frame in (
                ("first", n.first_frame, 0), ("last", n.last_frame, self.num_frames - 1)) if anchor in self.anchors)
            placed, notes = place_guides(self.guides, num_frames=self.num_frames, width=self.width,
                                         height=self.height, audio_latents=shape.audio_latents, anchors=anchors,
                                         name=n.guides)
            set_(self, "_placed_guides", placed)
            set_(self, "_notes", notes)
        if self.reference_image_size not in REFERENCE_IMAGE_SIZES:
            raise H3Error(f"{n.reference_image_size} {self.reference_image_size!r}: use one of "
                          f"{', '.join(REFERENCE_IMAGE_SIZES)}.")
        if self.loras is not None:
            set_(self, "loras", _check_loras(self.loras, n.loras))
        if self.step_cache is None or isinstance(self.step_cache, (str, StepCacheSettings)):
            set_(self, "step_cache", step_cache_settings(self.step_cache, name=n.step_cache))
        else:
            raise H3Error(f"{n.step_cache} {self.step_cache!r}: give a preset name "
                          f"({', '.join(STEP_CACHE_PRESETS)}) or StepCacheSettings.")

    # -- what the request implies ----------------------------------------------------------------------------------

    @property
    def shape(self) -> LatentShape:
        return LatentShape.for_request(self.width, self.height, self.num_frames)

    @property
    def seconds(self) -> float:
        return self.num_frames / FPS

    @property
    def anchors(self) -> tuple[str, ...]:
        """The keyframe anchors given, in packed order ("first", "last")."""
        return tuple(a for a, image in (("first", self.first_frame), ("last", self.last_frame)) if image is not None)

    @property
    def keyframe_images(self) -> list:
        return [image for image in (self.first_frame, self.last_frame) if image is not None]

    @property
    def placed_guides(self) -> tuple:
        """The guides checked against this request's canvas and duration (`request.guides.PlacedGuide`s, request
        order): resolved frame, the clip frames kept, the audio as stereo 32 kHz."""
        return self._placed_guides

    @property
    def notes(self) -> tuple[str, ...]:
        """Lines to show the user about how the request was taken (a guide clip cropped to the 17k + 5 grid, ...);
        the CLI prints them, `H3Pipeline` logs them."""
        return self._notes

    @property
    def has_references(self) -> bool:
        return bool(self.reference_images or self.reference_videos or self.reference_audios)

    def normalised_references(self, canvas_rules: dict | None = None) -> ReferenceRequest | None:
        """The references checked and normalised onto H3's rates and sizes (`references.build_references`) with a
        model's canvas rules; None without references. Made once per rule set, whoever asks first (the CLI's
        estimate, then the pipeline)."""
        if not self.has_references:
            return None
        key = tuple(sorted((canvas_rules or {}).items()))
        if key not in self._normalised:
            self._normalised[key] = build_references(
                self.reference_images, self.reference_videos, self.reference_audios, num_frames=self.num_frames,
                width=self.width, height=self.height, reference_image_size=self.reference_image_size,
                names=self.names.references, labels=dict(self.reference_labels), canvas_rules=canvas_rules)
        return self._normalised[key]

    def replace(self, **changes) -> "GenerationRequest":
        """A copy with `changes`, checked again (in the same words)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, request: "GenerationRequest | str", fields: dict, names: RequestNames = PYTHON_NAMES,
           ) -> "GenerationRequest":
        """The request an engine call gives: a `GenerationRequest`, or a prompt with the fields as keywords (the
        Python API's `generate(prompt, width=..., ...)`), never both."""
        if isinstance(request, GenerationRequest):
            if fields:
                raise H3Error(f"give a GenerationRequest or its fields ({', '.join(sorted(fields))}), not both.")
            return request
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls) if f.init} - {"names"})
        if unknown:
            raise H3Error(f"unknown request field(s) {unknown}; a request has "
                          f"{[f.name for f in dataclasses.fields(cls) if f.init and f.name != 'names']}.")
        return cls(prompt=request, **{"names": names, **fields})


def _check_loras(loras, name: str) -> tuple:
    """((file, strength), ...): each strength a finite number; the files are read by the LoRA loader."""
    checked = []
    for entry in loras:
        try:
            path, strength = entry
        except (TypeError, ValueError):
            raise H3Error(f"{name}: each LoRA is (file, strength), got {entry!r}.") from None
        if isinstance(strength, bool) or not isinstance(strength, numbers.Real) or not math.isfinite(strength):
            raise H3Error(f"{name}: the strength of {path} must be a finite number, got {strength!r}.")
        checked.append((path, float(strength)))
    return tuple(checked)

