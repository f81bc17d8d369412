"""Checkpoint plumbing shared by every loader: one checkpoint record, one resolver skeleton, how a model tensor is
made from stored tensors (with the row permutations the released layouts need), and the strict key / shape / dtype
check."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch

from ..errors import CheckpointError, H3Error, PickleCheckpointError
from ..json_values import is_positive_real, is_whole
from ..runtime.host_store import HostTensor
from .gguf_io import GGUF_SUFFIX, GGUFFile
from .quantised import DEQUANTISED_DEFAULT_DTYPE, QuantisedWeight, detect_quantised, quantised_decoder
from .safetensors_io import PICKLE_SUFFIXES, SafetensorsFile, refuse_pickle

T = TypeVar("T")

# The dtypes every component computes in; anything else in a checkpoint (fp8, int8, packed 4-bit, ...) is a quantised
# format, refused from the header instead of failing at the first forward.
FULL_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
QUANTISED_NOT_SUPPORTED = "quantised checkpoints (fp8, int8, NVFP4, ...) are not supported yet"
# The rule of components that read quantised files: a bare fp8 / int8 tensor says nothing of its scales.
QUANTISED_NEEDS_FORMAT = ("another dtype is read only as a quantised layer in a ComfyUI format (its "
                          "'<layer>.comfy_quant' and scales, or 'scale_weight' with a 'scaled_fp8' marker) or from a "
                          "GGUF file")


def full_precision(dtype: torch.dtype) -> bool:
    return dtype in FULL_PRECISION_DTYPES


def compute_dtype(dtype, component: str) -> torch.dtype | None:
    """A loader's `dtype=` option: None (the checkpoint's own) or a floating dtype the model can compute in. An integer
    or fp8 dtype would cast the weights to it and give noise (quantised weights are read from quantised files, with
    their scales), a string would fail deep inside torch."""
    if dtype is None or (isinstance(dtype, torch.dtype) and full_precision(dtype)):
        return dtype
    raise H3Error(f"dtype={dtype!r}: the {component} computes in torch.bfloat16, float16, float32 or float64 (or "
                  "dtype=None, the checkpoint's own). Casting weights to another type does not quantise them: load a "
                  "quantised file instead (python -m h3_core quantize writes one).")


@dataclass
class WeightSpec:
    """How one model tensor is made from checkpoint tensors: `combine(*[file.tensor(k) for k in keys])`."""

    name: str
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable[..., torch.Tensor] | None = None


@dataclass
class Checkpoint:
    """A resolved checkpoint of one component: its layout and config, where every stored key lives (memory maps)
    and how each model tensor is made from them."""

    component: str  # one of `h3_core.components.COMPONENTS`
    source: Path
    layout: str
    config: Any
    files: dict[str, SafetensorsFile]  # stored key -> file
    specs: list[WeightSpec]
    allowed_extra: set[str] = field(default_factory=set)  # stored keys that are recognised but never read
    defaults: dict = field(default_factory=dict)  # loader option defaults the checkpoint's config carries
    # Quantised stored weights (key -> how it is dequantised), filled by `check` from the files.
    quantised: dict[str, QuantisedWeight] = field(default_factory=dict)

    def tensors(self, spec: WeightSpec) -> tuple[torch.Tensor, ...]:
        """The stored (memory-mapped) tensors `spec` is made from."""
        return tuple(self.files[k].tensor(k) for k in spec.keys)

    def weight(self, spec: WeightSpec) -> torch.Tensor:
        tensors = self.tensors(spec)
        return spec.combine(*tensors) if spec.combine else tensors[0]

    def recipe(self, spec: WeightSpec, dtype_for: Callable[[torch.dtype], torch.dtype],
               shape: tuple[int, ...], platform=None) -> HostTensor:
        """How the parameter of `spec` is made, at `dtype_for(stored dtype)`: the stored tensors and the combine,
        or, when a stored tensor is quantised, its payloads and a decode that dequantises then combines (the
        stored dtype of a quantised weight counts as `DEQUANTISED_DEFAULT_DTYPE`), on `platform`'s device where it can
        (`HostTensor.placed_for`; None: wherever it is materialised)."""
        if not any(k in self.quantised for k in spec.keys):
            sources = self.tensors(spec)
            return HostTensor(sources, dtype_for(sources[0].dtype), shape, spec.combine)
        dtype = dtype_for(DEQUANTISED_DEFAULT_DTYPE)
        keys, decode = quantised_decoder(spec.keys, spec.shapes, self.quantised, dtype, spec.combine)
        recipe = HostTensor(tuple(self.files[k].tensor(k) for k in keys), dtype, shape, decode=decode)
        return recipe if platform is None else recipe.placed_for(platform)

    def quantised_bytes(self, spec: WeightSpec) -> int | None:
        """Stored bytes of the payloads `spec` is made from when one of its tensors is quantised (what streaming
        moves); None when none is."""
        if not any(k in self.quantised for k in spec.keys):
            return None
        keys = [p for k in spec.keys for p in (self.quantised[k].payload_keys if k in self.quantised else (k,))]
        return sum(self.files[k].nbytes(k) for k in keys)

    def numel(self, spec: WeightSpec) -> int:
        """Elements behind `spec`, read from the headers (a quantised tensor's dequantised elements)."""
        return sum(math.prod(self.quantised[k].shape if k in self.quantised else self.files[k].shape(k))
                   for k in spec.keys)

    def main_dtype(self, kept: Callable[[str], bool] = lambda name: False) -> torch.dtype:
        """The dtype most stored elements have (a quantised weight's counted as `DEQUANTISED_DEFAULT_DTYPE`, what it
        is dequantised into), the parameters `kept` at their own dtype (fp32 islands) aside: what a loader computes in
        when no dtype is asked for, so that one tensor saved in another dtype (an fp16 tensor in an fp32 file) or the
        fp32 norms of a file quantised from fp32 do not fail the first matmul."""
        elements: dict[torch.dtype, int] = {}
        for spec in self.specs:
            if kept(spec.name):
                continue
            quantised = any(k in self.quantised for k in spec.keys)
            dtypes = [DEQUANTISED_DEFAULT_DTYPE] if quantised else [self.files[k].dtype(k) for k in spec.keys]
            if all(full_precision(d) for d in dtypes):
                elements[dtypes[0]] = elements.get(dtypes[0], 0) + self.numel(spec)
        return max(elements, key=elements.get) if elements else DEQUANTISED_DEFAULT_DTYPE

    @property
    def paths(self) -> list[Path]:
        return sorted({f.path for f in self.files.values()})

    def check(self, describe: str, *, accept_quantised: bool = False, **rules) -> "Checkpoint":
        """`check_tensors` against the specs, `allowed_extra` aside; `rules` are its dtype rules. With
        `accept_quantised`, quantised layers are detected first (`quantised`) and checked by their logical shape.
        Returns self."""
        if accept_quantised:
            self.quantised, described = detect_quantised(self.source, self.files)
            self.allowed_extra = self.allowed_extra | described
        check_tensors(self.source, self.files, expected_shapes(self.specs), describe,
                      ignore=self.allowed_extra.__contains__, quantised=self.quantised, **rules)
        return self


def resolve_source(source: str | os.PathLike, hint: str, single_file: Callable[[Path], T],
                   folder: Callable[[Path], T], owning_folder: Callable[[Path], Path | None] = lambda path: None,
                   *, gguf: bool = False) -> T:
    """The opening every resolver shares: an existing path that is not a pickle file, then `single_file(path)` for a
    `.safetensors` file (or a `.gguf` file, with `gguf`) or `folder(path)` for a folder. `hint` says what to give
    instead of a missing path; `owning_folder(path)` is the checkpoint folder a weights file belongs to, resolved as
    that folder (None: none)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder. {hint}", path=path)
    refuse_pickle(path)
    if path.is_file() and owning_folder(path) is not None:
        path = owning_folder(path)
    if path.is_file():
        if path.suffix.lower() not in (".safetensors",) + ((GGUF_SUFFIX,) if gguf else ()):
            kinds = ".safetensors or .gguf file" if gguf else ".safetensors file"
            raise CheckpointError(f"{path}: expected a {kinds} or a checkpoint folder.", path=path)
        return single_file(path)
    return folder(path)


def open_weights_file(path: Path):
    """The one-file checkpoint at `path`: a `GGUFFile` for `.gguf`, else a `SafetensorsFile`."""
    if path.suffix.lower() == GGUF_SUFFIX:
        return GGUFFile(path)
    return SafetensorsFile(path)


def shape_reader(path: Path, files: Mapping[str, SafetensorsFile], what: str, prefix: str = "",
                 quantised: Mapping[str, QuantisedWeight] | None = None):
    """`shape(key)` and `need(key)`: the shape of stored key `prefix + key` (a quantised one's dequantised shape),
    None / a `CheckpointError` naming the key when absent. For configs read from tensor shapes; `what` names the
    model the file should be."""
    quantised = quantised or {}

    def shape(key: str) -> tuple[int, ...] | None:
        key = prefix + key
        if key in quantised:
            return quantised[key].shape
        return files[key].shape(key) if key in files else None

    def need(key: str) -> tuple[int, ...]:
        found = shape(key)
        if found is None:
            raise CheckpointError(f"{path}: missing key '{prefix + key}', needed to read the model size; the file is "
                                  f"not a complete {what}.", path=path, key=prefix + key)
        return found

    return shape, need


def count_indexed(shape: Callable[[str], tuple[int, ...] | None], pattern: str) -> int:
    """How many of `pattern.format(0)`, `pattern.format(1)`, ... `shape` finds, counting until the first gap."""
    n = 0
    while shape(pattern.format(n)) is not None:
        n += 1
    return n


class HeaderSizes:
    """Sizes read from the headers of a checkpoint's files, each with the words that say where it was read: what a
    config.json is checked against before any module is built (a config asking for 10^9 layers must not build them
    to find out the file holds 50). `what` names the model the files should be."""

    def __init__(self, source: Path, files: Mapping[str, SafetensorsFile], what: str, prefix: str = "",
                 quantised: Mapping[str, QuantisedWeight] | None = None):
        self.source, self.files, self.what, self.prefix = source, files, what, prefix
        self.quantised = quantised or {}

    def dim(self, key: str, index: int) -> tuple[int, str]:
        """Dimension `index` of stored tensor `prefix + key`."""
        key = self.prefix + key
        if key not in self.files:
            raise CheckpointError(f"{self.source}: missing key '{key}', needed to check the config against the "
                                  f"weights; the checkpoint is not a complete {self.what}.", path=self.source, key=key)
        file = self.files[key]
        shape = self.quantised[key].shape if key in self.quantised else file.shape(key)
        if len(shape) <= index:
            raise CheckpointError(f"{file.path}: tensor '{key}' has shape {list(shape)}, which is not the shape of "
                                  f"that tensor in a {self.what}.", path=file.path, key=key)
        return shape[index], f"'{key}' has shape {list(shape)} in {file.path.name}"

    def count(self, prefix: str, what: str) -> tuple[int, str]:
        """How many indexed groups `prefix + N.` the files hold, counting N = 0, 1, ... until the first gap (keys
        past a gap are reported by the strict key check, naming the file)."""
        head = self.prefix + prefix
        indices = set()
        for key in self.files:
            if key.startswith(head):
                number = key[len(head):].partition(".")[0]
                if number.isdigit():
                    indices.add(int(number))
        n = 0
        while n in indices:
            n += 1
        if n == 0:
            return 0, f"no '{head}N.' {what}"
        return n, f"{n} {what} ('{head}0.' to '{head}{n - 1}.')"


def check_config_sizes(config_path: Path, checks) -> None:
    """Each `(config key, configured value, (found, where))` must agree: else one `CheckpointError` naming the config
    file, the key, its value and what the weights hold. A size made of several fields is given as
    `((key, value), (key, value), ...)` with their product as the configured value."""
    for key, configured, (found, where) in checks:
        if configured == found:
            continue
        if isinstance(key, tuple):
            said = " and ".join(f"'{k}' is {v!r}" for k, v in key) + f", making {configured!r},"
            key = key[0][0]
        else:
            said = f"'{key}' is {configured!r}"
        raise CheckpointError(
            f"{config_path}: {said} but the weights hold {found}: {where}. The config and the weights do not "
            "match; restore the config.json that came with these weights.", path=config_path, key=key)


def config_int(raw: Mapping[str, Any], key: str, default, path: Path, *, minimum: int = 1, label: str | None = None):
    """`raw[key]` (else `default`) as an integer >= `minimum`: JSON true, 2.0 and "2" are refused, naming the key."""
    value = raw.get(key, default)
    if not is_whole(value, minimum):
        kind = "positive integer" if minimum == 1 else f"integer >= {minimum}"
        raise CheckpointError(f"{path}: '{label or key}' must be a {kind}, got {value!r}. Restore the config.json of "
                              "the release.", path=path, key=label or key)
    return value


def config_float(raw: Mapping[str, Any], key: str, default, path: Path, *, label: str | None = None):
    """`raw[key]` (else `default`) as a finite positive number."""
    value = raw.get(key, default)
    if not is_positive_real(value):
        raise CheckpointError(f"{path}: '{label or key}' must be a positive number, got {value!r}. Restore the "
                              "config.json of the release.", path=path, key=label or key)
    return float(value)


# Only the audio VAE has this tensor (its encoder's attention); also how its loader recognises one.
AUDIO_DETECT_KEY = "pre_block.attn.zero_k_bias"


def _any_key(keys, *, starts=(), ends=()) -> bool:
    return any(k.startswith(starts) or k.endswith(ends) for k in keys)


# What other components' keys look like, in the order they are told apart: the components an entry names (a loader of
# one of them skips it) and what to do with such a file instead.
_LOOKS_LIKE = (
    ((), lambda keys: _any_key(keys, starts=("decoder.proj_in.", "encoder.down_blocks.")),
     "It is a diffusers-layout video VAE file; pass the folder holding it and its config.json to load_video_vae."),
    (("transformer",), lambda keys: _any_key(keys, starts=("blocks.", "transformer_blocks.", "model.diffusion_model."))
     and not _any_key(keys, starts=("decoder.", "encoder.")),
     "It looks like an H3 transformer (DiT) checkpoint; pass it to load_dit instead."),
    (("audio_vae",), lambda keys: _any_key(keys, ends=(AUDIO_DETECT_KEY,)),
     "It looks like an audio VAE checkpoint; pass it to load_audio_vae instead."),
    (("video_vae",), lambda keys: any(k.endswith("scale1") and "transformer_blocks" in k for k in keys),
     "It looks like a video VAE checkpoint; pass it to load_video_vae instead."),
    (("video_vae", "audio_vae"), lambda keys: _any_key(keys, starts=("decoder.", "encoder.", "quant_conv",
                                                                     "post_quant")),
     "It looks like a VAE checkpoint; pass it to load_video_vae / load_audio_vae instead."),
    (("text_encoder",), lambda keys: _any_key(keys, starts=("model.layers.", "model.language_model.", "visual.",
                                                            "language_model.")),
     "It looks like a text encoder checkpoint; pass it to load_text_encoder instead."),
    # llama.cpp's names: a published GGUF language model (`blk.N.`, `token_embd`) or its vision projector (`v.`).
    (("text_encoder",), lambda keys: _any_key(keys, starts=("blk.", "token_embd.", "v.blk.")),
     "It looks like a llama.cpp GGUF (a Qwen3-VL text encoder or its mmproj); give the language .gguf as the text "
     "encoder (load_text_encoder, the text_encoder input) instead."),
)


def not_a_checkpoint(path: Path, keys, component: str, what: str) -> CheckpointError:
    """`path` holds no checkpoint of `component`: the error says `what` was expected, names a few of its keys and,
    when they give another component away, the loader for that one."""
    keys = list(keys)
    hint = next((f" {advice}" for names, found, advice in _LOOKS_LIKE if component not in names and found(keys)), "")
    return CheckpointError(f"{path}: not {what} (found {', '.join(sorted(keys)[:3]) or 'no tensors'}"
                           f"{' ...' if len(keys) > 3 else ''}).{hint}", path=path)


def deinterleave_rows(heads: int, head_dim: int):
    """Fused QKV stored per head `[head0: q k v, head1: q k v, ...]` (weight rows or bias entries) -> the logical
    `[q_all; k_all; v_all]` the models hold."""
    def combine(tensor: torch.Tensor) -> torch.Tensor:
        rest = tensor.shape[1:]
        return tensor.reshape(heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * heads * head_dim, *rest)

    def into(target: torch.Tensor, tensor: torch.Tensor) -> None:
        # One strided copy (casting on the way) straight into the destination: no full-size temporaries.
        rest = tensor.shape[1:]
        target.view(3, heads, head_dim, *rest).copy_(tensor.reshape(heads, 3, head_dim, *rest).transpose(0, 1))

    combine.into = into  # a pure rearrangement: stores may write it in place, casting as they copy
    return combine


def cat_rows(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _cat_rows_into(target: torch.Tensor, *tensors: torch.Tensor) -> None:
    start = 0
    for tensor in tensors:
        target[start: start + tensor.shape[0]].copy_(tensor)
        start += tensor.shape[0]


cat_rows.into = _cat_rows_into


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """`[a; b]` -> `[b; a]` along the rows: the SwiGLU input projection's half order differs between layouts."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def expected_shapes(specs) -> dict[str, tuple[int, ...]]:
    expected: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        expected.update(zip(spec.keys, spec.shapes))
    return expected


def check_tensors(source: Path, files: Mapping[str, SafetensorsFile], expected: Mapping[str, tuple[int, ...]],
                  describe: str, *, ignore: Callable[[str], bool] = lambda key: False,
                  dtype_ok: Callable[[torch.dtype], bool] = full_precision,
                  dtype_rule: str = f"weights must be bf16, fp16 or fp32; {QUANTISED_NOT_SUPPORTED}",
                  quantised: Mapping[str, QuantisedWeight] | None = None) -> None:
    """Every expected key present with its shape and an accepted dtype, and no unknown key (`ignore` aside): one
    `CheckpointError` naming the file and key otherwise. `describe` says what the checkpoint was expected to be."""
    missing = [k for k in expected if k not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{source}: missing key '{missing[0]}'{more}, expected shape {list(expected[missing[0]])} for {describe}. "
            "The checkpoint is incomplete or of another model; download it again.",
            path=source, key=missing[0])
    unexpected = sorted(k for k in files if k not in expected and not ignore(k))
    if unexpected:
        key = unexpected[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{files[key].path}: unexpected key '{key}'{more} for {describe}; the file belongs to another model or "
            "its config does not match it.", path=files[key].path, key=key)
    quantised = quantised or {}
    for key, shape in expected.items():
        file = files[key]
        if key in quantised:  # its stored dtype and (packed) shape are the format's; its logical shape is checked
            if not quantised[key].fits(shape):
                raise CheckpointError(
                    f"{file.path}: tensor '{key}' ({quantised[key].format}) is stored as "
                    f"{list(quantised[key].stored_shape)}, which does not hold the {list(shape)} expected for "
                    f"{describe}; the config and the weights do not match.", path=file.path, key=key)
            continue
        if file.shape(key) != shape:
            raise CheckpointError(
                f"{file.path}: tensor '{key}' has shape {list(file.shape(key))}, expected {list(shape)} for "
                f"{describe}; the config and the weights do not match.", path=file.path, key=key)
        if not dtype_ok(file.dtype(key)):
            raise CheckpointError(
                f"{file.path}: tensor '{key}' has dtype {str(file.dtype(key)).replace('torch.', '')}; {dtype_rule}.",
                path=file.path, key=key)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON ({exc}).", path=path) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object.", path=path)
    return data


def open_folder_files(folder: Path, stem: str,
                      may_be_absent: Callable[[str], bool] | None = None) -> dict[str, SafetensorsFile]:
    """Map every tensor key of `<stem>*.safetensors` in `folder` (through the index when there is one) to its file.

    A shard missing from the folder is left out when `may_be_absent(key)` holds for every key the index puts in it
    (the hub download skips the text encoder's shards that hold only layers H3 never reads)."""
    index_path = folder / f"{stem}.safetensors.index.json"
    files: dict[str, SafetensorsFile] = {}
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' object; the index is corrupt.", path=index_path)
        opened: dict[str, SafetensorsFile] = {}
        skipped = set()
        if may_be_absent is not None:
            needed_shards = {str(shard) for key, shard in weight_map.items() if not may_be_absent(key)}
            skipped = {str(shard) for shard in weight_map.values()
                       if str(shard) not in needed_shards and not (folder / str(shard)).is_file()}
        for key, shard in weight_map.items():
            shard_path = folder / str(shard)
            if Path(str(shard)).name != str(shard):
                raise CheckpointError(f"{index_path}: shard name {shard!r} for key '{key}' must be a plain file name "
                                      "inside the checkpoint folder.", path=index_path, key=key)
            if str(shard) in skipped:
                continue
            if shard not in opened:
                if not shard_path.is_file():
                    raise CheckpointError(
                        f"{index_path}: names shard '{shard}' (for key '{key}'), which is missing from {folder}. "
                        "Download the missing shard or the whole folder again.",
                        path=shard_path,
                        key=key,
                    )
                opened[shard] = SafetensorsFile(shard_path)
            if key not in opened[shard]:
                raise CheckpointError(
                    f"{shard_path}: the index says it holds '{key}' but it does not; the shard or the index is from a "
                    "different download.",
                    path=shard_path,
                    key=key,
                )
            files[key] = opened[shard]
        return files
    paths = sorted(folder.glob(f"{stem}*.safetensors"))
    if not paths:
        pickles = [p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES]
        if pickles:
            raise PickleCheckpointError(
                f"{folder}: holds only pickle checkpoints ({', '.join(sorted(pickles)[:3])}); h3-stream reads "
                "safetensors only. Download the safetensors release.",
                path=folder,
            )
        raise CheckpointError(f"{folder}: no {stem}*.safetensors files.", path=folder)
    for path in paths:
        shard = SafetensorsFile(path)
        for key in shard:
            if key in files:
                raise CheckpointError(f"{path}: key '{key}' also appears in {files[key].path}.", path=path, key=key)
            files[key] = shard
    return files
