"""Reading the next phase's component ahead: while sampling runs, the kernel reads the video VAE's files into the page
cache (`H3Pipeline.read_ahead`, `file_reads.read_ahead_files`), so its load after sampling reads memory instead of
waiting for the disk (benchmarks/whole_model.py: a resident 5 GB video VAE took 10 s to load after sampling)."""

from __future__ import annotations

import os

import pytest
import torch

from h3_core.runtime.file_reads import disk_read_bytes, read_ahead_files

needs_hints = pytest.mark.skipif(not hasattr(os, "posix_fadvise") or disk_read_bytes() is None,
                                 reason="dropping cached pages and /proc/self/io are Linux's")


def _drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_counted(path) -> int:
    """Bytes read from storage while reading the whole file."""
    before = disk_read_bytes()
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass
    return disk_read_bytes() - before


@needs_hints
def test_a_file_read_ahead_is_then_read_from_memory(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(48 << 20))
    _drop(path)
    cold = _read_counted(path)
    if cold < (40 << 20):
        pytest.skip("this file system does not drop cached pages (tmpfs?): nothing to measure")
    _drop(path)
    thread = read_ahead_files([path], limit_bytes=1 << 40)
    assert thread is not None
    thread.join()
    assert _read_counted(path) < (4 << 20)  # the read-ahead read it; our read found it in memory


@needs_hints
def test_files_larger_than_the_limit_or_memory_unknown_are_not_read_ahead(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * (1 << 20))
    assert read_ahead_files([path], limit_bytes=(1 << 20) - 1) is None
    assert read_ahead_files([path], limit_bytes=None) is None
    assert read_ahead_files([tmp_path / "gone.bin"], limit_bytes=1 << 40) is None


@needs_hints
def test_the_pipeline_reads_the_video_vae_ahead_only_while_it_is_not_loaded(tiny):
    from h3_core.pipeline import H3Pipeline
    from h3_core.sources.model_sources import resolve_model

    pipeline = H3Pipeline(resolve_model(tiny), device="cpu", dtype=torch.float32)
    thread = pipeline.read_ahead("video_vae")
    assert thread is not None
    thread.join()
    pipeline.component("video_vae")
    assert pipeline.read_ahead("video_vae") is None
    pipeline.release_all()
