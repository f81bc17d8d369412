"""Ref2VA end to end on the embedded tiny model: `H3Pipeline.generate(reference_images=, reference_videos=,
reference_audios=)`, the sampling loop against the diffusers modular Ref2VA loop (same weights, conditions and
seed), resident and layerwise, and each bad reference's one error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.pipeline.layout import audio_to_rows, patchify
from h3_core.request.grid import LatentShape
from h3_core.request.references import build_references
from h3_core.sources import resolve_model
from h3_core.sources.model_sources import canvas_rules, transformer_partition

WIDTH, HEIGHT, FRAMES = 64, 96, 22


@pytest.fixture(scope="module")
def sources(tiny):
    return resolve_model(tiny, partition="ref2va")


@pytest.fixture(scope="module")
def pipeline(sources):
    pipe = H3Pipeline(sources, keep_text_encoder=True)
    yield pipe
    pipe.release_all()


def picture(width, height, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def request(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(reference_images=[picture(120, 80, seed)],
                reference_videos=[(torch.rand(30, 40, 72, 3, generator=g), 0.1 * torch.randn(2, 40000, generator=g)),
                                  (torch.rand(14, 64, 64, 3, generator=g), None)],
                reference_audios=[0.1 * torch.randn(1, 20000, generator=g)])


def test_the_tiny_model_has_a_ref2va_transformer(tiny, sources):
    assert sources.transformer.name == "minimax_h3_tiny_ref2va_fp32.safetensors"
    assert transformer_partition(sources.transformer) == "ref2va"
    assert transformer_partition(resolve_model(tiny).transformer) == "fl2va"
    assert canvas_rules(sources)["canvas_short_edge"] == 64


def test_generate_with_references(pipeline):
    result = pipeline.generate("a fox sings", width=WIDTH, height=HEIGHT, num_frames=FRAMES, steps=3, seed=1,
                               **request())
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and result.waveform.shape == (2, 29334)
    plain = pipeline.generate("a fox sings", width=WIDTH, height=HEIGHT, num_frames=FRAMES, steps=3, seed=1)
    assert not torch.equal(result.frames, plain.frames)  # the references condition the sample


def diffusers_references(refs):
    from diffusers.modular_pipelines.minimax_h3 import references as R

    out = []
    for ref in refs.references:
        if ref.kind == "image":
            out.append(R.MiniMaxH3ImageReference(image=ref.image))
        elif ref.kind == "video":
            out.append(R.MiniMaxH3VideoReference(frames=ref.frames, audio=ref.audio, sample_rate=32000))
        else:
            out.append(R.MiniMaxH3AudioReference(audio=ref.audio, sample_rate=32000))
    return out


def reference_loop(transformer, cond, refs, visual, audio, steps, seed):
    """diffusers' Ref2VA core denoise chain (layout, condition noise, noise, packing, timesteps, loop)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3 import before_denoise as bd
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3Ref2VADenoiseStep

    blocks = SequentialPipelineBlocks.from_blocks_dict({
        "prepare_layout": bd.MiniMaxH3Ref2VAPrepareLayoutStep(),
        "prepare_condition_latents": bd.MiniMaxH3PrepareConditionLatentsStep(),
        "prepare_latents": bd.MiniMaxH3PrepareLatentsStep(),
        "prepare_latents_ref2va": bd.MiniMaxH3Ref2VAPrepareLatentsStep(),
        "set_timesteps": bd.MiniMaxH3SetTimestepsStep(),
        "denoise": MiniMaxH3Ref2VADenoiseStep()})
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer_ref=transformer, scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    return pipe(text_token_tags=cond.tags, normalized_references=diffusers_references(refs),
                condition_latents=visual, audio_condition_latents=audio, height=HEIGHT, width=WIDTH,
                num_frames=FRAMES, generator=torch.Generator().manual_seed(seed), prompt_embeds=cond.states[None],
                num_inference_steps=steps,
                output=["latents", "audio_latents", "num_condition_video_rows", "num_condition_audio_rows"])


