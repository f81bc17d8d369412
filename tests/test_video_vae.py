"""Video VAE: parity with diffusers `AutoencoderKLMiniMaxH3` (tiny random fp32 model), the three checkpoint layouts,
streaming decode memory, and the error surface."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from vae_fixtures import (one_error as _one_error, LiveTensorBytes, reference_audio, reference_video, reference_video_decode,
                          reference_video_decode_clip, reference_video_encode, rel_l2, save_audio_comfy,
                          save_video_comfy, save_video_diffusers, save_video_native)

import h3_core
from h3_core import CheckpointError, H3Error, PickleCheckpointError, Platform, load_video_vae
from h3_core.models.video_vae import (PUBLISHED_LATENTS_MEAN, PUBLISHED_LATENTS_STD, DecodeAutocast, DecoderAttention,
                               DecoderBlock, split_tiles)

TOL = 1e-5
# Decode tests: 48-px tiles with >= 16-px overlaps; encode tests: 32-px tiles (the smallest the encoder's deepest level
# can reflect-pad) with >= 16-px overlaps.
DECODE_TILES = dict(tile_size=48, tile_min_overlap=16)
ENCODE_TILES = dict(tile_size=32, tile_min_overlap=16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These tiny models are overhead-bound; one intra-op thread avoids OpenMP spin contention when the two cores are
    # shared (20x slower with two threads on a loaded machine), and changes no result the tests compare.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    return reference_video(seed=0)


@pytest.fixture(scope="module")
def checkpoints(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("video_vae")
    return {
        "diffusers": save_video_diffusers(reference, root / "vae"),
        "native": save_video_native(reference, root / "video_vae"),
        "comfy": save_video_comfy(reference, root / "minimax_h3_video_vae_fp16.safetensors"),
    }


@pytest.fixture(scope="module")
def decode_vae(checkpoints):
    return load_video_vae(checkpoints["diffusers"], **DECODE_TILES)


@pytest.fixture(scope="module")
def encode_vae(checkpoints):
    return load_video_vae(checkpoints["native"], **ENCODE_TILES)


def _latent(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _frames(shape, seed):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def _saturated(frames: torch.Tensor) -> float:
    return float(((frames == 0) | (frames == 1)).float().mean())


# ---- layouts ---------------------------------------------------------------------------------------------------------


def test_three_layouts_load_identical_parameters(checkpoints, reference):
    models = {layout: load_video_vae(path) for layout, path in checkpoints.items()}
    states = {layout: m.state_dict() for layout, m in models.items()}
    base = states["diffusers"]
    assert len(base) > 0
    for layout in ("native", "comfy"):
        assert states[layout].keys() == base.keys()
        for key, value in base.items():
            assert states[layout][key].dtype == torch.float32
            assert torch.equal(states[layout][key], value), f"{layout}: {key} differs"
        assert models[layout].config == models["diffusers"].config
        assert models[layout].checkpoint_layout == layout
    assert models["diffusers"].config.latents_mean == tuple(reference.config.latents_mean)
    # The native wrapper config's tile settings become the defaults; the other layouts use the reference's 256 / 64.
    assert (models["native"].tiling.tile_size, models["native"].tiling.min_overlap) == (64, 32)
    assert (models["comfy"].tiling.tile_size, models["comfy"].tiling.min_overlap) == (256, 64)
    # The fused QKV rows are held [q; k; v]: the diffusers to_q / to_k / to_v are contiguous row blocks.
    qkv = base["decoder.transformer_blocks.1.attn.to_qkv.weight"]
    ref = reference.state_dict()
    assert torch.equal(qkv[128:256], ref["decoder.transformer_blocks.1.attn.to_k.weight"])


def test_repo_roots_and_prefixed_single_file(checkpoints, reference, tmp_path):
    # An official repo root (holding vae/) and a release partition (holding video_vae/) resolve to their VAE folder.
    assert load_video_vae(checkpoints["diffusers"].parent).checkpoint_layout == "diffusers"
    partition = tmp_path / "FL2VA"
    save_video_native(reference, partition / "video_vae")
    assert load_video_vae(partition).checkpoint_layout == "native"
    assert load_video_vae(partition / "video_vae" / "source").checkpoint_layout == "native"
    # A folder layout's weights file, given directly, still loads with its folder's config (latent statistics).
    direct = load_video_vae(partition / "video_vae" / "source" / "model.safetensors")
    assert direct.checkpoint_layout == "native"
    assert direct.config.latents_mean == tuple(reference.config.latents_mean)
    direct = load_video_vae(checkpoints["diffusers"] / "diffusion_pytorch_model.safetensors")
    assert direct.checkpoint_layout == "diffusers"
    # A single file cut from a combined checkpoint carries a `vae.` prefix; without stats the published ones apply.
    path = save_video_comfy(reference, tmp_path / "prefixed.safetensors", with_stats=False, prefix="vae.")
    model = load_video_vae(path)
    assert model.config.latents_mean == PUBLISHED_LATENTS_MEAN
    assert model.config.latents_std == PUBLISHED_LATENTS_STD
    assert torch.equal(model.state_dict()["decoder.proj_out.weight"], reference.decoder.proj_out.weight)


# ---- geometry --------------------------------------------------------------------------------------------------------


def test_tile_layout_matches_spec_and_reference(reference):
    # The spec's worked example (1344 x 768 px, 256-px tiles, >= 64-px overlaps in 16-px steps).
    assert split_tiles(768, 256, 64, 16)[0::2] == ([0, 160, 336, 512], [96, 80, 80])
    assert split_tiles(1344, 256, 64, 16)[0::2] == ([0, 176, 352, 528, 704, 896, 1088], [80, 80, 80, 80, 64, 64])
    for length in range(16, 2049, 16):
        for tile, overlap in ((256, 64), (48, 16), (32, 16)):
            assert split_tiles(length, tile, overlap, 16) == reference._split_tiles(length, tile, overlap), length


def test_output_frames_follow_the_clip_grid(decode_vae):
    for k in range(0, 8):
        assert decode_vae.output_frames(5 * k + 2) == 17 * k + 5
    assert decode_vae.output_frames(1) == 1
    # Off the grid: the first latent of each 5-latent clip covers one frame (17 = 1 + 4 * 4), every other one four.
    for t in range(2, 40):
        assert decode_vae.output_frames(t) == sum(1 if i % 5 == 0 else 4 for i in range(t)), t


# ---- decode ----------------------------------------------------------------------------------------------------------


def test_decode_multi_clip_multi_tile_matches_reference(decode_vae, reference):
    # 12 latent frames = 3 clips (39 frames); 64 x 96 px = 2 x 3 tiles of 48 px with overlaps 32 and 32 / 16 px.
    rows, cols = split_tiles(64, 48, 16, 16), split_tiles(96, 48, 16, 16)
    assert (len(rows[0]), len(cols[0]), rows[2], cols[2]) == (2, 3, [32], [32, 16])
    reference.enable_tiling(48, 48, 16, 16)
    latent = _latent((1, 24, 12, 4, 6), seed=1)
    ours = decode_vae.decode(latent)
    theirs = reference_video_decode(reference, latent)
    assert ours.shape == theirs.shape == (1, 39, 64, 96, 3)
    assert ours.device.type == "cpu" and ours.dtype == torch.float32
    assert _saturated(theirs) < 0.2
    assert rel_l2(ours, theirs) <= TOL


@pytest.mark.parametrize("frames, batch", [(4, 2), (9, 1), (7, 1)])
def test_decode_other_lengths_match_reference(decode_vae, reference, frames, batch):
    # 4 and 9 latent frames are off the 5k + 2 grid (padded, then trimmed); 7 is one clip.
    reference.enable_tiling(48, 48, 16, 16)
    latent = _latent((batch, 24, frames, 2, 2), seed=frames)
    ours = decode_vae.decode(latent)
    theirs = reference_video_decode(reference, latent)
    assert ours.shape == theirs.shape
    assert ours.shape[1] == decode_vae.output_frames(frames)
    assert rel_l2(ours, theirs) <= TOL


def test_decode_two_latent_frames_pads_one_more_chunk(decode_vae, reference):
    # The reference has no clip for 2 latent frames (it raises); like ComfyUI we pad one more chunk of repeats,
    # which equals decoding the latent padded to 7 frames and keeping the first 5 output frames.
    reference.enable_tiling(48, 48, 16, 16)
    latent = _latent((1, 24, 2, 2, 3), seed=3)
    ours = decode_vae.decode(latent)
    padded = torch.cat((latent, latent[:, :, -1:].expand(-1, -1, 5, -1, -1)), dim=2)
    theirs = reference_video_decode(reference, padded)[:, :5]
    assert ours.shape == (1, 5, 32, 48, 3)
    assert rel_l2(ours, theirs) <= TOL


def test_decode_single_latent_frame_keeps_last_of_four(decode_vae, reference):
    # One latent frame decodes to 4 frames of which the reference image path keeps the last; multi-tile canvas.
    reference.enable_tiling(48, 48, 16, 16)
    latent = _latent((1, 24, 1, 4, 6), seed=4)
    ours = decode_vae.decode(latent)
    four = reference_video_decode_clip(reference, latent)
    assert four.shape[1] == 4
    assert ours.shape == (1, 1, 64, 96, 3)
    assert rel_l2(ours, four[:, -1:]) <= TOL
    assert rel_l2(ours, four[:, :1]) > 1e-2  # keeping another frame would be visibly different


def test_decode_untiled_matches_reference(checkpoints, reference):
    model = load_video_vae(checkpoints["comfy"], tiling=False)
    reference.disable_tiling()
    try:
        latent = _latent((1, 24, 7, 3, 4), seed=5)
        assert rel_l2(model.decode(latent), reference_video_decode(reference, latent)) <= TOL
    finally:
        reference.enable_tiling()


def test_decode_writes_into_a_given_buffer(decode_vae):
    latent = _latent((1, 24, 7, 2, 2), seed=6)
    out = torch.full((1, 22, 32, 32, 3), -1.0)
    result = decode_vae.decode(latent, out=out)
    assert result is out
    assert float(out.min()) >= 0.0  # every frame was written
    assert torch.equal(out, decode_vae.decode(latent))
    with pytest.raises(H3Error, match=r"out: expected a float32 buffer of shape \[1, 22, 32, 32, 3\]"):
        decode_vae.decode(latent, out=torch.empty(1, 21, 32, 32, 3))


def test_decode_peak_memory_is_set_by_clip_not_length(decode_vae, reference):
    """Decoding 124 frames instead of 39 (3.2x) must not raise the decode's own peak allocation by 20% or more.

    Frames stream clip by clip into the preallocated output (not counted: it exists before the decode); the reference,
    which concatenates every clip, is measured the same way for contrast.
    """
    reference.enable_tiling(48, 48, 16, 16)
    peaks, reference_peaks = {}, {}
    for latent_frames in (12, 37):
        latent = _latent((1, 24, latent_frames, 4, 4), seed=7)
        out = torch.empty(1, decode_vae.output_frames(latent_frames), 64, 64, 3)
        with LiveTensorBytes("cpu") as tracker:
            decode_vae.decode(latent, out=out)
        assert tracker.current == 0  # nothing left behind
        peaks[out.shape[1]] = tracker.peak
        with LiveTensorBytes("cpu") as tracker:
            reference_video_decode(reference, latent)
        reference_peaks[out.shape[1]] = tracker.peak
    assert set(peaks) == {39, 124}
    assert peaks[124] < 1.2 * peaks[39]
    assert reference_peaks[124] > 1.5 * reference_peaks[39]  # the measurement does see length-bound memory


def test_decoder_blocks_and_attention_are_single_points(decode_vae, monkeypatch):
    """The decoder's blocks are one ModuleList iterated once per tile, and attention goes through one method."""
    blocks = decode_vae.decoder.transformer_blocks
    assert isinstance(blocks, torch.nn.ModuleList) and all(type(b) is DecoderBlock for b in blocks)
    calls = []
    original = DecoderAttention.attend

    def counting(self, q, k, v):
        calls.append(q.shape[1])
        return original(self, q, k, v)

    latent = _latent((1, 24, 1, 2, 2), seed=8)
    expected = decode_vae.decode(latent)
    monkeypatch.setattr(DecoderAttention, "attend", counting)
    assert torch.equal(decode_vae.decode(latent), expected)
    assert calls == [1 * 2 * 2 + 5] * len(blocks)  # tokens = latent voxels + 4 registers + 1 zero token


