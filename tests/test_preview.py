"""Live previews: the sampler's x0 estimate, core's latent2rgb picture, the TAEH3 decoder against the `taehv` package,
the H3 Sampler's previews through ComfyUI's progress bar (the test double), and the CLI's --preview.

References: ComfyUI core's latent2rgb output and factors recorded in tests/comfy_double/contract/core_latent2rgb.json
(tests/comfy_double/verify_preview.py, in a real ComfyUI, which also checks fresh latents there); madebyollin's
`taehv` package (`TAEHV`) for the decoder, with the same random weights.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy
import pytest
import torch
from safetensors.torch import save_file

import comfy_double
from h3_core.errors import CheckpointError, PickleCheckpointError
from h3_core.pipeline import H3Pipeline
from h3_core.pipeline import preview as preview_module
from h3_core.pipeline import sampler as sampler_module
from h3_core.pipeline.layout import patchify
from h3_core.pipeline.preview import (VIDEO_RGB_BIAS, VIDEO_RGB_FACTORS, Latent2RGBPreviewer, StepEstimate,
                                      frame_to_rgb, latent_to_rgb, taeh3_previewer)
from h3_core.pipeline.sampler import Schedule, denoised_estimate, euler_blend, euler_step, initial_noise
from h3_core.sources import resolve_model
from h3_core.checkpoints.taeh3_loader import load_taeh3
from taeh3_reference import CASES, case_inputs, recorded, samples, seeded_decoder_state

FIXTURE = json.loads((comfy_double.CONTRACT / "core_latent2rgb.json").read_text())
CONTRACT_SIGNATURES = json.loads((comfy_double.CONTRACT / "signatures.json").read_text())


# ---- latent2rgb is core's -----------------------------------------------------------------------------------------


def test_the_factors_are_the_numbers_recorded_from_comfyui_core():
    assert len(FIXTURE["comfyui_commit"]) == 40
    assert [list(row) for row in VIDEO_RGB_FACTORS] == FIXTURE["latent_rgb_factors"]
    assert list(VIDEO_RGB_BIAS) == FIXTURE["latent_rgb_factors_bias"]
    assert len(VIDEO_RGB_FACTORS) == 24 and all(len(row) == 3 for row in VIDEO_RGB_FACTORS)


def test_latent2rgb_is_cores_picture_pixel_for_pixel():
    frame = torch.tensor(FIXTURE["latent_frame"], dtype=torch.float32)
    core = torch.tensor(FIXTURE["core_picture"], dtype=torch.uint8)
    ours = latent_to_rgb(frame)
    assert ours.dtype == torch.uint8 and ours.shape == core.shape == (5, 7, 3)
    assert torch.equal(ours, core)
    # the recorded picture exercises both clamps and the truncating cast (not a flat or saturated image)
    assert (core == 0).any() and (core == 255).any() and len(torch.unique(core)) > 20
    # a change of one factor changes the picture: the comparison can fail
    shifted = frame.clone()
    shifted[9] += 0.02
    assert not torch.equal(latent_to_rgb(shifted), core)


def test_latent2rgb_refuses_what_is_not_one_h3_latent_frame():
    with pytest.raises(ValueError, match=r"\[24, h, w\]"):
        latent_to_rgb(torch.zeros(16, 4, 4))
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        frame_to_rgb(torch.zeros(4, 8, 8))


# ---- the x0 estimate ----------------------------------------------------------------------------------------------


def test_the_x0_estimate_is_the_flow_matching_x0():
    """`x_sigma = (1 - sigma) x0 + sigma eps` and `v = x0 - eps`: x0 = x_sigma + sigma v, with sigma = 1 - t."""
    generator = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(10, 8, generator=generator), torch.randn(10, 8, generator=generator)
    for sigma in (0.9, 0.5, 0.02):
        noisy = (1 - sigma) * x0 + sigma * eps
        estimate = denoised_estimate(noisy, x0 - eps, torch.tensor(1 - sigma))
        assert torch.allclose(estimate, x0, atol=1e-5)
    # the step is the blend of that estimate, exactly (the split changes no bit)
    sample, velocity = torch.randn(6, 4, generator=generator), torch.randn(6, 4, generator=generator)
    s = Schedule.build(5, 12.0, 3.0)
    for i in range(s.num_model_calls):
        t, sigma, following = s.video_timesteps[i], s.video_sigmas[i], s.video_sigmas[i + 1]
        assert torch.equal(euler_step(sample, velocity, t, sigma, following),
                           euler_blend(sample, denoised_estimate(sample, velocity, t), sigma, following))


def test_step_estimate_reads_the_first_frames_from_the_packed_rows():
    latent = torch.randn(1, 24, 7, 4, 6)
    estimate = StepEstimate(1, 2, patchify(latent)[0], torch.randn(10, 32), (24, 7, 4, 6), (1, 2, 2))
    assert torch.equal(estimate.video_latent(1), latent[:, :, :1])
    assert torch.equal(estimate.video_latent(3), latent[:, :, :3])
    assert torch.equal(estimate.video_latent(), latent)
    assert estimate.audio_latent().shape == (1, 32, 2, 5)
    copy = estimate.video_latent(1)
    copy += 1  # a copy: the sampler's rows are never changed through it
    assert torch.equal(estimate.video_latent(1), latent[:, :, :1])


@pytest.fixture(scope="module")
def pipeline(tiny):
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True)
    yield pipe
    pipe.release_all()


def test_the_preview_gets_the_samplers_own_x0_and_changes_no_bit(pipeline, monkeypatch):
    """Every step's estimate is the x0 the Euler update blends: replaying the updates from the initial noise with the
    estimates alone gives the sampled latent bitwise; and the samples are those of a run without previews."""
    cond = pipeline.encode_prompt("a red kite", width=96, height=64, num_frames=22, steps=5, seed=11)
    plain = pipeline.sample(cond)
    estimates = []
    seen = []
    latents = pipeline.sample(cond, preview=estimates.append,
                              progress=lambda step, total: seen.append((step, len(estimates))))
    assert torch.equal(latents.video, plain.video) and torch.equal(latents.audio, plain.audio)
    request, shape = cond.request, plain.shape
    schedule = Schedule.build(request.steps, request.video_shift, request.audio_shift)
    assert [(e.step, e.total) for e in estimates] == [(i, 4) for i in range(1, 5)]
    assert seen == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]  # each step's estimate arrives before its progress
    _, video, audio = initial_noise(shape.video, 2 * shape.audio_latents, shape.audio_latent_channels, request.seed)
    for i, estimate in enumerate(estimates):
        video = euler_blend(video, estimate.video_latent(), schedule.video_sigmas[i], schedule.video_sigmas[i + 1])
    assert torch.equal(video, plain.video)
    assert torch.equal(estimates[-1].video_latent(), plain.video)  # the last blend is all estimate (sigma 0)
    assert torch.equal(estimates[-1].audio_latent(), plain.audio)
    assert not torch.equal(estimates[0].video_latent(1), estimates[-1].video_latent(1))


def spy_on_the_loop(monkeypatch):
    """What the sampling loop was given for previews (`denoised`, None: off) and how often each half of the Euler
    step ran on its own (the split path runs only with a preview)."""
    import h3_core.pipeline.pipeline as pipeline_module

    seen = {"denoised": [], "split": 0}
    real_denoise, real_blend = sampler_module.denoise, sampler_module.euler_blend

    def denoise(*args, **kwargs):
        seen["denoised"].append(kwargs.get("denoised"))
        return real_denoise(*args, **kwargs)

    def blend(*args):
        seen["split"] += 1
        return real_blend(*args)

    monkeypatch.setattr(pipeline_module, "denoise", denoise)
    monkeypatch.setattr(sampler_module, "euler_blend", blend)
    # euler_step calls the module's euler_blend too: count only the loop's own calls of it
    monkeypatch.setattr(sampler_module, "euler_step", lambda s, v, t, a, b: real_blend(
        s, sampler_module.denoised_estimate(s, v, t), a, b))
    return seen


def test_without_a_preview_nothing_is_computed_for_one(pipeline, monkeypatch):
    seen = spy_on_the_loop(monkeypatch)
    cond = pipeline.encode_prompt("a red kite", width=96, height=64, num_frames=5, steps=3, seed=1)
    pipeline.sample(cond)
    assert seen == {"denoised": [None], "split": 0}
    pipeline.sample(cond, preview=lambda estimate: None)
    assert seen["denoised"][1] is not None and seen["split"] == 2 * 2  # video and audio, per model call


# ---- TAEH3 against the taehv package --------------------------------------------------------------------------------


def taehv_reference(seed=0, **options):
    """madebyollin's TAEHV configured as its checkpoint-name rule configures taeh3 (24 channels, patch 2, H3's
    chunking), with random weights; the decoder's last bias lifted so the frames are not all clamped to black."""
    taehv = pytest.importorskip("taehv")
    torch.manual_seed(seed)
    reference = taehv.TAEHV(checkpoint_path=None, patch_size=2, latent_channels=24, **options)
    reference.is_h3 = True
    with torch.no_grad():  # random convolutions shrink the signal: scaled, the last one spans the [0, 1] range
        reference.decoder[22].weight.mul_(100.0)
        reference.decoder[22].bias.fill_(0.5)
    return reference.eval()


