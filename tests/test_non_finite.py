"""NaN/Inf: named after the stage and tensor at fault, with advice that fits the run's dtype.

A corrupt weight of each component is named with its file and key once a run reveals it; a NaN keyframe latent names
the video VAE's encoder, a non-finite shift names the shift, a NaN noise input names the sampler input (all three once
surfaced as "the transformer produced NaN/Inf ... Run in float32 or bfloat16 rather than float16", on float32 runs
too); non-finite latents are refused before decoding, by the pipeline and the decode nodes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from h3_fixtures import tiny_copy_with
from PIL import Image

from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model

REQUEST = dict(width=64, height=64, num_frames=5, steps=3, seed=5)


# ---- corrupt weights: the file and tensor -------------------------------------------------------------------------


@pytest.mark.parametrize("component,key,value,message", [
    ("diffusion_models/*fl2va*.safetensors", "blocks.1.mlp.fc2.weight", float("nan"),
     "the transformer produced NaN/Inf"),
    ("vae/minimax_h3_video_vae*.safetensors", "decoder.transformer_blocks.0.ff.w2.weight", float("inf"),
     "the video VAE produced NaN/Inf"),
    ("vae/minimax_h3_audio_vae*.safetensors", "decoder.conv_post.weight", float("nan"),
     "the audio VAE produced NaN/Inf"),
    ("text_encoders/*/model.safetensors", "model.language_model.layers.0.mlp.down_proj.weight", float("nan"),
     "the text encoder produced NaN/Inf"),
])
def test_non_finite_weights_are_named(tiny, tmp_path, component, key, value, message):
    root, path = tiny_copy_with(tiny, tmp_path, component, key, value)
    pipe = H3Pipeline(resolve_model(root))
    with pytest.raises(H3Error) as info:
        pipe.generate("a red fox", **REQUEST)
    pipe.release_all()
    text = str(info.value)
    assert str(path) in text and f"'{key}'" in text and message in text and "download it again" in text


# ---- the stage at fault and its inputs --------------------------------------------------------------------------


def test_a_nan_keyframe_latent_names_the_video_vae_encoder_not_the_transformer(tiny, tmp_path):
    root, path = tiny_copy_with(tiny, tmp_path, "vae/minimax_h3_video_vae*.safetensors", "encoder.conv_in.weight",
                             float("nan"))
    pipe = H3Pipeline(resolve_model(root))
    with pytest.raises(H3Error) as error:
        pipe.generate("a fox", first_frame=Image.new("RGB", (64, 64), "red"), **REQUEST)
    assert str(error.value) == (f"{path}: tensor 'encoder.conv_in.weight' contains NaN or Inf values, so the video "
                                "VAE's encoder produced NaN/Inf at keyframe encode (the first keyframe's latent). The "
                                "file is corrupt; download it again.")
    assert pipe.loaded == ("video_vae",)  # found before the transformer ran (or was even loaded)


@pytest.mark.parametrize("name,value", [("video_shift", float("inf")), ("audio_shift", float("nan"))])
def test_a_non_finite_shift_names_the_shift(tiny, name, value):
    pipe = H3Pipeline(resolve_model(tiny))
    with pytest.raises(H3Error) as error:
        pipe.generate("a fox", **REQUEST, **{name: value})
    # Checked with the request, before any model loads (the schedule's own check says the same for direct callers).
    assert str(error.value) == (f"{name} {value}: must be a finite number above 0 and at most 100 (the released "
                                "model uses 12 for video and 3 for audio).")
    assert pipe.loaded == ()


def test_a_nan_noise_input_names_the_sampler_input(tiny):
    import h3_core
    from h3_core.pipeline.layout import build_packed_layout
    from h3_core.pipeline.sampler import Schedule, denoise

    dit = h3_core.load_dit(resolve_model(tiny).transformer)
    c = dit.config
    tags = torch.ones(4, dtype=torch.long)
    layout = build_packed_layout(tags, 2, 2, 2, 3, (), c.patch_size)
    video = torch.randn(layout.video_indices.numel(), c.video_patch_dim)
    video[1, 1] = float("nan")  # one NaN element of the initial noise (epsilon)
    audio = torch.randn(layout.audio_indices.numel(), c.audio_in_channels)
    with pytest.raises(H3Error) as error:
        denoise(dit, torch.randn(4, c.text_dim), layout, Schedule.build(3), video, audio)
    assert str(error.value) == ("the initial video rows given to the sampler (noise and keyframe latents) contain NaN "
                                "or Inf values: the sampler input is not finite, so sampling cannot start. Encode the "
                                "prompt (and keyframes) again.")


OVERFLOW = 3e38  # finite in float32 and bfloat16; any product with it overflows


@pytest.mark.parametrize("dtype,advice", [
    (None, "the run is already float32, so this is not a precision problem: check the inputs of this stage and the "
           "component's config values (eps, scales), or report it with the request that caused it."),
    (torch.bfloat16,
     "the numbers overflowed or lost precision in bfloat16. Set the dtype to float32 to rule that out."),
])
def test_transformer_overflow_advice_fits_the_run_dtype(tiny, tmp_path, dtype, advice):
    root, _ = tiny_copy_with(tiny, tmp_path, "diffusion_models/*fl2va*.safetensors", "blocks.1.mlp.fc2.weight",
                             OVERFLOW)
    pipe = H3Pipeline(resolve_model(root), dtype=dtype)
    with pytest.raises(H3Error) as error:
        pipe.generate("a fox", **REQUEST)
    assert str(error.value) == ("the transformer produced NaN/Inf at step 1 of 2 (its video velocity output) although "
                                f"its weights are finite: {advice}")


def test_a_non_finite_config_value_is_named():
    from h3_core.models.dit_config import H3DiTConfig
    from h3_core.pipeline.sampler import non_finite_error

    config = dataclasses.replace(H3DiTConfig(), norm_eps=float("nan"))
    assert str(non_finite_error("the transformer", (), "step 2 of 5 (its audio velocity output)", config=config)) == (
        "the transformer produced NaN/Inf at step 2 of 5 (its audio velocity output): its config sets norm_eps = nan. "
        "Give it a finite value (the released config's) in the component's config.")
    assert "float16" in str(non_finite_error("the transformer", (), "step 1", dtype=torch.float16))


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_decoding_non_finite_latents_names_the_latents(tiny, kind):
    from h3_core.pipeline.pipeline import Latents
    from h3_core.request.grid import LatentShape

    shape = LatentShape.for_request(64, 64, 5)
    latents = Latents(torch.zeros(shape.video), torch.zeros(1, 32, 2, shape.audio_latents), shape)
    getattr(latents, kind)[0, 0, 0, 0] = float("inf")
    pipe = H3Pipeline(resolve_model(tiny))
    with pytest.raises(H3Error) as error:
        getattr(pipe, f"decode_{kind}")(latents)
    assert str(error.value).startswith(f"the {kind} latents given to decode contain NaN or Inf values")
    assert pipe.loaded == ()  # refused before the VAE was loaded


@pytest.mark.parametrize("node,kind", [("H3StreamDecodeVideo", "video"), ("H3StreamDecodeAudio", "audio")])
def test_the_decode_nodes_refuse_non_finite_latents(tmp_path, node, kind):
    """The decode nodes go through the pipeline's decode_video / decode_audio, so its checks are theirs."""
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    pack = comfy_double.load_pack()
    from comfy_double.executor import run_node

    from h3_core.pipeline.pipeline import Latents
    from h3_core.request.grid import LatentShape

    loader = dict(source="tiny test model (embedded)", partition="FL2VA", transformer_residency="RESIDENT",
                  text_encoder_residency="RESIDENT", video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT",
                  prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu")
    handle, = run_node(pack["H3StreamLoader"], "1", **loader)
    shape = LatentShape.for_request(64, 64, 5)
    latents = Latents(torch.zeros(shape.video), torch.zeros(1, 32, 2, shape.audio_latents), shape)
    getattr(latents, kind)[0, 0, 0, 0] = float("nan")
    with pytest.raises(H3Error, match=f"^the {kind} latents given to decode contain NaN or Inf values"):
        run_node(pack[node], "4", h3_model=handle, h3_latent=latents)
