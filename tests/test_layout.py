"""Packed layout, shape arithmetic and patchify against the reference pipeline (diffusers.modular_pipelines)."""

from __future__ import annotations

import pytest
import torch

from h3_core.errors import H3Error
from h3_core.pipeline import layout as L
from h3_core.pipeline.sampler import row_timesteps
from h3_core.request import grid as G

mp = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.modular_pipeline")
bd = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.before_denoise")


def reference_layout(text_tags, frames, lh, lw, ta, anchors):
    return bd.MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, frames, lh, lw, ta, (1, 2, 2), audio_channels=2, audio_tag=2, video_tag=0,
        keyframe_anchors=anchors)


CASES = [
    # (text tokens, latent frames, latent h, latent w, audio latents, anchors)
    (7, 2, 4, 4, 3, ()),
    (5, 7, 4, 6, 12, ("first",)),
    (11, 12, 6, 2, 20, ("last",)),
    (3, 17, 4, 8, 66, ("first", "last")),   # >= 16 latent frames: pairwise vs sequential sums differ
    (256, 32, 48, 84, 178, ()),             # the real 4 s 1344x768 request
    (40, 37, 48, 84, 207, ("first", "last")),
    (9, 22, 84, 48, 120, ("last",)),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c[:5]) + "-".join(c[5]) for c in CASES])
def test_layout_matches_reference(case):
    text_len, frames, lh, lw, ta, anchors = case
    tags = torch.ones(text_len, dtype=torch.long)
    tags[1:3] = 0  # a vision block inside the text rows
    ours = L.build_packed_layout(tags, frames, lh, lw, ta, anchors)
    pos, ttags, vid, aud, txt, ncv, nca = reference_layout(tags, frames, lh, lw, ta, anchors)
    assert ours.position_ids.dtype == torch.float64
    assert torch.equal(ours.position_ids, pos), (ours.position_ids - pos).abs().max()
    assert torch.equal(ours.token_tags, ttags)
    assert torch.equal(ours.video_indices, vid)
    assert torch.equal(ours.audio_indices, aud)
    assert torch.equal(ours.text_indices, txt)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (ncv, nca)


def test_last_keyframe_uses_pairwise_sum():
    """From 16 latent frames on, the pairwise-summed span differs from the sequential one in the last ulp."""
    import numpy as np

    spans = L.latent_frame_spans(37)
    sequential = 0.0
    for s in spans:
        sequential += s
    assert L.last_keyframe_time(37, 0.0) + L.ROPE_FRAME_UNITS == float(np.sum(spans))
    assert float(np.sum(spans)) != sequential  # the two orders really differ here


@pytest.mark.parametrize("case", [c for c in CASES if c[5]], ids=lambda c: str(c[:5]))
@pytest.mark.parametrize("t_video,t_audio", [(0.0, 0.0), (0.3, 0.55), (0.9995, 0.2), (0.8, 0.941)])
def test_row_timesteps_match_reference(case, t_video, t_audio):
    text_len, frames, lh, lw, ta, anchors = case
    layout = L.build_packed_layout(torch.ones(text_len, dtype=torch.long), frames, lh, lw, ta, anchors)
    ours = row_timesteps(layout, t_video, t_audio)
    ref = bd.MiniMaxH3SetTimestepsStep.build_row_timesteps(
        layout.video_indices, layout.audio_indices, layout.num_condition_video_rows, 0, text_len,
        t_video, t_audio, max(t_video, 0.999), 1.0)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    # Condition rows sit at max(t, 0.999); target rows at their own modality's time.
    cond = layout.video_indices[: layout.num_condition_video_rows]
    assert torch.all(ours[0][ours[1][cond]] == torch.tensor(max(t_video, 0.999), dtype=torch.float32))
    assert torch.all(ours[0][ours[1][layout.audio_indices]] == torch.tensor(t_audio, dtype=torch.float32))


@pytest.mark.parametrize("frames", list(range(1, 400, 7)) + [107, 124, 243, 362])
def test_frame_arithmetic_matches_reference(frames):
    aligned = G.align_num_frames(frames)
    assert aligned == mp.align_num_frames(frames, 17, 5)
    assert G.video_latent_frames(aligned) == mp.video_latent_num_frames(aligned, 17, 5)
    assert G.audio_latent_frames(aligned) == mp.audio_latent_num_frames(aligned)


def test_shape_table_from_the_spec():
    assert G.frames_for_seconds(1) == 39
    assert G.frames_for_seconds(4) == 107
    for frames, tv, ta in ((107, 32, 178), (124, 37, 207), (243, 72, 405), (362, 107, 603)):
        shape = G.LatentShape.for_request(1344, 768, frames)
        assert (shape.latent_frames, shape.audio_latents) == (tv, ta)
        assert (shape.latent_height, shape.latent_width) == (48, 84)
    assert G.video_latent_frames(5) == 2


def test_bad_frames_and_canvas_are_explained():
    with pytest.raises(H3Error, match=r"17n \+ 5.*40.*56"):
        G.video_latent_frames(40)
    with pytest.raises(H3Error, match="width 100 is not a positive multiple of 32 pixels; use 96 or 128"):
        G.LatentShape.for_request(100, 64, 39)
    with pytest.raises(H3Error, match="height"):
        G.check_canvas(64, 0)
    with pytest.raises(H3Error, match="seconds must be positive"):
        G.frames_for_seconds(0)
    with pytest.raises(H3Error, match="anchor"):
        L.build_packed_layout(torch.ones(2, dtype=torch.long), 2, 4, 4, 3, ("middle",))


def test_patchify_matches_reference_and_inverts():
    latent = torch.randn(1, 24, 3, 6, 10)
    rows = L.patchify(latent)
    assert rows.shape == (1, 3 * 3 * 5, 96)
    assert torch.equal(rows[0], bd.patchify_video_latents(latent, (1, 2, 2)))
    assert torch.equal(L.unpatchify(rows, (24, 3, 6, 10)), latent)
    # Feature index c * 4 + ph * 2 + pw, rows frame-major then row-major.
    t, i, j, c, ph, pw = 2, 1, 3, 5, 1, 0
    assert rows[0, (t * 3 + i) * 5 + j, c * 4 + ph * 2 + pw] == latent[0, c, t, 2 * i + ph, 2 * j + pw]


def test_audio_rows_are_channel_major():
    latent = torch.randn(1, 32, 2, 5)
    rows = L.audio_to_rows(latent)
    assert torch.equal(rows[0, 5 + 3], latent[0, :, 1, 3])
    # The reference packs its [2, 32, Ta] latent the same way.
    assert torch.equal(rows[0], latent[0].permute(1, 0, 2).permute(0, 2, 1).reshape(-1, 32))
    assert torch.equal(L.rows_to_audio(rows), latent)
