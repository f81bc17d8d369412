"""The published GGUF layout of a Qwen3-VL text encoder (llama.cpp's), in one place, for reading and for writing.

A Qwen3-VL model is published as two GGUF files (llama.cpp's `convert_hf_to_gguf.py`, classes `Qwen3VLTextModel`
and `Qwen3VLVisionModel`; the names are gguf 0.19.0's `MODEL_TENSORS` / `TENSOR_NAMES` tables):

* the **language file**: `general.architecture` = `qwen3vl` (`MODEL_ARCH.QWEN3VL`). Tensors `token_embd`,
  `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up,
  ffn_down}` (`.weight`), `output_norm`, `output` (Hugging Face `model.layers.N.input_layernorm` -> `attn_norm`,
  `post_attention_layernorm` -> `ffn_norm`, `q_norm` / `k_norm` -> `attn_q_norm` / `attn_k_norm`; gguf's
  `get_tensor_name_map(MODEL_ARCH.QWEN3VL, n)`). The rows of `attn_q` / `attn_k` are stored as Hugging Face has
  them: only llama.cpp's `LlamaModel` permutes them for its rope, `Qwen2Model` / `Qwen3Model` (which
  `Qwen3VLTextModel` extends) pass them through. Metadata (`TextModel.set_gguf_parameters` + `Qwen3VLTextModel`):
  `qwen3vl.block_count`, `.context_length`, `.embedding_length` (the plain `hidden_size`),
  `.feed_forward_length`, `.attention.head_count`, `.attention.head_count_kv`, `.attention.key_length` /
  `.value_length` (`head_dim`; llama.cpp's default when absent is embedding_length / head_count),
  `.rope.freq_base`, `.attention.layer_norm_rms_epsilon`, `.rope.dimension_sections` (the mRoPE t/h/w sections
  padded with 0 to four) and `.n_deepstack_layers` (how many deep-stack mergers; their vision layers are in the
  mmproj). The vocabulary size is `token_embd`'s row count.
* the **vision file** ("mmproj", written as `mmproj-<name>.gguf`): `general.architecture` = `clip`,
  `clip.projector_type` = `qwen3vl_merger` (`VISION_PROJECTOR_TYPE.QWEN3VL`), `clip.has_vision_encoder`, and
  `clip.vision.{block_count, embedding_length, feed_forward_length, attention.head_count,
  attention.layer_norm_epsilon (written from the text config's rms_norm_eps), patch_size, image_size (sqrt(
  num_position_embeddings) * patch_size), projection_dim (the language hidden size), spatial_merge_size, image_mean,
  image_std, is_deepstack_layers (one bool per vision layer)}`, `clip.use_gelu`. Tensors (`MmprojModel` + gguf's
  `MODEL_ARCH.MMPROJ` map): the Conv3d patch embedding split along its temporal kernel into two Conv2d weights
  `v.patch_embd.weight` (t = 0) and `v.patch_embd.weight.1` (t = 1), its bias `v.patch_embd.bias` (the converter
  refuses a temporal patch other than 2 and keeps the patch embedding F32 / F16, never quantised);
  `v.position_embd.weight`; per block `v.blk.N.{ln1, attn_qkv (fused q, k, v rows as Hugging Face has them),
  attn_out, ln2, ffn_up (linear_fc1), ffn_down (linear_fc2)}.{weight,bias}`; the final merger's norm `v.post_ln`,
  its `linear_fc1` / `linear_fc2` as `mm.0` / `mm.2`; the deep-stack mergers `v.deepstack.{bid}.{norm, fc1, fc2}`
  where **bid is the vision layer the merger taps** (`deepstack_visual_indexes[i]`, "absolute clip layer index"),
  not the merger's list index.

Some converter forks can fuse `attn_qkv` / `ffn_gate_up` in the language file; gguf 0.19's `qwen3vl` table has
no such tensors, and such a file is refused naming the fused tensor.

`published_tensors` / `text_metadata` / `mmproj_metadata` / `add_metadata` write such files (the quantiser);
`resolve_gguf_text_encoder` reads them (`reader_specs`, `language_config_from_metadata`,
`vision_config_from_metadata`; called by `text_encoder_loader` for a `.gguf`). The mmproj is found beside the
language file (`find_mmproj`: the `.gguf` files of its folder whose header says `clip` / `qwen3vl_merger`, and whose
projection width is the language model's; of several, the one whose name without its `mmproj-` start shares the
longest start with the language file's name, then the first by name); `load_text_encoder(vision=...)` names one or
(False) reads text only. Listings tell the files apart from their headers (`gguf_kind`, cached by size and mtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy
import torch

from ..errors import CheckpointError, H3Error
from ..models.meta_models import meta_model
from ..models.text_encoder import LanguageModelConfig, TextEncoder, TextEncoderConfig
from ..models.vision_tower import ImageProcessorConfig, VisionTowerConfig

TEXT_ARCH = "qwen3vl"
MMPROJ_ARCH = "clip"
PROJECTOR_TYPE = "qwen3vl_merger"
TEXT_FILE = "text"
MMPROJ_FILE = "mmproj"
# What a published language file holds that H3 never reads (the final norm and the LM head).
UNUSED_TEXT_TENSORS = ("output_norm.weight", "output.weight", "rope_freqs.weight")
# Qwen3-VL's max_position_embeddings (the released configs): the language file's context_length.
CONTEXT_LENGTH = 262144

_LANGUAGE_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LANGUAGE_BIAS = {"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                  "self_attn.v_proj.bias": "attn_v.bias"}
_VISION_BLOCK = {"norm1": "ln1", "attn.qkv": "attn_qkv", "attn.proj": "attn_out", "norm2": "ln2",
                 "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


@dataclass(frozen=True)
class PublishedTensor:
    """One tensor of the published files: `make(*[ours[s] for s in sources])` is the logical tensor stored under
    `name` in `file` ("text" or "mmproj"), of torch-order `shape` (GGUF writes the dimensions reversed)."""

    file: str
    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    make: Callable[..., torch.Tensor]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _temporal_slice(index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def make(weight: torch.Tensor) -> torch.Tensor:
        return weight[:, :, index].contiguous()
    return make


def stack_temporal(*slices: torch.Tensor) -> torch.Tensor:
    """The Conv3d patch embedding (out, in, t, p, p) from its published per-t Conv2d weights."""
    return torch.stack(slices, dim=2)


def _stack_into(target: torch.Tensor, *slices: torch.Tensor) -> None:
    for index, piece in enumerate(slices):
        target[:, :, index].copy_(piece)


stack_temporal.into = _stack_into  # a pure rearrangement: a store may write it in place


def patch_embedding_names(temporal: int) -> tuple[str, ...]:
    """`v.patch_embd.weight`, `v.patch_embd.weight.1`, ...: one Conv2d weight per temporal kernel index."""
    return tuple("v.patch_embd.weight" + (f".{t}" if t else "") for t in range(temporal))


def gguf_name(name: str, config: TextEncoderConfig) -> tuple[str, str] | None:
    """(file, published name) of our parameter `name` (`language_model.…` / `vision_tower.…`), except the patch
    embedding weight, which is split (`published_tensors`); None for a name the layout has no place for."""
    head, _, rest = name.partition(".")
    if head == "language_model":
        if rest == "embed_tokens.weight":
            return TEXT_FILE, "token_embd.weight"
        parts = rest.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3:
            table = {**_LANGUAGE_LAYER, **_LANGUAGE_BIAS}
            if parts[2] in table:
                return TEXT_FILE, f"blk.{parts[1]}.{table[parts[2]]}"
        return None
    if head != "vision_tower" or config.vision is None:
        return None
    if rest == "patch_embed.proj.bias":
        return MMPROJ_FILE, "v.patch_embd.bias"
    if rest == "pos_embed.weight":
        return MMPROJ_FILE, "v.position_embd.weight"
    module, _, kind = rest.rpartition(".")
    if module.startswith("blocks."):
        _, index, inner = module.split(".", 2)
        if inner in _VISION_BLOCK:
            return MMPROJ_FILE, f"v.blk.{index}.{_VISION_BLOCK[inner]}.{kind}"
    elif module.startswith("merger."):
        inner = module.split(".", 1)[1]
        if inner in _MERGER:
            return MMPROJ_FILE, f"{_MERGER[inner]}.{kind}"
    elif module.startswith("deepstack_merger_list."):
        _, index, inner = module.split(".", 2)
        taps = config.vision.deepstack_visual_indexes
        if inner in _DEEPSTACK and int(index) < len(taps):
            return MMPROJ_FILE, f"v.deepstack.{taps[int(index)]}.{_DEEPSTACK[inner]}.{kind}"
    return None


def _our_parameters(config: TextEncoderConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in meta_model(TextEncoder, config, layer).named_parameters()]


PATCH_WEIGHT = "vision_tower.patch_embed.proj.weight"


def published_tensors(config: TextEncoderConfig, layer: int) -> list[PublishedTensor]:
    """Every tensor of the published files made from our TextEncoder's parameters (up to decoder layer `layer`; the
    vision tower when `config.vision`), in our parameters' order."""
    out = []
    for name, shape in _our_parameters(config, layer):
        if name == PATCH_WEIGHT:
            out += [PublishedTensor(MMPROJ_FILE, stored, (name,), shape[:2] + shape[3:], _temporal_slice(t))
                    for t, stored in enumerate(patch_embedding_names(shape[2]))]
            continue
        where = gguf_name(name, config)
        if where is None:
            raise ValueError(f"{name}: no place for it in the published Qwen3-VL GGUF layout")
        out.append(PublishedTensor(where[0], where[1], (name,), shape, _same))
    return out


