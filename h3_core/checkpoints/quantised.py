"""Quantised checkpoint tensors: which stored tensors are quantised, in which format, and how each is dequantised.

Formats are detected per tensor from the file, as ComfyUI core reads them:

* ComfyUI mixed precision (`<layer>.comfy_quant` JSON, or the file's `_quantization_metadata`): `float8_e4m3fn` /
  `float8_e5m2` (per-tensor `weight_scale`), `int8_tensorwise` (scalar or per-row `weight_scale`; with
  `"convrot": true` the rows were block-Hadamard rotated, `convrot_groupsize`), `nvfp4` (packed E2M1, fp8 block
  scales `weight_scale` in cuBLAS's tiled layout, per-tensor `weight_scale_2`, optional AWQ `pre_quant_scale`).
  `input_scale` only matters to quantised matmuls, which are not used: weights are dequantised.
* the older "fp8 scaled" files (a `scaled_fp8` marker tensor, `<layer>.scale_weight`): per-tensor fp8.
* GGUF files (`gguf_io.GGUFFile`): any ggml quantisation type the `gguf` package dequantises.

Dequantisation is comfy-kitchen's eager (pure PyTorch) functions and gguf's `dequantize`, never a rewrite; both
packages are the optional `quant` extra, imported only when a quantised file is opened. A quantised parameter's
host recipe holds the stored payloads (the quantised bytes) and dequantises them where it is materialised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..errors import CheckpointError

QUANT_EXTRA = "pip install 'h3-stream[quant]' (or: pip install comfy-kitchen gguf)"
# What a dequantised weight is when the loader is asked to keep the checkpoint's dtypes: the repacks are made from
# the bf16 release.
DEQUANTISED_DEFAULT_DTYPE = torch.bfloat16
# Keys beside a quantised weight that only describe it (read with it, or unused without quantised matmuls).
_LAYER_EXTRAS = ("comfy_quant", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "scale_weight",
                 "scale_input")
# Prefixes of the state-dict keys in ComfyUI repacks (the metadata may name layers without them).
_KNOWN_PREFIXES = ("", "model.diffusion_model.")
SUPPORTED_COMFY_FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "nvfp4")


def kitchen_eager(path, key: str):
    """comfy-kitchen's eager quantisation module, or one `CheckpointError` naming the extra to install."""
    try:
        from comfy_kitchen.backends.eager import quantization
    except ImportError:
        raise CheckpointError(f"{path}: tensor '{key}' is quantised (ComfyUI mixed precision); reading it needs "
                              f"comfy-kitchen: {QUANT_EXTRA}.", path=path, key=key) from None
    return quantization


def gguf_package(path, key: str | None = None):
    try:
        import gguf
        import gguf.quants
    except ImportError:
        raise CheckpointError(f"{path}: a GGUF file; reading it needs the gguf package: {QUANT_EXTRA}.",
                              path=path, key=key) from None
    return gguf


