"""Quantised checkpoint tensors: which stored tensors are quantised, in which format, and how each is dequantised.

Formats are detected per tensor from the file, as ComfyUI core reads them:

* ComfyUI mixed precision (`<layer>.comfy_quant` JSON, or the file's `_quantization_metadata`): `float8_e4m3fn` /
  `float8_e5m2` (per-tensor `weight_scale`), `int8_tensorwise` (scalar or per-row `weight_scale`; with
  `"convrot": true` the rows were block-Hadamard rotated, `convrot_groupsize`), `nvfp4` (packed E2M1, fp8 block
  scales `weight_scale` in cuBLAS's tiled layout, per-tensor `weight_scale_2`, optional AWQ `pre_quant_scale`).
  `input_scale` only matters to quantised matmuls, which are not used: weights are dequantised.
* the older "fp8 scaled" files (a `scaled_fp8` marker tensor, `<layer>.scale_weight`): per-tensor fp8.
* GGUF files (`gguf_io.GGUFFile`): any ggml quantisation type the `gguf` package dequantises.

When a file is opened, each ComfyUI layer's stored weight dtype and its scales are checked as the dequantisation
will read them (`check_layer_payloads`: dtype and shape from the header, then the values, which are small: finite,
above 0, not making weights past the fp16 range), and each GGUF tensor's bytes against its type and shape
(`gguf_io`); a damaged file is one `CheckpointError` naming the tensor, never noise or a traceback in the forward.

Dequantisation is comfy-kitchen's eager (pure PyTorch) functions, and for GGUF our torch decoder
(`gguf_dequant`, checked bit for bit against gguf's NumPy `dequantize`, which still decodes the grid-based IQ types
on the host); both packages are the optional `quant` extra, imported only when a quantised file is opened. A
quantised parameter's host recipe holds the stored payloads (the quantised bytes) and dequantises them where it is
materialised, or on the host where the device cannot (`HostTensor.placed_for`: fp8 payloads on MPS, gguf's NumPy
types).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..errors import CheckpointError
from . import gguf_dequant

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
# What a corrupt quantised file's error ends with.
_CORRUPT = ("the file is corrupt: download it again, or quantise the bf16 release yourself (python -m h3_core "
            "quantize)")
# The largest weight a quantisation scale may make (the scale times the largest stored value): the fp16 range.
# Trained weights stay far below it; a scale of 1e30 (a corrupt file) would give inf or noise in any dtype.
LARGEST_WEIGHT = float(torch.finfo(torch.float16).max)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The stored dtypes of each format's weight (uint8: the legacy container of fp8 bytes, and NVFP4's packed pairs).
_WEIGHT_DTYPES = {"float8_e4m3fn": (torch.float8_e4m3fn, torch.uint8), "float8_e5m2": (torch.float8_e5m2, torch.uint8),
                  "fp8_scaled": (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8),
                  "int8_tensorwise": (torch.int8,), "int8_convrot": (torch.int8,), "nvfp4": (torch.uint8,)}
NVFP4_LARGEST = 6.0 * 448.0  # the largest E2M1 value times the largest E4M3 block scale
# Layers whose scales were checked: (file, identity, weight key). Files are opened several times per run (plans,
# estimates, the load); NVFP4 block scales are an eighth of the weights' bytes, so they are read once.
_CHECKED: set = set()


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
    pre_quant_length: int | None = None  # NVFP4 AWQ: one smoothing factor per column of the logical weight

    @property
    def key(self) -> str:
        return self.payload_keys[0]

    def fits(self, shape: Sequence[int]) -> bool:
        shape = tuple(shape)
        if self.format == "nvfp4":
            return (len(shape) == 2 and len(self.stored_shape) == 2 and self.stored_shape == (_roundup(shape[0], 16), _roundup(shape[1], 16) // 2)
                    and self.pre_quant_length in (None, shape[1]))
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


# Values decoded at a time: the decoders' float32 temporaries take about 11 bytes a value, so a whole Qwen3-VL token
# embedding (778M values) decoded at once held 7.9 GiB beside its 1.45 GiB result; in pieces they stay near 48 MiB.
DECODE_CHUNK_VALUES = 1 << 22


def _gguf_dequantise(q: QuantisedWeight, raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    if gguf_dequant.torch_decodes(q.gguf_type):  # where the blocks are: no trip through the host
        rows = raw.reshape(-1, raw.shape[-1])  # whole blocks per row; every row decodes on its own
        per_row = math.prod(shape) // rows.shape[0]
        out = torch.empty((rows.shape[0], per_row), dtype=dtype, device=raw.device)
        step = max(1, DECODE_CHUNK_VALUES // per_row)
        for start in range(0, rows.shape[0], step):
            out[start:start + step] = gguf_dequant.dequantize(rows[start:start + step], q.gguf_type)
        return out.reshape(tuple(shape))
    # The grid-based IQ types only: gguf's NumPy code, on the host (their recipes are decoded there: `host_only`).
    gguf = gguf_package(q.path, q.key)
    host = raw.detach().to("cpu").contiguous().numpy()
    values = gguf.quants.dequantize(host, gguf.GGMLQuantizationType(q.gguf_type))
    return torch.from_numpy(values).reshape(tuple(shape)).to(device=raw.device, dtype=dtype)


_GGUF_SUPPORTED: dict[int, bool] = {}


def _gguf_dequantises(path, gguf_type: int) -> bool:
    """Whether `gguf_type` is decoded: by the torch decoder, or by gguf's `dequantize` (tried once on one zero
    block)."""
    if gguf_dequant.torch_decodes(gguf_type):
        return True
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
        if config.get("convrot") not in (None, True, False):
            raise CheckpointError(f"{at}: '{layer}.comfy_quant' has convrot {config['convrot']!r}; expected true or "
                                  f"false; {_CORRUPT}.", path=at, key=f"{layer}.comfy_quant")
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
        stored = tuple(where.shape(weight_key))
        # NVFP4 packs two values a byte and pads to 16 x 16: the shape it reads as is the padded one.
        shape = (stored[0], stored[1] * 2) if fmt == "nvfp4" and len(stored) == 2 else stored
        check_layer_payloads(files, fmt, payload, shape)
        group = 0
        if fmt == "int8_convrot":
            params = config.get("params") if isinstance(config.get("params"), dict) else {}
            group = config.get("convrot_groupsize", params.get("convrot_groupsize", 256))
            # The Hadamard blocks are 4^k wide and tile each row.
            power_of_4 = (isinstance(group, int) and not isinstance(group, bool) and group >= 4
                          and group & (group - 1) == 0 and (group.bit_length() - 1) % 2 == 0)
            if not power_of_4 or shape[1] % group:
                fault = ("expected a power of 4" if not power_of_4 else
                         f"expected a power of 4 that divides the {shape[1]} columns of '{weight_key}'")
                raise CheckpointError(f"{at}: '{layer}.comfy_quant' has convrot_groupsize {group!r}; {fault}; "
                                      f"{_CORRUPT}.", path=at, key=f"{layer}.comfy_quant")
        quantised[weight_key] = QuantisedWeight(
            at, fmt, tuple(payload), stored, shape, group_size=group, has_pre_quant_scale=pre_quant,
            pre_quant_length=files[payload[3]].shape(payload[3])[0] if pre_quant else None)
        described.update(f"{layer}.{extra}" for extra in _LAYER_EXTRAS if f"{layer}.{extra}" in files)
    if quantised and any(q.gguf_type is None for q in quantised.values()):
        kitchen_eager(path, next(iter(quantised)))  # a missing extra is reported at open, not at the first block
    if any(q.gguf_type is not None for q in quantised.values()):
        gguf_package(path)
    return quantised, described


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_layer_payloads(files: Mapping[str, object], fmt: str, payload: Sequence[str], shape: tuple) -> None:
    """The stored weight `payload[0]` of a layer quantised as `fmt` (ComfyUI formats) and its scales, as the
    dequantisation reads them: the weight's dtype; each scale's dtype and shape from the header, then its values
    (finite, above 0, and not making weights past `LARGEST_WEIGHT`). `shape` is the weight's (padded) shape. One
    `CheckpointError` naming the file, the tensor, the value and what was expected; each layer is checked once per
    file version."""
    weight_key = payload[0]
    file = files[weight_key]
    identity = getattr(file, "identity", None)
    done = (str(file.path), identity, weight_key)
    if identity is not None and done in _CHECKED:
        return
    at = file.path
    dtype = file.dtype(weight_key)
    if dtype not in _WEIGHT_DTYPES[fmt] or len(shape) != 2:
        stored_as = f"{_dtype_name(dtype)} {list(file.shape(weight_key))}"
        raise CheckpointError(
            f"{at}: tensor '{weight_key}' is quantised as {fmt!r} but is stored as {stored_as}; {fmt} weights are "
            f"2-D {_one_of(_dtype_name(d) for d in _WEIGHT_DTYPES[fmt])}; {_CORRUPT}.", path=at, key=weight_key)
    rows, cols = shape
    one = ((),)  # a per-tensor scale: one value, stored as [] or [1] (or [1, 1])
    if fmt == "nvfp4":
        blocks = (_roundup(rows, 128), _roundup(cols // 16, 4))  # cuBLAS's tiled layout, as comfy-kitchen writes
        _check_block_scales(files[payload[1]], payload[1], weight_key, blocks)
        _check_scale(files[payload[2]], payload[2], weight_key, fmt, one, NVFP4_LARGEST)
        if len(payload) > 3:
            _check_pre_quant_scale(files[payload[3]], payload[3], weight_key, cols)
    else:
        if fmt.startswith("int8"):
            largest, shapes = 128.0, one + ((rows, 1),)  # per tensor or per row
        else:
            fp8 = dtype if dtype != torch.uint8 else (torch.float8_e5m2 if fmt == "float8_e5m2" else
                                                      torch.float8_e4m3fn)
            largest, shapes = float(torch.finfo(fp8).max), one
        _check_scale(files[payload[1]], payload[1], weight_key, fmt, shapes, largest)
    if identity is not None:
        _CHECKED.add(done)


def _shape_text(shape) -> str:
    return str(list(shape))


def _one_of(words) -> str:
    words = list(words)
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _scale_problem(file, key: str, weight_key: str, what: str, dtypes, shapes) -> str | None:
    """What is wrong (the message less its fix) when `key`'s dtype or shape is not one of `dtypes` / `shapes` (`()`
    stands for any one-value shape); None when nothing is."""
    dtype, shape = file.dtype(key), tuple(file.shape(key))
    head = f"{file.path}: tensor '{key}' ({what} of '{weight_key}')"
    if dtype not in dtypes:
        return f"{head} has dtype {_dtype_name(dtype)}; expected {_one_of(_dtype_name(d) for d in dtypes)}"
    fits = any(shape == s or (s == () and math.prod(shape) == 1 and len(shape) <= 2) for s in shapes)
    if not fits:
        expected = " or ".join("[] (one value for the tensor)" if s == () else
                               f"{_shape_text(s)} (one per row)" if len(s) == 2 and s[1] == 1 else _shape_text(s)
                               for s in shapes)
        return f"{head} has shape {_shape_text(shape)}; expected {expected}"
    return None


def _check_scale(file, key: str, weight_key: str, fmt: str, shapes, largest: float) -> None:
    """A per-tensor or per-row scale: a float, of one of `shapes`, each value finite, above 0 and at most
    `LARGEST_WEIGHT / largest` (`largest`: the largest magnitude of a stored value)."""
    what = f"the {fmt} scale"
    problem = _scale_problem(file, key, weight_key, what, SCALE_DTYPES, shapes)
    if problem is None:
        values = file.tensor(key).to(torch.float64).reshape(-1)
        bad = (~torch.isfinite(values)) | (values <= 0)
        where = lambda i: f" (row {i})" if values.numel() > 1 else ""  # noqa: E731
        if bad.any():
            i = int(bad.nonzero()[0])
            problem = (f"{file.path}: tensor '{key}' ({what} of '{weight_key}') holds {float(values[i]):.4g}{where(i)}; "
                       "a scale is a finite number above 0")
        else:
            i = int(values.argmax())
            if float(values[i]) * largest > LARGEST_WEIGHT:
                problem = (f"{file.path}: tensor '{key}' ({what} of '{weight_key}') holds {float(values[i]):.4g}"
                           f"{where(i)}, which makes weights up to {float(values[i]) * largest:.4g} ({largest:g} x the "
                           f"scale), past {LARGEST_WEIGHT:g}, the fp16 range, which no trained weight comes near")
    if problem is not None:
        raise CheckpointError(f"{problem}; {_CORRUPT}.", path=file.path, key=key)


def _check_block_scales(file, key: str, weight_key: str, shape: tuple[int, int]) -> None:
    """NVFP4 block scales: E4M3 (or its uint8 container), as many as the tiled layout `shape` holds (comfy-kitchen
    stores them in that shape; its unswizzle reshapes whatever shape they have, so a flattened copy reads the same);
    none NaN or negative (E4M3 has no inf and nothing above 448). A zero block scale is an all-zero block, which
    quantisers write."""
    what = "the nvfp4 block scales"
    stored = tuple(file.shape(key))
    problem = _scale_problem(file, key, weight_key, what, (torch.float8_e4m3fn, torch.uint8), (stored,))
    if problem is None and (math.prod(stored) != math.prod(shape) or len(stored) > 2):
        problem = (f"{file.path}: tensor '{key}' ({what} of '{weight_key}') has shape {_shape_text(stored)}; "
                   f"expected {_shape_text(shape)} (one scale per 16 weights, in cuBLAS's tiled layout)")
    if problem is None:
        raw = file.tensor(key).view(torch.uint8).reshape(shape)
        bad = (raw > 0x80) | (raw == 0x7F)  # the sign bit set (-0 aside), or E4M3's NaN
        if bad.any():
            row, block = (int(i) for i in bad.nonzero()[0])
            value = float(raw[row, block].view(torch.float8_e4m3fn).float())
            problem = (f"{file.path}: tensor '{key}' ({what} of '{weight_key}') holds {value:.4g} at [{row}, {block}] "
                       "of the tiled layout; a block scale is finite and not negative")
    if problem is not None:
        raise CheckpointError(f"{problem}; {_CORRUPT}.", path=file.path, key=key)


def _check_pre_quant_scale(file, key: str, weight_key: str, cols: int) -> None:
    """NVFP4 AWQ smoothing: one factor per logical column (the padded width rounds it up to 16), each finite, above
    0 and at most `LARGEST_WEIGHT` (it multiplies the dequantised weight's columns)."""
    what = "the AWQ pre-quantisation scale"
    shape = tuple(file.shape(key))
    problem = _scale_problem(file, key, weight_key, what, SCALE_DTYPES, (shape,))
    if problem is None and (len(shape) != 1 or _roundup(shape[0], 16) != cols):
        problem = (f"{file.path}: tensor '{key}' ({what} of '{weight_key}') has shape {_shape_text(shape)}; expected "
                   f"one value per column of the weight ([{cols}] for its {cols} stored columns)")
    if problem is None:
        values = file.tensor(key).to(torch.float64)
        bad = (~torch.isfinite(values)) | (values <= 0) | (values > LARGEST_WEIGHT)
        if bad.any():
            i = int(bad.nonzero()[0])
            problem = (f"{file.path}: tensor '{key}' ({what} of '{weight_key}') holds {float(values[i]):.4g} (column "
                       f"{i}); a smoothing factor is a finite number above 0 and at most {LARGEST_WEIGHT:g}")
    if problem is not None:
        raise CheckpointError(f"{problem}; {_CORRUPT}.", path=file.path, key=key)


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

    # gguf's NumPy types decode on the host only: their payloads are never moved to the device (HostTensor.placed_for).
    decode.host_only = any(q is not None and q.gguf_type is not None and not gguf_dequant.torch_decodes(q.gguf_type)
                           for q, _, _ in plan)
    return tuple(payload_keys), decode
