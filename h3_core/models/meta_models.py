"""Models built on the meta device to read their layout — parameter names and shapes, module kinds, stage prefixes —
cached per class and constructor arguments.

Building one still runs every module's constructor and weight initialiser (0.1-0.5 s for H3's VAEs and text encoder
in Python, more at the released widths), and a request's memory plan, every checkpoint check and every LoRA check read
the same few layouts again and again. The configs are frozen dataclasses, so equal configs share one model."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def meta_model(model_cls, *args) -> torch.nn.Module:
    """`model_cls(*args)` on the meta device, shared by every caller with equal arguments: read it, never run it,
    change it or load weights into it (a loader builds its own)."""
    with torch.device("meta"):
        return model_cls(*args)
