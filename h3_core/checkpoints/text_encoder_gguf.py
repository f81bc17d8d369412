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

`published_tensors` / `text_metadata` / `mmproj_metadata` / `add_metadata` write such files (the quantiser);
`reader_specs` and `config_from_metadata` read them (`text_encoder_loader`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

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
