"""The Ref2VA packed layout and per-row timesteps against the reference pipeline's Ref2VA steps
(diffusers.modular_pipelines.minimax_h3: `MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence`,
`MiniMaxH3SetTimestepsStep.build_row_timesteps`), bitwise."""

from __future__ import annotations

import pytest
import torch

from h3_core.errors import H3Error
from h3_core.pipeline import layout as L
from h3_core.pipeline.sampler import row_timesteps

bd = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.before_denoise")
refs = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.references")


def reference_request(blocks):
    """The diffusers reference objects and their encoded-latent stand-ins (only shapes are read by the layout)."""
    references, condition_latents, audio_condition_latents = [], [], []
    for block in blocks:
        if block.kind == "image":
            references.append(refs.MiniMaxH3ImageReference(image=None))
        elif block.kind == "video":
            audio = torch.zeros(2, 10) if block.audio_latents else None
            references.append(refs.MiniMaxH3VideoReference(frames=None, audio=audio))
        else:
            references.append(refs.MiniMaxH3AudioReference(audio=torch.zeros(2, 10)))
        if block.kind != "audio":
            condition_latents.append(torch.zeros(1, 24, block.latent_frames, block.latent_height, block.latent_width))
        if block.has_audio:
            audio_condition_latents.append(torch.zeros(2 * block.audio_latents, 32))
    return references, condition_latents, audio_condition_latents


IMAGE = L.ReferenceBlock("image", 1, 6, 4)
WIDE_IMAGE = L.ReferenceBlock("image", 1, 128, 72)  # a 2048-short-edge image (2048 x 1152 px)
VIDEO_SOUND = L.ReferenceBlock("video", 7, 4, 6, audio_latents=37)  # 39 frames: 5/3*(1+4*4+1+4) < 37 latents
VIDEO_SILENT = L.ReferenceBlock("video", 12, 6, 4)
LONG_VIDEO_SOUND = L.ReferenceBlock("video", 17, 4, 8, audio_latents=20)  # the frame span wins; 17 frames >= 16
AUDIO = L.ReferenceBlock("audio", audio_latents=15)

CASES = {
    "image": (5, [IMAGE], (2, 4, 4, 3)),
    "two-images-audio": (9, [IMAGE, WIDE_IMAGE, AUDIO], (7, 4, 6, 12)),
    "video-with-sound": (4, [VIDEO_SOUND], (12, 6, 2, 20)),
    "video-without-sound": (6, [VIDEO_SILENT], (7, 4, 6, 12)),
    "mixed": (11, [AUDIO, IMAGE, VIDEO_SILENT, LONG_VIDEO_SOUND, AUDIO, WIDE_IMAGE, VIDEO_SOUND],
              (17, 4, 8, 66)),
    "real-size": (300, [WIDE_IMAGE, L.ReferenceBlock("video", 37, 48, 84, audio_latents=207), AUDIO],
                  (37, 48, 84, 207)),
}


@pytest.mark.parametrize("name", CASES)
def test_ref2va_layout_matches_reference(name):
    text_len, blocks, (frames, lh, lw, ta) = CASES[name]
    tags = torch.ones(text_len, dtype=torch.long)
    tags[1:3] = 0  # a vision block inside the text rows
    ours = L.build_ref2va_layout(tags, blocks, frames, lh, lw, ta)
    references, visual, audio = reference_request(blocks)
    pos, ttags, vid, aud, txt, ncv, nca = bd.MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags, references, visual, audio, frames, lh, lw, ta, (1, 2, 2), 2, 2, 0)
    assert ours.position_ids.dtype == torch.float64
    assert torch.equal(ours.position_ids, pos), (ours.position_ids - pos).abs().max()
    assert torch.equal(ours.token_tags, ttags)
    assert torch.equal(ours.video_indices, vid)
    assert torch.equal(ours.audio_indices, aud)
    assert torch.equal(ours.text_indices, txt)
    assert (ours.num_condition_video_rows, ours.num_condition_audio_rows) == (ncv, nca)
    for t_video, t_audio in ((0.0, 0.0), (0.3, 0.55), (0.9995, 0.2), (0.8, 0.941)):
        mine = row_timesteps(ours, t_video, t_audio)
        theirs = bd.MiniMaxH3SetTimestepsStep.build_row_timesteps(
            vid, aud, ncv, nca, text_len, t_video, t_audio, max(t_video, 0.999), 1.0)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


def test_reference_rows_sit_at_their_timesteps_and_tags():
    blocks = [IMAGE, VIDEO_SOUND, AUDIO]
    layout = L.build_ref2va_layout(torch.ones(5, dtype=torch.long), blocks, 7, 4, 6, 12)
    distinct, index = row_timesteps(layout, 0.3, 0.55)
    visual = layout.video_indices[: layout.num_condition_video_rows]
    ref_audio = layout.audio_indices[: layout.num_condition_audio_rows]
    assert layout.num_condition_video_rows == 3 * 2 + 7 * 2 * 3 and layout.num_condition_audio_rows == 2 * (37 + 15)
    assert torch.all(distinct[index[visual]] == torch.tensor(0.999))
    assert torch.all(distinct[index[ref_audio]] == 1.0)
    assert torch.all(layout.token_tags[visual] == 0) and torch.all(layout.token_tags[ref_audio] == 2)
    # Row order: image rows, then the video's soundtrack, then its frames, then the audio reference, then targets.
    assert layout.video_indices[:6].tolist() == list(range(5, 11))
    assert layout.audio_indices[:74].tolist() == list(range(11, 85))
    assert layout.video_indices[6:48].tolist() == list(range(85, 127))
    assert layout.audio_indices[74:104].tolist() == list(range(127, 157))


def test_bad_reference_blocks_are_explained():
    tags = torch.ones(3, dtype=torch.long)
    with pytest.raises(H3Error, match="reference 1: kind must be 'image', 'video' or 'audio', got 'text'"):
        L.build_ref2va_layout(tags, [L.ReferenceBlock("text")], 2, 4, 4, 3)
    with pytest.raises(H3Error, match=r"reference 2 \(image\): an image has one latent frame, got 2"):
        L.build_ref2va_layout(tags, [IMAGE, L.ReferenceBlock("image", 2, 4, 4)], 2, 4, 4, 3)
    with pytest.raises(H3Error, match=r"reference 1 \(video\): latent 3x5x4 is empty or not divisible"):
        L.build_ref2va_layout(tags, [L.ReferenceBlock("video", 3, 5, 4)], 2, 4, 4, 3)
