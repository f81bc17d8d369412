"""Hardening: bad inputs end in one clear error with nothing left behind; interruption and out-of-memory inside a
block release every streamed block; a soak run does not leak memory or file handles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from h3_fixtures import tiny_copy_with

import h3_core
from h3_core.errors import CheckpointError, H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model
from h3_core.sources.tiny_default import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]
REQUEST = dict(width=64, height=64, num_frames=5, steps=3, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- non-finite weights: named after the run reveals them -----------------------------------------------------------


@pytest.mark.parametrize("component,key,value,message", [
    ("diffusion_models/*fl2va*.safetensors", "blocks.1.mlp.fc2.weight", float("nan"), "the transformer produced NaN/Inf"),
    ("vae/minimax_h3_video_vae*.safetensors", "decoder.transformer_blocks.0.ff.w2.weight", float("inf"),
     "the video VAE produced NaN/Inf"),
    ("vae/minimax_h3_audio_vae*.safetensors", "decoder.conv_post.weight", float("nan"),
     "the audio VAE produced NaN/Inf"),
    ("text_encoders/*/model.safetensors", "model.language_model.layers.0.mlp.down_proj.weight", float("nan"),
     "the text encoder produced NaN/Inf"),
])
def test_non_finite_weights_are_named(tiny, tmp_path, component, key, value, message):
    root, path = tiny_copy_with(tiny, tmp_path, component, key, value)
    pipe = H3Pipeline(resolve_model(root))
    with pytest.raises(H3Error) as info:
        pipe.generate("a red fox", **REQUEST)
    pipe.release_all()
    text = str(info.value)
    assert str(path) in text and f"'{key}'" in text and message in text and "download it again" in text


# ---- wrong component for the loader -----------------------------------------------------------------------------


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


# ---- prompts, audio, requests ------------------------------------------------------------------------------------


def test_empty_and_very_long_prompts(tiny):
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True)
    result = pipe.generate("", **REQUEST)  # one <|endoftext|> token
    assert result.frames.shape == (5, 64, 64, 3)
    with pytest.raises(H3Error, match="at most 4096 are accepted"):
        pipe.generate("fox " * 5000, **REQUEST)
    with pytest.raises(H3Error, match="prompt must be a string"):
        pipe.generate(None, **REQUEST)
    pipe.release_all()


def test_audio_encode_rejects_wrong_layout(tiny):
    vae = h3_core.load_audio_vae(resolve_model(tiny).audio_vae)
    with pytest.raises(H3Error, match="32000 Hz"):
        vae.encode(torch.zeros(1, 1, 1600))  # mono
    with pytest.raises(H3Error, match="32000 Hz"):
        vae.encode(torch.zeros(2, 1600))  # no batch axis


@pytest.mark.parametrize("kwargs,message", [
    (dict(width=100), "width 100 is not a positive multiple of 32"),
    (dict(height=0), "height 0 is not a positive multiple of 32"),
    (dict(num_frames=40), r"num_frames 40 is off the 17n \+ 5 frame grid .*; use 56"),
    (dict(steps=1), "steps 1: must be at least 2"),
])
def test_bad_request_sizes(tiny, kwargs, message):
    pipe = H3Pipeline(resolve_model(tiny))
    with pytest.raises(H3Error, match=message):
        pipe.generate("x", **dict(REQUEST, **kwargs))
    pipe.release_all()


# ---- interruption and out of memory inside a block ----------------------------------------------------------------


class Stop(Exception):
    pass


def streamed_pipeline(tiny):
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True, keep_transformer=True,  # the same model each run
                      component_options={"transformer": {"residency": "layerwise", "prefetch": 1}})
    return pipe, pipe.component("transformer")


def test_interrupt_mid_step_releases_every_streamed_block(tiny):
    pipe, dit = streamed_pipeline(tiny)
    clean = pipe.generate("a red fox", **REQUEST)
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
    pipe.release_all()


def test_out_of_memory_inside_a_block(tiny, monkeypatch):
    pipe, dit = streamed_pipeline(tiny)
    clean = pipe.generate("a red fox", **REQUEST)
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
    pipe.release_all()


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


# ---- soak ---------------------------------------------------------------------------------------------------------

SOAK = r"""
import gc, os, sys, json
import h3_core
from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model
sources = resolve_model(sys.argv[1])

def rss_anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024

def fds():
    return len(os.listdir('/proc/self/fd'))

samples = []
for i in range(20):
    pipe = H3Pipeline(sources, component_options={"transformer": {"residency": "layerwise"}})
    pipe.generate("a red fox runs through snow", width=64, height=64, num_frames=5, steps=3, seed=i)
    pipe.release_all()
    del pipe
    gc.collect()
    samples.append((rss_anon(), fds()))
print(json.dumps(samples))
"""


def test_soak_twenty_generations(tiny, tmp_path):
    import json

    script = tmp_path / "soak.py"
    script.write_text(SOAK)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script), str(tiny)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    samples = json.loads(done.stdout.strip().splitlines()[-1])
    # After the first generations (allocator pools, lazy imports) resident memory is flat.
    baseline = samples[2][0]
    assert max(rss for rss, _ in samples[2:]) <= baseline * 1.05, samples
    assert len({fd for _, fd in samples[1:]}) == 1, samples
