"""End to end on the embedded tiny default: pipeline, sampling loop parity, model sources, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import h3_core
from h3_core.errors import CheckpointError, H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.sources import is_repo_id, resolve_model
from h3_core.sources.tiny_default import ensure_tiny_model, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def pipeline(tiny):
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True)
    yield pipe
    pipe.release_all()


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tiny_default_is_deterministic_and_in_real_layouts(tiny, tmp_path):
    again = write_tiny_model(tmp_path / "again")
    assert digest(again) == digest(tiny)
    sources = resolve_model(tiny)
    assert h3_core.resolve_dit_checkpoint(sources.transformer).layout == "comfy"
    assert sources.text_encoder.is_dir() and (sources.text_encoder / "config.json").is_file()
    assert sources.video_vae.name.startswith("minimax_h3_video_vae")
    assert ensure_tiny_model(tiny.parent) == tiny  # generated once, then reused


def test_one_second_follows_the_frame_grid_with_matching_audio(pipeline):
    result = pipeline.generate("a red fox runs through snow", width=96, height=64, num_frames=39, steps=3, seed=1)
    assert h3_core.frames_for_seconds(1) == 39
    assert result.frames.shape == (39, 64, 96, 3)
    assert result.frames.dtype == torch.float32
    assert 0.0 <= float(result.frames.min()) and float(result.frames.max()) <= 1.0
    assert result.sample_rate == 32000 and result.fps == 24
    assert result.waveform.shape == (2, 52000)  # ceil(32000 / 24 * 39) samples per channel
    assert float(result.waveform.abs().max()) > 0


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(pipeline, seed=3, **kw):
    args = dict(width=64, height=96, num_frames=5, steps=3, seed=seed)
    args.update(kw)
    return pipeline.generate("a quiet harbour at night", **args)


def test_same_seed_same_output_other_seed_differs(pipeline):
    first, second, other = run(pipeline), run(pipeline), run(pipeline, seed=4)
    assert torch.equal(first.frames, second.frames) and torch.equal(first.waveform, second.waveform)
    assert not torch.equal(first.frames, other.frames)


def test_layerwise_and_chunked_runs_give_the_same_frames(tiny, pipeline):
    reference = run(pipeline)
    for options in ({"residency": "layerwise", "prefetch": 1}, {"chunk_size": 7},
                    {"residency": "layerwise", "chunk_size": 16}):
        pipe = H3Pipeline(resolve_model(tiny), component_options={"transformer": options})
        result = run(pipe)
        pipe.release_all()
        if "chunk_size" in options:
            # Chunked attention sums in another order (the chunked MLP is bitwise): latents differ at 1e-7, which
            # the random tiny audio decoder (saturating, high gain) amplifies about a hundredfold.
            assert rel(result.frames, reference.frames) <= 1e-6, options
            assert rel(result.waveform, reference.waveform) <= 1e-4, options
        else:
            assert torch.equal(result.frames, reference.frames), options
            assert torch.equal(result.waveform, reference.waveform), options


def test_keyframes_condition_the_sample(pipeline):
    red = Image.new("RGB", (120, 80), (220, 20, 20))
    blue = Image.new("RGB", (40, 90), (20, 20, 220))
    plain = run(pipeline)
    first = run(pipeline, first_frame=red)
    both = run(pipeline, first_frame=red, last_frame=blue)
    assert first.frames.shape == both.frames.shape == plain.frames.shape
    assert not torch.equal(first.frames, plain.frames) and not torch.equal(both.frames, first.frames)


def test_keyframe_preparation_stretches_then_cover_crops():
    from h3_core.request.keyframes import prepare_keyframes

    wide = Image.new("RGB", (300, 100))
    tall = Image.new("RGB", (100, 300))
    first, second = prepare_keyframes([wide, tall], 128, 96)
    assert first.size == second.size == (128, 96)
    with pytest.raises(H3Error, match="NaN"):
        prepare_keyframes([torch.full((8, 8, 3), float("nan"))], 32, 32)
    with pytest.raises(H3Error, match=r"\[H, W, 3\]"):
        prepare_keyframes([torch.zeros(3, 8, 8)], 32, 32)


def test_sampling_loop_matches_the_reference_denoise_loop(tiny):
    """Identical noise and conditioning through the diffusers modular denoising loop and through ours."""
    pytest.importorskip("diffusers")
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep
    from h3_fixtures import TINY, reference_model, save_comfy

    from h3_core.pipeline.sampler import Schedule, denoise

    reference = reference_model(TINY, seed=11)
    path = save_comfy(reference, TINY, tiny.parent / "loop_parity.safetensors")
    ours = h3_core.load_dit(path)
    blocks = SequentialPipelineBlocks.from_blocks_dict(
        {"set_timesteps": MiniMaxH3SetTimestepsStep(), "denoise": MiniMaxH3DenoiseStep()})
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=reference, scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    g = torch.Generator().manual_seed(0)
    tags = torch.ones(6, dtype=torch.long)
    for anchors in ((), ("first", "last")):
        layout = h3_core.build_packed_layout(tags, 3, 4, 6, 4, anchors)
        video = torch.randn(layout.video_indices.numel(), TINY.video_patch_dim, generator=g)
        audio = torch.randn(8, TINY.audio_in_channels, generator=g)
        text = torch.randn(1, 6, TINY.text_dim, generator=g)
        fields = dict(position_ids=layout.position_ids, token_tags=layout.token_tags,
                      video_indices=layout.video_indices, audio_indices=layout.audio_indices,
                      text_indices=layout.text_indices)
        out = pipe(latents=video.clone(), audio_latents=audio.clone(), prompt_embeds=text, num_inference_steps=5,
                   num_condition_video_rows=layout.num_condition_video_rows, video_indices=layout.video_indices,
                   audio_indices=layout.audio_indices, text_indices=layout.text_indices,
                   denoiser_input_fields=fields, output=["latents", "audio_latents"])
        result = denoise(ours, text[0], layout, Schedule.build(5), video, audio,
                         num_condition_video_rows=layout.num_condition_video_rows)
        nc = layout.num_condition_video_rows
        ref_video, ref_audio = out["latents"][nc:], out["audio_latents"]
        assert float((result.video_rows - ref_video).norm() / ref_video.norm()) <= 1e-4
        assert float((result.audio_rows - ref_audio).norm() / ref_audio.norm()) <= 1e-4


def test_progress_and_interrupt(pipeline):
    seen = []
    run(pipeline, progress=lambda done, total: seen.append((done, total)), steps=4)
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 3)]

    class Stop(H3Error):
        pass

    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 2:
            raise Stop("stop")

    with pytest.raises(Stop):
        run(pipeline, check_interrupt=interrupt)
    # The next run works and is unaffected.
    assert torch.equal(run(pipeline).frames, run(pipeline).frames)


def test_chunking_is_an_option_of_one_sample_call(pipeline):
    """`sample(chunk_size=, between_chunks=)` chunk this call only: the transformer's own policy is untouched."""
    from h3_core.request.grid import LatentShape
    from h3_core.runtime.chunking import ChunkingError

    cond = pipeline.encode_prompt("a quiet harbour at night", width=64, height=96)
    shape = LatentShape.for_request(64, 96, 5)
    fused = pipeline.sample(cond, num_frames=shape.num_frames, steps=3, seed=3)
    policy = pipeline.component("transformer").chunking
    saved = vars(policy).copy()
    reclaims = []
    chunked = pipeline.sample(cond, num_frames=shape.num_frames, steps=3, seed=3, chunk_size=16,
                              between_chunks=lambda: reclaims.append(1))
    assert reclaims  # ran between the row chunks of this call
    assert pipeline.component("transformer").chunking is policy and vars(policy) == saved
    assert torch.allclose(chunked.video, fused.video, atol=1e-5, rtol=0)
    assert torch.allclose(chunked.audio, fused.audio, atol=1e-5, rtol=0)
    reclaims.clear()
    again = pipeline.sample(cond, num_frames=shape.num_frames, steps=3, seed=3)
    assert torch.equal(again.video, fused.video) and not reclaims
    with pytest.raises(ChunkingError, match="chunk_size must be a positive integer"):
        pipeline.sample(cond, num_frames=shape.num_frames, steps=3, seed=3, chunk_size=0)


