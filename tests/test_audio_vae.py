"""Audio VAE: parity with diffusers `AutoencoderKLMiniMaxH3Audio` (tiny random fp32 model), the three checkpoint
layouts, exact weight-norm folding, and the error surface."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from vae_fixtures import (one_error as _one_error, folded_audio_state, reference_audio, reference_audio_decode, reference_audio_encode,
                          reference_video, rel_l2, save_audio_comfy, save_audio_diffusers, save_audio_native,
                          save_video_comfy)

import h3_core
from h3_core import CheckpointError, H3Error, PickleCheckpointError, load_audio_vae
from h3_core.models.audio_vae import PUBLISHED_LATENTS_MEAN, PUBLISHED_LATENTS_STD, WEIGHT_NORM_MODULES

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def small_cpu_kernels():
    # Tiny, overhead-bound model: one intra-op thread avoids OpenMP spin contention on shared cores, and the native
    # convolution kernels avoid oneDNN's per-shape setup (seconds for the ~400 distinct BigVGAN convolutions). Both
    # sides of every comparison run under the same settings.
    threads, mkldnn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    yield
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = mkldnn


@pytest.fixture(scope="module")
def reference():
    return reference_audio(seed=0)


@pytest.fixture(scope="module")
def checkpoints(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_vae")
    return {
        "diffusers": save_audio_diffusers(reference, root / "audio_vae"),
        "native": save_audio_native(reference, root / "FL2VA" / "audio_vae"),
        "comfy": save_audio_comfy(reference, root / "minimax_h3_audio_vae_fp32.safetensors"),
    }


@pytest.fixture(scope="module")
def vae(checkpoints):
    return load_audio_vae(checkpoints["native"])


# ---- layouts ---------------------------------------------------------------------------------------------------------


def test_three_layouts_load_identical_parameters(checkpoints, reference):
    models = {layout: load_audio_vae(path) for layout, path in checkpoints.items()}
    states = {layout: m.state_dict() for layout, m in models.items()}
    base = states["diffusers"]
    for layout in ("native", "comfy"):
        assert states[layout].keys() == base.keys()
        for key, value in base.items():
            assert torch.equal(states[layout][key], value), f"{layout}: {key} differs"
        assert models[layout].config == models["diffusers"].config
        assert models[layout].checkpoint_layout == layout
    assert models["comfy"].config.latents_std == tuple(reference.config.latents_std)
    # A release partition or repo root resolves to its audio_vae/ folder; a weights file to the folder holding it.
    assert load_audio_vae(checkpoints["native"].parent).checkpoint_layout == "native"
    direct = load_audio_vae(checkpoints["native"] / "model.safetensors")
    assert direct.checkpoint_layout == "native"
    assert direct.config.latents_mean == tuple(reference.config.latents_mean)


def test_weight_norm_folding_is_exact(vae, reference):
    """Every folded weight equals, bit for bit, the weight the reference's weight-norm hook computes for its forward."""
    folded = folded_audio_state(reference)
    state = vae.state_dict()
    normed = [name for name, module in vae.named_modules() if isinstance(module, WEIGHT_NORM_MODULES)]
    assert len(normed) > 50 and "decoder.ups.0.0" in normed and "decoder.conv_post" in normed
    for name in normed:
        assert torch.equal(state[f"{name}.weight"], folded[f"{name}.weight"]), name
    # The fold really is g * v / ||v|| (a value check, independent of the kernel used).
    g = reference.decoder.ups[0][0].weight_g.detach().double()
    v = reference.decoder.ups[0][0].weight_v.detach().double()
    expected = g * v / v.flatten(1).norm(dim=1).view(-1, 1, 1)
    assert torch.allclose(state["decoder.ups.0.0.weight"].double(), expected, rtol=1e-6, atol=1e-7)


def test_parametrizations_spelling_loads_the_same(checkpoints, tmp_path):
    """`torch.nn.utils.parametrizations.weight_norm` names the pair original0 / original1; it is the same layout."""
    folder = tmp_path / "audio_vae"
    folder.mkdir()
    for name in ("config.json", "metadata.json"):
        (folder / name).write_text((checkpoints["native"] / name).read_text())
    state = {}
    for key, value in load_file(checkpoints["native"] / "model.safetensors").items():
        key = key.replace(".weight_g", ".parametrizations.weight.original0")
        state[key.replace(".weight_v", ".parametrizations.weight.original1")] = value
    save_file(state, folder / "model.safetensors")
    ours = load_audio_vae(folder).state_dict()
    base = load_audio_vae(checkpoints["native"]).state_dict()
    assert all(torch.equal(ours[k], base[k]) for k in base)


