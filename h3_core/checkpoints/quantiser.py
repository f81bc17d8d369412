"""Make a quantised transformer file from a bf16 one, a tensor at a time: `python -m h3_core quantize SRC DST`.

The output's header (every name, dtype and shape) is known before any weight is read, so it is written first and
each parameter is then read from the source (in the model's logical order, whatever the source layout), quantised,
written and dropped: the process never holds more than one parameter of the model. Formats:

* `fp8`: ComfyUI mixed precision `float8_e4m3fn` (per-tensor `weight_scale`, `comfy_quant` JSON), a `.safetensors`;
* `int8`: ComfyUI mixed precision `int8_tensorwise` with per-row scales, a `.safetensors`;
* `q8_0`: GGUF Q8_0 (ComfyUI-GGUF's names: the state-dict keys), a `.gguf`;
* `q6_k` / `q4_k`: GGUF Q6_K / Q4_K (the same names; our own quantisers, `kquants`: gguf's package has none), a
  `.gguf`.

`--component text_encoder` is `text_encoder_quantiser` (the same formats, ComfyUI's and llama.cpp's text-encoder
layouts), sharing the writers below.

Quantised are the 2-D matrices of the transformer blocks and of the text refiner, by comfy-kitchen's and gguf's own
quantisers (and ours for the K-quants); every other tensor (norms, biases, the fp32 islands) is written as stored,
so the file runs at the loader's default dtype whatever the source's (fp32, fp16 or bf16). The file is written under
a hidden staging name in DST's folder (`.NAME.PID.partial`, as generate's outputs), synced to disk and renamed over
DST when complete: a failed or interrupted run leaves no partial file and the file already at DST untouched; a
complete one replaces it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import CheckpointError, H3Error
from ..staged_files import remove_dead_staging, staging_path, write_failure
from ..runtime.file_reads import FileReader
from ..models.dit import RotaryEmbedding3D
from .dit_loader import COMFY_PREFIX, _expected_tensors, resolve_dit_checkpoint, target_dtype
from .quantised import LARGEST_WEIGHT, gguf_package, kitchen_eager

QUANTISE_FORMATS = {"fp8": ".safetensors", "int8": ".safetensors", "q8_0": ".gguf", "q6_k": ".gguf", "q4_k": ".gguf"}
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8", torch.uint8: "U8"}
GGUF_BLOCK = {"q8_0": 32, "q6_k": 256, "q4_k": 256}  # values per block (ggml's Q8_0, Q6_K, Q4_K)


def _quantised(name: str, shape: tuple[int, ...], fmt: str) -> bool:
    if len(shape) != 2 or not name.endswith(".weight") or not name.startswith(("blocks.", "token_refiner.blocks.")):
        return False
    return fmt not in GGUF_BLOCK or shape[1] % GGUF_BLOCK[fmt] == 0


def check_paths(source: Path, target: Path, fmt: str) -> None:
    """Everything about the arguments that can be known before reading: the format, the target's suffix, and that
    its folder exists and can be written (a file is created and removed there)."""
    if fmt not in QUANTISE_FORMATS:
        raise H3Error(f"format={fmt!r} is not a quantisation h3-stream writes; use one of "
                      f"{', '.join(QUANTISE_FORMATS)}.")
    suffix = QUANTISE_FORMATS[fmt]
    if target.suffix.lower() != suffix:
        raise H3Error(f"{target}: a {fmt} file is written as {suffix}; name the output '{target.stem}{suffix}'.")
    if not target.parent.is_dir():
        raise H3Error(f"{target}: the folder {target.parent} does not exist; create it first.")
    if target.exists() and source.exists() and target.resolve() == source.resolve():
        raise H3Error(f"{target}: is the source itself; write the quantised file under another name.")
    if target.is_dir() or (target.exists() and not target.is_file()):
        raise H3Error(f"{target}: exists and is not a regular file (a folder, a device or a pipe); give a file "
                      "name.")
    try:
        handle, probe = tempfile.mkstemp(prefix=".h3-write-check-", dir=target.parent)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise H3Error(f"{target}: cannot write in {target.parent} ({exc.strerror or exc}); choose a folder you can "
                      "write.") from None


# The loaders' words for a file of another component, and the quantiser's.
_OTHER_COMPONENT = {"pass it to load_dit instead.": "quantise it with quantise_checkpoint instead.",
                    "pass it to load_text_encoder instead.": "quantise it with quantise_text_encoder instead.",
                    "give the language .gguf as the text encoder (load_text_encoder, the text_encoder input) instead.":
                    "quantise it with quantise_text_encoder instead."}


def for_quantising(exc: CheckpointError) -> CheckpointError:
    """`exc` with a loader's advice on a file of another component ("pass it to load_dit instead") in the
    quantiser's words (which the CLI spells --component); else `exc` itself."""
    text = str(exc)
    for theirs, ours in _OTHER_COMPONENT.items():
        if text.endswith(theirs):
            return CheckpointError(text[: -len(theirs)] + ours, path=exc.path, key=exc.key)
    return exc


