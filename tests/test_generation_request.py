"""One generation request, checked once: every rule of `GenerationRequest` (and the canvas and frame-grid rules of
`grid.py`) in the words of each surface, and the engines and front ends that build one."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from h3_core.errors import H3Error
from h3_core.request.generation_request import (PYTHON_NAMES, SEED_MAX, GenerationRequest, RequestNames,
                                                frames_for_duration)
from h3_core.request.grid import MAX_FRAMES, canvas_problem, frame_count_problem

ROOT = Path(__file__).resolve().parents[1]


def make(**fields):
    return GenerationRequest(**{"prompt": "a fox", "width": 96, "height": 64, "num_frames": 5, "steps": 3, **fields})


@pytest.mark.parametrize("change, message", [
    (dict(width=33), "width 33 is not a positive multiple of 32 pixels; use 32 or 64."),
    (dict(height=0), "height 0 is not a positive multiple of 32 pixels; use 32 or 64."),
    (dict(width=8192), "width 8192 is past the 4096-pixel limit (H3 was trained at 1344x768)."),
    (dict(width=64.0), "width 64.0 is not a whole number of pixels."),
    (dict(width=True), "width True is not a whole number of pixels."),
    (dict(num_frames=6), "num_frames 6 is off the 17n + 5 frame grid the video VAE needs (5, 22, 39, ...); use 22."),
    (dict(num_frames=379), "num_frames 379 is 15.8 s of video; H3 generates at most 15 s (362 frames)."),
    (dict(num_frames=5.0), "num_frames 5.0 is not a whole number of frames."),
    (dict(steps=1), "steps 1: must be at least 2"),
    (dict(seed=-1), f"seed -1: must be a whole number from 0 to 2**64 - 1 ({SEED_MAX})."),
    (dict(seed=2**64), "seed 18446744073709551616: must be a whole number"),
    (dict(video_shift=float("nan")), "video_shift nan: must be a finite number above 0"),
    (dict(audio_shift=0), "audio_shift 0: must be a finite number above 0"),
    (dict(prompt=b"bytes"), "prompt must be a string, got bytes."),
    (dict(prompt="caf\udce9"), "prompt: character 3 is byte 0xe9, which is not UTF-8"),
    (dict(reference_image_size="huge"), "reference_image_size 'huge': use one of reference, max, match."),
    (dict(loras=[("a.safetensors", float("inf"))]), "loras: the strength of a.safetensors must be a finite number"),
    (dict(loras=["a.safetensors"]), "loras: each LoRA is (file, strength)"),
    (dict(first_frame=torch.zeros(8, 8, 3), reference_images=[torch.zeros(8, 8, 3)]),
     "first_frame / last_frame cannot be combined with reference_images / reference_videos / reference_audios"),
    (dict(reference_images=[torch.zeros(8, 8, 3)] * 10), "reference_images: 10 image references given"),
])
def test_each_rule_is_one_error_naming_the_field(change, message):
    with pytest.raises(H3Error) as caught:
        make(**change)
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_surface_names_its_own_fields():
    cli = RequestNames(width="--size 100x64: width", seed="--seed", num_frames="--frames")
    with pytest.raises(H3Error, match=r"^--size 100x64: width 100 is not a positive multiple of 32 pixels"):
        make(width=100, names=cli)
    with pytest.raises(H3Error, match=r"^--seed -5: must be a whole number"):
        make(seed=-5, names=cli)
    nodes = dataclasses.replace(PYTHON_NAMES, num_frames="frames", reference_images="ref_image")
    with pytest.raises(H3Error, match=r"^frames 40 is off the 17n \+ 5 frame grid"):
        make(num_frames=40, names=nodes)
    # A changed copy is checked again, in the same words.
    request = make(names=nodes)
    with pytest.raises(H3Error, match=r"^frames 6 is off"):
        request.replace(num_frames=6)


def test_values_are_normalised_and_the_request_is_frozen():
    import numpy as np

    request = make(width=np.int64(96), seed=np.uint64(7), video_shift=5, loras=[("x.safetensors", 1)])
    assert type(request.width) is int and type(request.seed) is int and request.video_shift == 5.0
    assert request.loras == (("x.safetensors", 1.0),) and request.reference_images == ()
    assert request.shape.latent_frames == 2 and request.seconds == 5 / 24 and request.anchors == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.width = 64
    keyed = make(last_frame=torch.zeros(8, 8, 3))
    assert keyed.anchors == ("last",) and len(keyed.keyframe_images) == 1


def test_an_engine_call_takes_a_request_or_its_fields_never_both():
    request = make()
    assert GenerationRequest.of(request, {}) is request
    assert GenerationRequest.of("a fox", {"width": 96, "height": 64}).width == 96
    with pytest.raises(H3Error, match="give a GenerationRequest or its fields \\(seed\\), not both"):
        GenerationRequest.of(request, {"seed": 1})
    with pytest.raises(H3Error, match=r"unknown request field\(s\) \['sizes'\]"):
        GenerationRequest.of("a fox", {"sizes": 1})


def test_references_are_normalised_once_per_canvas_rule_set():
    request = make(reference_images=[torch.rand(80, 120, 3)], num_frames=22)
    rules = {"canvas_short_edge": 64, "canvas_max_pixels": 64 * 112, "reference_image_short_edge": 64}
    first = request.normalised_references(rules)
    assert first is request.normalised_references(dict(rules))  # the CLI's estimate, then the pipeline
    assert first is not request.normalised_references(None)
    assert make().normalised_references(rules) is None


def test_the_duration_widgets_and_flags_map_to_one_frame_count():
    assert frames_for_duration(5.0, None) == (124, None)
    assert frames_for_duration(None, 39) == (39, None)
    assert frames_for_duration(1.0, None) == (39, None)
    assert frames_for_duration(None, 6, round_up=True) == (22, "note: 6 frames is off the 17n+5 grid the video VAE "
                                                               "needs; rounding up to 22.")
    for seconds, frames, names, round_up, message in (
            (None, 6, ("seconds", "frames"), False, "frames 6 is off the 17n + 5 frame grid"),
            (None, 100000, ("--seconds", "--frames"), True, "--frames 100000 (100016 on the 17n + 5 grid) is 4167.3 s"),
            (16.0, None, ("--seconds", "--frames"), False, "--seconds 16: must be more than 0 and at most 15"),
            (0.0, None, ("seconds", "frames"), False, "seconds 0: must be more than 0"),
            (15.1, None, ("--seconds", "--frames"), False, "--seconds 15.1: must be more than 0 and at most 15"),
            (float("nan"), None, ("seconds", "frames"), False, "seconds nan: must be a number of seconds"),
            (None, 0, ("--seconds", "--frames"), True, "--frames 0: must be a whole number of frames, at least 1"),
            (None, -3, ("seconds", "frames"), False, "frames -3: must be a whole number of frames, at least 1")):
        with pytest.raises(H3Error) as caught:
            frames_for_duration(seconds, frames, names=names, round_up=round_up)
        assert str(caught.value).startswith(message), str(caught.value)


def test_each_request_rule_has_one_definition():
    """The canvas multiple, the frame grid and the seed range are written once, in h3_core/request (the widgets take
    their limits from there); no front end or engine repeats them."""
    sources = {p: p.read_text() for folder in ("h3_core", "nodes") for p in (ROOT / folder).rglob("*.py")}
    patterns = {"canvas multiple": re.compile(r"%\s*(32|CANVAS_MULTIPLE)\b"),
                "frame grid": re.compile(r"%\s*(17|FRAMES_PER_CHUNK)\b"),
                "seed range": re.compile(r"2\s*\*\*\s*64|0x[fF]{16}")}
    for rule, pattern in patterns.items():
        places = sorted(str(p.relative_to(ROOT)) for p, text in sources.items()
                        if any(pattern.search(line.split("#")[0]) for line in text.splitlines()))
        assert places == {"canvas multiple": ["h3_core/request/grid.py"], "frame grid": ["h3_core/request/grid.py"],
                          "seed range": ["h3_core/request/generation_request.py"]}[rule], (rule, places)
    assert canvas_problem(4096) is None and frame_count_problem(MAX_FRAMES) is None


# ---- the pipeline's own surface: prompts and sizes through H3Pipeline.generate -----------------------------------

PIPELINE_REQUEST = dict(width=64, height=64, num_frames=5, steps=3, seed=5)


def test_empty_and_very_long_prompts(tiny):
    from h3_core.pipeline import H3Pipeline
    from h3_core.sources import resolve_model

    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True)
    result = pipe.generate("", **PIPELINE_REQUEST)  # one <|endoftext|> token
    assert result.frames.shape == (5, 64, 64, 3)
    with pytest.raises(H3Error, match="at most 4096 are accepted"):
        pipe.generate("fox " * 5000, **PIPELINE_REQUEST)
    with pytest.raises(H3Error, match="prompt must be a string"):
        pipe.generate(None, **PIPELINE_REQUEST)
    pipe.release_all()


def test_a_prompt_too_long_to_tokenise_is_refused_before_any_model_loads(tiny):
    # Before: a 10 MB paste was tokenised (27 s here) once the text encoder had loaded, then refused for its tokens.
    from h3_core.pipeline import H3Pipeline
    from h3_core.request.generation_request import MAX_PROMPT_CHARACTERS
    from h3_core.sources import resolve_model

    pipe = H3Pipeline(resolve_model(tiny))
    with pytest.raises(H3Error) as info:
        pipe.generate("a" * (MAX_PROMPT_CHARACTERS + 1), **PIPELINE_REQUEST)
    assert str(info.value) == ("prompt: 262,145 characters; at most 262,144 characters (and 4096 tokens) are accepted "
                               "(H3 was trained on prompts of a few hundred tokens). Shorten it.")
    assert pipe.loaded == ()


@pytest.fixture(scope="module")
def pipeline(tiny):
    """One pipeline for the refusals below: a request is checked before anything loads, so none changes it."""
    from h3_core.pipeline import H3Pipeline
    from h3_core.sources import resolve_model

    pipe = H3Pipeline(resolve_model(tiny))
    yield pipe
    pipe.release_all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(width=100), "width 100 is not a positive multiple of 32"),
    (dict(height=0), "height 0 is not a positive multiple of 32"),
    (dict(num_frames=40), r"num_frames 40 is off the 17n \+ 5 frame grid .*; use 56"),
    (dict(steps=1), "steps 1: must be at least 2"),
])
def test_bad_request_sizes(pipeline, kwargs, message):
    with pytest.raises(H3Error, match=message):
        pipeline.generate("x", **dict(PIPELINE_REQUEST, **kwargs))
    assert pipeline.loaded == ()
