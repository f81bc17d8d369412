"""Interruption and out of device memory inside a transformer block: every streamed block is released, the model is
left as it was (the next run gives the clean run's output), and the CLI's Ctrl-C exits with 130 and writes nothing."""

from __future__ import annotations

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
        if len(calls) == 5:  # step 2, inside the block loop
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