def unquantised_source(resolve: Callable[[], object], source: Path, what: str):
    """The checkpoint `resolve()` opens, in the quantiser's words, refused when it is already quantised (`what`: the
    unquantised file to quantise instead)."""
    try:
        ckpt = resolve()
    except CheckpointError as exc:
        raise for_quantising(exc) from None
    if ckpt.quantised:
        key = next(iter(ckpt.quantised))
        raise CheckpointError(f"{source}: is already quantised ('{key}' is {ckpt.quantised[key].format}); quantise "
                              f"{what} instead.", path=source, key=key)
    return ckpt


@contextmanager
def staged_outputs(targets: list[Path]) -> Iterator[list[Path]]:
    """Hidden staging files beside `targets` (`.NAME.PID.partial`) to write in the `with` body; when it completes,
    each is synced and renamed over its target, the last target first (an mmproj before the language file it
    belongs to), and the folder synced. A failure, Ctrl-C or SIGTERM leaves no staging file and the files already at
    the targets untouched; a write error is one `H3Error` naming the first target."""
    for path in targets:
        remove_dead_staging(path)
    stagings = [staging_path(path) for path in targets]
    try:
        yield stagings
        for staging in stagings:
            sync_file(staging)
        for staging, path in reversed(list(zip(stagings, targets))):
            os.replace(staging, path)
    except BaseException as exc:
        written = sum(s.stat().st_size for s in stagings if s.exists())
        for staging in stagings:
            staging.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_error(targets[0], exc, written) from None
        raise
    sync_folder(targets[0].parent)


def read_for_quantising(ckpt, spec, dtype: torch.dtype, shape, reader: FileReader, source: Path, quantise: bool,
                        name: str) -> torch.Tensor:
    """One parameter of `ckpt` in `dtype`, read into the process's memory (checked as `checked_for_quantising`
    when it is to be quantised); an error names the source file and `name`, never the output's."""
    try:
        tensor = ckpt.recipe(spec, lambda stored: dtype, tuple(shape)).private_value(reader)
    except OSError as exc:
        raise CheckpointError(f"{source}: could not read '{name}' ({exc.strerror or exc}); check the disk or copy the "
                              "checkpoint again.", path=source, key=name) from None
    return checked_for_quantising(source, name, tensor) if quantise else tensor


def write_error(target: Path, exc: OSError, written: int) -> H3Error:
    """One message for a failed write of `written` bytes."""
    kept = "; the file already there is unchanged" if target.exists() else ""
    return H3Error(f"{target}: could not write the quantised file: {write_failure(exc, target.parent, written)}. "
                   f"Nothing was written{kept}.")


