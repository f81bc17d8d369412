"""Test-session settings that must be in place before torch is imported."""

import os

# MKL picks GEMM kernels by operand alignment unless asked for conditional numerical reproducibility, so the same
# weights memory-mapped from a file and copied to a fresh allocation can differ in the last ulp. The bitwise
# equalities these tests assert (layerwise vs resident, chunked MLP vs fused) hold in that mode.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# The tiny test models gain nothing from threads, and OpenMP threads spinning on a busy 2-core machine slow small
# kernels down by orders of magnitude. Subprocesses (CLI tests) inherit these settings.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# H3_WITHOUT_POSIX=1: run the suite as Windows' Python would see h3_core (tests/no_posix.py); applied here, before any
# test module imports h3_core.
import no_posix  # noqa: E402

if no_posix.enabled():
    no_posix.apply()

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


@pytest.fixture(scope="session")
def engine_servers(tmp_path_factory):
    """The engines' own H3 servers (tests/engine_servers.py), those whose venv is built, all started side by side
    (each takes seconds to import its engine) and shared by the modules that talk to them: "fl2va" and "ref2va"
    (SGLang 0.5.23, the Ref2VA one storing its results in S3 — moto's server — as a server with
    SGLANG_CLOUD_STORAGE_TYPE=s3 does, so its jobs end with a URL) and "vllm-omni" (vLLM-Omni 0.30.0, with an API
    key)."""
    from contextlib import ExitStack

    from engine_servers import VLLM_OMNI_KEY, MotoS3, SGLangServer, VllmOmniServer, unavailable

    started = {}
    with ExitStack() as stack:
        s3 = None
        if unavailable("sglang") is None:
            s3 = MotoS3(tmp_path_factory.mktemp("s3")).start()
            stack.callback(s3.__exit__)
            started["fl2va"] = SGLangServer(tmp_path_factory.mktemp("sglang-fl2va"), "fl2va").start()
            started["ref2va"] = SGLangServer(tmp_path_factory.mktemp("sglang-ref2va"), "ref2va",
                                             env=s3.sglang_environment()).start()
        if unavailable("vllm-omni") is None:
            started["vllm-omni"] = VllmOmniServer(tmp_path_factory.mktemp("vllm-omni"), api_key=VLLM_OMNI_KEY).start()
        for server in started.values():
            stack.callback(server.__exit__, None, None, None)
        if s3 is not None:
            s3.wait_ready()
        yield {name: server.wait_ready() for name, server in started.items()}


@pytest.fixture(scope="session")
def sglang_servers(engine_servers):
    """{"fl2va": ..., "ref2va": ...}: SGLang's own server, once per partition (see `engine_servers`)."""
    from engine_servers import require

    require("sglang")
    return {variant: engine_servers[variant] for variant in ("fl2va", "ref2va")}


@pytest.fixture(scope="session")
def vllm_omni_server(engine_servers):
    from engine_servers import require

    require("vllm-omni")
    return engine_servers["vllm-omni"]


@pytest.fixture(autouse=True)
def process_pin_budget():
    """Each test starts from a fresh process-wide pin budget: the node tests share it with the ComfyUI double's
    pinned-memory ledger (limit 0 there), which would otherwise stop every later test's CUDA-like stores pinning."""
    from h3_core.runtime import host_store

    host_store._SHARED_BUDGET = None
    yield
    host_store._SHARED_BUDGET = None