def test_decode_autocast_is_cuda_only(checkpoints):
    assert Platform("cpu").decode_autocast_dtype() is None
    assert Platform("mps").decode_autocast_dtype() is None
    assert Platform("cuda").decode_autocast_dtype() == torch.float16
    assert Platform("cuda").decode_autocast_dtype(enabled=False) is None
    with pytest.raises(H3Error, match="CUDA-only"):
        Platform("mps").decode_autocast_dtype(enabled=True)
    with pytest.raises(H3Error, match="CUDA-only"):
        h3_core.load_video_vae(checkpoints["comfy"], decode_autocast=True)


def test_decode_under_autocast_keeps_the_fp32_islands(checkpoints):
    """The autocast path (fp16 on CUDA) exercised on the CPU with bf16: the embedding, norms and output projection
    stay float32, the block projections run in the autocast dtype, and the frames stay close to the fp32 decode."""
    model = load_video_vae(checkpoints["diffusers"], **DECODE_TILES)
    latent = _latent((1, 24, 2, 2, 3), seed=12)
    exact = model.decode(latent)
    seen = {}

    def recorder(name):
        def hook(module, inputs, output):
            seen[name] = output.dtype
        return hook

    hooks = [module.register_forward_hook(recorder(name))
             for name, module in (("x_embedder", model.decoder.x_embedder), ("proj_out", model.decoder.proj_out),
                                  ("to_qkv", model.decoder.transformer_blocks[0].attn.to_qkv))]
    model.autocast = DecodeAutocast("cpu", torch.bfloat16)
    try:
        mixed = model.decode(latent)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == {"x_embedder": torch.float32, "to_qkv": torch.bfloat16, "proj_out": torch.float32}
    assert mixed.dtype == torch.float32
    assert 0 < rel_l2(mixed, exact) < 0.05