def sync_file(path: Path) -> None:
    """The file's bytes on disk before it is renamed into place (a crash then leaves the old file or the new one)."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def sync_folder(folder: Path) -> None:
    """The rename itself on disk (POSIX; Windows cannot open a folder, and renames durably)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def checked_for_quantising(source: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A matrix about to be quantised: finite and within `LARGEST_WEIGHT` (what a quantised file may hold; its
    loader refuses larger scales), so that a corrupt source is named here, not the file written from it."""
    flat, step = tensor.reshape(-1), _ROWS_CHUNK_VALUES  # a chunk at a time: no copy of the whole matrix
    amax = max((float(flat[i:i + step].abs().amax()) for i in range(0, flat.numel(), step)), default=0.0,
               key=lambda v: math.inf if math.isnan(v) else v)  # NaN when any value is
    if not math.isfinite(amax) or amax > LARGEST_WEIGHT:
        what = "NaN or infinite values" if not math.isfinite(amax) else f"values up to {amax:.4g}"
        raise CheckpointError(f"{source}: tensor '{name}' holds {what}; a trained weight is finite and far below "
                              f"{LARGEST_WEIGHT:g}. The source checkpoint is corrupt: download it again.",
                              path=source, key=name)
    return tensor


def quantise_checkpoint(source: str | os.PathLike, target: str | os.PathLike, fmt: str, *,
                        log: Callable[[str], None] | None = None) -> Path:
    """Write `target`, the transformer at `source` (any layout, unquantised, fp32, fp16 or bf16) with its block
    matrices quantised as `fmt` ("fp8", "int8", "q8_0", "q6_k" or "q4_k"); returns `target`. A file already at
    `target` is replaced only by a complete one. See the module docstring; the text encoder's is
    `text_encoder_quantiser.quantise_text_encoder`."""
    source, target = Path(source).expanduser(), Path(target).expanduser()
    check_paths(source, target, fmt)
    ckpt = unquantised_source(lambda: resolve_dit_checkpoint(source), source, "the bf16 release")
    kitchen = kitchen_eager(source, "(output)") if fmt not in GGUF_TYPES else None
    gguf = gguf_package(target) if fmt in GGUF_TYPES else None
    shapes = _expected_tensors(ckpt.config)
    plan = []  # (parameter name, spec, shape, stored dtype, quantised?)
    # rope.inv_freq: our loaders recompute it from rope_theta, but ComfyUI's model detection reads its length, so
    # every written file carries it (fp32, as the release ships it).
    c = ckpt.config
    inv_freq = RotaryEmbedding3D.frequencies(c.rope_freq_dim, c.rope_theta).to(torch.float32)
    plan.append(("rope.inv_freq", None, tuple(inv_freq.shape), torch.float32, False))
    for spec in ckpt.specs:
        if spec.name == "rope.inv_freq":
            continue  # written above
        stored = ckpt.files[spec.keys[0]].dtype(spec.keys[0])
        dtype = target_dtype(spec.name, stored, None)
        shape = tuple(shapes[spec.name])
        plan.append((spec.name, spec, shape, dtype, _quantised(spec.name, shape, fmt)))
    say = log or (lambda message: None)
    with staged_outputs([target]) as (staging,), closing(FileReader()) as reader:
        def value(spec, dtype, shape, quantise=False):
            if spec is None:
                return inv_freq
            return read_for_quantising(ckpt, spec, dtype, shape, reader, source, quantise, spec.name)

        if fmt in GGUF_TYPES:
            stored = GGUF_TYPES[fmt]
            write_gguf(staging, "minimax_h3", [
                GGUFTensor(name, shape, stored if quantise else dtype,
                           lambda spec=spec, dtype=dtype, shape=shape, quantise=quantise:
                           value(spec, dtype, shape, quantise))
                for name, spec, shape, dtype, quantise in plan], gguf, say)
        else:
            write_safetensors(staging, plan, value, fmt, kitchen, say)
    return target


# ---- ComfyUI mixed precision (.safetensors) -------------------------------------------------------------------------


def _comfy_quant(fmt: str) -> bytes:
    return json.dumps({"format": "float8_e4m3fn" if fmt == "fp8" else "int8_tensorwise"}).encode("utf-8")


def _safetensors_entries(plan, fmt, key_of):
    """(key, dtype, shape) of every output tensor, in file order, and the parameter each belongs to."""
    for name, spec, shape, dtype, quantise in plan:
        key = key_of(name)
        if not quantise:
            yield key, dtype, shape, name, "plain"
            continue
        layer = key[: -len(".weight")]
        yield key, torch.float8_e4m3fn if fmt == "fp8" else torch.int8, shape, name, "weight"
        yield f"{layer}.weight_scale", torch.float32, () if fmt == "fp8" else (shape[0], 1), name, "scale"
        yield f"{layer}.comfy_quant", torch.uint8, (len(_comfy_quant(fmt)),), name, "config"


def write_safetensors(path: Path, plan, value, fmt: str, kitchen, say,
                      key_of: Callable[[str], str] = lambda name: COMFY_PREFIX + name) -> None:
    """Write `plan` ((parameter name, spec, shape, dtype, quantise?) in file order) as a ComfyUI mixed-precision
    .safetensors, each parameter's stored key `key_of(name)`, the ones marked quantised as `fmt` by comfy-kitchen."""
    entries = list(_safetensors_entries(plan, fmt, key_of))
    header, offset = {"__metadata__": {"format": "pt", "h3_stream_quantised": fmt}}, 0
    for key, dtype, shape, _, _ in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset,
                                                                                                    offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as the safetensors library writes
    specs = {name: (spec, shape, dtype) for name, spec, shape, dtype, _ in plan}
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        current: dict[str, torch.Tensor] = {}  # the one parameter being written: its weight, scale and config
        for key, dtype, shape, name, role in entries:
            if role in ("plain", "weight"):
                spec, shape_, dtype_ = specs[name]
                tensor = value(spec, dtype_, shape_, role == "weight")
                if role == "plain":
                    current = {"plain": tensor}
                elif fmt == "fp8":
                    # comfy-kitchen's own recipe (TensorCoreFP8Layout): scale = amax / 448, then its quantiser; the
                    # floor (comfy-kitchen's int8 one) keeps an all-zero matrix zero, not 0 / 0 = NaN.
                    scale = (tensor.float().abs().amax() / torch.finfo(torch.float8_e4m3fn).max).clamp(
                        min=1e-30).to(torch.float32)
                    current = {"weight": kitchen.quantize_per_tensor_fp8(tensor.float(), scale), "scale": scale}
                else:
                    q, scale = kitchen.quantize_int8_rowwise(tensor.float())
                    current = {"weight": q, "scale": scale.to(torch.float32)}
                del tensor  # only `current` (what is still to be written) outlives this parameter
                say(f"{name}: {'quantised as ' + fmt if role == 'weight' else 'kept as stored'}")
            data = (torch.tensor(list(_comfy_quant(fmt)), dtype=torch.uint8) if role == "config" else
                    current[role])
            out.write(data.contiguous().reshape(-1).view(torch.uint8).numpy())  # its buffer, not a copy
            del data
            if role in ("plain", "config"):
                current = {}


# ---- GGUF ------------------------------------------------------------------------------------------------------

GGUF_TYPES = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q4_k": "Q4_K"}
# Values quantised per call of a row quantiser: bounds its scratch (gguf's NumPy Q8_0 makes several float32 copies)
# whatever the tensor's size, e.g. the text encoder's 778-million-value embedding.
_ROWS_CHUNK_VALUES = 1 << 24


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file being written: `read()` gives its logical value (torch order `shape`), stored as
    `stored` (a ggml quantisation name, "Q8_0" / "Q4_K", or a torch float dtype kept as is)."""

    name: str
    shape: tuple[int, ...]
    stored: str | torch.dtype
    read: Callable[[], torch.Tensor]


def gguf_block(gguf, stored: str) -> tuple[int, int]:
    """(values, bytes) of a block of the ggml type `stored`."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[stored]]


def gguf_suits(gguf, stored: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of torch-order `shape` can be stored as `stored`: a matrix of rows of whole blocks."""
    return len(shape) == 2 and shape[1] % gguf_block(gguf, stored)[0] == 0


def quantize_rows(gguf, tensor: torch.Tensor, stored: str):
    """The ggml blocks (NumPy uint8, one row of blocks per row) of the matrix `tensor`, a few rows at a time."""
    import numpy as np

    from .kquants import quantize_q4_k, quantize_q6_k

    rows, cols = tensor.shape
    block, size = gguf_block(gguf, stored)
    out = np.empty((rows, cols // block * size), dtype=np.uint8)
    step = max(1, _ROWS_CHUNK_VALUES // max(cols, 1))
    qtype = gguf.GGMLQuantizationType[stored]
    for start in range(0, rows, step):
        chunk = tensor[start:start + step]
        if stored in ("Q4_K", "Q6_K"):
            out[start:start + step] = (quantize_q4_k if stored == "Q4_K" else quantize_q6_k)(chunk).numpy()
        else:
            out[start:start + step] = gguf.quants.quantize(chunk.float().numpy(), qtype)
    return out


def write_gguf(path: Path, arch: str, tensors: list[GGUFTensor], gguf, say, metadata=(),
               add_metadata=None) -> None:
    """Write `tensors` to a GGUF file of architecture `arch`: the header, `metadata` and every tensor's info first,
    then each tensor read, converted, written and dropped in turn."""
    import numpy as np

    types = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), arch)
    try:
        if add_metadata is not None:
            add_metadata(writer, metadata)
        quantised = {t.stored for t in tensors if isinstance(t.stored, str)}
        if quantised:  # what llama.cpp writes in the files it quantises
            file_type = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
                         "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S}
            writer.add_file_type(file_type[next(t for t in ("Q4_K", "Q6_K", "Q8_0") if t in quantised)])
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for t in tensors:
            if isinstance(t.stored, str):
                rows, cols = t.shape
                block, size = gguf_block(gguf, t.stored)
                writer.add_tensor_info(t.name, (rows, cols // block * size), np.dtype(np.uint8),
                                       rows * cols // block * size, raw_dtype=types[t.stored])
            elif t.stored == torch.bfloat16:
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.uint16), math.prod(t.shape) * 2,
                                       raw_dtype=types.BF16)
            else:
                np_dtype = np.dtype(np.float16 if t.stored == torch.float16 else np.float32)
                writer.add_tensor_info(t.name, t.shape, np_dtype, math.prod(t.shape) * np_dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            tensor = t.read()
            if isinstance(t.stored, str):
                array = quantize_rows(gguf, tensor, t.stored)
            elif t.stored == torch.bfloat16:
                array = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
            else:
                array = tensor.to(t.stored).contiguous().numpy()
            writer.write_tensor_data(array)
            say(f"{t.name}: {'quantised as ' + t.stored.lower() if isinstance(t.stored, str) else 'kept as stored'}")
            del tensor, array
    finally:
        writer.close()  # also on a failure: the staging file is removed after, and Windows cannot remove it open
