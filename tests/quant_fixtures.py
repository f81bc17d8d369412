"""Tiny H3 transformers quantised by the reference libraries' own quantisers and saved in the real layouts.

ComfyUI mixed precision: comfy-kitchen's layout classes quantise each block weight and serialise it
(`QuantizedTensor.state_dict`: `<layer>.weight`, `.weight_scale`, `.weight_scale_2`), plus the `<layer>.comfy_quant`
JSON ComfyUI writes beside it (`comfy/ops.py`), or the older `scale_weight` + `scaled_fp8` marker. GGUF: gguf's
`quantize` and `GGUFWriter` (K-quants, which gguf cannot quantise, are random blocks with small finite scales).
The references (`reference_dequantised`) are the same libraries' dequantisations, never `h3_core` code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from h3_core.models.dit_config import H3DiTConfig
from offload_fixtures import interleave_qkv, random_state

# Widths every format accepts: rows and columns multiples of 256 (GGUF K-quant super-blocks, ConvRot groups).
QCFG = H3DiTConfig(
    num_layers=2, num_refiner_layers=1, hidden_size=256, num_attention_heads=2, attention_head_dim=128, ffn_dim=256,
    in_channels=4, audio_in_channels=8, text_dim=64, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=256,
    rope_freq_dim=16,
)
COMFY_PREFIX = "model.diffusion_model."
CONVROT_GROUP = 64
COMFY_FORMATS = ["float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "int8_rowwise", "int8_convrot", "nvfp4",
                 "nvfp4_awq", "fp8_scaled"]
GGUF_FORMATS = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "F16", "BF16"]


def quantised_layer(name: str, value: torch.Tensor) -> bool:
    """The weights the repacks quantise: the 2-D matrices of the transformer blocks and of the refiner."""
    return value.ndim == 2 and "blocks." in name and name.endswith(".weight")


def bf16_state(config: H3DiTConfig = QCFG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights rounded to bf16 (the release's dtype, what the repacks are made from); fp32 islands kept."""
    state = random_state(config, seed)
    return {k: v if k == "rope.inv_freq" else v.to(torch.bfloat16) for k, v in state.items()}


def kitchen_quantise(value: torch.Tensor, fmt: str, convrot_group: int = CONVROT_GROUP):
    """`(QuantizedTensor, comfy_quant config)` of one weight, by comfy-kitchen's own quantiser."""
    from comfy_kitchen.tensor import QuantizedTensor

    if fmt in ("float8_e4m3fn", "float8_e5m2", "fp8_scaled"):
        dtype = torch.float8_e5m2 if fmt == "float8_e5m2" else torch.float8_e4m3fn
        return QuantizedTensor.from_float(value, "TensorCoreFP8Layout", dtype=dtype), {"format": fmt}
    if fmt == "int8_tensorwise":
        return QuantizedTensor.from_float(value, "TensorWiseINT8Layout"), {"format": "int8_tensorwise"}
    if fmt == "int8_rowwise":
        return (QuantizedTensor.from_float(value, "TensorWiseINT8Layout", per_channel=True),
                {"format": "int8_tensorwise"})
    if fmt == "int8_convrot":
        return (QuantizedTensor.from_float(value, "TensorWiseINT8Layout", per_channel=True, convrot=True,
                                           convrot_groupsize=convrot_group),
                {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": convrot_group})
    if fmt in ("nvfp4", "nvfp4_awq"):
        return QuantizedTensor.from_float(value, "TensorCoreNVFP4Layout"), {"format": "nvfp4"}
    raise ValueError(fmt)


def comfy_quantised_state(state: dict[str, torch.Tensor], fmt: str, prefix: str = COMFY_PREFIX, *,
                          qkv_interleave: H3DiTConfig | None = None):
    """`(file tensors, {parameter name: QuantizedTensor})` of `state` with every block matrix quantised as `fmt`.

    `qkv_interleave`: store the fused QKV per head interleaved (the native release) before quantising, so its
    per-row scales are stored in that order too."""
    out: dict[str, torch.Tensor] = {}
    quantised = {}
    for name, value in state.items():
        if name == "rope.inv_freq" and prefix:
            continue
        if not quantised_layer(name, value):
            out[prefix + name] = value.contiguous()
            continue
        if qkv_interleave is not None and name.endswith("attn.qkv_proj.weight"):
            value = interleave_qkv(value, qkv_interleave.num_attention_heads, qkv_interleave.attention_head_dim)
        layer = prefix + name[: -len(".weight")]
        pre_quant = None
        if fmt == "nvfp4_awq":  # AWQ: the weight's columns divided by the smoothing the input is multiplied by
            generator = torch.Generator().manual_seed(len(name))
            pre_quant = (0.5 + torch.rand(value.shape[1], generator=generator)).to(torch.bfloat16)
            value = (value.float() / pre_quant.float()).to(value.dtype)
        qt, config = kitchen_quantise(value, fmt)
        quantised[name] = qt
        tensors = qt.state_dict(f"{layer}.weight")
        if fmt == "fp8_scaled":  # the older layout: `scale_weight` and a marker tensor, no comfy_quant
            out[f"{layer}.weight"] = tensors[f"{layer}.weight"]
            out[f"{layer}.scale_weight"] = tensors[f"{layer}.weight_scale"]
            continue
        out.update((k, v.contiguous()) for k, v in tensors.items())
        out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(config).encode("utf-8")), dtype=torch.uint8)
        if fmt.startswith("nvfp4"):
            out[f"{layer}.input_scale"] = torch.tensor(1.0)
        if pre_quant is not None:
            out[f"{layer}.pre_quant_scale"] = pre_quant
    if fmt == "fp8_scaled":
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out, quantised


