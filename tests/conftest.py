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


def pytest_collection_finish(session):
    """Move everything imported while collecting (torch, diffusers, transformers, the test modules: about 470,000
    objects) out of the garbage collector's sight. The pipeline runs `gc.collect()` when it releases a component, and
    with those libraries loaded each collection walks them all (0.3 s), four times per generation; frozen, a
    collection sees only what the tests made since. Nothing frozen is a test's object, so what the memory and release
    tests check is collected as before."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache folder for the embedded tiny model, shared by the test modules that run it end to end."""
    return tmp_path_factory.mktemp("h3cache")


@pytest.fixture(scope="session")
def tiny(tiny_cache):
    """The embedded tiny default model's folder (written once per session)."""
    from h3_core.sources.tiny_default import ensure_tiny_model

    return ensure_tiny_model(tiny_cache)


@pytest.fixture
def run_cli(monkeypatch, capsys, tiny_cache):
    """`run_cli(args, cwd, **environment)`: `python -m h3_core ARGS` in this process (tests/cli_fixtures.py), with
    the session's tiny-model cache unless the test sets H3_STREAM_CACHE itself."""
    from cli_fixtures import run_cli_in_process

    def run(args, cwd, **environment):
        environment = {"H3_STREAM_CACHE": tiny_cache, **environment}
        return run_cli_in_process(args, cwd=cwd, monkeypatch=monkeypatch, capsys=capsys, environment=environment)

    return run