def write_taeh3(reference, path: Path, dtype=torch.float32) -> Path:
    save_file({key: value.to(dtype).contiguous() for key, value in reference.state_dict().items()}, str(path))
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_taeh3_decodes_as_recorded_from_the_taehv_package(name, tmp_path):
    """CI's check (taehv is not on PyPI): the frames taehv.TAEHV decoded from the same seeded weights and latents,
    recorded by tests/taeh3_reference.py; the live comparisons below run where taehv is installed."""
    state, latent, stages = case_inputs(name)
    save_file(state, str(tmp_path / "taeh3.safetensors"))
    expected = recorded()["cases"][name]
    with torch.no_grad():
        clip = load_taeh3(tmp_path / "taeh3.safetensors", space_upscale=stages).decode_video(latent)
        first = load_taeh3(tmp_path / "taeh3.safetensors").first_frame(latent, stages)
    for part, got in (("clip", clip), ("first", first)):
        assert list(got.shape) == expected[part]["shape"], part
        assert torch.allclose(torch.tensor(samples(got)), torch.tensor(expected[part]["samples"]), rtol=0,
                              atol=1e-6), part
        assert abs(float(got.double().mean()) - expected[part]["mean"]) < 1e-7, part
    assert 0.05 < expected["clip"]["std"] and 0 < expected["clip"]["mean"] < 1  # not a flat or clamped picture