def test_decode_video_and_audio_are_the_two_halves_of_decode(pipeline):
    from h3_core.request.grid import audio_samples_for_frames

    cond = pipeline.encode_prompt("a quiet harbour at night", width=64, height=96)
    latents = pipeline.sample(cond, num_frames=22, steps=3, seed=3)
    frames, waveform = pipeline.decode_video(latents), pipeline.decode_audio(latents)
    assert frames.shape == (22, 96, 64, 3) and frames.dtype == torch.float32 and frames.is_contiguous()
    assert waveform.shape == (2, audio_samples_for_frames(22)) and waveform.is_contiguous()  # trimmed to the video
    both = pipeline.decode(latents)
    assert torch.equal(both[0], frames) and torch.equal(both[1], waveform)


def test_residency_summary_of_a_loaded_component(tiny):
    from h3_core.pipeline.pipeline import ResidencySummary

    logged = []
    pipe = H3Pipeline(resolve_model(tiny), component_options={
        "transformer": {"residency": "layerwise", "resident_blocks": 1}}, log=logged.append)
    assert pipe.residency_summary("transformer") is None and not logged  # not loaded, and asking does not load it
    pipe.component("transformer")
    pipe.component("video_vae")
    assert pipe.residency_summary("transformer") == ResidencySummary("layerwise", 1, 2)
    video = pipe.residency_summary("video_vae")
    assert video.residency == "resident" and video.resident_blocks == video.total_blocks > 0
    with pytest.raises(H3Error, match="unknown component 'vae'"):
        pipe.residency_summary("vae")
    pipe.release_all()
    assert pipe.residency_summary("transformer") is None