# ---- encode ----------------------------------------------------------------------------------------------------------


def test_encode_multi_clip_matches_reference(encode_vae, reference):
    reference.enable_tiling(32, 32, 16, 16)
    frames = _frames((1, 39, 32, 32, 3), seed=9)
    ours = encode_vae.encode(frames)
    theirs = reference_video_encode(reference, frames)
    assert ours.shape == theirs.shape == (1, 24, 12, 2, 2)
    assert rel_l2(ours, theirs) <= TOL


def test_encode_multi_tile_matches_reference(encode_vae, reference):
    # 48 x 48 px with 32-px tiles: 2 x 2 tiles overlapping 16 px (one latent).
    assert len(split_tiles(48, 32, 16, 16)[0]) == 2
    reference.enable_tiling(32, 32, 16, 16)
    frames = _frames((1, 5, 48, 48, 3), seed=10)
    ours = encode_vae.encode(frames)
    theirs = reference_video_encode(reference, frames)
    assert ours.shape == theirs.shape == (1, 24, 2, 3, 3)
    assert rel_l2(ours, theirs) <= TOL


def test_encode_one_frame_matches_reference(encode_vae, reference):
    reference.enable_tiling(32, 32, 16, 16)
    frames = _frames((2, 1, 48, 64, 3), seed=11)
    ours = encode_vae.encode(frames)
    theirs = reference_video_encode(reference, frames)
    assert ours.shape == theirs.shape == (2, 24, 1, 3, 4)
    assert rel_l2(ours, theirs) <= TOL