def test_taeh3_decodes_as_the_taehv_package_does(tmp_path):
    reference = taehv_reference()
    ours = load_taeh3(write_taeh3(reference, tmp_path / "taeh3.safetensors"))
    latent = torch.randn(1, 24, 7, 3, 5)  # 7 latent frames: 22 frames at 48x80
    with torch.no_grad():
        expected = reference.decode_video(latent.movedim(1, 2).clone(), parallel=True, show_progress_bar=False)
        frames = ours.decode_video(latent)
        first = ours.first_frame(latent)
        first_alone = reference.decode_video(latent[:, :, :1].movedim(1, 2).clone(), parallel=True,
                                             show_progress_bar=False)[0, 0]
    assert frames.shape == expected.shape == (1, 22, 3, 48, 80)
    assert torch.equal(frames, expected)
    assert 0.05 < float(frames.std()) and 0 < float(frames.mean()) < 1  # not a flat or clamped picture
    assert torch.equal(first, first_alone)
    assert torch.allclose(first, expected[0, 0], atol=1e-6)  # latent frame 0 alone gives the clip's first frame


def test_taeh3_with_fewer_spatial_stages_is_taehvs_cheaper_preview(tmp_path):
    full = taehv_reference(seed=1)
    path = write_taeh3(full, tmp_path / "taeh3.safetensors", torch.float16)  # taehv's weights are half precision
    reduced = taehv_reference(seed=1, decoder_space_upscale=(True, False, False))
    reduced.load_state_dict(full.state_dict())
    ours = load_taeh3(path)
    latent = torch.randn(1, 24, 2, 4, 4)
    with torch.no_grad():
        state16 = {k: v.half().float() for k, v in full.state_dict().items()}
        reduced.load_state_dict(state16)
        expected = reduced.decode_video(latent.movedim(1, 2).clone(), show_progress_bar=False)
        first_alone = reduced.decode_video(latent[:, :, :1].movedim(1, 2).clone(), show_progress_bar=False)[0, 0]
        got = ours.first_frame(latent, (True, False, False))
        clip = load_taeh3(path, space_upscale=(True, False, False)).decode_video(latent)
    assert got.shape == first_alone.shape == (3, 16, 16)
    assert torch.equal(got, first_alone)
    assert torch.equal(clip, expected)


