"""Guides against SGLang 0.5.23's own H3 keyframe lowering, run from its wheel in its venv (CPU, no server).

SGLang's `conditions` admit keyframes only as images at frame 0 and -1 (`MINIMAX_H3_FL2VA_KEYFRAME_SIGNATURES`);
for those our guides are compared with SGLang's `minimax_h3_packed_sequence` row for row: positions, modality tags,
the visual / audio row lists and the update mask (condition rows are never updated). Middle frames, clips and audio
guides have no SGLang lowering (it refuses them: checked here too); for them ComfyUI core is the reference
(tests/comfy_double/verify_guides_core.py, its output in the README). Skips without the venv
(tests/real_servers/build_sglang_venv.sh), fails then with H3_STREAM_REQUIRE_REAL_SERVERS=1.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from engine_servers import venv_python
from h3_core.pipeline.layout import GuideBlock, build_packed_layout
from h3_core.request.generation_request import GenerationRequest
from h3_core.request.guides import Guide

SCRIPT = os.path.join(os.path.dirname(__file__), "real_servers", "sglang_guide_layout.py")


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    python = venv_python("sglang")
    if not python.is_file():
        reason = f"SGLang's venv is not built ({python}); run bash tests/real_servers/build_sglang_venv.sh"
        if os.environ.get("H3_STREAM_REQUIRE_REAL_SERVERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("sglang-guides") / "layout.npz"
    done = subprocess.run([str(python), SCRIPT, str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


def ours(width, height, num_frames, text_len, *, guides=(), first=None, last=None):
    request = GenerationRequest("p", width=width, height=height, num_frames=num_frames, first_frame=first,
                                last_frame=last, guides=guides)
    shape = request.shape
    blocks = [GuideBlock(g.frame, 1, 0) for g in request.placed_guides]
    return build_packed_layout(torch.ones(text_len, dtype=torch.long), shape.latent_frames, shape.latent_height,
                               shape.latent_width, shape.audio_latents, request.anchors, guides=blocks)


def image():
    return torch.rand(1, 40, 70, 3, generator=torch.Generator().manual_seed(0))


def same_rows(sglang, case, layout):
    """Rows, tags, row lists and update mask bitwise."""
    assert torch.equal(torch.from_numpy(sglang[f"{case}.tags"]), layout.token_tags)
    assert torch.equal(torch.from_numpy(sglang[f"{case}.img_pos"]), layout.video_indices)
    assert torch.equal(torch.from_numpy(sglang[f"{case}.audio_pos"]), layout.audio_indices)
    update = torch.arange(layout.video_indices.numel()) >= layout.num_condition_video_rows
    assert torch.equal(torch.from_numpy(sglang[f"{case}.update_mask"]), update)


@pytest.mark.parametrize("case, width, height, text_len", [("first_124", 320, 192, 9), ("first_1344", 1344, 768, 256)])
def test_an_image_guide_at_frame_0_is_sglangs_first_keyframe_bitwise(sglang, case, width, height, text_len):
    layout = ours(width, height, 124, text_len, guides=(Guide(frame=0, frames=image()),))
    same_rows(sglang, case, layout)
    assert torch.equal(torch.from_numpy(sglang[f"{case}.positions"]), layout.position_ids)
    # and first_frame, the same rows
    assert torch.equal(ours(width, height, 124, text_len, first=image()).position_ids, layout.position_ids)


@pytest.mark.parametrize("case, num_frames", [("last_124", 124), ("last_362", 362)])
def test_an_image_guide_at_frame_minus_1_is_sglangs_last_keyframe_in_fp32(sglang, case, num_frames):
    """A guide follows core (`L + 5/3 (F - 1)`); SGLang's last keyframe sums the spans pairwise: the same rows, tags
    and grid, the same fp32 time (what the model uses), at most two float64 ulps apart. last_frame keeps SGLang's
    anchor bitwise."""
    positions = torch.from_numpy(sglang[f"{case}.positions"])
    layout = ours(320, 192, num_frames, 9, guides=(Guide(frame=-1, frames=image()),))
    same_rows(sglang, case, layout)
    assert torch.equal(positions[:, 1:], layout.position_ids[:, 1:])
    assert torch.equal(positions.float(), layout.position_ids.float())
    ulps = (positions - layout.position_ids).abs() / torch.from_numpy(np.spacing(positions.numpy()))
    assert float(ulps.max()) <= 2
    last_frame = ours(320, 192, num_frames, 9, last=image())
    assert torch.equal(positions, last_frame.position_ids)


def test_guides_at_0_and_minus_1_are_sglangs_first_and_last_keyframes(sglang):
    positions = torch.from_numpy(sglang["both_124.positions"])
    layout = ours(320, 192, 124, 9, guides=(Guide(frame=0, frames=image()), Guide(frame=-1, frames=image())))
    same_rows(sglang, "both_124", layout)
    assert torch.equal(positions.float(), layout.position_ids.float())
    keyframes = ours(320, 192, 124, 9, first=image(), last=image())
    same_rows(sglang, "both_124", keyframes)
    assert torch.equal(positions, keyframes.position_ids)


def test_sglang_has_no_lowering_for_middle_frames_clips_or_audio(sglang):
    """What the README says about SGLang 0.5.23: a middle frame or a clip as a keyframe is refused; Qwen sees an FL2VA
    keyframe but not a hybrid Ref2VA one (as core's Add Guide: guides never enter Qwen)."""
    meta = json.loads(str(sglang["meta"]))
    assert "keyframe_frame_indices in ((0,), (-1,), (0, -1))" in meta["refused"]["middle_124"]
    assert meta["qwen"]["fl2va image keyframe at 62"].startswith("refused")
    assert meta["qwen"]["fl2va video keyframe at 0"].startswith("refused")
    assert meta["qwen"]["fl2va image keyframe at 0"] == [0]
    assert meta["qwen"]["ref2va reference image + image keyframe at 0"] == [0]  # the reference only
