"""Test-session settings that must be in place before torch is imported."""

import os

# MKL picks GEMM kernels by operand alignment unless asked for conditional numerical reproducibility, so the same
# weights memory-mapped from a file and copied to a fresh allocation can differ in the last ulp. The bitwise
# equalities these tests assert (layerwise vs resident, chunked MLP vs fused) hold in that mode.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# The tiny test models gain nothing from threads, and OpenMP threads spinning on a busy 2-core machine slow small
# kernels down by orders of magnitude. Subprocesses (CLI tests) inherit these settings.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the settings above: pytest does not import torch)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache folder for the embedded tiny model, shared by the test modules that run it end to end."""
    return tmp_path_factory.mktemp("h3cache")


@pytest.fixture(scope="session")
def tiny(tiny_cache):
    """The embedded tiny default model's folder (written once per session)."""
    from h3_core.sources.tiny_default import ensure_tiny_model

    return ensure_tiny_model(tiny_cache)
