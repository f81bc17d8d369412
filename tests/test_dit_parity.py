"""The H3 DiT against the reference (diffusers MiniMaxH3Transformer3DModel) in all three checkpoint layouts, and its
diffusers-style output (`return_dict=True`)."""

from __future__ import annotations

import pytest
import torch

import h3_core
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_fixtures import (TINY, TINY_B, cast_like_release, packed_inputs, reference_model, rel_l2, save_comfy,
                         save_diffusers, save_native)

LAYOUTS = ["diffusers", "diffusers_sharded", "native", "native_sharded", "comfy", "comfy_prefixed"]


def write_layout(kind, reference, config, root):
    if kind == "diffusers":
        return save_diffusers(reference, root / "diffusers")
    if kind == "diffusers_sharded":
        return save_diffusers(reference, root / "diffusers_sharded", shard_bytes=60_000)
    if kind == "native":
        return save_native(reference, config, root / "native")
    if kind == "native_sharded":
        return save_native(reference, config, root / "native_sharded", shards=3)
    if kind == "comfy":
        return save_comfy(reference, config, root / "minimax_h3_tiny.safetensors")
    return save_comfy(reference, config, root / "minimax_h3_tiny_prefixed.safetensors",
                      prefix="model.diffusion_model.")


@pytest.fixture(scope="module", params=[TINY, TINY_B], ids=["tiny_a", "tiny_b"])
def fp32_checkpoints(request, tmp_path_factory):
    config = request.param
    reference = reference_model(config, seed=3)
    root = tmp_path_factory.mktemp("fp32")
    return config, reference, {kind: write_layout(kind, reference, config, root) for kind in LAYOUTS}


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("anchors", [(), ("first",), ("first", "last")], ids=["t2va", "fl2va_first", "fl2va_both"])
def test_fp32_velocities_match_reference(fp32_checkpoints, kind, anchors):
    config, reference, paths = fp32_checkpoints
    model = h3_core.load_dit(paths[kind])
    assert model.checkpoint_layout == kind.split("_")[0]
    inputs = packed_inputs(config, anchors=anchors, vision_rows=2 if anchors else 0, batch=2)
    assert inputs["timestep"].numel() == (3 if anchors else 2)
    with torch.no_grad():
        ref_video, ref_audio = reference(**inputs, return_dict=False)
        video, audio = model(**inputs)
    assert video.shape == ref_video.shape and audio.shape == ref_audio.shape
    assert video.dtype == torch.float32 and audio.dtype == torch.float32
    assert rel_l2(video, ref_video) <= 1e-5
    assert rel_l2(audio, ref_audio) <= 1e-5


def test_non_square_canvas_and_long_text(fp32_checkpoints):
    config, reference, paths = fp32_checkpoints
    model = h3_core.load_dit(paths["native"])
    inputs = packed_inputs(config, text_len=19, latent_frames=7, latent_hw=(2, 8), audio_latents=12,
                           anchors=("last",), seed=9)
    with torch.no_grad():
        ref_video, ref_audio = reference(**inputs, return_dict=False)
        video, audio = model(**inputs)
    assert rel_l2(video, ref_video) <= 1e-5 and rel_l2(audio, ref_audio) <= 1e-5


def test_all_layouts_load_identical_parameters(fp32_checkpoints):
    config, reference, paths = fp32_checkpoints
    states = {kind: h3_core.load_dit(path).state_dict() for kind, path in paths.items()}
    first = states["diffusers"]
    assert len(first) == sum(1 for _ in h3_core.H3DiT(config).state_dict())
    for kind, state in states.items():
        assert state.keys() == first.keys(), kind
        for name, tensor in state.items():
            assert tensor.dtype == first[name].dtype, (kind, name)
            assert torch.equal(tensor, first[name]), (kind, name)


def test_config_read_from_each_layout(fp32_checkpoints):
    config, _, paths = fp32_checkpoints
    for kind, path in paths.items():
        assert h3_core.resolve_dit_checkpoint(path).config == config, kind



