"""Ref2VA text-encoder presentation against the reference: diffusers' `MiniMaxH3Ref2VATextEncoderStep` (labels,
vision blocks, 2 fps video sampling and block timestamps, tags) on `transformers.Qwen3VLForConditionalGeneration`
(tiny random config, fp32), and the reference setup step's normalisation of the references."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from text_encoder_fixtures import reference_image_processor, reference_model, relative_l2, write_official

from h3_core import load_text_encoder
from h3_core.errors import H3Error
from h3_core.models.tokenizer import ReferenceTokens
from h3_core.models.vision_tower import prepare_image, prepare_video
from h3_core.request import references as R

encoders = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.encoders")
refs = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.references")
setup_step = pytest.importorskip("diffusers.modular_pipelines.minimax_h3.before_encoder")

LAYER = 4
TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("ref2va_text")
    reference = reference_model(num_layers=6, seed=0)
    official = write_official(reference, root / "official")
    return dict(reference=reference, encoder=load_text_encoder(official, layer=LAYER),
                tokenizer=official / "tokenizer" / "tokenizer.json")


def picture(width, height, seed):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def clip(frames, height, width, seed):
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


class ReferenceVideoProcessor:
    """Qwen3-VL's video processor for frames already at its own size: transformers' `smart_resize` decides the
    size (asserted to need no resize: its torchvision resize cannot run here) and its `patchify` lays out the
    patches; rescale and normalise are the released (x / 255 - 0.5) / 0.5."""

    def __init__(self):
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        self.processor = Qwen3VLVideoProcessor.__new__(Qwen3VLVideoProcessor)
        self.temporal_patch_size = 2

    def __call__(self, videos, do_sample_frames, return_tensors):
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        patches, grids = [], []
        for video in videos:
            n, h, w, _ = video.shape
            assert smart_resize(n, h, w, 2, 32, 128 * 32 * 32, 768 * 32 * 32) == (h, w)
            x = torch.from_numpy(video).permute(0, 3, 1, 2)[None].float() * (1 / 255)
            x = (x - 0.5) / 0.5
            flat, t, gh, gw = self.processor.patchify(x, patch_size=16, merge_size=2, temporal_patch_size=2)
            patches.append(flat[0])
            grids.append([t, gh, gw])
        return {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids)}


def reference_components(setup, layer=LAYER):
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_TEXT_TAG, MINIMAX_H3_VIDEO_TAG
    from transformers import Qwen2TokenizerFast, Qwen3VLProcessor

    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(setup["tokenizer"]))
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.image_processor = reference_image_processor()
    processor.video_processor = ReferenceVideoProcessor()
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return SimpleNamespace(tokenizer=tokenizer, processor=processor, text_encoder=setup["reference"],
                           text_encoder_layer=layer, text_tag=MINIMAX_H3_TEXT_TAG, video_tag=MINIMAX_H3_VIDEO_TAG,
                           fps=24, _execution_device=torch.device("cpu"))


def reference_run(setup, prompt, references):
    from diffusers.modular_pipelines import PipelineState

    state = PipelineState()
    state.set("prompt", prompt)
    state.set("normalized_references", references)
    seen = []
    original = encoders.get_qwen3vl_prompt_embeds

    def spy(encoder, processor, token_ids, *args, **kwargs):
        seen.append(list(token_ids))
        return original(encoder, processor, token_ids, *args, **kwargs)

    encoders.get_qwen3vl_prompt_embeds = spy
    try:
        encoders.MiniMaxH3Ref2VATextEncoderStep()(reference_components(setup), state)
    finally:
        encoders.get_qwen3vl_prompt_embeds = original
    return state.get("prompt_embeds")[0], state.get("text_token_tags"), seen[0]


def ours(setup, prompt, entries):
    """entries: ("image", PIL) / ("video", frames uint8, has_audio) / ("audio",) in request order."""
    converted = []
    for entry in entries:
        if entry[0] == "video":
            frames, seconds = R.sample_video_for_text_encoder(entry[1])
            converted.append(("video", frames, seconds, entry[2]))
        else:
            converted.append(entry)
    return setup["encoder"].encode_references(prompt, converted)


def diffusers_references(entries):
    out = []
    for entry in entries:
        if entry[0] == "image":
            out.append(refs.MiniMaxH3ImageReference(image=entry[1]))
        elif entry[0] == "video":
            out.append(refs.MiniMaxH3VideoReference(frames=entry[1], fps=24.0,
                                                    audio=torch.zeros(2, 8) if entry[2] else None))
        else:
            out.append(refs.MiniMaxH3AudioReference(audio=torch.zeros(2, 8)))
    return out


REQUESTS = {
    "images-and-audio": [("image", picture(130, 90, 1)), ("audio",), ("image", picture(64, 200, 2))],
    "video-with-sound": [("video", clip(25, 256, 256, 3), True)],
    "mixed": [("audio",), ("image", picture(96, 96, 4)), ("video", clip(13, 256, 288, 5), False),
              ("video", clip(30, 256, 256, 6), True), ("audio",)],
}


@pytest.mark.parametrize("name", REQUESTS)
def test_presentation_and_states_match_the_reference(setup, name):
    entries = REQUESTS[name]
    prompt = "then the fox sings"
    expected, expected_tags, expected_ids = reference_run(setup, prompt, diffusers_references(entries))
    states, tags = ours(setup, prompt, entries)
    assert tags.tolist() == expected_tags.tolist()
    assert states.shape == expected.shape
    assert relative_l2(states, expected) <= TOLERANCE
    # The token ids, from our tokenizer's presentation with the same counts.
    tokens = []
    for entry in entries:
        if entry[0] == "image":
            tokens.append(ReferenceTokens("image", prepare_image(entry[1], setup["encoder"].image_processor)
                                          .num_tokens))
        elif entry[0] == "video":
            frames, seconds = R.sample_video_for_text_encoder(entry[1])
            blocks = prepare_video(frames, setup["encoder"].image_processor)
            tokens.append(ReferenceTokens("video", blocks[0].num_tokens, tuple(seconds), entry[2]))
        else:
            tokens.append(ReferenceTokens("audio", has_audio=True))
    assert list(setup["encoder"].tokenizer.present_references(prompt, tokens).token_ids) == expected_ids


@pytest.mark.parametrize("frames", [13, 24, 25, 36, 37, 49, 124, 362])
def test_video_sampling_and_timestamps_match_the_reference(frames):
    video = np.arange(frames, dtype=np.uint8)[:, None, None, None].repeat(2, 1).repeat(2, 2).repeat(3, 3)
    ours_frames, ours_seconds = R.sample_video_for_text_encoder(video)
    theirs_frames, theirs_seconds = encoders.MiniMaxH3Ref2VATextEncoderStep._sample_video_condition_frames(
        video, 24.0, 2.0, 2)
    assert [int(f[0, 0, 0]) for f in ours_frames] == [int(f[0, 0, 0]) for f in theirs_frames]
    assert ours_seconds == theirs_seconds
    assert [f"{s:.1f}" for s in ours_seconds][:1] == ["0.2"]  # 0.25 s rounds half to even


def test_a_video_too_short_for_the_text_encoder_is_explained():
    with pytest.raises(H3Error, match=r"reference_videos\[0\]: the video has 12 frames at 24 fps.*at least 13"):
        R.sample_video_for_text_encoder(clip(12, 4, 4, 0), "reference_videos[0]")


# ---- normalisation against the reference setup step ------------------------------------------------------------------


@pytest.mark.parametrize("fps", [24.0, 30.0, 12.5, 60.0])
@pytest.mark.parametrize("size", [(90, 160), (768, 1344), (300, 200)])
def test_video_normalisation_matches_the_reference(fps, size):
    video = clip(50, *size, seed=7)
    mine = R.normalise_video(video, fps, "v", 39)
    theirs = setup_step.MiniMaxH3Ref2VASetupStep._normalize_video_condition(video, fps, 39, 32, 768, 768 * 1344, 24.0)
    assert mine.shape == theirs.shape and np.array_equal(mine, theirs)


@pytest.mark.parametrize("size", [(130, 90), (2048, 1152), (500, 2000), (3000, 3000)])
def test_image_normalisation_matches_the_reference(size):
    from diffusers.image_processor import VaeImageProcessor

    image = picture(*size, seed=8)
    mine = R.normalise_image(image, "i", "reference", 1344, 768)
    width, height = image.size
    scale = 2048 / min(width, height)
    target = (max(32, round(width * scale / 32) * 32), max(32, round(height * scale / 32) * 32))
    theirs = VaeImageProcessor(vae_scale_factor=16).resize(image, height=target[1], width=target[0])
    assert mine.size == theirs.size and np.array_equal(np.asarray(mine), np.asarray(theirs))


def test_audio_normalisation_matches_the_reference_at_32k():
    waveform = torch.randn(1, 32000 * 3, generator=torch.Generator().manual_seed(0))
    mine = R.normalise_audio(waveform, 32000, "a", 39 / 24)
    theirs = setup_step.MiniMaxH3Ref2VASetupStep._normalize_audio_condition(waveform, 32000, 32000, 39 / 24)
    assert torch.equal(mine, theirs) and mine.shape == (2, 52000)


def test_audio_at_another_rate_is_resampled_to_32k():
    pytest.importorskip("av")
    tone = torch.sin(torch.arange(48000 * 2) / 48000 * 2 * torch.pi * 440)[None].repeat(2, 1)
    out = R.normalise_audio(tone, 48000, "a", 10.0)
    assert out.shape[0] == 2 and abs(out.shape[1] - 64000) <= 64
    expected = torch.sin(torch.arange(out.shape[1]) / 32000 * 2 * torch.pi * 440)
    middle = slice(1000, 60000)  # the filter's edges aside
    assert float((out[0, middle] - expected[middle]).abs().max()) < 0.02