@pytest.mark.parametrize("residency", ["resident", "layerwise"])
def test_sampling_loop_matches_the_reference_ref2va_loop(sources, tmp_path, residency):
    pytest.importorskip("diffusers")
    from h3_fixtures import reference_model, save_comfy

    from h3_core.sources.tiny_default import TINY_DIT

    reference = reference_model(TINY_DIT, seed=5)
    path = save_comfy(reference, TINY_DIT, tmp_path / "minimax_h3_parity_ref2va.safetensors")
    options = {"transformer": {"residency": "layerwise", "prefetch": 1}} if residency == "layerwise" else {}
    pipe = H3Pipeline(sources.replace(transformer=path), component_options=options)
    given = request(seed=2)
    refs = build_references(given["reference_images"], given["reference_videos"], given["reference_audios"],
                            num_frames=FRAMES, width=WIDTH, height=HEIGHT, canvas_rules=canvas_rules(sources))
    cond = pipe.encode_prompt("a fox sings", width=WIDTH, height=HEIGHT, num_frames=FRAMES, **given)
    latents = pipe.sample(cond, num_frames=FRAMES, steps=4, seed=7)
    visual, audio = pipe.encode_reference_latents(cond)
    pipe.release_all()
    out = reference_loop(reference, cond, refs, visual, audio, steps=4, seed=7)
    nv, na = out["num_condition_video_rows"], out["num_condition_audio_rows"]
    assert nv > 0 and na == sum(rows.shape[0] for rows in audio) > 0
    ours_video, ours_audio = patchify(latents.video)[0], audio_to_rows(latents.audio)[0]
    ref_video, ref_audio = out["latents"][nv:], out["audio_latents"][na:]
    assert float((ours_video - ref_video).norm() / ref_video.norm()) <= 1e-4
    assert float((ours_audio - ref_audio).norm() / ref_audio.norm()) <= 1e-4


# ---- bad references: one error each ---------------------------------------------------------------------------------


def generate(pipeline, **kw):
    return pipeline.generate("a fox", width=WIDTH, height=HEIGHT, num_frames=FRAMES, steps=2, seed=0, **kw)


@pytest.mark.parametrize("kw,message", [
    (dict(reference_images=[picture(64, 64, 0)] * 10), r"reference_images: 10 image references given; H3 accepts at "
                                                       r"most 9\. Drop 1 of them\."),
    (dict(reference_videos=[(torch.rand(14, 32, 32, 3), None)] * 4), r"reference_videos: 4 video references given; "
                                                                     r"H3 accepts at most 3"),
    (dict(reference_images=[picture(64, 64, 0)], reference_audios=[torch.zeros(1, 100)] * 4),
     r"reference_audios: 4 audio references given; H3 accepts at most 3"),
    (dict(reference_audios=[torch.zeros(1, 100)]), r"reference_audios: an audio reference must come with at least one "
                                                   r"image or video reference"),
    (dict(reference_videos=[(torch.zeros(0, 32, 32, 3), None)]), r"reference_videos\[0\]: the video has no frames\."),
    (dict(reference_videos=[(torch.rand(8, 32, 32, 3), None)]), r"reference_videos\[0\]: the video has 8 frames at 24 "
                                                                r"fps; .* at least 13 frames"),
    (dict(reference_videos=[(torch.rand(14, 32, 32), None)]), r"reference_videos\[0\]: video frames must be \[frames, "
                                                              r"height, width, 3\] RGB"),
    (dict(reference_images=[picture(400, 64, 0)]), r"reference_images\[0\]: the image is 400x64; H3 takes reference "
                                                   r"images between 1:4 and 4:1"),
    (dict(reference_images=["/nonexistent/ref.png"]), r"reference_images\[0\]: /nonexistent/ref.png: no such reference image file\."),
    (dict(reference_images=[picture(64, 64, 0)], reference_audios=[(torch.zeros(2, 100), 0)]),
     r"reference_audios\[0\]: the sample rate must be a positive whole number of Hz, got 0"),
    (dict(reference_images=[picture(64, 64, 0)], reference_audios=[torch.full((2, 100), float("nan"))]),
     r"reference_audios\[0\]: the audio contains NaN or Inf samples"),
    (dict(reference_images=[picture(64, 64, 0)], reference_image_size="huge"),
     r"reference_image_size 'huge': use one of reference, max, match"),
])
def test_bad_references_get_one_clear_error(pipeline, kw, message):
    with pytest.raises(H3Error, match=message):
        generate(pipeline, **kw)


def test_references_need_the_ref2va_transformer(tiny):
    pipe = H3Pipeline(resolve_model(tiny))  # the FL2VA partition
    with pytest.raises(H3Error, match=r"references need the Ref2VA transformer, but .*fl2va.* is the FL2VA one: load "
                                      r"the model with partition='ref2va' \(CLI: --partition ref2va\)"):
        generate(pipe, reference_images=[picture(64, 64, 0)])
    assert pipe.loaded == ()  # refused before anything loaded


def test_keyframes_and_references_are_not_combined(pipeline):
    with pytest.raises(H3Error, match="first_frame / last_frame cannot be combined with "
                                      "reference_images / reference_videos / reference_audios"):
        generate(pipeline, first_frame=picture(64, 96, 1), reference_images=[picture(64, 64, 0)])


