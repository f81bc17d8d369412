"""LoRAs for the H3 transformer: every published file format read into one form, folded into the weights when they
are materialised on the device.

Formats, told apart by their keys (diffusers 0.42.1 reads the same set):

* **original module names** (`blocks.N.attn.qkv_proj.lora_A.weight`, ...), as the reference code, ComfyUI and
  ai-toolkit (`diffusion_model.` prefix) write them; fused QKV in logical `[q; k; v]` row order, `fc1` as `[gate; up]`;
* **kohya / musubi-tuner**: `lora_down` / `lora_up` with a per-module `alpha`, and musubi's flattened
  `lora_unet_blocks_0_attn_qkv_proj` names;
* **DiffSynth-Studio**: original names with peft's `.default.` infix, trained against the *per-head interleaved*
  fused QKV of the raw checkpoint (de-interleaved here with the loaded model's head count);
* **diffusers / peft** names on `MiniMaxH3Transformer3DModel` (`transformer.transformer_blocks.N.attn.to_q.lora_A`,
  or a bare peft dump with `.default.`): separate q / k / v map onto row slices of our fused QKV, and `ff.net.0.proj`
  rows `[up; gate]` onto our `[gate; up]`;
* **full-weight deltas**: `<module>.diff` (weight) and `<module>.diff_b` (bias), original names.

Scale of a low-rank pair: its `alpha / rank` when the file has per-module alphas; the file's `__metadata__` `alpha` over
the rank when it has none, or peft's `lora_alpha` from `lora_adapter_metadata` (over sqrt(rank) with `use_rslora`, as
peft does); 1.0 otherwise (`alpha == rank`, the convention of the published alpha-less LoRAs).

A fold adds `strength * scale * up @ down` (computed in float32 on the device, then cast) to a freshly materialised
tensor, so the host store and the memory maps are never written and layerwise residency holds no second copy.

Every number is checked when the file is read, before any fold (factors, alphas: dtype, finiteness, magnitude), and
the strengths when a fold is made (`check_strengths`). Factors are read with explicit reads by the file's own
`FileReader`, checked against the file's identity, as checkpoints are: a LoRA truncated or rewritten while in use is
the checkpoints' "changed while it was loaded" error, never a SIGBUS, and what is folded is what was checked.

On an asynchronous-copy device (CUDA) the streamed blocks' folds use a `CachedFold` (`AsyncBackend.bind_transform`):
their factors read once per LoRA set, in the model's row order, into page-locked host memory of the backend's pin
budget, and copied non-blocking on the compute stream, so a fold neither reads a file nor makes the host wait. The
numbers are the same: the same factors, cast the same way, added in the same steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
import weakref
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..errors import CheckpointError
from ..json_values import is_positive_real
from ..models.dit import H3DiT
from ..models.dit_config import H3DiTConfig
from ..models.meta_models import meta_model
from ..runtime.file_reads import FileIdentity, FileReader, read_private, segment_of
from ..runtime.host_store import HostPinner, PinBudget, PinWarning, page_aligned_bytes, plan_slab, view_in
from .safetensors_io import SafetensorsFile, refuse_pickle


# A fold into a bf16 / fp16 weight runs this many weight elements per `addmm_` call, bounding whatever accumulation
# buffer the kernel keeps (a float32 copy of the slice would be 64 MiB); a float32 weight is folded in one call.
FOLD_ELEMENTS = 1 << 24

# How large a LoRA's numbers may be. A fold casts the factors to the weight's dtype, float16 the narrowest (largest
# finite value 65504), and adds `strength * scale * up @ down`. Factor entries up to FACTOR_LIMIT survive that cast;
# every partial sum of `up @ down` is at most rank * max |up| * max |down| (an update's `product_bound`), kept under
# FACTOR_LIMIT too, so no accumulator overflows whatever precision the GEMM reduces in; and the change to any
# weight, at most |strength| * scale * product_bound summed over the updates of that weight, is kept under
# MAX_WEIGHT_CHANGE, so a folded weight (trained weights are O(1)) stays finite in float16. Trained LoRAs have factors
# of about 1e-3..1 and change weights by well under 1 at strength 1, so these refuse only broken files (factors or an
# alpha off by powers of ten, NaN / Inf) and strengths that are typos, never a LoRA that works.
FACTOR_LIMIT = float(torch.finfo(torch.float16).max)
MAX_WEIGHT_CHANGE = 1e4
# Bytes of a LoRA tensor read at a time to check it, into one buffer for the whole file: checking holds no copy of
# the file and leaves no heap behind (a buffer per tensor left ~0.4 MB of holes between the objects made meanwhile;
# one of 1 MiB is a mapping of its own, returned whole when freed).
CHECK_CHUNK_BYTES = 1 << 20


class LoraError(CheckpointError):
    """A LoRA file that cannot be applied to the loaded transformer; the message names the file, key and fix."""


# ---- one update of one model parameter ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """`scale * up @ down` (or the full `delta` when `down` is None) added to rows `rows` of a parameter.

    `row_order` permutes the rows of `up` / `delta` into the model's order (DiffSynth's interleaved QKV, diffusers'
    `[up; gate]`); None keeps them. Tensors are the file's memory-mapped views, whose pages are never touched: a fold
    reads their bytes with the LoRA file's `FileReader`. `change_bound` bounds |scale * up @ down| (or |delta|)
    entry by entry, from the values checked when the file was read (see FACTOR_LIMIT).
    """

    up: torch.Tensor
    down: torch.Tensor | None
    scale: float = 1.0
    rows: tuple[int, int] | None = None
    row_order: torch.Tensor | None = None
    change_bound: float = 0.0

    def add_to(self, target: torch.Tensor, strength: float, reader: FileReader | None = None,
               factors: "CachedFactors | None" = None) -> int:
        """`target += strength * scale * update` in place, one `addmm_` per `fold_rows` rows with the factors in the
        weight's dtype (the GEMM accumulates in float32 and rounds once: as precise as a float32 product added, and
        20x faster than a mixed-dtype add on the CPU). Factors in a file are read by `reader` (a temporary one when
        None), or, given `factors` (this update's, read once by a `CachedFold`), copied from those with no file read.
        Returns the bytes of the factors moved onto the device."""
        with ExitStack() as stack:
            device, dtype, factor = target.device, target.dtype, strength * self.scale
            if factors is not None:  # read once, in the model's row order and the weight's dtype
                def down_rows():
                    return factors.to_device(factors.down)

                def up_rows(start, stop):
                    return factors.to_device(factors.up[start:stop])
            else:
                if reader is None and (segment_of(self.up) is not None or
                                       (self.down is not None and segment_of(self.down) is not None)):
                    reader = stack.enter_context(closing(FileReader()))
                order = self.row_order

                def down_rows():
                    return _read_rows(self.down, None, reader).to(device=device, dtype=dtype)

                def up_rows(start, stop):
                    rows = range(start, stop) if order is None else order[start:stop]
                    return _read_rows(self.up, rows, reader).to(device=device, dtype=dtype)

            down = None if self.down is None else down_rows()
            moved = 0 if down is None else down.numel() * down.element_size()
            step = fold_rows(target)
            for start in range(0, target.shape[0], step):
                stop = min(start + step, target.shape[0])
                up = up_rows(start, stop)
                moved += up.numel() * up.element_size()
                if down is None:
                    target[start:stop].add_(up, alpha=factor)
                else:
                    target[start:stop].addmm_(up, down, alpha=factor)
            return moved


def _read_rows(tensor: torch.Tensor, rows: range | torch.Tensor | None, reader: FileReader | None) -> torch.Tensor:
    """Rows `rows` (a range, an index tensor, or None: all) of a LoRA tensor. A memory-mapped one is read by
    `reader` into the process's own memory, a run of consecutive rows per read, so its map's pages are never faulted
    (a file changed since it was read is `changed_file_error`, not a SIGBUS); any other is indexed as it is."""
    segment = segment_of(tensor)
    if segment is None or reader is None:
        if rows is None:
            return tensor
        return tensor[rows.start:rows.stop] if isinstance(rows, range) else tensor.index_select(0, rows)
    if rows is None:
        return read_private(tensor, reader)
    if isinstance(rows, range):
        runs = [(0, rows.start, len(rows))]
    else:  # split the index into runs of consecutive rows: head_dim long for DiffSynth's QKV, halves for the swap
        rows = rows.tolist()
        runs, begin = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                runs.append((begin, rows[begin], i - begin))
                begin = i
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    out = torch.empty((sum(n for _, _, n in runs), *tensor.shape[1:]), dtype=tensor.dtype)
    for at, first, count in runs:
        if count:
            reader.read_into(segment, out[at: at + count], start=first * row_bytes)
    return out


def fold_rows(target: torch.Tensor) -> int:
    """Rows per fold step: all of them for a float32 weight (no temporary), else FOLD_ELEMENTS worth."""
    if target.dtype == torch.float32:
        return max(1, target.shape[0])
    return max(1, FOLD_ELEMENTS // max(1, target[0].numel()))


@dataclass
class LoraFile:
    """A read and checked LoRA: what it changes (`updates`: model parameter name -> updates) and what it says."""

    path: Path
    format: str
    metadata: dict
    updates: dict[str, list[Update]]
    nbytes: int
    # "steps" (sigma grid points, as the pipeline's `steps`: the metadata's sampling steps + 1), "video_shift",
    # "audio_shift", where the file's metadata recommends them.
    recommended: dict = field(default_factory=dict)
    identity: FileIdentity | None = None  # the file when it was read: what its factors' reads check
    placed: bool = False  # updates in the model's row order (read with its config): only then can it be folded
    # The explicit reads of this file's factors, open while it can be folded: its descriptor stays on the file that
    # was read and checked (a replacement by rename keeps reading it; an in-place change is an error).
    reader: FileReader | None = field(default=None, repr=False, compare=False)

    def largest_changes(self, strength: float) -> dict[str, float]:
        """Model parameter -> the most `strength` times this LoRA can change one of its entries (a bound)."""
        return {name: abs(strength) * sum(u.change_bound for u in updates) for name, updates in self.updates.items()}


def check_strengths(loras: Sequence[tuple[LoraFile, float]]) -> None:
    """Every strength is a finite number, and with all of them no weight can change by more than MAX_WEIGHT_CHANGE
    (so no fold can overflow); one `LoraError` naming the file, strength and largest usable strength otherwise."""
    totals: dict[str, float] = {}
    for lora, strength in loras:
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
            raise LoraError(f"{lora.path}: LoRA strength must be a finite number, got {strength!r}.", path=lora.path)
        for name, change in lora.largest_changes(strength).items():
            totals[name] = totals.get(name, 0.0) + change
    for name, total in totals.items():
        if total > MAX_WEIGHT_CHANGE:  # a product past float's range is inf, also refused here
            lora, strength = max(loras, key=lambda entry: entry[0].largest_changes(entry[1]).get(name, 0.0))
            own = lora.largest_changes(1.0)[name]
            others = f" (with the other LoRAs on it, {total:.3g})" if len(loras) > 1 else ""
            raise LoraError(
                f"{lora.path}: strength {strength:g} would change '{name}' by up to "
                f"{abs(strength) * own:.3g}{others}, more than the {MAX_WEIGHT_CHANGE:g} any LoRA may (trained "
                f"LoRAs change weights by well under 1, at strengths near 1). Use a strength of at most "
                f"{MAX_WEIGHT_CHANGE / own:.3g} in size.", path=lora.path, key=name)


# ---- key vocabulary -------------------------------------------------------------------------------------------------


# diffusers module name (after `transformer.`) -> our module name; blocks and refiner blocks are handled below.
_DIFFUSERS_GLOBALS = {
    "proj_in": "video_patch_proj",
    "audio_proj_in": "audio_patch_proj",
    "context_embedder": "condition_proj",
    "time_embedder.linear_1": "time_embedder.proj_in",
    "time_embedder.linear_2": "time_embedder.proj_out",
    "norm_out.linear": "final_layer.adaln_proj.linear",
    "proj_out": "final_layer.video_out",
    "audio_proj_out": "final_layer.audio_out",
}
_DIFFUSERS_BLOCK = {
    "attn.to_q": ("attn.qkv_proj", 0),
    "attn.to_k": ("attn.qkv_proj", 1),
    "attn.to_v": ("attn.qkv_proj", 2),
    "attn.to_out.0": ("attn.out_proj", None),
    "ff.net.0.proj": ("mlp.fc1", "swap"),
    "ff.net.2": ("mlp.fc2", None),
    "adaln_proj.linear": ("adaln_proj.linear", None),
}
# musubi-tuner's flattened names -> ours (H3's own names contain underscores, so match whole names).
_FLAT = [
    (r"blocks_(\d+)_attn_(qkv|out)_proj", r"blocks.\1.attn.\2_proj"),
    (r"blocks_(\d+)_mlp_fc([12])", r"blocks.\1.mlp.fc\2"),
    (r"blocks_(\d+)_adaln_proj_linear", r"blocks.\1.adaln_proj.linear"),
    (r"token_refiner_blocks_(\d+)_attn_(qkv|out)_proj", r"token_refiner.blocks.\1.attn.\2_proj"),
    (r"token_refiner_blocks_(\d+)_mlp_fc([12])", r"token_refiner.blocks.\1.mlp.fc\2"),
    (r"(video|audio)_patch_proj", r"\1_patch_proj"),
    (r"condition_proj", "condition_proj"),
    (r"time_embedder_proj_(in|out)", r"time_embedder.proj_\1"),
    (r"final_layer_adaln_proj_linear", "final_layer.adaln_proj.linear"),
    (r"final_layer_(video|audio)_out", r"final_layer.\1_out"),
]
_PAIR_SUFFIXES = {".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_down.weight": "down",
                  ".lora_up.weight": "up", ".alpha": "alpha", ".diff": "diff", ".diff_b": "diff_b"}
METADATA_STEPS = ("steps", "num_inference_steps", "recommended_steps", "h3_stream.steps")
METADATA_VIDEO_SHIFT = ("video_shift", "shift", "flow_shift", "h3_stream.video_shift")
METADATA_AUDIO_SHIFT = ("audio_shift", "h3_stream.audio_shift")


def _split(key: str) -> tuple[str, str]:
    for suffix, part in _PAIR_SUFFIXES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], part
    return key, ""


def _diffusers_module(module: str) -> tuple[str, int | str | None] | None:
    """A diffusers module name -> (our module, QKV part index / "swap" / None), or None if it is not one."""
    if module in _DIFFUSERS_GLOBALS:
        return _DIFFUSERS_GLOBALS[module], None
    match = re.fullmatch(r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)", module)
    if match and match.group(3) in _DIFFUSERS_BLOCK:
        stack = "blocks" if match.group(1) == "transformer_blocks" else "token_refiner.blocks"
        ours, part = _DIFFUSERS_BLOCK[match.group(3)]
        return f"{stack}.{match.group(2)}.{ours}", part
    return None


def _detect(keys: Sequence[str]) -> str:
    if any(k.startswith("lora_unet_") for k in keys):
        return "kohya (musubi-tuner, flattened names)"
    if any(".default." in k for k in keys):
        stripped = [k.replace(".default.", ".") for k in keys]
        if any(_diffusers_module(_split(k.removeprefix("transformer."))[0]) for k in stripped):
            return "peft (diffusers names)"
        return "DiffSynth-Studio"
    if any(k.startswith(("transformer.", "transformer_blocks.")) for k in keys):
        return "diffusers"
    if any(k.endswith((".lora_down.weight", ".lora_up.weight")) for k in keys):
        return "kohya"
    if any(k.endswith((".diff", ".diff_b")) for k in keys) and not any(".lora_" in k for k in keys):
        return "full-weight diff"
    return "original module names"


# ---- reading a file -------------------------------------------------------------------------------------------------


def _number(metadata: dict, names: Iterable[str], kind, path: Path):
    for name in names:
        if name in metadata:
            try:
                value = kind(metadata[name])
            except (TypeError, ValueError):
                raise LoraError(f"{path}: metadata '{name}' is {metadata[name]!r}, not a number.", path=path,
                                key=name) from None
            if not math.isfinite(value) or value <= 0:
                raise LoraError(f"{path}: metadata '{name}' must be a positive finite number, got "
                                f"{metadata[name]!r}.", path=path, key=name)
            return value
    return None


def _recommended(metadata: dict, path: Path) -> dict:
    out = {}
    for key, names, kind in (("steps", METADATA_STEPS, int), ("video_shift", METADATA_VIDEO_SHIFT, float),
                             ("audio_shift", METADATA_AUDIO_SHIFT, float)):
        value = _number(metadata, names, kind, path)
        if value is not None:
            # A LoRA's "steps" are sampling steps (transformer calls, as ComfyUI counts them); ours are grid points.
            out[key] = value + 1 if key == "steps" else value
    return out


@dataclass(frozen=True)
class NetworkAlpha:
    """A uniform alpha from the metadata, where it was found (for messages) and whether it scales by sqrt(rank)."""

    value: float
    source: str
    rslora: bool = False

    def scale(self, rank: int) -> float:
        # peft's rsLoRA scales by alpha / sqrt(r) (LoraLayer.update_layer), plain LoRA by alpha / r.
        return self.value / (math.sqrt(rank) if self.rslora else rank)


def _network_alpha(metadata: dict, path: Path) -> NetworkAlpha | None:
    """A uniform alpha from the metadata: `alpha`, or peft's `lora_adapter_metadata` JSON (`lora_alpha`, with
    `use_rslora`), as a model saves it or as diffusers' pipelines do (every key prefixed `transformer.`)."""
    if "alpha" in metadata:
        return NetworkAlpha(_number(metadata, ("alpha",), float, path), "metadata 'alpha'")
    adapter = metadata.get("lora_adapter_metadata")
    if not adapter:
        return None
    where = "metadata 'lora_adapter_metadata'"
    try:
        config = json.loads(adapter)
    except (json.JSONDecodeError, RecursionError):
        raise LoraError(f"{path}: {where} is not JSON (or nested too deeply); it should be the JSON object of the "
                        "adapter's peft LoraConfig. Save the LoRA again, or remove that metadata.", path=path,
                        key="lora_adapter_metadata") from None
    if not isinstance(config, dict):
        raise LoraError(f"{path}: {where} is {adapter[:80]!r}, not a JSON object (the adapter's peft LoraConfig). "
                        "Save the LoRA again, or remove that metadata.", path=path, key="lora_adapter_metadata")
    prefixed = {k.removeprefix("transformer."): v for k, v in config.items() if k.startswith("transformer.")}
    config = prefixed or config
    if config.get("alpha_pattern") or config.get("rank_pattern"):
        raise LoraError(f"{path}: per-module alpha_pattern / rank_pattern in lora_adapter_metadata are not "
                        "supported; save the LoRA with per-module '.alpha' tensors instead.", path=path)
    if config.get("use_dora"):
        raise LoraError(f"{path}: {where} sets use_dora, which marks a DoRA; DoRA is not supported: use a plain "
                        "LoRA.", path=path, key="lora_adapter_metadata")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise LoraError(f"{path}: {where} sets use_rslora to {rslora!r}; it must be true or false. Save the LoRA "
                        "again, or correct that metadata.", path=path, key="lora_adapter_metadata")
    if "lora_alpha" not in config:
        return None
    alpha = config["lora_alpha"]
    if not is_positive_real(alpha):
        raise LoraError(f"{path}: {where} sets lora_alpha to {json.dumps(alpha)[:80]}; it must be a positive finite "
                        "number (JSON, not a string). Save the LoRA again, or correct that metadata.", path=path,
                        key="lora_adapter_metadata")
    return NetworkAlpha(float(alpha), f"{where} lora_alpha", bool(rslora))