# ---- model sources ----------------------------------------------------------------------------------------------


def test_resolve_official_partition_and_comfy_layouts(tmp_path):
    official = tmp_path / "MiniMax-H3"
    for sub in ("transformer", "transformer_ref", "text_encoder", "tokenizer", "vae", "audio_vae"):
        (official / sub).mkdir(parents=True)
    s = resolve_model(official)
    assert (s.transformer.name, s.video_vae.name, s.audio_vae.name) == ("transformer", "vae", "audio_vae")
    assert resolve_model(official, partition="ref2va").transformer.name == "transformer_ref"
    release = tmp_path / "release"
    for sub in ("transformer", "text_encoder", "video_vae", "audio_vae"):
        (release / "FL2VA" / sub).mkdir(parents=True)
    s = resolve_model(release)
    assert s.transformer == release / "FL2VA" / "transformer" and s.video_vae.name == "video_vae"
    comfy = tmp_path / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (comfy / sub).mkdir(parents=True)
    for name in ("diffusion_models/minimax_h3_fl2va_bf16.safetensors",
                 "diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                 "text_encoders/qwen3vl_32b_minimax_h3_bf16.safetensors",
                 "vae/minimax_h3_video_vae_fp16.safetensors", "vae/minimax_h3_audio_vae_fp32.safetensors"):
        (comfy / name).write_bytes(b"")
    s = resolve_model(comfy)
    assert s.transformer.name == "minimax_h3_fl2va_bf16.safetensors"  # pruned / quantised variants skipped
    assert s.audio_vae.name == "minimax_h3_audio_vae_fp32.safetensors"
    # Without the bf16 release, a quantised repack is taken (never the pruned variant).
    (comfy / "diffusion_models/minimax_h3_fl2va_bf16.safetensors").unlink()
    (comfy / "diffusion_models/minimax_h3_fl2va_int8_convrot.safetensors").write_bytes(b"")
    assert resolve_model(comfy).transformer.name == "minimax_h3_fl2va_int8_convrot.safetensors"


def test_resolve_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not an H3 model folder"):
        resolve_model(tmp_path)
    with pytest.raises(CheckpointError, match="not a Hugging Face repo id"):
        resolve_model(str(tmp_path / "missing" / "x" / "y"))
    (tmp_path / "models" / "diffusion_models").mkdir(parents=True)
    (tmp_path / "models" / "vae").mkdir()
    with pytest.raises(CheckpointError, match="no H3 transformer file"):
        resolve_model(tmp_path / "models")
    with pytest.raises(H3Error, match="partition"):
        resolve_model(tmp_path, partition="t2v")
    assert is_repo_id("MiniMaxAI/MiniMax-H3") and not is_repo_id("../etc/passwd") and not is_repo_id("a/b/c")


def test_repo_id_offline_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="Offline mode is on"):
        resolve_model("MiniMaxAI/MiniMax-H3-not-cached")