@pytest.mark.parametrize("shape", [(1, 1, 48, 64, 3), (1, 22, 32, 48, 3)], ids=["image", "video"])
def test_sampled_posterior_matches_the_reference_condition_encode(encode_vae, reference, shape):
    """`posterior="sample"` is diffusers' `encode_vae_condition` (Ref2VA references, FL2VA keyframes there): the
    posterior sampled from a CPU generator seeded 42, rounded to float16, normalised."""
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    reference.enable_tiling(32, 32, 16, 16)
    pixels = (_frames(shape, seed=12) * 255).round().to(torch.uint8)
    ours = encode_vae.encode(pixels.float() / 255.0, posterior="sample", seed=42)
    theirs = encode_vae_condition(reference, pixels.permute(0, 4, 1, 2, 3), (0.485, 0.456, 0.406),
                                  (0.229, 0.224, 0.225), encode_seed=42)
    assert ours.shape == theirs.shape
    assert rel_l2(ours, theirs) <= 1e-4  # float16 rounding of a value 1e-7 apart can land one fp16 ulp away
    mean = encode_vae.encode(pixels.float() / 255.0)
    assert rel_l2(mean, theirs) > 1e-2  # the sample really differs from the mean on this random VAE
    with pytest.raises(H3Error, match="posterior must be 'mean' or 'sample', got 'mode'"):
        encode_vae.encode(pixels.float() / 255.0, posterior="mode")