def _checked_values(file: SafetensorsFile, key: str, reader: FileReader, buffer: torch.Tensor, path: Path,
                    what: str) -> float:
    """Tensor `key` (a LoRA factor or delta) read explicitly (never through the memory map), a `buffer` (bytes) at a
    time, and checked: floating point, non-empty, finite, no entry past FACTOR_LIMIT. Returns the largest entry's
    size; one `LoraError` naming the key if not."""
    view = file.tensor(key)
    if not view.dtype.is_floating_point:
        raise LoraError(f"{path}: tensor '{key}' ({what}) has dtype {str(view.dtype).removeprefix('torch.')}; LoRA "
                        "factors are floating-point numbers (F32, F16 or BF16). The file was written wrongly: export "
                        "the LoRA again.", path=path, key=key)
    if view.numel() == 0:
        raise LoraError(f"{path}: tensor '{key}' ({what}) has shape {list(view.shape)}, no values; the file is "
                        "broken: export the LoRA again.", path=path, key=key)
    segment, size, total = segment_of(view), view.element_size(), view.numel()
    step = buffer.numel() // size
    largest = 0.0
    for first in range(0, total, step):
        count = min(step, total - first)
        if segment is None:  # an unaligned tensor, copied when the file was opened
            chunk = view.reshape(-1)[first: first + count]
        else:
            chunk = buffer[: count * size].view(view.dtype)
            reader.read_into(segment, chunk, start=first * size)
        wide = chunk if size > 1 else chunk.float()  # aminmax has no 8-bit float kernels
        low, high = (float(v) for v in torch.aminmax(wide))
        if not (math.isfinite(low) and math.isfinite(high)):  # aminmax propagates NaN
            bad = int((~torch.isfinite(wide)).nonzero()[0])
            raise LoraError(f"{path}: tensor '{key}' ({what}) holds {float(wide[bad])} at flat index {first + bad}: "
                            "its values must be finite. The file is corrupt (or was saved from a diverged training "
                            "run); use another copy.", path=path, key=key)
        largest = max(largest, -low, high)
    if largest > FACTOR_LIMIT:
        raise LoraError(f"{path}: tensor '{key}' ({what}) holds values up to {largest:.3g} in size; LoRA values "
                        f"are at most {FACTOR_LIMIT:g} (trained ones are about 1e-3..1), so the file is corrupt or "
                        "scaled wrongly: export the LoRA again.", path=path, key=key)
    return largest