def test_reference_image_size_rules(pipeline):
    from h3_core.request.references import normalise_image

    image = picture(300, 200, 3)
    assert normalise_image(image, "i", "reference", 64, 96, 128).size == (192, 128)  # short edge 128, up or down
    assert normalise_image(image, "i", "max", 64, 96, 128).size == (192, 128)  # down to it
    assert normalise_image(picture(90, 60, 3), "i", "max", 64, 96, 128).size == (96, 64)  # never up (rounded to 32)
    assert normalise_image(image, "i", "match", 64, 96, 128).size == (96, 64)  # the canvas's area: 64 x 96


def test_the_memory_plan_counts_the_reference_rows_and_phases(sources):
    from h3_core.planning.phase_plans import plan_for_budget, reference_rows_estimate

    given = request()
    refs = build_references(given["reference_images"], given["reference_videos"], given["reference_audios"],
                            num_frames=FRAMES, width=WIDTH, height=HEIGHT, canvas_rules=canvas_rules(sources))
    size = dict(width=WIDTH, height=HEIGHT, num_frames=FRAMES)
    plain = plan_for_budget(sources, budget_bytes=1 << 34, **size)
    ref2va = plan_for_budget(sources, budget_bytes=1 << 34, references=refs, **size)
    assert [p.name for p in ref2va.phases][:3] == ["text encode", "reference encode", "reference audio encode"]
    assert "reference encode" not in [p.name for p in plain.phases]
    # The rows the transformer is planned for (its activations and the chunk-size choice) include the references'.
    from h3_core.planning.phase_plans import _dit_estimate

    shape = LatentShape.for_request(WIDTH, HEIGHT, FRAMES)
    extra = reference_rows_estimate(refs)
    assert extra > 0
    assert _dit_estimate(sources.transformer, shape, None, reference_rows=extra)[2] == \
        _dit_estimate(sources.transformer, shape, None)[2] + extra
    transformer = lambda plan: next(p for p in plan.phases if p.name == "sampling").total_bytes
    assert transformer(ref2va) > transformer(plain)


def test_reference_encoders_are_phase_scoped_and_released_before_sampling(sources):
    """Layerwise VAEs: their encoders' weights exist only inside each encode; both VAEs go when sampling starts."""
    logged = []
    pipe = H3Pipeline(sources, log=logged.append,
                      component_options={"video_vae": {"residency": "layerwise"},
                                         "audio_vae": {"residency": "layerwise"}})
    given = request(seed=3)
    refs = build_references(given["reference_images"], given["reference_videos"], given["reference_audios"],
                            num_frames=FRAMES, width=WIDTH, height=HEIGHT, canvas_rules=canvas_rules(sources))
    cond = pipe.encode_prompt("a fox", width=WIDTH, height=HEIGHT, num_frames=FRAMES, **given)
    visual, audio = pipe.encode_reference_latents(cond)
    assert [v.shape[2] for v in visual] == [1, 7, 2] and len(audio) == 2  # image, video 22 -> 7, video 14 -> 5 -> 2
    assert pipe.loaded == ("audio_vae",)  # the video VAE went when the audio encode started
    phases = pipe.component("audio_vae").weight_phases
    assert phases.names == ("encoder",) and phases.materialised() == ()  # its weights released after the encode
    pipe.sample(cond, num_frames=FRAMES, steps=2, seed=0)
    assert "sampling: releasing audio_vae (not kept)" in logged
    assert "reference audio encode: releasing video_vae (not kept)" in logged
    pipe.release_all()


@pytest.mark.parametrize("glob,key,message", [
    ("vae/minimax_h3_video_vae*.safetensors", "encoder.conv_in.weight",
     "tensor 'encoder.conv_in.weight' contains NaN or Inf values, so the video VAE's encoder produced NaN/Inf at "
     "reference encode (reference_images[0]'s latent). The file is corrupt; download it again."),
    ("vae/minimax_h3_audio_vae*.safetensors", "encoder.block.0.weight",
     "tensor 'encoder.block.0.weight' contains NaN or Inf values, so the audio VAE's encoder produced NaN/Inf at "
     "reference audio encode (reference_audios[0]'s latent). The file is corrupt; download it again."),
])
def test_a_corrupt_reference_encoder_is_named(tiny, tmp_path, glob, key, message):
    from h3_fixtures import tiny_copy_with

    root, _ = tiny_copy_with(tiny, tmp_path, glob, key, float("nan"))
    pipe = H3Pipeline(resolve_model(root, partition="ref2va"))
    with pytest.raises(H3Error) as error:
        generate(pipe, reference_images=[picture(64, 64, 0)], reference_audios=[torch.zeros(1, 3200)])
    assert str(error.value).endswith(message)
