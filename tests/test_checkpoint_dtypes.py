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
