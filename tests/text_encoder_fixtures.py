"""Tiny random Qwen3-VL text encoders in the real H3 file layouts, a tiny H3 tokenizer, and the reference recipe.

The reference model is `transformers.Qwen3VLForConditionalGeneration` with a tiny config and random weights. The
official layout is written by its own `save_pretrained`; the partition and ComfyUI layouts by the renames the spec
describes (`h3-components.md` §2.4, §6), implemented here independently of `h3_core`.

The tokenizer is a byte-level BPE trained on a few sentences, with Qwen's pre-tokenisation and Qwen's special tokens
plus H3's 7 extra tokens at their real ids (151643-151668 and 151669-151675).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3_core.sources.tiny_default import QWEN_FIRST_SPECIAL_ID, QWEN_SPECIAL_TOKENS, write_tiny_tokenizer

IMAGE_PAD_ID = 151655

TINY_TEXT_CONFIG = dict(
    vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True},
)
TINY_VISION_CONFIG = dict(
    depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=16, temporal_patch_size=2,
    spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 2],
    hidden_act="gelu_pytorch_tanh",
)
# Widths of whole 256-value rows (GGUF K-quant super-blocks) for every language matrix: the quantiser tests.
KQUANT_TEXT_CONFIG = dict(TINY_TEXT_CONFIG, hidden_size=256, intermediate_size=512, head_dim=64,
                          rope_parameters=dict(TINY_TEXT_CONFIG["rope_parameters"], mrope_section=[16, 8, 8]))
KQUANT_VISION_CONFIG = dict(TINY_VISION_CONFIG, out_hidden_size=256)
PROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


# ---- tokenizer -------------------------------------------------------------------------------------------------------


# ---- reference model -------------------------------------------------------------------------------------------------


def reference_config(num_layers: int = 6, vision: bool = True, kquant: bool = False):
    """`kquant`: the widths of `KQUANT_TEXT_CONFIG` / `KQUANT_VISION_CONFIG`."""
    from transformers import Qwen3VLConfig

    text, visual = (KQUANT_TEXT_CONFIG, KQUANT_VISION_CONFIG) if kquant else (TINY_TEXT_CONFIG, TINY_VISION_CONFIG)
    return Qwen3VLConfig(text_config={**text, "num_hidden_layers": num_layers},
                         vision_config=dict(visual) if vision else None)


def reference_model(num_layers: int = 6, seed: int = 0, kquant: bool = False):
    """A `Qwen3VLForConditionalGeneration` with every parameter drawn at random (fp32)."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(reference_config(num_layers, kquant=kquant)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1 and "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif param.ndim == 1:
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name or "pos_embed" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param[0].numel() ** 0.5)
    return model


def reference_states(model, token_ids, layer: int, pixel_values=None, image_grid_thw=None) -> torch.Tensor:
    """`hidden_states[layer]` as the reference pipeline reads it (diffusers `get_qwen3vl_prompt_embeds`)."""
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
    kwargs = {}
    if pixel_values is not None:
        kwargs = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    with torch.no_grad():
        out = model.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          mm_token_type_ids=(input_ids == IMAGE_PAD_ID).long(), use_cache=False,
                          output_hidden_states=True, **kwargs)
    return out.hidden_states[layer][0]


def reference_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = {k: v for k, v in PROCESSOR_CONFIG.items() if k not in ("processor_class", "image_processor_type")}
    return Qwen2VLImageProcessorPil(**config)


def relative_l2(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.double(), theirs.double()
    return float((ours - theirs).norm() / theirs.norm())


# ---- layouts ---------------------------------------------------------------------------------------------------------


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def write_official(reference, root: Path) -> Path:
    """The official repo: `text_encoder/` (save_pretrained, sharded), `tokenizer/`, `processor/`."""
    reference.save_pretrained(root / "text_encoder", max_shard_size="20MB")
    write_tiny_tokenizer(root / "tokenizer" / "tokenizer.json")
    write_tiny_tokenizer(root / "processor" / "tokenizer.json")
    (root / "processor" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG))
    (root / "model_index.json").write_text(json.dumps({"_class_name": "MiniMaxH3ModularPipeline"}))
    return root


def write_partition(reference, root: Path) -> Path:
    """An original-format partition (`FL2VA/`): model_index with the `_minimax_h3` block, text_encoder/ with two
    hand-written shards and an index."""
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps({"_minimax_h3": {"schema_version": 1, "partition": "fl2va"}}))
    folder = root / "text_encoder"
    folder.mkdir()
    state = _state(reference)
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for shard, shard_keys in halves.items():
        save_file({k: state[k] for k in shard_keys}, str(folder / shard))
        weight_map.update({k: shard for k in shard_keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(reference.config.to_dict()))
    write_tiny_tokenizer(root / "tokenizer" / "tokenizer.json")
    (root / "processor").mkdir()
    (root / "processor" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIG))
    return root


def comfy_state(reference, keep_layers: int) -> dict[str, torch.Tensor]:
    """The ComfyUI repack: `model.layers.N` / `model.embed_tokens` / `visual.*`, truncated, no lm_head."""
    out = {}
    for key, value in _state(reference).items():
        if key.startswith("model.language_model."):
            rest = key[len("model.language_model."):]
            if rest.startswith("layers.") and int(rest.split(".")[1]) >= keep_layers:
                continue
            out["model." + rest] = value
        elif key.startswith("model.visual."):
            out["visual." + key[len("model.visual."):]] = value
    return out


def write_comfy(reference, path: Path, keep_layers: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(comfy_state(reference, keep_layers), str(path))
    return path