def reader_specs(config: TextEncoderConfig, layer: int) -> list[tuple[str, tuple[str, ...],
                                                                       tuple[tuple[int, ...], ...], Callable | None]]:
    """For each of our parameters: (our name, the published names it is read from, their torch shapes, how they
    combine (None: the one tensor as stored))."""
    specs = []
    for name, shape in _our_parameters(config, layer):
        if name == PATCH_WEIGHT:
            names = patch_embedding_names(shape[2])
            specs.append((name, names, (shape[:2] + shape[3:],) * len(names), stack_temporal))
            continue
        specs.append((name, (gguf_name(name, config)[1],), (shape,), None))
    return specs


# ---- metadata --------------------------------------------------------------------------------------------------------


def _types():
    from .quantised import gguf_package

    return gguf_package("the GGUF writer").GGUFValueType


def text_metadata(config: TextEncoderConfig, layer: int) -> list[tuple[str, object, "gguf.GGUFValueType"]]:  # noqa: F821
    """The `qwen3vl.*` metadata of a language file holding decoder layers 0 .. `layer` - 1 (what
    `published_tensors(config, layer)` writes), as llama.cpp's converter writes it."""
    t = _types()
    c = config.language
    deepstack = len(config.vision.deepstack_visual_indexes) if config.vision is not None else 0
    a = TEXT_ARCH
    return [
        (f"{a}.block_count", min(layer, c.num_hidden_layers), t.UINT32),
        (f"{a}.context_length", CONTEXT_LENGTH, t.UINT32),
        (f"{a}.embedding_length", c.hidden_size, t.UINT32),
        (f"{a}.feed_forward_length", c.intermediate_size, t.UINT32),
        (f"{a}.attention.head_count", c.num_attention_heads, t.UINT32),
        (f"{a}.attention.head_count_kv", c.num_key_value_heads, t.UINT32),
        (f"{a}.attention.key_length", c.head_dim, t.UINT32),
        (f"{a}.attention.value_length", c.head_dim, t.UINT32),
        (f"{a}.rope.freq_base", float(c.rope_theta), t.FLOAT32),
        (f"{a}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps), t.FLOAT32),
        (f"{a}.rope.dimension_sections", [*c.mrope_section, 0], t.ARRAY),
        (f"{a}.n_deepstack_layers", deepstack, t.UINT32),
    ]


def mmproj_metadata(config: TextEncoderConfig, processor: ImageProcessorConfig
                    ) -> list[tuple[str, object, "gguf.GGUFValueType"]]:  # noqa: F821
    """The `clip.*` metadata of the vision file of `config.vision`, as llama.cpp's converter writes it."""
    t = _types()
    v = config.vision
    if v is None:
        raise ValueError("the config has no vision tower: there is no mmproj file to write")
    return [
        ("general.type", "mmproj", t.STRING),  # MmprojModel.set_type (GGUFType.MMPROJ)
        ("clip.projector_type", PROJECTOR_TYPE, t.STRING),
        ("clip.has_vision_encoder", True, t.BOOL),
        ("clip.use_gelu", True, t.BOOL),
        ("clip.vision.projection_dim", config.language.hidden_size, t.UINT32),
        ("clip.vision.image_size", v.position_grid_side * v.patch_size, t.UINT32),
        ("clip.vision.patch_size", v.patch_size, t.UINT32),
        ("clip.vision.embedding_length", v.hidden_size, t.UINT32),
        ("clip.vision.feed_forward_length", v.intermediate_size, t.UINT32),
        ("clip.vision.block_count", v.depth, t.UINT32),
        ("clip.vision.attention.head_count", v.num_heads, t.UINT32),
        ("clip.vision.attention.layer_norm_epsilon", float(config.language.rms_norm_eps), t.FLOAT32),
        ("clip.vision.spatial_merge_size", v.spatial_merge_size, t.UINT32),
        ("clip.vision.image_mean", [float(x) for x in processor.image_mean], t.ARRAY),
        ("clip.vision.image_std", [float(x) for x in processor.image_std], t.ARRAY),
        ("clip.vision.is_deepstack_layers", [i in v.deepstack_visual_indexes for i in range(v.depth)], t.ARRAY),
    ]


def add_metadata(writer, entries: Sequence[tuple[str, object, object]]) -> None:
    """Write `entries` (from `text_metadata` / `mmproj_metadata`) with a `gguf.GGUFWriter` (array element types
    are the writer's, inferred from the values as its `add_array` does)."""
    for key, value, value_type in entries:
        writer.add_key_value(key, value, value_type)


# ---- telling the files apart cheaply (listings) ----------------------------------------------------------------------

_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
_HEADER_CACHE: dict[tuple, tuple[str | None, str | None]] = {}


def _scan_header(path: Path) -> tuple[str | None, str | None]:
    """`general.architecture` and `clip.projector_type` from the start of a GGUF header, without GGUFReader (which
    decodes every field, the 151k-entry token list included): the key-value pairs are walked until both are
    found (the architecture comes first in files written by gguf's writer). (None, None) for a file that is not
    GGUF or is cut short."""
    import struct

    arch = projector = None
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None, None
            version = struct.unpack("<I", f.read(4))[0]
            order = "<" if version < 65536 else ">"
            count = struct.unpack(order + "QQ", f.read(16))[1] if version >= 2 else 0

            def number(fmt: str, size: int):
                data = f.read(size)
                if len(data) != size:
                    raise EOFError
                return struct.unpack(order + fmt, data)[0]

            def string() -> bytes:
                length = number("Q", 8)
                if length > 1 << 20:
                    raise EOFError
                return f.read(length)

            def skip(kind: int) -> None:
                if kind == _STRING:
                    f.seek(number("Q", 8), 1)
                elif kind == _ARRAY:
                    item, length = number("I", 4), number("Q", 8)
                    if item in _VALUE_SIZES:
                        f.seek(_VALUE_SIZES[item] * length, 1)
                    else:
                        for _ in range(length):
                            skip(item)
                elif kind in _VALUE_SIZES:
                    f.seek(_VALUE_SIZES[kind], 1)
                else:
                    raise EOFError

            for _ in range(min(count, 1 << 16)):
                key = string()
                kind = number("I", 4)
                if key in (b"general.architecture", b"clip.projector_type") and kind == _STRING:
                    value = string().decode("utf-8", "replace")
                    if key == b"general.architecture":
                        arch = value
                    else:
                        projector = value
                    if arch is not None and (arch != MMPROJ_ARCH or projector is not None):
                        break
                else:
                    skip(kind)
    except (OSError, EOFError, struct.error):
        pass
    return arch, projector


def gguf_kind(path) -> str:
    """What a `.gguf` file is, from its header (cached by path, size and mtime): "text" (a `qwen3vl` language
    file), "mmproj" (a `clip` file with the `qwen3vl_merger` projector), else "other"."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return "other"
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HEADER_CACHE:
        _HEADER_CACHE[key] = _scan_header(path)
    arch, projector = _HEADER_CACHE[key]
    if arch == TEXT_ARCH:
        return "text"
    if arch == MMPROJ_ARCH and projector == PROJECTOR_TYPE:
        return "mmproj"
    return "other"


def is_gguf_text_encoder(path) -> bool:
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file() and gguf_kind(path) == "text"


# ---- reading ---------------------------------------------------------------------------------------------------------

LAYOUT = "gguf"
MMPROJ_HINT = ("put the Qwen3-VL vision projector (the publisher's mmproj-*.gguf, architecture 'clip', projector "
               "'qwen3vl_merger') in the same folder")


def _gguf_file(path: Path):
    from .gguf_io import GGUFFile

    return GGUFFile(path)


def _float32_decimal(value) -> float:
    """A float32 from the file as its shortest decimal (1e-06, not 9.99999997e-07): what the config said."""
    return float(str(numpy.float32(value)))


def _read(file, key: str, kind: type, default=None, *, required: bool = True):
    """Metadata `key` of `file` as `kind` (int / float / list), or `default`; a missing required key or a value of
    the wrong type is one error naming the file and the key."""
    value = file.metadata.get(key)
    if value is None:
        if default is not None or not required:
            return default
        raise CheckpointError(f"{file.path}: no '{key}' in its GGUF metadata, needed to build the Qwen3-VL text "
                              "encoder; the file is not a complete llama.cpp Qwen3-VL conversion.", path=file.path,
                              key=key)
    ok = (isinstance(value, list) if kind is list else
          isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or value == int(value)))
    if not ok or (kind is not list and value <= 0):
        raise CheckpointError(f"{file.path}: GGUF metadata '{key}' is {value!r}, not a positive "
                              f"{'list' if kind is list else kind.__name__}; the file is corrupt.", path=file.path,
                              key=key)
    if kind is float:
        return _float32_decimal(value)  # float32 in the file: its shortest decimal (1e-06)
    return value if kind is list else int(value)


def _count_blocks(file, pattern: str) -> int:
    n = 0
    while pattern.format(n) in file:
        n += 1
    return n


def _refuse_other_architecture(file) -> None:
    arch = file.metadata.get("general.architecture")
    if arch == TEXT_ARCH:
        return
    if arch == MMPROJ_ARCH:
        projector = file.metadata.get("clip.projector_type")
        if projector == PROJECTOR_TYPE:
            raise CheckpointError(
                f"{file.path}: this is the Qwen3-VL vision projector (mmproj: architecture 'clip', projector "
                f"'{PROJECTOR_TYPE}'), not the language model. Choose the language file (architecture "
                f"'{TEXT_ARCH}') as the text encoder and keep this file beside it: it is found there for keyframes "
                "and references.", path=file.path, key="general.architecture")
        raise CheckpointError(f"{file.path}: a vision projector of projector type {projector!r}, not a Qwen3-VL text "
                              f"encoder (a GGUF of architecture '{TEXT_ARCH}').", path=file.path,
                              key="clip.projector_type")
    from .checkpoint import not_a_checkpoint

    raise not_a_checkpoint(file.path, file.keys(), "text_encoder",
                           f"a Qwen3-VL text encoder: its GGUF architecture is {arch!r}, H3's text encoder is "
                           f"'{TEXT_ARCH}' (llama.cpp's Qwen3-VL conversion)")


def language_config_from_metadata(file) -> tuple[LanguageModelConfig, int]:
    """The language model's config from a `qwen3vl` file's metadata and shapes, and how many decoder layers it
    holds."""
    a = TEXT_ARCH
    if "token_embd.weight" not in file:
        raise CheckpointError(f"{file.path}: missing tensor 'token_embd.weight' (the token embedding); the file is "
                              "not a complete Qwen3-VL language model.", path=file.path, key="token_embd.weight")
    vocab, width = file.shape("token_embd.weight")
    hidden = _read(file, f"{a}.embedding_length", int)
    heads = _read(file, f"{a}.attention.head_count", int)
    sections = _read(file, f"{a}.rope.dimension_sections", list)
    if len(sections) < 3 or any(type(s) is not int or s < 0 for s in sections) or any(sections[3:]):
        raise CheckpointError(f"{file.path}: GGUF metadata '{a}.rope.dimension_sections' is {sections!r}; Qwen3-VL's "
                              "interleaved mRoPE has three sections (t, h, w) and a fourth of 0.", path=file.path,
                              key=f"{a}.rope.dimension_sections")
    if hidden != width:
        raise CheckpointError(f"{file.path}: '{a}.embedding_length' is {hidden} but 'token_embd.weight' is "
                              f"{[vocab, width]}; the metadata does not match the tensors.", path=file.path,
                              key=f"{a}.embedding_length")
    stored = _count_blocks(file, "blk.{}.attn_norm.weight")
    try:
        config = LanguageModelConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=_read(file, f"{a}.feed_forward_length", int),
            num_hidden_layers=max(stored, 1),
            num_attention_heads=heads,
            num_key_value_heads=_read(file, f"{a}.attention.head_count_kv", int, heads),
            head_dim=_read(file, f"{a}.attention.key_length", int, hidden // heads),
            rms_norm_eps=_read(file, f"{a}.attention.layer_norm_rms_epsilon", float),
            rope_theta=_read(file, f"{a}.rope.freq_base", float),
            mrope_section=tuple(sections[:3]),
            attention_bias="blk.0.attn_q.bias" in file,
        )
    except H3Error as exc:
        raise CheckpointError(f"{file.path}: its '{a}.*' metadata does not describe a Qwen3-VL language model "
                              f"({exc}).", path=file.path) from None
    return config, stored


def vision_config_from_metadata(file, language: LanguageModelConfig) -> tuple[VisionTowerConfig, dict]:
    """The vision tower's config from a `clip` / `qwen3vl_merger` file's metadata and shapes, and its image
    preprocessing values (`ImageProcessorConfig` fields)."""
    v = "clip.vision."
    depth = _read(file, v + "block_count", int)
    taps = _read(file, v + "is_deepstack_layers", list)
    if len(taps) != depth or not all(isinstance(t, bool) for t in taps):
        raise CheckpointError(f"{file.path}: GGUF metadata '{v}is_deepstack_layers' must be one true/false per vision "
                              f"layer ({depth}), got {str(taps)[:80]}.", path=file.path, key=v + "is_deepstack_layers")
    for key in ("v.patch_embd.weight", "v.position_embd.weight"):
        if key not in file:
            raise CheckpointError(f"{file.path}: missing tensor '{key}'; the mmproj file is not a complete Qwen3-VL "
                                  "vision projector.", path=file.path, key=key)
    temporal = 1  # the temporal kernel: one Conv2d weight per index, 'v.patch_embd.weight', '….weight.1', ...
    while f"v.patch_embd.weight.{temporal}" in file:
        temporal += 1
    out, channels, patch, _ = file.shape("v.patch_embd.weight")
    projection = _read(file, v + "projection_dim", int)
    if projection != language.hidden_size:
        raise CheckpointError(f"{file.path}: the vision projector gives features of width {projection} "
                              f"('{v}projection_dim') but the language model's width is {language.hidden_size}; "
                              "the mmproj belongs to another Qwen3-VL size. Use the mmproj published with this "
                              "language file.", path=file.path, key=v + "projection_dim")
    try:
        config = VisionTowerConfig(
            depth=depth, hidden_size=_read(file, v + "embedding_length", int),
            intermediate_size=_read(file, v + "feed_forward_length", int),
            num_heads=_read(file, v + "attention.head_count", int), in_channels=channels,
            patch_size=_read(file, v + "patch_size", int), temporal_patch_size=temporal,
            spatial_merge_size=_read(file, v + "spatial_merge_size", int), out_hidden_size=projection,
            num_position_embeddings=file.shape("v.position_embd.weight")[0],
            deepstack_visual_indexes=tuple(i for i, tap in enumerate(taps) if tap),
        )
    except H3Error as exc:
        raise CheckpointError(f"{file.path}: its 'clip.vision.*' metadata does not describe a Qwen3-VL vision tower "
                              f"({exc}).", path=file.path) from None
    processor = dict(patch_size=config.patch_size, merge_size=config.spatial_merge_size,
                     temporal_patch_size=config.temporal_patch_size)
    for name in ("image_mean", "image_std"):
        values = file.metadata.get(v + name)
        if values is not None:
            processor[name] = tuple(_float32_decimal(x) for x in values)
    return config, processor


def _shared_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def find_mmproj(text_path: Path, hidden_size: int | None = None) -> Path | None:
    """The Qwen3-VL vision projector beside a language file: the `.gguf` files of its folder whose header says
    architecture `clip` and projector `qwen3vl_merger` (and, when `hidden_size` is given, whose
    `clip.vision.projection_dim` is it). Of several, the one whose name, without its `mmproj-` / `mmproj_` /
    `mmproj.` start, shares the longest start with the language file's name (case-insensitive), then the first by
    name: deterministic, and right for publishers' naming (`Qwen3-VL-32B-Q4_K_M.gguf` +
    `mmproj-Qwen3-VL-32B-F16.gguf`)."""
    folder = Path(text_path).parent
    try:
        names = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".gguf" and p.name != Path(text_path).name)
    except OSError:
        return None
    candidates = [p for p in names if p.is_file() and gguf_kind(p) == "mmproj"]
    if hidden_size is not None and len(candidates) > 1:
        fitting = []
        for p in candidates:
            try:
                if _gguf_file(p).metadata.get("clip.vision.projection_dim") == hidden_size:
                    fitting.append(p)
            except CheckpointError:
                continue
        candidates = fitting or candidates
    if not candidates:
        return None
    text = Path(text_path).name.lower()

    def score(p: Path):
        name = p.name.lower()
        for start in ("mmproj-", "mmproj_", "mmproj."):
            if name.startswith(start):
                name = name[len(start):]
        return (-_shared_prefix(name, text), p.name)

    return min(candidates, key=score)


def missing_vision_message(text_path: Path) -> str:
    return (f"{text_path} is a GGUF text encoder without its vision projector, so it serves text-only prompts; "
            f"keyframes and references need the Qwen3-VL vision tower: {MMPROJ_HINT} as {Path(text_path).name}.")


def vision_missing(source) -> str | None:
    """For a GGUF language file without an mmproj beside it: the error keyframes or references give (cheap: the
    headers of its folder, cached); None for any other source."""
    path = Path(source)
    if not is_gguf_text_encoder(path) or find_mmproj(path) is not None:
        return None
    return missing_vision_message(path)


def resolve_gguf_text_encoder(path: Path, layer: int, config=None, vision=None):
    """The `Checkpoint` of a published Qwen3-VL GGUF text encoder: the `qwen3vl` language file at `path` and its
    mmproj (`vision`: None finds it beside the file (`find_mmproj`), a path names it, False reads text only).
    `config` (a `TextEncoderConfig`) replaces what the metadata says."""
    from .checkpoint import Checkpoint, QUANTISED_NEEDS_FORMAT, WeightSpec

    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 1:
        raise H3Error(f"layer={layer!r}: must be a positive integer (H3 reads hidden_states[50]).")
    text = _gguf_file(path)
    _refuse_other_architecture(text)
    for fused in ("blk.0.attn_qkv.weight", "blk.0.ffn_gate_up.weight"):
        if fused in text:
            raise CheckpointError(
                f"{path}: '{fused}' is a fused tensor, which the published Qwen3-VL layout (gguf's qwen3vl tensors: "
                "attn_q / attn_k / attn_v, ffn_gate / ffn_up) does not have; it comes from a converter option H3 does "
                "not read. Use a file converted by llama.cpp's convert_hf_to_gguf.py without fusing.", path=path,
                key=fused)
    language, stored = language_config_from_metadata(text)
    if layer > stored:
        block_count = text.metadata.get(f"{TEXT_ARCH}.block_count")
        raise CheckpointError(
            f"{path}: holds {stored} decoder layers ('blk.0.*' to 'blk.{stored - 1}.*'"
            f"{f', {TEXT_ARCH}.block_count {block_count}' if block_count is not None else ''}) but layer={layer} "
            f"needs {layer}. The file is truncated too far or incomplete; H3 needs layers 0-49 (layer=50).",
            path=path, key=f"blk.{stored}.attn_norm.weight")
    mmproj_path = None
    if vision is None:
        mmproj_path = find_mmproj(path, language.hidden_size)
    elif vision is not False:
        mmproj_path = Path(vision).expanduser()
        if not mmproj_path.is_file():
            raise CheckpointError(f"{mmproj_path}: vision= names no such file.", path=mmproj_path)
    mmproj, processor = None, {}
    encoder_config = TextEncoderConfig(language, None)
    if mmproj_path is not None:
        mmproj = _gguf_file(mmproj_path)
        if (mmproj.metadata.get("general.architecture"), mmproj.metadata.get("clip.projector_type")) != (
                MMPROJ_ARCH, PROJECTOR_TYPE):
            raise CheckpointError(
                f"{mmproj_path}: not a Qwen3-VL vision projector (architecture "
                f"{mmproj.metadata.get('general.architecture')!r}, projector "
                f"{mmproj.metadata.get('clip.projector_type')!r}; expected '{MMPROJ_ARCH}' / '{PROJECTOR_TYPE}').",
                path=mmproj_path, key="general.architecture")
        vision_config, processor = vision_config_from_metadata(mmproj, language)
        deepstack = text.metadata.get(f"{TEXT_ARCH}.n_deepstack_layers")
        if deepstack is not None and deepstack != len(vision_config.deepstack_visual_indexes):
            raise CheckpointError(
                f"{path}: '{TEXT_ARCH}.n_deepstack_layers' is {deepstack} but its vision projector {mmproj_path} has "
                f"{len(vision_config.deepstack_visual_indexes)} deep-stack layers; the two files are not of one "
                "model. Use the mmproj published with this language file.", path=path,
                key=f"{TEXT_ARCH}.n_deepstack_layers")
        encoder_config = TextEncoderConfig(language, vision_config)
    if config is not None:
        if not isinstance(config, TextEncoderConfig):
            raise H3Error("config= for a GGUF text encoder must be a TextEncoderConfig (the file's metadata gives "
                          "the rest); leave it out to read the metadata.")
        encoder_config = config if mmproj is not None else config.without_vision()
    files = {key: text for key in text.keys()}
    if mmproj is not None:
        files.update({key: mmproj for key in mmproj.keys()})
    specs = [WeightSpec(name, keys, shapes, combine) for name, keys, shapes, combine
             in reader_specs(encoder_config, layer)]
    for spec in specs:  # a missing tensor names the file it belongs in
        for key in spec.keys:
            if key not in files:
                owner = mmproj_path if key.startswith(("v.", "mm.")) else path
                raise CheckpointError(
                    f"{owner}: missing tensor '{key}' for a Qwen3-VL text encoder read up to layer {layer} (the "
                    "published llama.cpp GGUF names); the file is incomplete or of another model. Download it "
                    "again.", path=owner, key=key)

    def never_read(key: str) -> bool:
        if key in UNUSED_TEXT_TENSORS:
            return True
        head, _, rest = key.partition(".")
        return head == "blk" and rest.partition(".")[0].isdigit() and int(rest.partition(".")[0]) >= layer

    ckpt = Checkpoint("text_encoder", Path(path), LAYOUT, encoder_config, files, specs,
                      allowed_extra={k for k in text.keys() if never_read(k)})
    ckpt.defaults["mmproj"] = mmproj_path
    if processor:
        ckpt.defaults["processor"] = ImageProcessorConfig(**processor)
    return ckpt.check(f"a published (llama.cpp) Qwen3-VL GGUF text encoder read up to layer {layer}",
                      accept_quantised=True,
                      dtype_rule=f"the text encoder must be bf16, fp16 or fp32; {QUANTISED_NEEDS_FORMAT}")