def _tensor_alpha(file: SafetensorsFile, key: str, reader: FileReader, path: Path) -> float:
    """A per-module `.alpha`: one positive, finite number (any float or integer dtype)."""
    view = file.tensor(key)
    if view.dtype == torch.bool or view.dtype.is_complex or view.numel() != 1:
        raise LoraError(f"{path}: '{key}' is a {str(view.dtype).removeprefix('torch.')} tensor of shape "
                        f"{list(view.shape)}; a LoRA alpha is one number (a scalar). The file was written wrongly: "
                        "export the LoRA again.", path=path, key=key)
    value = float(read_private(view, reader).reshape(()).item())
    if not math.isfinite(value) or value <= 0:
        raise LoraError(f"{path}: '{key}' is {value}; a LoRA alpha must be a positive finite number (usually the "
                        "rank or twice it). The file is corrupt or was written wrongly: export the LoRA again.",
                        path=path, key=key)
    return value


def _check_change(path: Path, key: str, change: float, subject: str) -> None:
    """The change `subject` (naming `key`) makes at strength 1 is within MAX_WEIGHT_CHANGE."""
    if not change <= MAX_WEIGHT_CHANGE:
        raise LoraError(f"{path}: {subject}, so at strength 1 it could change a weight by up to {change:.3g}, more "
                        f"than the {MAX_WEIGHT_CHANGE:g} any LoRA may (trained LoRAs change weights by well under 1). "
                        "The file is corrupt or its alpha is wrong: export the LoRA again.", path=path, key=key)


