"""Every bad checkpoint input raises one CheckpointError naming the file and key and saying what was expected."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from h3_fixtures import TINY, reference_model, save_comfy, save_diffusers, save_native
from safetensors.torch import load_file, save_file

import h3_core
from h3_core.errors import CheckpointError, PickleCheckpointError


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    reference = reference_model(TINY, seed=1)
    return {
        "native": save_native(reference, TINY, root / "native"),
        "sharded": save_native(reference, TINY, root / "sharded", shards=3),
        "diffusers": save_diffusers(reference, root / "diffusers"),
        "comfy": save_comfy(reference, TINY, root / "minimax_h3_tiny.safetensors"),
    }


def copy(src, dst):
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    return dst


def rewrite(path, edit):
    state = load_file(path)
    edit(state)
    save_file(state, path)


def expect(source, *fragments, error=CheckpointError):
    with pytest.raises(error) as info:
        h3_core.load_dit(source)
    message = str(info.value)
    for fragment in fragments:
        assert str(fragment) in message, message
    return info.value


def test_missing_key(good, tmp_path):
    folder = copy(good["native"], tmp_path / "n")
    rewrite(folder / "model.safetensors", lambda s: s.pop("blocks.1.mlp.fc2.weight"))
    err = expect(folder, "missing key 'blocks.1.mlp.fc2.weight'", "expected shape [64, 96]")
    assert err.key == "blocks.1.mlp.fc2.weight"


def test_unexpected_key(good, tmp_path):
    path = copy(good["comfy"], tmp_path / "c.safetensors")
    rewrite(path, lambda s: s.__setitem__("blocks.0.attn.extra.weight", torch.zeros(2)))
    expect(path, str(path), "unexpected key 'blocks.0.attn.extra.weight'")


def test_unexpected_key_in_a_shard_names_that_shard(good, tmp_path):
    folder = copy(good["sharded"], tmp_path / "s")
    shard = folder / "model-00002-of-00003.safetensors"
    rewrite(shard, lambda s: s.__setitem__("blocks.9.norm1.weight", torch.zeros(64)))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["blocks.9.norm1.weight"] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expect(folder, shard.name, "unexpected key 'blocks.9.norm1.weight'")


def test_shape_mismatch_between_config_and_weights(good, tmp_path):
    folder = copy(good["diffusers"], tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    config["ffn_dim"] = 80
    (folder / "config.json").write_text(json.dumps(config))
    expect(folder, f"{folder / 'config.json'}: 'ffn_dim' is 80 but the weights hold 96: "
                   "'transformer_blocks.0.ff.net.2.weight' has shape [64, 96] in diffusion_pytorch_model.safetensors.")


def test_integer_dtype(good, tmp_path):
    path = copy(good["comfy"], tmp_path / "c.safetensors")
    rewrite(path, lambda s: s.__setitem__("blocks.0.norm1.weight", torch.ones(64, dtype=torch.int32)))
    expect(path, "c.safetensors", "'blocks.0.norm1.weight' has dtype int32", "bf16, fp16 or fp32")


def test_truncated_file(good, tmp_path):
    path = copy(good["comfy"], tmp_path / "c.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect(path, "c.safetensors", "truncated")


def test_header_longer_than_file(tmp_path):
    path = tmp_path / "h.safetensors"
    path.write_bytes((10_000).to_bytes(8, "little") + b"{}")
    expect(path, "h.safetensors", "header claims 10000 bytes")


def test_offsets_past_the_end(tmp_path):
    path = tmp_path / "o.safetensors"
    header = json.dumps({"blocks.0.norm1.weight": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}})
    raw = header.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 16)
    err = expect(path, "o.safetensors", "'blocks.0.norm1.weight' ends at byte 256", "truncated")
    assert err.key == "blocks.0.norm1.weight"


def test_random_bytes_and_empty_file(tmp_path):
    path = tmp_path / "random.safetensors"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())
    expect(path, "random.safetensors")
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    expect(empty, "empty.safetensors", "too small")


def test_corrupt_header_json(tmp_path):
    path = tmp_path / "j.safetensors"
    path.write_bytes((5).to_bytes(8, "little") + b"{nope" + b"\0" * 8)
    expect(path, "j.safetensors", "not valid JSON")


def test_folder_that_is_not_an_h3_transformer(good, tmp_path):
    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLMiniMaxH3"}))
    expect(folder, "config.json", "'AutoencoderKLMiniMaxH3'", "not an H3 transformer")
    bare = tmp_path / "bare"
    bare.mkdir()
    expect(bare, "no config.json")


def test_vae_file_given_as_transformer(tmp_path):
    path = tmp_path / "minimax_h3_video_vae_fp16.safetensors"
    save_file({"decoder.blocks.0.attn.qkv.weight": torch.zeros(4, 4), "encoder.conv_in.weight": torch.zeros(2)},
              path)
    expect(path, "minimax_h3_video_vae_fp16.safetensors", "not an H3 transformer", "VAE")


def test_text_encoder_file_given_as_transformer(tmp_path):
    path = tmp_path / "qwen.safetensors"
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}, path)
    expect(path, "qwen.safetensors", "text encoder")


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin", ".pth"])
def test_pickle_checkpoints_are_refused_unopened(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\x80\x04 not even read")
    expect(path, str(path), "pickle", "safetensors only", error=PickleCheckpointError)


def test_folder_with_only_pickle_weights(good, tmp_path):
    folder = tmp_path / "pkl"
    folder.mkdir()
    shutil.copy(good["native"] / "config.json", folder / "config.json")
    (folder / "model.bin").write_bytes(b"\x80\x04")
    expect(folder, "model.bin", "safetensors only", error=PickleCheckpointError)


def test_index_naming_a_missing_shard(good, tmp_path):
    folder = copy(good["sharded"], tmp_path / "s")
    (folder / "model-00003-of-00003.safetensors").unlink()
    expect(folder, "model.safetensors.index.json", "'model-00003-of-00003.safetensors'", "missing")


def test_index_shard_outside_the_folder(good, tmp_path):
    folder = copy(good["sharded"], tmp_path / "s")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expect(folder, "plain file name")


def test_pruned_comfy_variant_is_refused(good, tmp_path):
    path = copy(good["comfy"], tmp_path / "minimax_h3_fl2va_pruned_bf16.safetensors")
    rewrite(path, lambda s: s.__setitem__("adaln_t_table", torch.zeros(8, 4)))
    expect(path, "pruned", "adaln_t_table")


def test_missing_path_and_unknown_option(good, tmp_path):
    expect(tmp_path / "nowhere", "no such file or folder")
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        h3_core.load_dit(good["comfy"], residencyy="layerwise")


def test_partition_root_resolves_to_its_transformer(good, tmp_path):
    root = tmp_path / "FL2VA"
    root.mkdir()
    copy(good["native"], root / "transformer")
    assert h3_core.load_dit(root).checkpoint_layout == "native"