def save_comfy_quantised(state, fmt: str, path: Path):
    tensors, quantised = comfy_quantised_state(state, fmt)
    save_file(tensors, path)
    return path, quantised, tensors


def reference_dequantised(qt, dtype: torch.dtype) -> torch.Tensor:
    """comfy-kitchen's own dequantisation of `qt` into `dtype` (`QuantizedTensor.dequantize`, which slices the
    NVFP4 padding away)."""
    from comfy_kitchen.tensor import QuantizedTensor

    params = dataclasses.replace(qt._params, orig_dtype=dtype)
    return QuantizedTensor(qt._qdata, qt._layout_cls, params).dequantize()


# ---- GGUF ----------------------------------------------------------------------------------------------------------


def _random_k_blocks(qtype, shape, seed: int) -> np.ndarray:
    """Random K-quant blocks whose f16 super-block scales are small and finite (gguf has no K-quant quantiser)."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    # The f16 fields: Q4_K / Q5_K start with d, dmin; Q6_K ends with d.
    scale = rng.uniform(1e-4, 2e-3, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        blocks[:, -2:] = scale[:, :2]
    else:
        blocks[:, :4] = scale
    return blocks.reshape(rows, cols // block_size * type_size)


def save_gguf(state: dict[str, torch.Tensor], fmt: str, path: Path) -> Path:
    """`state` as a GGUF file (ComfyUI-GGUF's names: the state-dict keys, no prefix), block matrices as `fmt`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt]
    writer = gguf.GGUFWriter(str(path), "minimax_h3")
    for index, (name, value) in enumerate(state.items()):
        if name == "rope.inv_freq":
            continue
        array = value.float().numpy()
        if not quantised_layer(name, value):
            writer.add_tensor(name, array.astype(np.float32) if value.dtype == torch.float32
                              else gguf.quants.quantize(array, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=None if value.dtype == torch.float32 else gguf.GGMLQuantizationType.BF16)
            continue
        if fmt == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        elif fmt in ("Q6_K", "Q5_K", "Q4_K"):
            writer.add_tensor(name, _random_k_blocks(qtype, array.shape, index), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_reference(path: Path) -> dict[str, torch.Tensor]:
    """gguf's own reader and `dequantize` of every tensor (fp32, torch order)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(shape)
    return out


def quantise_file(source: Path, target: Path, fmt: str) -> dict:
    """Rewrite the plain checkpoint file `source` as `target` with its block matrices quantised as `fmt` (whatever
    its layout's names and row orders); returns {stored key: QuantizedTensor}."""
    from safetensors.torch import load_file

    state = load_file(source)
    tensors, quantised = comfy_quantised_state({k: v for k, v in state.items()}, fmt, prefix="")
    save_file(tensors, target)
    return {f"{name}": qt for name, qt in quantised.items()}


def dequantised_twin(source: Path, target: Path, quantised: dict, dtype=torch.float32) -> Path:
    """`source` with every quantised tensor replaced by comfy-kitchen's dequantisation of it, in `dtype`."""
    from safetensors.torch import load_file

    state = load_file(source)
    state.update({k: reference_dequantised(qt, dtype).contiguous() for k, qt in quantised.items()})
    save_file(state, target)
    return target
