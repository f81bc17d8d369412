"""Guides at any frame (issue 30): their checks and notes, their rows, and a run end to end on the tiny model.

Parity of the rows with the references: tests/test_guides_sglang.py (SGLang's wheel) and
tests/comfy_double/verify_guides_core.py (ComfyUI core, output in the README)."""

from __future__ import annotations

import pytest
import torch

from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.pipeline.layout import GuideBlock, build_packed_layout
from h3_core.pipeline.sampler import row_timesteps
from h3_core.request.generation_request import GenerationRequest, RequestNames
from h3_core.request.guides import Guide, guide_clip_frames, prepare_guide_frames
from h3_core.sources import resolve_model

G = torch.Generator().manual_seed(5)


def frames(n=1, h=96, w=64):
    return torch.rand(n, h, w, 3, generator=G)


def sound(video_frames):
    return (torch.rand(2, -(-32000 * video_frames // 24), generator=G) - 0.5) * 0.2


def request(*guides, num_frames=39, **kw):
    return GenerationRequest("a harbour", width=64, height=96, num_frames=num_frames, steps=3, seed=3,
                             guides=guides, **kw)


# ---- checks and notes ---------------------------------------------------------------------------------------------


def test_clips_keep_17k_plus_5_frames_and_say_so():
    assert [guide_clip_frames(n) for n in (1, 4, 5, 10, 21, 22, 38, 39)] == [1, 1, 5, 5, 5, 22, 22, 39]
    req = request(Guide(frame=3, frames=frames(10), label="clip.mp4@3"))
    (placed,) = req.placed_guides
    assert (placed.frame, placed.num_frames, placed.frames.shape[0]) == (3, 5, 5)
    assert req.notes == ("note: clip.mp4@3: a clip of 10 frames is cropped to its first 5 (clips are 17k + 5 "
                         "frames: 5, 22, 39, ...).",)
    short = request(Guide(frame=3, frames=frames(3)))
    assert short.placed_guides[0].num_frames == 1 and "only its first frame is used" in short.notes[0]
    assert request(Guide(frame=0, frames=frames(22))).notes == ()


def test_negative_frames_count_from_the_end():
    req = request(Guide(frame=-1, frames=frames()), Guide(frame=-23, frames=frames(22), audio=sound(10)))
    assert [(g.frame, g.num_frames) for g in req.placed_guides] == [(38, 1), (16, 22)]
    assert req.placed_guides[0].label == "guides[1]"  # the default label: the field and its place


@pytest.mark.parametrize("guide, message", [
    (Guide(frame=39, frames=frames()), r"clip@39: frame 39 is outside the video's 39 frames \(0 to 38, or -1 to -39"),
    (Guide(frame=-40, frames=frames()), "clip@39: frame -40 is outside the video's 39 frames"),
    (Guide(frame=20, frames=frames(22)), r"a clip of 22 frames at frame 20 runs past the end of the video \(39 "
                                         r"frames: it ends at frame 41\); start it at frame 17 at the latest"),
    (Guide(frame=0, frames=frames(1, 1, 2000)), "its 2000x1 frames do not fit the 64x96 canvas"),
    (Guide(frame=30, audio=sound(24)), r"its audio is 1.00 s but the video has 0.38 s left from frame 30"),
    (Guide(frame=0, audio=sound(60)), r"its audio is 2.50 s but the video has 1.62 s left from frame 0"),
    (Guide(frame=0, frames=torch.full((1, 8, 8, 3), float("nan"))), "NaN or Inf"),
])
def test_each_bad_guide_is_one_error_naming_it(guide, message):
    labelled = Guide(frame=guide.frame, frames=guide.frames, audio=guide.audio, label="clip@39")
    with pytest.raises(H3Error, match=message):
        request(labelled)


def test_audio_one_latent_over_the_end_is_rounding_and_cropped():
    # 22 frames of soundtrack ending at the last frame of 107: 37 latents, 36 left (floor(178 - 5/3 x 85)).
    req = request(Guide(frame=85, frames=frames(22), audio=sound(22)), num_frames=107)
    assert req.placed_guides[0].audio_latents == 36


def test_overlaps_are_one_error_naming_both():
    with pytest.raises(H3Error, match=r"b overlaps a: a holds frames 0-4, b frame 3"):
        request(Guide(frame=0, frames=frames(5), label="a"), Guide(frame=3, frames=frames(), label="b"))
    with pytest.raises(H3Error, match=r"b overlaps a: their audio overlaps"):
        request(Guide(frame=0, audio=sound(10), label="a"), Guide(frame=5, audio=sound(5), label="b"))
    with pytest.raises(H3Error, match=r"g overlaps first_frame: first_frame holds frame 0, g frames 0-4"):
        request(Guide(frame=0, frames=frames(5), label="g"), first_frame=frames()[0])
    with pytest.raises(H3Error, match=r"--guide x.png@-1 overlaps --last-frame"):
        request(Guide(frame=-1, frames=frames(), label="--guide x.png@-1"), last_frame=frames()[0],
                names=RequestNames(last_frame="--last-frame"))
    # an image and an audio at one frame do not overlap (two streams), nor do back-to-back clips
    request(Guide(frame=5, frames=frames()), Guide(frame=5, audio=sound(5)), Guide(frame=6, frames=frames(5)),
            Guide(frame=11, frames=frames(5)))


def test_guides_and_references_are_refused_together_and_non_guides_named():
    with pytest.raises(H3Error, match="guides cannot be combined with reference_images"):
        request(Guide(frame=0, frames=frames()), reference_images=(frames()[0],))
    with pytest.raises(H3Error, match=r"--guide: item 1 is a Tensor; give h3_core.Guide"):
        request(frames(), names=RequestNames(guides="--guide"))


def test_frames_are_centre_cropped_to_the_canvas_then_scaled():
    wide = torch.zeros(1, 10, 40, 3)
    wide[:, :, 15:25] = 1.0  # a white band in the middle 10 of 40 columns; the canvas is 1:1 -> columns 15-25 kept
    out = prepare_guide_frames(wide, 32, 32)
    assert out.shape == (1, 32, 32, 3) and float(out.min()) > 0.9


# ---- rows -----------------------------------------------------------------------------------------------------------


def test_guide_rows_follow_the_keyframes_and_are_never_updated():
    tags = torch.ones(4, dtype=torch.long)
    layout = build_packed_layout(tags, 7, 4, 6, 37, ("first",), guides=[
        GuideBlock(frame=10, latent_frames=2, audio_latents=3), GuideBlock(frame=30, audio_latents=2)])
    frame_rows = 6
    # text 4 | first 6 | guide 1 video 12, audio 6 | guide 2 audio 4 | target audio 74 | target video 42
    assert layout.num_rows == 4 + 6 + 12 + 6 + 4 + 74 + 42
    assert layout.num_condition_video_rows == 18 and layout.num_condition_audio_rows == 10
    assert layout.video_indices[:18].tolist() == list(range(4, 22))
    assert layout.audio_indices[:10].tolist() == list(range(22, 28)) + list(range(28, 32))
    pos = layout.position_ids
    assert pos[10, 0] == 4 + 5 / 3 * 10 and pos[10 + frame_rows, 0] == 4 + 5 / 3 * 10 + 5 / 3  # 1, then 4 frames
    assert pos[22, 0] == pos[10, 0] and pos[24, 0] == pos[10, 0] + 2  # audio from the guide's time, 1 per latent
    assert pos[28, 0] == 4 + 5 / 3 * 30
    assert layout.token_tags[22:32].eq(2).all() and layout.token_tags[4:22].eq(0).all()
    unique, index = row_timesteps(layout, 0.3, 0.2)
    assert unique[index[4:22]].eq(torch.tensor(0.999)).all() and unique[index[22:32]].eq(1.0).all()


# ---- end to end on the tiny model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(tiny):
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True, keep_video_vae=True, keep_audio_vae=True)
    yield pipe
    pipe.release_all()


def test_a_clip_with_its_soundtrack_at_frame_0_runs_end_to_end(pipeline):
    """The continuation case the long-video windows use: 22 frames and their soundtrack at frame 0."""
    logged = []
    pipeline.log = logged.append
    clip, track = frames(22), sound(22)
    req = request(Guide(frame=0, frames=clip, audio=track))
    cond = pipeline.encode_prompt(req)
    assert pipeline.sampling_phases(cond) == ("keyframe encode", "reference audio encode", "sampling")
    video, audio = pipeline.encode_guides(cond)
    assert video[0].shape == (1, 24, 7, 6, 4) and audio[0].shape == (2 * 37, 32)
    result = pipeline.generate(req)
    assert result.frames.shape == (39, 96, 64, 3) and result.waveform.shape == (2, 52000)
    plain = pipeline.generate(req.replace(guides=()))
    assert not torch.equal(result.frames, plain.frames) and not torch.equal(result.waveform, plain.waveform)
    # the guide's rows are conditions: only the target's rows come back
    latents = pipeline.sample(cond)
    assert latents.video.shape == req.shape.video and latents.audio.shape == req.shape.audio


def test_each_kind_of_guide_conditions_the_sample_and_notes_are_logged(pipeline):
    logged = []
    pipeline.log = logged.append
    plain = pipeline.sample(pipeline.encode_prompt(request()))
    for guide in (Guide(frame=-1, frames=frames()), Guide(frame=17, audio=sound(10)),
                  Guide(frame=10, frames=frames(10))):
        latents = pipeline.sample(pipeline.encode_prompt(request(guide)))
        assert not torch.equal(latents.video, plain.video), guide.kind
    assert any("cropped to its first 5" in line for line in logged)


def test_guides_leave_the_text_presentation_alone_and_frame_0_is_not_first_frame(pipeline):
    """Core's Add Guide (and SGLang's hybrid keyframes) keep guides out of Qwen; first_frame enters it as
    "<Picture 1>:" and is stretched, where a guide is centre-cropped: the two are different conditionings."""
    image = frames(1, 80, 120)
    plain = pipeline.encode_prompt(request())
    guided = pipeline.encode_prompt(request(Guide(frame=0, frames=image)))
    first = pipeline.encode_prompt(request(first_frame=image[0]))
    assert torch.equal(guided.states, plain.states) and torch.equal(guided.tags, plain.tags)
    assert first.tags.eq(0).any() and first.states.shape[0] > plain.states.shape[0]
    assert not torch.equal(pipeline.sample(guided).video, pipeline.sample(first).video)


def test_sampling_another_duration_or_canvas_than_the_guides_were_placed_on_is_refused(pipeline):
    cond = pipeline.encode_prompt(request(Guide(frame=0, frames=frames())))
    with pytest.raises(H3Error, match="the guides were placed on 39 frames"):
        pipeline.sample(cond, num_frames=22)


def test_the_memory_plan_counts_guide_rows_and_their_encodes(pipeline):
    plain = pipeline.plan_request(request())
    guided = pipeline.plan_request(request(Guide(frame=0, frames=frames(22), audio=sound(22))))
    names = [phase.name for phase in guided.phases]
    assert names[:3] == ["text encode", "keyframe encode", "reference audio encode"] and "sampling" in names
    assert "keyframe encode" not in [phase.name for phase in plain.phases]
    assert guided.phase("sampling").total_bytes > plain.phase("sampling").total_bytes
