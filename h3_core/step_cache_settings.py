"""The step cache's settings and presets (the algorithm is models/step_cache.py): shared by the request, which takes a
preset name or settings from every surface, and the transformer's cache, which runs them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .errors import H3Error

STEP_CACHE_OFF = "off"


@dataclass(frozen=True)
class StepCacheSettings:
    """DBCache's settings: Fn, Bn, the residual-change threshold, warm-up calls and the cap on consecutive hits."""

    first_blocks: int = 1
    last_blocks: int = 0
    threshold: float = 0.04
    warmup_steps: int = 4
    max_consecutive: int = 1
    name: str = "custom"

    def describe(self) -> str:
        cap = "no cap" if self.max_consecutive < 0 else f"at most {self.max_consecutive} in a row"
        return (f"{self.name}: first {self.first_blocks} / last {self.last_blocks} blocks always run, threshold "
                f"{self.threshold:g}, {self.warmup_steps} warm-up steps, {cap}")


# The anchors' H3 settings: SGLang's quality="high" (MINIMAX_H3_HIGH_QUALITY_CACHE_DIT_CONFIG = (4, 0.04, 1) with Fn 1,
# Bn 0, sglang 0.5.23) is vLLM-Omni 0.30's quality="high" profile too; "fast" is SGLang's generic Cache-DiT default
# (CacheDitConfig: Fn 1, Bn 0, warm-up 4, threshold 0.24, at most 3 in a row).
STEP_CACHE_PRESETS: dict[str, StepCacheSettings | None] = {
    STEP_CACHE_OFF: None,
    "quality": StepCacheSettings(1, 0, 0.04, 4, 1, name="quality"),
    "fast": StepCacheSettings(1, 0, 0.24, 4, 3, name="fast"),
}


def _integer(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise H3Error(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def step_cache_settings(preset="off", *, first_blocks=None, last_blocks=None, threshold=None, warmup_steps=None,
                        max_consecutive=None, name: str = "step_cache",
                        labels: dict[str, str] | None = None) -> StepCacheSettings | None:
    """The settings of `preset` (a name of `STEP_CACHE_PRESETS`, or settings) with any number given overriding it;
    None for "off" with no override. `name` is how the surface names the option in its messages, `labels` how it
    names each number (a field name -> e.g. a CLI flag; see `check_settings`)."""
    if isinstance(preset, StepCacheSettings):
        base = preset
    else:
        key = str(preset).strip().lower() if preset is not None else STEP_CACHE_OFF
        if key not in STEP_CACHE_PRESETS:
            raise H3Error(f"{name} {preset!r} is not a preset; use one of {', '.join(STEP_CACHE_PRESETS)}.")
        base = STEP_CACHE_PRESETS[key]
    overrides = {k: v for k, v in (("first_blocks", first_blocks), ("last_blocks", last_blocks),
                                   ("threshold", threshold), ("warmup_steps", warmup_steps),
                                   ("max_consecutive", max_consecutive)) if v is not None}
    if base is None and not overrides:
        return None
    if base is None:
        base = STEP_CACHE_PRESETS["quality"]
    if overrides:
        base = StepCacheSettings(**{**base.__dict__, **overrides, "name": "custom"})
    return check_settings(base, name, labels)


def check_settings(settings: StepCacheSettings, name: str = "step_cache",
                   labels: dict[str, str] | None = None) -> StepCacheSettings:
    """The settings with each number checked; a bad one is named `labels[field]`, else "`name`: <what it is>"."""
    label = {field: f"{name}: {what}" for field, what in (
        ("first_blocks", "first blocks (Fn)"), ("last_blocks", "last blocks (Bn)"), ("warmup_steps", "warm-up steps"),
        ("max_consecutive", "most consecutive hits"), ("threshold", "the threshold"))}
    label.update(labels or {})
    first = _integer(settings.first_blocks, label["first_blocks"], 1)
    last = _integer(settings.last_blocks, label["last_blocks"], 0)
    warmup = _integer(settings.warmup_steps, label["warmup_steps"], 0)
    cap = _integer(settings.max_consecutive, label["max_consecutive"], -1)
    threshold = settings.threshold
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(threshold):
        raise H3Error(f"{label['threshold']} must be a finite number (0 never skips, 1 always does), got "
                      f"{threshold!r}.")
    return StepCacheSettings(first, last, float(threshold), warmup, cap, settings.name)
