"""The one spelling of each setting a user chooses, shared by every surface: the CLI's choices are these names, the
ComfyUI widgets map their own labels onto them in one line each, and h3_core's code compares against these."""

from __future__ import annotations

import torch

from .errors import H3Error

# Where a component's weights live while it runs (`h3_core.runtime.residency.Residency` takes its values from here).
RESIDENT = "resident"  # every weight on the device
LAYERWISE = "layerwise"  # blocks in host memory, streamed to the device one at a time
RESIDENCIES = (RESIDENT, LAYERWISE)
# The compute dtype a component is loaded in; "auto" keeps the checkpoint's own dtypes.
DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_named(name: str, setting: str = "dtype") -> torch.dtype | None:
    """The torch dtype a `DTYPES` name stands for (None: the checkpoint's own); `setting` names it in errors."""
    if name not in DTYPES:
        raise H3Error(f"{setting} {name!r}: use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def check_residency(name: str, setting: str = "residency") -> str:
    if name not in RESIDENCIES:
        raise H3Error(f"{setting} {name!r}: use one of {', '.join(RESIDENCIES)}.")
    return name
