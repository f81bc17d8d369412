"""Interruption and out of device memory inside a transformer block: every streamed block is released, the model is
left as it was (the next run gives the clean run's output), and the CLI's Ctrl-C exits with 130 and writes nothing."""

from __future__ import annotations

import os

import pytest
import torch

from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model

REQUEST = dict(width=64, height=64, num_frames=5, steps=3, seed=5)


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def streamed(tiny):
    """A pipeline streaming its transformer layerwise, kept across runs (so each run uses the same model), and its
    clean output. Shared by the tests below: each leaves the model as it found it, which the other then relies on."""
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True, keep_transformer=True,
                      component_options={"transformer": {"residency": "layerwise", "prefetch": 1}})
    clean = pipe.generate("a red fox", **REQUEST)
    yield pipe, pipe.component("transformer"), clean
    pipe.release_all()


def test_interrupt_mid_step_releases_every_streamed_block(streamed):
    pipe, dit, clean = streamed
    attributes = {name: id(value) for name, value in vars(dit).items()}
    calls = []

    def interrupt():
        calls.append(1)
        # 3 checks in the sampling setup, 1 before the precompute, 2 in it, 1 + 2 in step 1: step 2, block 0
        if len(calls) == 11:
            raise Stop()

    with pytest.raises(Stop):
        pipe.generate("a red fox", check_interrupt=interrupt, **REQUEST)
    assert dit.block_residency.materialised_streamed() == []
    assert dit.weight_phases.materialised() == ()
    assert {name: id(value) for name, value in vars(dit).items()} == attributes  # the run changed nothing on it
    again = pipe.generate("a red fox", **REQUEST)
    assert torch.equal(again.frames, clean.frames) and torch.equal(again.waveform, clean.waveform)


def test_out_of_memory_inside_a_block(streamed, monkeypatch):
    pipe, dit, clean = streamed
    block = dit.blocks[1]
    original = type(block).forward

    def exhausted(self, *args, **kwargs):
        if self is block:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(block), "forward", exhausted)
    with pytest.raises(H3Error) as info:
        pipe.generate("a red fox", **REQUEST)
    message = str(info.value)
    assert "out of device memory" in message and "chunk size" in message and "layerwise" in message
    assert "memory_budget" in message and "Every streamed block was released" in message
    assert dit.block_residency.materialised_streamed() == []
    monkeypatch.setattr(type(block), "forward", original)
    assert torch.equal(pipe.generate("a red fox", **REQUEST).frames, clean.frames)


def test_cli_ctrl_c_exits_cleanly(tiny, monkeypatch, capsys):
    from h3_core.app import cli

    released = []
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(H3Pipeline, "generate", interrupted)
    monkeypatch.setattr(H3Pipeline, "release_all", lambda self: released.append(True))
    assert cli.main(["generate", "x", "--out", str(tiny.parent / "never.mp4")]) == 130
    assert "interrupted" in capsys.readouterr().err and released == [True]
    assert not (tiny.parent / "never.mp4").exists()


# ---- a Ctrl-C after the output is written: the real CLI process, a real SIGINT at a chosen instruction ------------

# Runs `python -m h3_core` as `python -m` does, after `patch` (Python source) has run in the child.
EPILOGUE_CHILD = """
import os, runpy, signal, sys
{patch}
sys.argv = ["h3_core", *sys.argv[1:]]
runpy.run_module("h3_core", run_name="__main__", alter_sys=True)
"""

# Main's finally restoring the SIGTERM handler: the moment the earlier round's traceback came from.
SIGINT_IN_MAINS_FINALLY = """
import h3_core.app.cli as cli
real_signal = signal.signal
def signal_with_a_ctrl_c(signum, handler):
    if signum == signal.SIGTERM and handler is not cli._on_sigterm:
        os.kill(os.getpid(), signal.SIGINT)
    return real_signal(signum, handler)
signal.signal = signal_with_a_ctrl_c
"""

# Main printed its result and is returning: the interrupt lands in its last instructions.
SIGINT_AS_MAIN_RETURNS = """
import h3_core.app.cli as cli
def main(argv=None):
    print("wrote out.mp4")
    os.kill(os.getpid(), signal.SIGINT)
    return 0
cli.main = main
"""


def _epilogue_child(patch, args, tmp_path, tiny_cache):
    import subprocess
    import sys

    from cli_fixtures import default_sigint
    from child_cases import ROOT

    env = dict(os.environ, H3_STREAM_CACHE=str(tiny_cache), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", EPILOGUE_CHILD.format(patch=patch), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=default_sigint)


def test_a_ctrl_c_in_mains_last_instructions_is_no_traceback(tiny, tiny_cache, tmp_path):
    # Before: "Traceback ... KeyboardInterrupt" from the signal restore in main's finally, after "wrote out.mp4".
    done = _epilogue_child(SIGINT_IN_MAINS_FINALLY, ["generate", "x", "--seconds", "0.2", "--size", "64x64",
                                                     "--steps", "2", "--out", "out.mp4"], tmp_path, tiny_cache)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0 and "\nwrote out.mp4\n" in done.stdout, (done.stdout, done.stderr)
    assert (tmp_path / "out.mp4").stat().st_size > 0


def test_a_ctrl_c_as_main_returns_exits_130_without_a_traceback(tiny_cache, tmp_path):
    done = _epilogue_child(SIGINT_AS_MAIN_RETURNS, [], tmp_path, tiny_cache)
    assert done.returncode == 130 and done.stderr == "" and done.stdout == "wrote out.mp4\n", (done.stdout,
                                                                                              done.stderr)