@pytest.mark.parametrize("value", ["abc", None, 1.7, 0, -3, True, [50]])
def test_a_text_encoder_layer_that_is_not_a_whole_number_is_named(tiny, tmp_path, value):
    # Before: "abc" and null were a ValueError / TypeError traceback from int(), and 1.7 silently read layer 1.
    model = tmp_path / "models"
    shutil.copytree(tiny, model, symlinks=True)
    index = model / "model_index.json"
    data = json.loads(index.read_text())
    data["_minimax_h3"]["text_encoder_layer"] = value
    index.unlink()
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        resolve_model(model)
    assert str(info.value) == (f"{index}: _minimax_h3.text_encoder_layer must be a whole number of layers >= 1 (the "
                               f"released model uses 50), got {value!r}. Fix the file, or download model_index.json "
                               "again.")
    assert info.value.key == "text_encoder_layer"


def test_missing_component_folder_names_it(tiny, tmp_path):
    broken = tmp_path / "models"
    shutil.copytree(tiny, broken)
    for p in (broken / "vae").glob("minimax_h3_audio_vae*"):
        p.unlink()
    with pytest.raises(CheckpointError, match="H3 audio VAE"):
        resolve_model(broken)


# ---- CLI --------------------------------------------------------------------------------------------------------------


def cli(args, cache, cwd):
    """A real `python -m h3_core` child: the README command is run as a user runs it."""
    env = dict(os.environ, H3_STREAM_CACHE=str(cache), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "h3_core", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_cli_readme_command_writes_an_mp4(tiny, tiny_cache, tmp_path):
    done = cli(["generate", "a red fox runs through snow", "--seconds", "1", "--size", "96x64", "--steps", "3",
                "--out", "out.mp4"], tiny_cache, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tiny random model" in done.stdout and "peak host memory" in done.stdout
    from h3_core.request.media_files import have_pyav

    if have_pyav():
        import av

        with av.open(str(tmp_path / "out.mp4")) as container:
            video = container.streams.video[0]
            audio = container.streams.audio[0]
            assert (video.codec_context.name, audio.codec_context.name) == ("h264", "aac")
            assert (video.codec_context.width, video.codec_context.height) == (96, 64)
            assert audio.codec_context.sample_rate == 32000 and audio.codec_context.channels == 2
            assert sum(1 for _ in container.decode(video=0)) == 39
    else:
        assert len(list((tmp_path / "out_frames").glob("*.png"))) == 39 and (tmp_path / "out.wav").is_file()


def test_cli_png_and_wav_fallback(tiny, tiny_cache, tmp_path):
    import soundfile

    from h3_core.request.media_files import save_generation

    written = save_generation(tmp_path / "clip.mp4", torch.rand(5, 32, 64, 3), torch.rand(2, 9000) * 2 - 1,
                              prefer_mp4=False)
    assert len(list(written[0].glob("frame_*.png"))) == 5
    data, rate = soundfile.read(written[1])
    assert rate == 32000 and data.shape == (6667, 2)  # trimmed to ceil(32000 / 24 * 5)


@pytest.mark.parametrize("args,message", [
    (["--size", "100x64"], "--size 100x64: width 100 is not a positive multiple of 32 pixels; use 96 or 128"),
    (["--size", "96by64"], "WIDTHxHEIGHT"),
    (["--seconds", "0"], "--seconds 0: must be more than 0"),
    (["--seconds", "601"], "at most 600"),
    (["--steps", "1"], "--steps 1: must be at least 2"),
    (["--seconds", "1", "--frames", "39"], "not both"),
    (["--first-frame", "missing.png"], "no such image file"),
    (["--model", "no_such_folder/at/all"], "not a Hugging Face repo id"),
])
def test_cli_bad_arguments_give_one_line(args, message, tiny, run_cli, tmp_path):
    done = run_cli(["generate", "x", *args], tmp_path)
    assert done.returncode == 2
    assert message in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_cli_rounds_frames_up_and_says_so(tiny, run_cli, tmp_path):
    done = run_cli(["generate", "x", "--frames", "6", "--size", "64x32", "--steps", "2", "--out", "o.mp4"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "6 frames is off the 17n+5 grid" in done.stdout and "rounding up to 22" in done.stdout