def read_lora(source, config: H3DiTConfig | None = None, shapes: dict | None = None) -> LoraFile:
    """Read and check a LoRA file: its keys, and every factor and alpha (read explicitly, never through the memory
    map). With the model's `config` (and its parameter `shapes`, if known) every update is placed in the model's row
    order and checked against the parameter it changes: only such a file can be folded, and it keeps its reader open
    for that. Without one (to read the format and the recommended settings) the shapes are not checked."""
    path = Path(source).expanduser()
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.safetensors"))[:3]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise LoraError(f"{path}: is a folder, not a LoRA file; give the LoRA's .safetensors file inside it{hint}.",
                        path=path)
    if not path.is_file():
        raise LoraError(f"{path}: no such LoRA file.", path=path)
    refuse_pickle(path)
    if path.suffix.lower() != ".safetensors":
        raise LoraError(f"{path}: a LoRA must be a .safetensors file.", path=path)
    file = SafetensorsFile(path)
    reader = FileReader()
    try:
        lora = _read_checked(path, file, reader, config, shapes)
    except BaseException:
        reader.close()
        raise
    if lora.placed:
        lora.reader = reader
        weakref.finalize(lora, reader.close)
    else:
        reader.close()
    return lora


def _read_checked(path: Path, file: SafetensorsFile, reader: FileReader, config: H3DiTConfig | None,
                  shapes: dict | None) -> LoraFile:
    buffer = torch.empty(CHECK_CHUNK_BYTES, dtype=torch.uint8)  # one for every tensor checked: no heap left behind
    metadata = dict(file.metadata or {})
    keys = list(file.keys())
    if not keys:
        raise LoraError(f"{path}: holds no tensors; it is not a LoRA.", path=path)
    if any("dora_scale" in k for k in keys):
        key = next(k for k in keys if "dora_scale" in k)
        raise LoraError(f"{path}: '{key}' marks a DoRA, which is not supported; use a plain LoRA.", path=path, key=key)
    kind = _detect(keys)
    network_alpha = _network_alpha(metadata, path)
    groups: dict[str, dict[str, str]] = {}
    for key in keys:
        name = key.replace(".default.", ".")
        for prefix in ("diffusion_model.", "model.diffusion_model.", "transformer."):
            name = name.removeprefix(prefix)
        module, part = _split(name)
        if not part:
            raise LoraError(f"{path}: key '{key}' is neither a LoRA pair (lora_A / lora_B, lora_down / lora_up), an "
                            "alpha nor a diff; the file is not an H3 LoRA.", path=path, key=key)
        if module.startswith("lora_unet_"):
            flat = module.removeprefix("lora_unet_")
            for pattern, replacement in _FLAT:
                if re.fullmatch(pattern, flat):
                    module = re.sub(pattern, replacement, flat)
                    break
            else:
                raise LoraError(f"{path}: key '{key}' names no H3 transformer module in musubi-tuner's flattened "
                                "layout.", path=path, key=key)
        group = groups.setdefault(module, {})
        if part in group:  # two spellings of one tensor (with and without a prefix, flattened and not)
            raise LoraError(f"{path}: keys '{group[part]}' and '{key}' are the same tensor of '{module}', so which one "
                            "applies is ambiguous; keep one of them.", path=path, key=key)
        group[part] = key
    updates: dict[str, list[Update]] = {}
    interleaved = kind == "DiffSynth-Studio"
    for module, parts in groups.items():
        target, part = module, None
        mapped = _diffusers_module(module)
        if mapped is not None:
            target, part = mapped
        if "down" in parts or "up" in parts:
            for needed in ("down", "up"):
                if needed not in parts:
                    have = next(iter(parts.values()))
                    half = "lora_A / lora_down" if needed == "down" else "lora_B / lora_up"
                    raise LoraError(f"{path}: '{have}' has no matching {half} tensor; the pair is incomplete.",
                                    path=path, key=have)
            down, up = file.tensor(parts["down"]), file.tensor(parts["up"])
            if down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
                raise LoraError(f"{path}: '{parts['up']}' {list(up.shape)} and '{parts['down']}' {list(down.shape)} are "
                                "not a rank-r pair ([out, r] and [r, in]).", path=path, key=parts["up"])
            rank = down.shape[0]
            if rank == 0:
                raise LoraError(f"{path}: '{parts['up']}' {list(up.shape)} and '{parts['down']}' {list(down.shape)} "
                                "have rank 0: the pair changes nothing and no alpha can scale it. The file is broken: "
                                "export the LoRA again.", path=path, key=parts["up"])
            product_bound = (rank * _checked_values(file, parts["up"], reader, buffer, path, "lora_B / lora_up")
                             * _checked_values(file, parts["down"], reader, buffer, path, "lora_A / lora_down"))
            if not product_bound <= FACTOR_LIMIT:
                raise LoraError(f"{path}: '{parts['up']}' @ '{parts['down']}' can reach {product_bound:.3g}, more "
                                f"than the {FACTOR_LIMIT:g} a fold holds (a trained LoRA's product is well under "
                                "1); the file is corrupt or scaled wrongly: export the LoRA again.", path=path,
                                key=parts["up"])
            pair = f"the pair '{parts['up']}' / '{parts['down']}'"
            if "alpha" in parts:
                alpha = _tensor_alpha(file, parts["alpha"], reader, path)
                scale = alpha / rank
                _check_change(path, parts["alpha"], scale * product_bound,
                              f"'{parts['alpha']}' = {alpha:g} with rank {rank} scales {pair} by {scale:g}")
            elif network_alpha is not None:
                scale = network_alpha.scale(rank)
                _check_change(path, parts["up"], scale * product_bound, f"{pair} is scaled by {scale:g} "
                              f"({network_alpha.source} = {network_alpha.value:g}, rank {rank})")
            else:
                scale = 1.0
                _check_change(path, parts["up"], product_bound, f"{pair} (no alpha: scale 1)")
            update = Update(up, down, scale, change_bound=scale * product_bound)
            updates.setdefault(target + ".weight", []).append(
                _placed(update, part, interleaved and target.endswith("attn.qkv_proj"), config))
        for diff, suffix in (("diff", ".weight"), ("diff_b", ".bias")):
            if diff in parts:
                change = _checked_values(file, parts[diff], reader, buffer, path, "a full-weight delta")
                _check_change(path, parts[diff], change, f"'{parts[diff]}' holds values up to {change:.3g} in size")
                updates.setdefault(target + suffix, []).append(
                    _placed(Update(file.tensor(parts[diff]), None, change_bound=change), part, False, config))
        if set(parts) == {"alpha"}:
            raise LoraError(f"{path}: '{parts['alpha']}' belongs to no LoRA pair.", path=path, key=parts["alpha"])
    lora = LoraFile(path, kind, metadata, updates, sum(file.nbytes(k) for k in keys), _recommended(metadata, path),
                    file.identity, placed=config is not None)
    if config is not None:
        check_against(lora, config, shapes)
    return lora