def test_return_dict_gives_diffusers_output_fields(fp32_checkpoints):
    config, reference, paths = fp32_checkpoints
    inputs = packed_inputs(config, seed=4)
    model = h3_core.load_dit(paths["diffusers"])
    with torch.no_grad():
        expected = reference(**inputs)  # diffusers' default: return_dict=True
        out = model(**inputs, return_dict=True)
        plain = model(**inputs)
    assert type(plain) is tuple and len(plain) == 2
    assert rel_l2(out.sample, expected.sample) <= 1e-5 and rel_l2(out.audio_sample, expected.audio_sample) <= 1e-5
    assert torch.equal(out.sample, plain[0]) and torch.equal(out.audio_sample, plain[1])

@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory):
    reference = cast_like_release(reference_model(TINY, seed=5))
    root = tmp_path_factory.mktemp("bf16")
    return reference, {kind: write_layout(kind, reference, TINY, root) for kind in ("diffusers", "native", "comfy")}


@pytest.mark.parametrize("kind", ["diffusers", "native", "comfy"])
def test_bf16_checkpoint_with_fp32_islands(bf16_checkpoints, kind):
    reference, paths = bf16_checkpoints
    model = h3_core.load_dit(paths[kind])  # dtype=None keeps the stored dtypes
    assert model.video_patch_proj.weight.dtype == torch.float32
    assert model.time_embedder.proj_out.weight.dtype == torch.float32
    assert model.final_layer.audio_out.bias.dtype == torch.float32
    assert model.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.blocks[0].adaln_proj.linear.weight.dtype == torch.bfloat16
    assert model.residual_dtype == torch.bfloat16
    inputs = packed_inputs(TINY, anchors=("first",), seed=4)
    with torch.no_grad():
        ref_video, ref_audio = reference(**inputs, return_dict=False)
        video, audio = model(**inputs)
    assert video.dtype == torch.float32
    assert rel_l2(video, ref_video) <= 1e-2 and rel_l2(audio, ref_audio) <= 1e-2


def test_requested_dtype_keeps_fp32_islands(fp32_checkpoints):
    config, reference, paths = fp32_checkpoints
    model = h3_core.load_dit(paths["native"], dtype=torch.bfloat16)
    assert model.blocks[0].mlp.fc1.weight.dtype == torch.bfloat16
    assert model.condition_proj.weight.dtype == torch.bfloat16
    assert model.video_patch_proj.weight.dtype == torch.float32
    assert model.final_layer.video_out.weight.dtype == torch.float32
    assert model.rope.inv_freq.dtype == torch.float32
    bf16_reference = cast_like_release(reference_model(config, seed=3))
    inputs = packed_inputs(config, anchors=("first",), seed=2)
    with torch.no_grad():
        ref_video, _ = bf16_reference(**inputs, return_dict=False)
        fp32_video, _ = reference(**inputs, return_dict=False)
        video, _ = model(**inputs)
    assert rel_l2(video, ref_video) <= 1e-2
    assert rel_l2(video, fp32_video) <= 5e-2  # bf16 against fp32: close, not equal
    assert rel_l2(video, fp32_video) > 0


def test_resident_weights_are_read_into_the_processs_own_memory(fp32_checkpoints):
    """A resident load reads every weight explicitly (never a view of the memory map), so the loaded model no longer
    depends on its file: with the stored dtype on the CPU too, the weights equal the file's tensors."""
    _, _, paths = fp32_checkpoints
    model = h3_core.load_dit(paths["comfy"])
    weight = model.blocks[0].mlp.fc2.weight
    # A private file mapping has no resizable allocator-owned buffer behind it; a read copy does.
    assert weight.untyped_storage().resizable()
    stored = SafetensorsFile(paths["comfy"])
    key = next(k for k in stored.keys() if k.endswith("blocks.0.mlp.fc2.weight"))
    assert torch.equal(weight, stored.tensor(key))


def test_forward_rejects_inconsistent_inputs(fp32_checkpoints):
    config, _, paths = fp32_checkpoints
    model = h3_core.load_dit(paths["comfy"])
    inputs = packed_inputs(config)
    bad = dict(inputs, hidden_states=inputs["hidden_states"][:, :-1])
    with pytest.raises(ValueError, match="hidden_states must be"):
        model(**bad)
    bad = dict(inputs, token_tags=inputs["token_tags"][:-1])
    with pytest.raises(ValueError, match="token_tags"):
        model(**bad)