def _roundup(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class QuantisedWeight:
    """One quantised stored tensor: `payload_keys[0]` is the weight's stored key, the others its scales, in the
    order `dequantise` takes them. `shape` is the dequantised shape as the file says it (NVFP4: padded to 16 x 16,
    so `fits` checks the model's shape against the storage)."""

    path: object
    format: str
    payload_keys: tuple[str, ...]
    stored_shape: tuple[int, ...]
    shape: tuple[int, ...]
    group_size: int = 0
    gguf_type: int | None = None
    has_pre_quant_scale: bool = False

    @property
    def key(self) -> str:
        return self.payload_keys[0]

    def fits(self, shape: Sequence[int]) -> bool:
        shape = tuple(shape)
        if self.format == "nvfp4":
            return (len(shape) == 2 and len(self.stored_shape) == 2 and self.stored_shape == (_roundup(shape[0], 16), _roundup(shape[1], 16) // 2))
        return self.shape == shape

    def dequantise(self, payloads: Sequence[torch.Tensor], dtype: torch.dtype,
                   shape: Sequence[int]) -> torch.Tensor:
        """The weight in `dtype` and logical `shape`, computed where `payloads` are (their device)."""
        if self.gguf_type is not None:
            return _gguf_dequantise(self, payloads[0], dtype, shape)
        eager = kitchen_eager(self.path, self.key)
        weight = payloads[0]
        if self.format in ("float8_e4m3fn", "float8_e5m2", "fp8_scaled"):
            fp8 = torch.float8_e5m2 if self.format == "float8_e5m2" else torch.float8_e4m3fn
            if weight.dtype == torch.uint8:  # the legacy uint8 container
                weight = weight.view(fp8)
            return eager.dequantize_per_tensor_fp8(weight, payloads[1], dtype)
        if self.format == "int8_tensorwise":
            return eager.dequantize_int8_simple(weight, payloads[1]).to(dtype)
        if self.format == "int8_convrot":
            return eager.dequantize_int8_convrot_weight(weight, payloads[1], self.group_size).to(dtype)
        if self.format == "nvfp4":
            block_scales = payloads[1].view(torch.float8_e4m3fn) if payloads[1].dtype == torch.uint8 else payloads[1]
            full = eager.dequantize_nvfp4(weight, payloads[2], block_scales, dtype)
            rows, cols = shape
            out = full[:rows, :cols]
            if self.has_pre_quant_scale:
                # AWQ smoothing: ComfyUI multiplies the input by it, the same as scaling the weight's columns.
                out = out * payloads[3].to(dtype)
            return out.contiguous()
        raise AssertionError(self.format)  # pragma: no cover - detection admits only the formats above


def _gguf_dequantise(q: QuantisedWeight, raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    gguf = gguf_package(q.path, q.key)
    # gguf's dequantize is NumPy: the raw blocks go through the host, the result back to their device.
    host = raw.detach().to("cpu").contiguous().numpy()
    values = gguf.quants.dequantize(host, gguf.GGMLQuantizationType(q.gguf_type))
    return torch.from_numpy(values).reshape(tuple(shape)).to(device=raw.device, dtype=dtype)


_GGUF_SUPPORTED: dict[int, bool] = {}


def _gguf_dequantises(path, gguf_type: int) -> bool:
    """Whether gguf's `dequantize` implements `gguf_type`: tried once on one zero block."""
    if gguf_type not in _GGUF_SUPPORTED:
        import numpy as np

        gguf = gguf_package(path)
        qtype = gguf.GGMLQuantizationType(gguf_type)
        size = gguf.GGML_QUANT_SIZES.get(qtype)
        try:
            if size is None:
                raise NotImplementedError
            gguf.quants.dequantize(np.zeros((1, size[1]), dtype=np.uint8), qtype)
            _GGUF_SUPPORTED[gguf_type] = True
        except NotImplementedError:
            _GGUF_SUPPORTED[gguf_type] = False
    return _GGUF_SUPPORTED[gguf_type]


def _layer_configs(path, files: Mapping[str, object], prefix: str) -> dict[str, dict]:
    """`layer name -> comfy_quant config` from the per-layer JSON tensors and the file metadata."""
    configs: dict[str, dict] = {}
    for key, file in files.items():
        if key.endswith(".comfy_quant"):
            try:
                raw = bytes(file.tensor(key).to(torch.uint8).reshape(-1).tolist())
                config = json.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                config = None
            if not isinstance(config, dict):
                raise CheckpointError(f"{file.path}: tensor '{key}' is not the JSON object ComfyUI writes there; "
                                      "the file is corrupt.", path=file.path, key=key)
            configs[key[: -len(".comfy_quant")]] = config
    for file in {id(f): f for f in files.values()}.values():
        meta = getattr(file, "metadata", {}).get("_quantization_metadata")
        if meta is None:
            continue
        try:
            layers = json.loads(meta).get("layers", {})
        except (ValueError, AttributeError):
            layers = None
        if not isinstance(layers, dict):
            raise CheckpointError(f"{file.path}: '_quantization_metadata' in the safetensors metadata is not "
                                  "{'layers': {...}}; the file is corrupt.", path=file.path, key="__metadata__")
        for layer, config in layers.items():
            full = next((p + layer for p in (prefix,) + _KNOWN_PREFIXES if p + layer + ".weight" in files), layer)
            configs.setdefault(full, config if isinstance(config, dict) else {})
    return configs


def detect_quantised(path, files: Mapping[str, object], prefix: str = "") -> tuple[dict[str, QuantisedWeight],
                                                                                   set[str]]:
    """The quantised weights of a checkpoint (stored weight key -> description) and the keys that only describe
    them. Unsupported formats raise one `CheckpointError` naming the tensor and the format."""
    quantised: dict[str, QuantisedWeight] = {}
    described: set[str] = set()
    for key, file in files.items():  # GGUF: the type of every tensor is in its header
        gguf_type = getattr(file, "quant_type", lambda k: None)(key)
        if gguf_type is not None:
            if not _gguf_dequantises(file.path, gguf_type):
                raise CheckpointError(
                    f"{file.path}: tensor '{key}' has GGUF type {file.type_name(key)}, which the gguf package cannot "
                    "dequantise (Q8_0, Q6_K, Q5_K, Q4_K and the other types gguf implements are read). Use a file "
                    "quantised in a supported type.", path=file.path, key=key)
            quantised[key] = QuantisedWeight(file.path, f"gguf {file.type_name(key)}", (key,), file.stored_shape(key),
                                             file.shape(key), gguf_type=gguf_type)
    configs = _layer_configs(path, files, prefix)
    marker = next((k for k in files if k.rpartition(".")[2] == "scaled_fp8"), None)
    if marker is not None:
        described.add(marker)
        for key in files:
            if key.endswith(".scale_weight"):
                configs.setdefault(key[: -len(".scale_weight")], {"format": "fp8_scaled"})
    for layer, config in configs.items():
        weight_key = f"{layer}.weight"
        fmt = config.get("format")
        where = files.get(weight_key)
        at = where.path if where is not None else path
        if where is None:
            raise CheckpointError(f"{at}: '{layer}' is described as quantised ({fmt!r}) but '{weight_key}' is not "
                                  "in the checkpoint; the file is corrupt.", path=at, key=weight_key)
        if config.get("convrot") and fmt == "int8_tensorwise":
            fmt = "int8_convrot"
        if fmt not in SUPPORTED_COMFY_FORMATS + ("int8_convrot", "fp8_scaled"):
            raise CheckpointError(
                f"{at}: tensor '{weight_key}' is quantised as {fmt!r}, which h3-stream cannot dequantise (supported: "
                f"{', '.join(SUPPORTED_COMFY_FORMATS)}, int8 ConvRot, fp8 scaled, GGUF). Use a checkpoint quantised "
                "in a supported format, or the bf16 release.", path=at, key=weight_key)
        scale_names = {"fp8_scaled": ("scale_weight",), "nvfp4": ("weight_scale", "weight_scale_2")}.get(
            fmt, ("weight_scale",))
        payload = [weight_key]
        for name in scale_names:
            if f"{layer}.{name}" not in files:
                raise CheckpointError(f"{at}: tensor '{weight_key}' is quantised as {fmt!r} but its '{layer}.{name}' "
                                      "is missing; the file is incomplete or corrupt.", path=at,
                                      key=f"{layer}.{name}")
            payload.append(f"{layer}.{name}")
        pre_quant = fmt == "nvfp4" and f"{layer}.pre_quant_scale" in files
        if pre_quant:
            payload.append(f"{layer}.pre_quant_scale")
        group = 0
        if fmt == "int8_convrot":
            params = config.get("params") if isinstance(config.get("params"), dict) else {}
            group = config.get("convrot_groupsize", params.get("convrot_groupsize", 256))
            if not isinstance(group, int) or isinstance(group, bool) or group < 4:
                raise CheckpointError(f"{at}: '{layer}.comfy_quant' has convrot_groupsize {group!r}; expected a "
                                      "power of 4.", path=at, key=f"{layer}.comfy_quant")
        stored = tuple(where.shape(weight_key))
        # NVFP4 packs two values a byte and pads to 16 x 16: the shape it reads as is the padded one.
        shape = (stored[0], stored[1] * 2) if fmt == "nvfp4" and len(stored) == 2 else stored
        quantised[weight_key] = QuantisedWeight(at, fmt, tuple(payload), stored, shape,
                                                group_size=group, has_pre_quant_scale=pre_quant)
        described.update(f"{layer}.{extra}" for extra in _LAYER_EXTRAS if f"{layer}.{extra}" in files)
    if quantised and any(q.gguf_type is None for q in quantised.values()):
        kitchen_eager(path, next(iter(quantised)))  # a missing extra is reported at open, not at the first block
    if any(q.gguf_type is not None for q in quantised.values()):
        gguf_package(path)
    return quantised, described


def quantised_decoder(keys: Sequence[str], shapes: Sequence[Sequence[int]], quantised: Mapping[str, QuantisedWeight],
                      dtype: torch.dtype, combine: Callable[..., torch.Tensor] | None):
    """`(payload keys, decode)` of a parameter made from stored `keys`: decode(*payloads) dequantises each stored
    tensor into `dtype`, then applies the loader's `combine` (QKV de-interleave, row concatenation, SwiGLU half
    swap). The row permutations run after dequantisation, so per-row scales always stay with their rows."""
    plan = []
    payload_keys: list[str] = []
    for key, shape in zip(keys, shapes):
        q = quantised.get(key)
        own = q.payload_keys if q is not None else (key,)
        plan.append((q, len(own), tuple(shape)))
        payload_keys.extend(own)

    def decode(*payloads: torch.Tensor) -> torch.Tensor:
        parts, at = [], 0
        for q, count, shape in plan:
            chunk = payloads[at: at + count]
            at += count
            parts.append(q.dequantise(chunk, dtype, shape) if q is not None else chunk[0].to(dtype))
        return combine(*parts) if combine is not None else parts[0]

    return tuple(payload_keys), decode