def _placed(update: Update, part, interleaved: bool, config: H3DiTConfig | None) -> Update:
    """Rows and row order of an update from the mapping of its module (QKV slice, fc1 half swap, interleave)."""
    rows = update.up.shape[0]
    if isinstance(part, int):
        return dataclasses.replace(update, rows=(part * rows, (part + 1) * rows))
    if part == "swap":  # diffusers [up; gate] -> our [gate; up]
        half = rows // 2
        return dataclasses.replace(update, row_order=torch.cat((torch.arange(half, rows), torch.arange(half))))
    if interleaved and config is not None:  # without the model's head count the file is only inspected
        heads, head_dim = config.num_attention_heads, config.attention_head_dim
        order = torch.arange(3 * heads * head_dim).reshape(heads, 3, head_dim).transpose(0, 1).reshape(-1)
        return dataclasses.replace(update, row_order=order)
    return update


def _parameter_shapes(config: H3DiTConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in meta_model(H3DiT, config).named_parameters()}


def check_against(lora: LoraFile, config: H3DiTConfig, shapes: dict | None = None) -> None:
    """Every update names a parameter of the model and fits its shape; one `LoraError` naming the key otherwise."""
    shapes = shapes or _parameter_shapes(config)
    for name, updates in lora.updates.items():
        if name not in shapes:
            raise LoraError(f"{lora.path}: changes '{name}', which the {config.num_layers}-block H3 transformer does "
                            "not have: the LoRA belongs to another model (or another partition size).", path=lora.path,
                            key=name)
        shape = shapes[name]
        for update in updates:
            start, stop = update.rows or (0, shape[0])
            rows = update.up.shape[0]
            expect_in = shape[1] if len(shape) > 1 else None
            if rows != stop - start or stop > shape[0] or (
                    update.down is not None and update.down.shape[1] != expect_in) or (
                    update.down is None and tuple(update.up.shape[1:]) != tuple(shape[1:])):
                got = [list(update.up.shape)] + ([list(update.down.shape)] if update.down is not None else [])
                want = (f"up [{stop - start}, r] and down [r, {expect_in}]" if update.down is not None
                        else f"{[stop - start, *shape[1:]]}")
                raise LoraError(f"{lora.path}: the update of '{name}' has shapes {got}; the model needs {want} "
                                f"(parameter {list(shape)}). The LoRA was trained for another model size.",
                                path=lora.path, key=name)


