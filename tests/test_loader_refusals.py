"""The component loaders (`load_dit`, `load_text_encoder`, `load_video_vae`, `load_audio_vae`) refuse another
component's file by naming what it is, and a failed load leaves no file descriptor open."""

from __future__ import annotations

import os

import pytest

import h3_core
from h3_core.errors import CheckpointError
from h3_core.sources import resolve_model


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_components_given_to_the_wrong_loader(tiny):
    sources = resolve_model(tiny)
    with pytest.raises(CheckpointError, match="transformer"):
        h3_core.load_video_vae(sources.transformer)
    with pytest.raises(CheckpointError, match="transformer"):
        h3_core.load_audio_vae(sources.transformer)
    with pytest.raises(CheckpointError, match="audio VAE"):
        h3_core.load_video_vae(sources.audio_vae)
    with pytest.raises(CheckpointError, match="load_video_vae"):
        h3_core.load_audio_vae(sources.video_vae)
    with pytest.raises(CheckpointError, match="VAE"):
        h3_core.load_dit(sources.audio_vae)
    with pytest.raises(CheckpointError, match="transformer"):
        h3_core.load_text_encoder(sources.transformer)


def test_failed_loads_leave_nothing_behind(tiny, tmp_path):
    bad = tmp_path / "truncated.safetensors"
    data = resolve_model(tiny).transformer.read_bytes()
    bad.write_bytes(data[: len(data) // 3])
    for attempt in range(3):  # warm up allocator and imports
        with pytest.raises(CheckpointError):
            h3_core.load_dit(bad)
    before = fd_count()
    for attempt in range(30):
        with pytest.raises(CheckpointError):
            h3_core.load_dit(bad)
        with pytest.raises(CheckpointError):
            h3_core.load_video_vae(bad)
    assert fd_count() == before