def test_the_taeh3_previewer_decodes_about_the_shown_size(tmp_path):
    path = tmp_path / "taeh3.safetensors"
    save_file(seeded_decoder_state(0), str(path))
    previewer = taeh3_previewer(path, max_size=512)
    assert previewer.stages(48, 84) == (True, True, False)  # 1344x768: 84 * 2 * 4 = 672 >= 512
    assert previewer.stages(4, 6) == (True, True, True)  # small canvases: every stage, 96 px
    assert taeh3_previewer(path).stages(48, 84) == (True, True, True)
    latent = torch.randn(1, 24, 2, 4, 6)
    estimate = StepEstimate(1, 1, patchify(latent)[0], torch.zeros(8, 32), (24, 2, 4, 6), (1, 2, 2))
    picture = previewer.render(estimate)
    assert picture.shape == (64, 96, 3) and picture.dtype == torch.uint8
    with torch.no_grad():
        assert torch.equal(picture, frame_to_rgb(previewer.decoder.first_frame(latent)))
    assert taeh3_previewer(path, max_size=512).decoder is previewer.decoder  # loaded once per file version


def test_taeh3_files_that_cannot_be_used_are_refused_with_the_fix(tmp_path):
    pickle = tmp_path / "taeh3.pth"
    pickle.write_bytes(b"not opened")
    with pytest.raises(PickleCheckpointError, match=r"taeh3\.pth.*safetensors only.*safetensors/.*convert"):
        load_taeh3(pickle)
    state = seeded_decoder_state(0)
    save_file({k: v for k, v in state.items() if k != "decoder.14.weight"}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(CheckpointError, match=r"'decoder\.14\.weight' is missing"):
        load_taeh3(tmp_path / "partial.safetensors")
    # another model's decoder (Hunyuan Video's TAEHV: 16-channel latents): its first convolution reads 16 channels
    other = dict(state, **{"decoder.1.weight": torch.randn(state["decoder.1.weight"].shape[0], 16, 3, 3)})
    save_file(other, str(tmp_path / "taehv.safetensors"))
    with pytest.raises(CheckpointError, match=r"16-channel latents; H3's have 24"):
        load_taeh3(tmp_path / "taehv.safetensors")


# ---- the sampler node, through ComfyUI's progress bar (the test double) -------------------------------------------

W, H = 96, 64
LOADER = dict(source="tiny test model (embedded)", partition="FL2VA", transformer_residency="RESIDENT",
              text_encoder_residency="RESIDENT", video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT",
              prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu")
SAMPLER = dict(steps=4, seed=7, video_shift=12.0, audio_shift=3.0, chunk_size=0)


@pytest.fixture
def pack(tmp_path):
    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


def run(node_class, node_id, **inputs):
    from comfy_double.executor import run_node

    return run_node(node_class, node_id, **inputs)


def sample_with(pack, method, node_id="3"):
    import comfy.cli_args
    import comfy.utils

    comfy.cli_args.args.preview_method = comfy.cli_args.LatentPreviewMethod(method)
    handle = run(pack["H3StreamLoader"], "1", **LOADER)[0]
    cond = run(pack["H3StreamEncodePrompt"], "2", h3_model=handle, prompt="A fox.", width=W, height=H,
               seconds=1.0, frames=5)[0]
    comfy.utils.UPDATES.clear()
    comfy.utils.PREVIEWS.clear()
    latents, = run(pack["H3StreamAVSampler"], node_id, h3_model=handle, h3_cond=cond, **SAMPLER)
    return latents, list(comfy.utils.PREVIEWS), list(comfy.utils.UPDATES)


def test_the_double_keeps_comfyuis_preview_settings(pack):
    import comfy.cli_args

    values = CONTRACT_SIGNATURES["values"]
    assert {m.name: m.value for m in comfy.cli_args.LatentPreviewMethod} == values["comfy.cli_args:LatentPreviewMethod"]
    assert type(comfy.cli_args.args).__name__ == values["comfy.cli_args:args"]
    assert type(comfy.cli_args.args.preview_method).__name__ == values["comfy.cli_args:args.preview_method"]
    assert type(comfy.cli_args.args.preview_size).__name__ == values["comfy.cli_args:args.preview_size"]


def test_latent2rgb_previews_go_out_with_each_steps_progress(pack):
    latents, previews, updates = sample_with(pack, "latent2rgb")
    assert [(node, step) for node, step, _ in previews] == [("3", 1), ("3", 2), ("3", 3)]
    assert updates == [("3", 0, 3), ("3", 1, 3), ("3", 2, 3), ("3", 3, 3)]
    for _, _, (kind, image, size) in previews:
        assert (kind, size, image.size, image.mode) == ("JPEG", 512, (W // 16, H // 16), "RGB")
    pictures = [torch.from_numpy(numpy.array(image)) for _, _, (_, image, _) in previews]
    assert not torch.equal(pictures[0], pictures[-1])  # the picture follows the run
    # the last step's picture is the sampled latent's first frame through core's latent2rgb
    assert torch.equal(pictures[-1], latent_to_rgb(latents.video[0, :, 0]))


def test_auto_is_latent2rgb_and_none_computes_nothing(pack, monkeypatch):
    _, previews, _ = sample_with(pack, "auto")
    assert len(previews) == 3 and previews[0][2][1].size == (W // 16, H // 16)
    seen = spy_on_the_loop(monkeypatch)
    latents, previews, updates = sample_with(pack, "none")
    assert previews == [] and seen == {"denoised": [None], "split": 0} and len(updates) == 4
    baseline = latents
    latents, _, _ = sample_with(pack, "latent2rgb")
    assert torch.equal(latents.video, baseline.video) and torch.equal(latents.audio, baseline.audio)


def test_taesd_previews_decode_with_the_taeh3_file_in_vae_approx(pack, tmp_path):
    import folder_paths

    folder = Path(folder_paths.get_folder_paths("vae_approx")[0])
    save_file(seeded_decoder_state(0, torch.float16), str(folder / "taeh3.safetensors"))
    _, previews, _ = sample_with(pack, "taesd")
    assert len(previews) == 3
    sizes = {image.size for _, _, (_, image, _) in previews}
    assert sizes == {(W, H)}  # decoded: the canvas's size (every stage: it is under --preview-size)


def test_taesd_without_a_usable_file_says_so_and_shows_latent2rgb(pack, caplog):
    import folder_paths
    import server

    preview_module._DECODER_CACHE.clear()
    runtime = comfy_double.pack_module("nodes.comfy_runtime")
    runtime._SAID_ONCE.clear()
    with caplog.at_level(logging.WARNING, logger="h3_stream"):
        _, previews, _ = sample_with(pack, "taesd")
        _, again, _ = sample_with(pack, "taesd")
    assert len(previews) == len(again) == 3 and previews[0][2][1].size == (W // 16, H // 16)
    texts = [data["text"] for event, data, _ in server.PromptServer.instance.messages if event == "progress_text"]
    assert sum("models/vae_approx/taeh3.safetensors" in text for text in texts) == 2  # on the node, each run
    assert sum("taeh3" in record.getMessage() for record in caplog.records) == 1  # in the log, once
    folder = Path(folder_paths.get_folder_paths("vae_approx")[0])
    (folder / "taeh3.pth").write_bytes(b"never opened")
    _, previews, _ = sample_with(pack, "taesd")
    assert previews[0][2][1].size == (W // 16, H // 16)
    texts = [data["text"] for event, data, _ in server.PromptServer.instance.messages if event == "progress_text"]
    assert any("taeh3.pth is a pickle" in text for text in texts)


def test_a_failing_preview_stops_the_previews_not_the_run(pack, monkeypatch):
    import server

    def out_of_memory(self, estimate):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    baseline, _, _ = sample_with(pack, "none")
    monkeypatch.setattr(Latent2RGBPreviewer, "render", out_of_memory)
    latents, previews, updates = sample_with(pack, "latent2rgb")
    assert previews == [] and len(updates) == 4 and torch.equal(latents.video, baseline.video)
    texts = [data["text"] for event, data, _ in server.PromptServer.instance.messages if event == "progress_text"]
    assert sum("previews off for the rest of this run: latent2rgb failed at step 1 (CUDA out of memory" in text
               for text in texts) == 1


# ---- the CLI ----------------------------------------------------------------------------------------------------------


def test_cli_preview_writes_the_last_steps_picture(run_cli, tmp_path):
    from PIL import Image

    result = run_cli(["generate", "a fox", "--out", tmp_path / "out.mp4", "--preview", tmp_path / "step.png",
                      "--steps", "4"], tmp_path)
    assert result.returncode == 0, result.stderr
    picture = Image.open(tmp_path / "step.png")
    assert (picture.format, picture.size, picture.mode) == ("PNG", (6, 4), "RGB")
    assert not list(tmp_path.glob(".step.png*"))  # the partial file was renamed over, none left behind


def test_cli_preview_taeh3_and_refusals(run_cli, tmp_path):
    from PIL import Image

    path = tmp_path / "taeh3.safetensors"
    save_file(seeded_decoder_state(0), str(path))
    result = run_cli(["generate", "a fox", "--out", tmp_path / "out.mp4", "--preview", tmp_path / "step.png",
                      "--preview-taeh3", path], tmp_path)
    assert result.returncode == 0, result.stderr
    assert Image.open(tmp_path / "step.png").size == (96, 64)
    (tmp_path / "taeh3.pth").write_bytes(b"never opened")
    for args, message in (
            (["--preview", tmp_path / "step.jpg"], "--preview .*step.jpg: the preview is a PNG; name it step.png"),
            (["--preview-taeh3", path], "--preview-taeh3 .*give --preview FILE.png too"),
            (["--preview", tmp_path / "step.png", "--preview-taeh3", tmp_path / "taeh3.pth"],
             r"--preview-taeh3 .*taeh3\.pth: '\.pth' files are pickles")):
        result = run_cli(["generate", "a fox", "--out", tmp_path / "out2.mp4", *args], tmp_path)
        assert result.returncode == 2
        assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "out2.mp4").exists()


def test_cli_without_preview_computes_nothing_for_it(run_cli, tmp_path, monkeypatch):
    seen = spy_on_the_loop(monkeypatch)
    result = run_cli(["generate", "a fox", "--out", tmp_path / "out.mp4"], tmp_path)
    assert result.returncode == 0 and seen == {"denoised": [None], "split": 0}