# ---- folding --------------------------------------------------------------------------------------------------------


@dataclass
class LoraFold:
    """The LoRAs applied to one model, with their strengths: folds them into materialised tensors by name."""

    loras: list[tuple[LoraFile, float]]
    folds: int = 0  # updates added so far
    factor_bytes_moved: int = 0  # LoRA factor bytes read onto the device by those folds

    def __post_init__(self):
        unplaced = [str(lora.path) for lora, _ in self.loras if not lora.placed]
        if unplaced:
            raise LoraError(f"{unplaced[0]}: read without the model's config, so its rows are not placed; read it "
                            "with read_lora(path, model.config).")
        check_strengths(self.loras)

    def targets(self) -> set[str]:
        return {name for lora, strength in self.loras if strength != 0 for name in lora.updates}

    def fold(self, name: str, tensor: torch.Tensor, cache: "CachedFold | None" = None) -> torch.Tensor:
        """`tensor` (a fresh device copy, never the host store) with every update of `name` added, in place; the
        factors from `cache` where it holds them, else read from their files."""
        for k, (lora, strength) in enumerate(self.loras):
            if strength == 0:
                continue
            for j, update in enumerate(lora.updates.get(name, ())):
                view = tensor if update.rows is None else tensor[update.rows[0]: update.rows[1]]
                factors = None if cache is None else cache.factors_of(k, name, j, view)
                self.factor_bytes_moved += update.add_to(view, strength, lora.reader, factors)
                self.folds += 1
        return tensor

    def cached(self, dtypes: Mapping[str, torch.dtype], *, platform, pin_budget, pinner) -> "CachedFold":
        """This fold with the factors of the parameters in `dtypes` (name -> the weight's dtype) read once into
        page-locked host memory (see `CachedFold`): what an asynchronous-copy backend folds its streamed units with."""
        return CachedFold(self, dtypes, platform=platform, pin_budget=pin_budget, pinner=pinner)

    def cached_bytes(self, dtypes: Mapping[str, torch.dtype]) -> int:
        """Host bytes `cached(dtypes)` holds: the factors of those parameters in their weights' dtypes."""
        return plan_slab([row[:4] for row in _cache_layout(self, dtypes)])[1]

    def peak_temporary_bytes(self, dtype: torch.dtype) -> int:
        """The largest temporary one fold step makes into weights of `dtype`: the factors of one update on the device
        (the up rows of a step and the down matrix, in `dtype`) and, where the file's dtype differs, the explicit
        read they are cast from (the down matrix, then a step's up rows); the fold itself is in place. (A
        `CachedFold`'s folds read nothing: only the factors, so this bounds them too.)"""
        size = torch.empty((), dtype=dtype).element_size()
        peak = 0
        for lora, strength in self.loras:
            if strength == 0:
                continue
            for updates in lora.updates.values():
                for u in updates:
                    rows, rank = u.up.shape[0], u.up[0].numel()
                    cols = u.down.shape[1] if u.down is not None else rank
                    step = min(rows if dtype == torch.float32 else max(1, FOLD_ELEMENTS // cols), rows)
                    down = u.down.numel() if u.down is not None else 0
                    # The explicit read is the factor itself in the weight's dtype (on the CPU: no cast, no copy).
                    down_read = 0 if u.down is None or u.down.dtype == dtype else u.down.element_size()
                    up_read = 0 if u.up.dtype == dtype else u.up.element_size()
                    peak = max(peak, size * down + max(down_read * down, (size + up_read) * step * rank))
        return peak

    def __call__(self, tensors: dict[str, torch.Tensor]) -> None:
        targets = self.targets()
        for name, tensor in tensors.items():
            if name in targets:
                self.fold(name, tensor)


def block_factor_bytes(fold: LoraFold, dtype: torch.dtype) -> int:
    """Host bytes of the factors a layerwise transformer's block manager holds on an asynchronous-copy device
    (`CachedFold`): those of the blocks' weights in `dtype`, but the AdaLN projections' (streamed apart, one pass per
    request: folded from the file)."""
    return fold.cached_bytes({name: dtype for name in fold.targets()
                              if name.startswith("blocks.") and ".adaln_proj." not in name})


def _cache_layout(fold: LoraFold, dtypes: Mapping[str, torch.dtype]) -> list[tuple]:
    """(key, dtype, shape, stride, lora, factor, row order) of every factor the folds of `dtypes`' parameters use,
    key (lora index, parameter, update index, "down" / "up")."""
    out = []
    for k, (lora, strength) in enumerate(fold.loras):
        if strength == 0:
            continue
        for name, updates in lora.updates.items():
            dtype = dtypes.get(name)
            if dtype is None:
                continue
            for j, u in enumerate(updates):
                for part, factor, order in (("down", u.down, None), ("up", u.up, u.row_order)):
                    if factor is not None:
                        shape = tuple(factor.shape)
                        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
                        out.append(((k, name, j, part), dtype, shape, stride, lora, factor, order))
    return out


@dataclass(frozen=True)
class CachedFactors:
    """One update's factors in host memory (`up` in the model's row order), and how they reach the device."""

    down: torch.Tensor | None
    up: torch.Tensor
    to_device: Callable[[torch.Tensor], torch.Tensor]


class CachedFold:
    """A `LoraFold` as an asynchronous-copy backend runs it on its streamed units (`AsyncBackend.bind_transform`).

    The factors of the parameters in `dtypes` are read once (per LoRA set and strengths), by each file's checked
    reader (a file changed since it was read is the checkpoints' error, here), in the model's row order and cast to
    the weight's dtype, into one host slab, page-locked in place and counted in `pin_budget` (the backend's), or left
    pageable with a `PinWarning` when the budget or the page-locker refuses. A fold copies them to the device with
    non-blocking copies on the current (compute) stream, which orders them before its `addmm_`: no file read, no
    host wait. The slab is never written once filled, and is unpinned only after a device synchronisation
    (`close`: a LoRA set change, the manager's close). Numbers are the plain fold's: the same factors, cast the same
    way, added in the same `fold_rows` steps. Parameters it holds no factors for are folded as `LoraFold` does."""

    def __init__(self, fold: LoraFold, dtypes: Mapping[str, torch.dtype], *, platform, pin_budget: PinBudget,
                 pinner: HostPinner | None):
        self.fold, self.platform, self.pin_budget, self._pinner = fold, platform, pin_budget, pinner
        self.pinned = False
        layout = _cache_layout(fold, dtypes)
        entries, self.host_bytes = plan_slab([row[:4] for row in layout])
        self.data = page_aligned_bytes(self.host_bytes)
        self._factors: dict[tuple, torch.Tensor] = {}
        for entry, (key, _, _, _, lora, factor, order) in zip(entries, layout):
            view = view_in(self.data, entry)
            view.copy_(_read_rows(factor, order, lora.reader))  # the row order applied once, cast as a fold casts
            self._factors[key] = view
        if self.host_bytes and pinner is not None:
            left = pin_budget.limit_bytes - pin_budget.used_bytes
            if pin_budget.try_reserve(self.host_bytes):
                self.pinned = bool(pinner.register(self.data))
                if not self.pinned:
                    pin_budget.give_back(self.host_bytes)
            if not self.pinned:
                warnings.warn(f"{self.host_bytes:,} bytes of LoRA factors stay in pageable host memory (the pin "
                              f"budget had {left:,} bytes left, or page-locking was refused): each streamed "
                              "block's fold copies them synchronously, so the host waits for the device there.",
                              PinWarning, stacklevel=3)

    @property
    def pinned_bytes(self) -> int:
        return self.host_bytes if self.pinned else 0

    def factors_of(self, lora_index: int, name: str, index: int, target: torch.Tensor) -> CachedFactors | None:
        """Update `index` of `name` from LoRA `lora_index`, for a weight like `target`; None when not held."""
        up = self._factors.get((lora_index, name, index, "up"))
        if up is None or up.dtype != target.dtype:
            return None
        return CachedFactors(self._factors.get((lora_index, name, index, "down")), up, self._to_device)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self.platform.device_copy(host, non_blocking=True)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> None:
        targets = self.fold.targets()
        for name, tensor in tensors.items():
            if name in targets:
                self.fold.fold(name, tensor, self)

    def close(self) -> None:
        """Unpin the slab (after a device synchronisation: a queued copy may still read it) and drop it; later
        folds read their files."""
        if self.pinned:
            self.platform.synchronize()
            self.pinned = False
            if self._pinner.unregister(self.data) is not False:
                self.pin_budget.give_back(self.host_bytes)
        self._factors = {}
        self.data = None

    def __del__(self):
        # Dropped without close(): leave no registration behind (a finaliser may not raise; see PinnedSlab).
        try:
            self.close()
        except Exception as exc:
            try:
                warnings.warn(f"LoRA factors dropped without close() could not be unpinned: {exc!r}.", PinWarning)
            except Exception:  # pragma: no cover - interpreter teardown
                pass


def _unchanged(lora: LoraFile) -> bool:
    try:
        return lora.identity == FileIdentity.of(lora.path)
    except OSError:
        return False


def has_loras(model: H3DiT, loras: Sequence[tuple[str | Path, float]]) -> bool:
    """The model's LoRA set is `loras` already, from files unchanged on disk since they were read (the identity
    their reads check, so a file those reads would refuse is read again instead)."""
    try:
        wanted = tuple((Path(path).expanduser(), float(strength)) for path, strength in loras)
    except (TypeError, ValueError):
        return False  # not (file, strength) pairs: set_loras says what is wrong
    fold = model.lora_fold  # None: no LoRA was ever set, so `model.loras` is ()
    return model.loras == wanted and (fold is None or all(_unchanged(lora) for lora, _ in fold.loras))


def set_loras(model: H3DiT, loras: Sequence[tuple[str | Path, float]] = ()) -> H3DiT:
    """Make `loras` ((file, strength), ...) the LoRAs of a loaded transformer, replacing any applied before, without
    reloading it. Streamed blocks get them when next materialised; resident weights are re-made from the checkpoint
    and folded now. `[]` (or strength 0) gives the base model's weights back exactly."""
    applied = []
    shapes = {name: tuple(r.shape) for name, r in model.weight_recipes.items()}
    for entry in loras:
        try:
            source, strength = entry
            strength = float(strength)
        except (TypeError, ValueError):
            raise LoraError(f"LoRAs are (file, strength) pairs, got {entry!r}.") from None
        applied.append((read_lora(source, model.config, shapes), strength))
    fold = LoraFold(applied)  # checks the strengths
    previous = getattr(model, "lora_fold", None)
    touched = fold.targets() | (previous.targets() if previous is not None else set())
    streamed = model.streamed_parameter_names()
    device = model.final_layer.norm.weight.device  # the output norm is never streamed
    with closing(FileReader()) as reader:  # explicit reads: a checkpoint changed since the load is a clear error
        for name, parameter in model.named_parameters():
            if name not in touched or name in streamed:
                continue
            recipe = model.weight_recipes[name]
            if name in fold.targets():
                parameter.data = fold.fold(name, recipe.materialise(device, reader))
            else:
                parameter.data = recipe.private_value(reader).to(device)  # exactly what the loader placed
    model.set_weight_transform(fold if fold.targets() else None)
    model.lora_fold = fold
    model.loras = tuple((lora.path, strength) for lora, strength in applied)
    return model
