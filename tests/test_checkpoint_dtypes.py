"""A tensor stored in a dtype the components do not compute in (fp8, int8, bool, ...) is refused from the header by
every loader, naming the file, key and dtype, instead of loading and failing at the first forward."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import h3_core
from h3_core.errors import CheckpointError
from h3_core.sources.tiny_default import TEXT_ENCODER_LAYER

# component -> (file inside the tiny model tree, how to load it, (a norm weight, a matrix) it holds)
COMPONENTS = {
    "transformer": ("diffusion_models/minimax_h3_tiny_fl2va_fp32.safetensors", h3_core.load_dit,
                    ("blocks.0.norm1.weight", "blocks.0.attn.qkv_proj.weight")),
    "text_encoder": ("text_encoders/qwen3vl_tiny_minimax_h3/model.safetensors",
                     lambda source: h3_core.load_text_encoder(source, layer=TEXT_ENCODER_LAYER),
                     ("model.language_model.layers.0.input_layernorm.weight",
                      "model.language_model.layers.0.mlp.down_proj.weight")),
    "video_vae": ("vae/minimax_h3_video_vae_tiny_fp32.safetensors", h3_core.load_video_vae,
                  ("decoder.transformer_blocks.0.norm1.weight", "decoder.proj_out.weight")),
    "audio_vae": ("vae/minimax_h3_audio_vae_tiny_fp32.safetensors", h3_core.load_audio_vae,
                  ("pre_block.norm1.weight", "dec_in_proj.weight")),
}
QUANTISED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int32, torch.bool]


@pytest.mark.parametrize("dtype", QUANTISED, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("which", [0, 1], ids=["norm-weight", "matrix"])
@pytest.mark.parametrize("component", list(COMPONENTS))
def test_quantised_tensor_is_refused_at_load(tiny, tmp_path, component, which, dtype):
    relative, load, keys = COMPONENTS[component]
    key = keys[which]
    source = tiny / relative
    if component == "text_encoder":  # a folder: copy it whole (config.json, tokenizer.json)
        folder = shutil.copytree(source.parent, tmp_path / source.parent.name)
        path, target = folder / source.name, folder
    else:
        path = target = shutil.copy(source, tmp_path / source.name)
    state = load_file(path)
    state[key] = state[key].to(dtype)
    save_file(state, path)
    with pytest.raises(CheckpointError) as info:
        load(target)
    name = str(dtype).replace("torch.", "")
    message = str(info.value)
    assert message.startswith(f"{path}: tensor '{key}' has dtype {name}; "), message
    assert "fp16" in message
    if component in ("transformer", "text_encoder", "video_vae"):  # quantised layers only in a known format
        assert ("; another dtype is read only as a quantised layer in a ComfyUI format (its '<layer>.comfy_quant' "
                "and scales, or 'scale_weight' with a 'scaled_fp8' marker) or from a GGUF file. Use ") in message
    else:
        assert "; quantised checkpoints (fp8, int8, NVFP4, ...) are not supported yet. Use " in message
    assert info.value.key == key and info.value.path == path


# ---- dtype=None with one tensor stored in another float dtype; dtype= options that are not a compute dtype -------


def _tiny_copy(tiny, tmp_path, component):
    relative, load, keys = COMPONENTS[component]
    source = tiny / relative
    if component == "text_encoder":
        folder = shutil.copytree(source.parent, tmp_path / source.parent.name)
        return folder / source.name, folder, load, keys
    path = shutil.copy(source, tmp_path / source.name)
    return path, path, load, keys


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_one_tensor_saved_in_another_float_dtype_is_computed_in_the_files_dtype(tiny, tmp_path, component):
    # Before: dtype=None kept the one fp16 matrix of an fp32 file as fp16 and the first forward failed inside torch
    # ("expected m1 and m2 to have the same dtype, but got: float != c10::Half").
    path, target, load, (_, matrix) = _tiny_copy(tiny, tmp_path, component)
    state = load_file(path)
    state[matrix] = state[matrix].half()
    save_file(state, path)
    model = load(target)
    dtypes = {p.dtype for name, p in model.named_parameters() if p.numel()}
    assert dtypes == {torch.float32}, dtypes
    loaded = dict(model.named_parameters())[matrix.removeprefix("model.")]
    assert torch.equal(loaded, state[matrix].float())


def test_a_transformer_with_one_fp16_tensor_generates_at_the_default_dtype(tiny, run_cli, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny, model, symlinks=True)
    path = model / COMPONENTS["transformer"][0]
    state = load_file(path)
    state["blocks.0.attn.out_proj.weight"] = state["blocks.0.attn.out_proj.weight"].half()
    path.unlink()
    save_file(state, path)
    done = run_cli(["generate", "x", "--model", str(model), "--seconds", "0.2", "--size", "64x64", "--steps", "2",
                    "--out", "o.mp4"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o.mp4").stat().st_size > 0


def test_an_fp32_island_saved_in_bf16_beside_its_fp32_bias_is_computed_in_float32(tiny, tmp_path):
    # Before: at dtype=None the island's bf16 weight stayed bf16 beside its fp32 bias and the first forward failed.
    path, target, load, _ = _tiny_copy(tiny, tmp_path, "transformer")
    state = load_file(path)
    islands = ["video_patch_proj.weight", "time_embedder.proj_in.weight"]
    for key in islands:
        state[key] = state[key].bfloat16()
    save_file(state, path)
    model = load(target)
    parameters = dict(model.named_parameters())
    for key in islands:
        assert parameters[key].dtype == torch.float32 and torch.equal(parameters[key], state[key].float())
    assert {p.dtype for p in parameters.values() if p.numel()} == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bool, "bf16", 16],
                         ids=["int8", "fp8", "bool", "string", "int"])
@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_a_dtype_option_that_is_no_compute_dtype_is_refused_before_reading(tiny, component, dtype):
    # Before: load_dit(dtype=torch.int8) cast every weight to int8 and loaded silently; a string failed in torch.
    relative, load, _ = COMPONENTS[component]
    source = tiny / relative
    loader = h3_core.load_dit if component == "transformer" else h3_core.load_text_encoder
    kwargs = {} if component == "transformer" else {"layer": TEXT_ENCODER_LAYER}
    with pytest.raises(h3_core.H3Error, match=rf"^dtype={dtype!r}: the {component.replace('_', ' ')} computes in "
                                              r"torch\.bfloat16, float16, float32 or float64 \(or dtype=None"):
        loader(source if component == "transformer" else source.parent, dtype=dtype, **kwargs)
