"""The H3 References node feeding H3 Text Encode (Ref2VA) on the tiny model, against the comfy test double: the
nodes sample what h3_core samples for the same references, and each bad reference is one error in socket names."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from test_nodes import LEGACY_SAMPLER, SAMPLER, H, W, load, pack, run  # noqa: F401  (pack: the fixture)

# 22 frames: a video reference is cut to the generated length, and the text encoder needs 13 frames of it.
FRAMES = 22
SECONDS_FRAMES = dict(seconds=1.0, frames=FRAMES)


def video(frames=14, sound=True):
    from comfy_double.core_nodes import VideoComponents

    g = torch.Generator().manual_seed(frames)
    audio = {"waveform": 0.1 * torch.randn(1, 2, 44100, generator=g), "sample_rate": 44100} if sound else None
    return VideoComponents(torch.rand(frames, 40, 72, 3, generator=g), audio, Fraction(24))


def image(seed=0):
    return torch.rand(1, 80, 120, 3, generator=torch.Generator().manual_seed(seed))


def audio(seconds=0.5):
    return {"waveform": 0.1 * torch.randn(1, 1, int(32000 * seconds), generator=torch.Generator().manual_seed(9)),
            "sample_rate": 32000}


def references(pack, **connected):
    return run(pack["H3StreamReferenceMedia"], "9", ref_image_size="reference", **connected)[0]


def encode(pack, handle, refs=None, prompt="a fox sings", **duration):
    return run(pack["H3StreamEncodePrompt"], "2", h3_model=handle, prompt=prompt, width=W, height=H,
               **{**SECONDS_FRAMES, **duration}, **({"h3_refs": refs} if refs is not None else {}))[0]


def sample(pack, handle, refs):
    return run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=encode(pack, handle, refs), **SAMPLER)[0]


def test_the_nodes_sample_what_h3_core_samples_for_the_same_references(pack):
    handle = load(pack, partition="Ref2VA")
    clip = video()
    refs = references(pack, ref_image_2=image(), ref_video_1=clip, ref_video_3=video(frames=20, sound=False),
                      ref_audio_1=audio())
    assert [label for _, label in refs.labels] == ["ref_image_2", "ref_video_1", "ref_video_3", "ref_audio_1"]
    latents = sample(pack, handle, refs)
    pipeline = handle.pipeline
    direct = dict(reference_images=[image()],
                  reference_videos=[(clip.images, clip.audio["waveform"][0], 24.0, 44100),
                                    (video(frames=20, sound=False).images, None)],
                  reference_audios=[(audio()["waveform"][0], 32000)])
    cond = pipeline.encode_prompt("a fox sings", width=W, height=H, num_frames=FRAMES, **direct)
    expected = pipeline.sample(cond, steps=SAMPLER["steps"], seed=SAMPLER["seed"])
    assert torch.equal(latents.video, expected.video) and torch.equal(latents.audio, expected.audio)
    plain = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=encode(pack, handle), **SAMPLER)[0]
    assert not torch.equal(plain.video, latents.video)


def test_bad_references_are_one_error_in_socket_names(pack):
    from h3_core.errors import H3Error

    with pytest.raises(H3Error, match=r"H3 References: connect at least one reference"):
        references(pack)
    with pytest.raises(H3Error, match=r"ref_audio: an audio reference must come with at least one image or video "
                                      r"reference \(ref_image / ref_video\)"):
        references(pack, ref_audio_1=audio())
    with pytest.raises(H3Error, match=r"ref_audio_2: expected an AUDIO"):
        references(pack, ref_image_1=image(), ref_audio_2=torch.zeros(3))
    handle = load(pack, partition="Ref2VA")
    with pytest.raises(H3Error, match=r"ref_video_2: the video has no frames\."):
        sample(pack, handle, references(pack, ref_video_2=video(frames=0, sound=False)))
    with pytest.raises(H3Error, match=r"ref_video_1: the video has 8 frames at 24 fps"):
        sample(pack, handle, references(pack, ref_video_1=video(frames=8)))
    refs = references(pack, ref_image_1=image())
    # Saved workflows: the legacy nodes, each with its own duration, must agree.
    legacy_refs = run(pack["H3StreamReferences"], "9", ref_image_size="reference", **SECONDS_FRAMES,
                      ref_image_1=image())[0]
    with pytest.raises(H3Error, match=r"h3_refs: H3 References \(legacy\) cuts its references to 22 frames but H3 "
                                      r"Text Encode makes 39"):
        encode(pack, handle, legacy_refs, frames=39)
    cond = run(pack["H3StreamTextEncode"], "2", h3_model=handle, prompt="a fox", width=W, height=H,
               h3_refs=legacy_refs)[0]
    with pytest.raises(H3Error, match=r"frames 39: the references were cut to 22 frames when the prompt was "
                                      r"encoded"):
        run(pack["H3StreamSampler"], "3", h3_model=handle, h3_cond=cond, **{**LEGACY_SAMPLER, "frames": 39})
    assert run(pack["H3StreamSampler"], "3", h3_model=handle, h3_cond=cond,
               **{**LEGACY_SAMPLER, "frames": FRAMES})[0].shape.num_frames == FRAMES
    fl2va = load(pack)
    with pytest.raises(H3Error, match=r"references need the Ref2VA transformer"):
        sample(pack, fl2va, refs)