# ---- errors ----------------------------------------------------------------------------------------------------------


def test_loader_errors_name_the_file_and_key(checkpoints, reference, tmp_path):
    pickle = tmp_path / "vae.ckpt"
    pickle.write_bytes(b"not read")
    _one_error(lambda: load_video_vae(pickle), PickleCheckpointError, "vae.ckpt", "safetensors")
    _one_error(lambda: load_video_vae(tmp_path / "nothing"), CheckpointError, "no such file")

    # A key missing from the native weights.
    native = save_video_native(reference, tmp_path / "broken")
    state = load_file(native / "source" / "model.safetensors")
    del state["decoder.transformer_blocks.1.scale2"]
    save_file(state, native / "source" / "model.safetensors")
    err = _one_error(lambda: load_video_vae(native), CheckpointError, "decoder.transformer_blocks.1.scale2",
                     "missing key")
    assert err.key == "decoder.transformer_blocks.1.scale2"

    # A diffusers config that does not match its weights.
    diffusers = tmp_path / "mismatch"
    save_video_diffusers(reference, diffusers)
    config = json.loads((diffusers / "config.json").read_text())
    config["decoder_ffn_mult"] = 2
    (diffusers / "config.json").write_text(json.dumps(config))
    _one_error(lambda: load_video_vae(diffusers), CheckpointError, f"{diffusers / 'config.json'}: 'decoder_ffn_mult' "
               "is 2.0 but the weights hold 4.0: 'decoder.transformer_blocks.0.ff.net.2.weight' has shape [128, 512]")

    # Integer weights are refused by name.
    state = load_file(checkpoints["comfy"])
    state["decoder.proj_out.bias"] = state["decoder.proj_out.bias"].to(torch.int8)
    bad = tmp_path / "int8.safetensors"
    save_file(state, bad)
    _one_error(lambda: load_video_vae(bad), CheckpointError, "decoder.proj_out.bias", "int8")

    # Another component's file gets a pointer to the right loader.
    audio = save_audio_comfy(reference_audio(seed=0), tmp_path / "audio.safetensors")
    _one_error(lambda: load_video_vae(audio), CheckpointError, "not an H3 video VAE", "load_audio_vae")


def test_option_and_input_errors(checkpoints, decode_vae):
    path = checkpoints["diffusers"]
    _one_error(lambda: load_video_vae(path, tile_size=50), H3Error, "tile_size=50", "multiple of 16")
    _one_error(lambda: load_video_vae(path, tile_size=64, tile_min_overlap=64), H3Error, "smaller than tile_size")
    _one_error(lambda: load_video_vae(path, dtype=torch.float16), H3Error, "float32")
    _one_error(lambda: load_video_vae(path, decode_autocast=True), H3Error, "CUDA-only")
    with pytest.raises(TypeError, match="tile_overlap"):
        load_video_vae(path, tile_overlap=64)
    _one_error(lambda: decode_vae.decode(torch.zeros(1, 16, 2, 2, 2)), H3Error, "[B, 24, T, H/16, W/16]",
               "(1, 16, 2, 2, 2)")
    _one_error(lambda: decode_vae.encode(torch.zeros(1, 5, 40, 48, 3)), H3Error, "40 x 48", "multiples of 16")
    _one_error(lambda: decode_vae.encode(torch.zeros(1, 5, 3, 32, 32)), H3Error, "[B, F, H, W, 3]")


def test_public_api_exports():
    assert h3_core.load_video_vae is load_video_vae