def test_comfy_file_without_statistics_uses_published_constants(reference, tmp_path):
    model = load_audio_vae(save_audio_comfy(reference, tmp_path / "a.safetensors", with_stats=False))
    assert model.config.latents_mean == PUBLISHED_LATENTS_MEAN
    assert model.config.latents_std == PUBLISHED_LATENTS_STD


# ---- parity ----------------------------------------------------------------------------------------------------------


def test_decode_matches_reference(vae, reference):
    latent = torch.randn(2, 32, 2, 3, generator=torch.Generator().manual_seed(1))
    ours = vae.decode(latent)
    theirs = reference_audio_decode(reference, latent)
    assert ours.shape == theirs.shape == (2, 2, 3 * 800)
    assert ours.dtype == torch.float32
    assert float((theirs.abs() < 1).float().mean()) > 0.8  # mostly inside the clamp: the comparison is informative
    assert rel_l2(ours, theirs) <= TOL


def test_encode_matches_reference_for_a_length_off_the_hop(vae, reference):
    # 2000 samples are not a multiple of 800: right-padded to 2400, three latents per channel.
    generator = torch.Generator().manual_seed(2)
    waveform = (0.5 * torch.randn(2, 2, 2000, generator=generator)).clamp(-1, 1)
    ours = vae.encode(waveform)
    theirs = reference_audio_encode(reference, waveform)
    assert ours.shape == theirs.shape == (2, 32, 2, 3)
    assert rel_l2(ours, theirs) <= TOL
    # The stereo channels are independent batch items: swapping them swaps the latent channels.
    swapped = vae.encode(waveform.flip(1))
    assert torch.allclose(swapped, ours.flip(2), rtol=1e-5, atol=1e-5)


# ---- errors ----------------------------------------------------------------------------------------------------------


def test_loader_errors_name_the_file_and_key(checkpoints, reference, tmp_path):
    pickle = tmp_path / "audio_vae.pt"
    pickle.write_bytes(b"not read")
    _one_error(lambda: load_audio_vae(pickle), PickleCheckpointError, "audio_vae.pt")

    state = load_file(checkpoints["comfy"])
    del state["decoder.resblocks.4.convs2.1.weight"]
    missing = tmp_path / "missing.safetensors"
    save_file(state, missing)
    err = _one_error(lambda: load_audio_vae(missing), CheckpointError, "decoder.resblocks.4.convs2.1.weight")
    assert err.key == "decoder.resblocks.4.convs2.1.weight"

    state = load_file(checkpoints["comfy"])
    state["pre_block.mlp.w2.bias"] = torch.zeros(31)
    wrong = tmp_path / "wrong.safetensors"
    save_file(state, wrong)
    _one_error(lambda: load_audio_vae(wrong), CheckpointError, "pre_block.mlp.w2.bias", "[31]", "[32]")

    folder = save_audio_native(reference, tmp_path / "nostats")
    config = json.loads((folder / "config.json").read_text())
    del config["latents_std"]
    (folder / "config.json").write_text(json.dumps(config))
    _one_error(lambda: load_audio_vae(folder), CheckpointError, "latents_std", "config.json")

    video = save_video_comfy(reference_video(seed=0), tmp_path / "video.safetensors")
    _one_error(lambda: load_audio_vae(video), CheckpointError, "not an H3 audio VAE", "load_video_vae")


def test_option_and_input_errors(checkpoints, vae):
    _one_error(lambda: load_audio_vae(checkpoints["comfy"], dtype=torch.bfloat16), H3Error, "float32")
    with pytest.raises(TypeError, match="tiling"):
        load_audio_vae(checkpoints["comfy"], tiling=True)
    _one_error(lambda: vae.decode(torch.zeros(1, 32, 3)), H3Error, "[B, 32, 2, Ta]", "(1, 32, 3)")
    _one_error(lambda: vae.encode(torch.zeros(1, 1, 800)), H3Error, "[B, 2, samples]", "Duplicate a mono track")


def test_encode_refuses_a_mono_or_unbatched_waveform(vae):
    with pytest.raises(H3Error, match="32000 Hz"):
        vae.encode(torch.zeros(1, 1, 1600))  # mono
    with pytest.raises(H3Error, match="32000 Hz"):
        vae.encode(torch.zeros(2, 1600))  # no batch axis


def test_public_api_exports():
    assert h3_core.load_audio_vae is load_audio_vae
