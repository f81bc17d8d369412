"""Test double of `comfy.cli_args`: the preview settings the pack reads (the real module parses all of ComfyUI's flags
with argparse into `args`; `--preview-method` defaults to none, `--preview-size` to 512). ComfyUI's executor sets
`args.preview_method` per prompt from the frontend's choice (`latent_preview.set_preview_method`); tests set it
directly."""

from __future__ import annotations

import argparse
import enum


class LatentPreviewMethod(enum.Enum):
    NoPreviews = "none"
    Auto = "auto"
    Latent2RGB = "latent2rgb"
    TAESD = "taesd"

    @classmethod
    def from_string(cls, value: str):
        return next((member for member in cls if member.value == value), None)


args = argparse.Namespace(preview_method=LatentPreviewMethod.NoPreviews, preview_size=512)


def reset() -> None:
    args.preview_method = LatentPreviewMethod.NoPreviews
    args.preview_size = 512
