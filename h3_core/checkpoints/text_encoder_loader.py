"""H3 Loader's Qwen3-VL text encoder from any of its checkpoint layouts.

* **official** folder (`MiniMaxAI/MiniMax-H3` `text_encoder/`, or the repo root): Hugging Face
  `Qwen3VLForConditionalGeneration` — `config.json`, `model*.safetensors` (+ `model.safetensors.index.json`), keys
  `model.language_model.*`, `model.visual.*`, `lm_head.weight` (older exports: `language_model.model.*`, `visual.*`).
* **partition** folder (original `FL2VA/` / `Ref2VA/` release, or its `text_encoder/`): the same Hugging Face files.
* **comfy** single `.safetensors` (ComfyUI repack, truncated to 50 layers): `model.layers.N.*`,
  `model.embed_tokens.weight`, `visual.*`, optionally nested under `text_encoders.qwen3vl_32b.transformer.`; no
  config, so the sizes are read from the shapes and the rest is Qwen3-VL-32B's unless `config=` says otherwise.
* **gguf**: a published llama.cpp conversion, any file name: the language `.gguf` (architecture `qwen3vl`) and, for
  keyframes and references, its vision projector (`mmproj-*.gguf`, architecture `clip`) found beside it; the config
  comes from their metadata (`text_encoder_gguf`, which documents the layout).

Only the embeddings, decoder layers below `layer` and the vision tower are ever read: the upper layers, the final
norm and `lm_head` are recognised and left untouched in the memory map. Every required key, shape and dtype is checked
before anything is placed; each problem raises one `CheckpointError` naming the file and key.
"""

from __future__ import annotations

import os
import re
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import torch

from ..errors import CheckpointError, H3Error
from ..models.meta_models import meta_model
from ..models.text_encoder import DecoderLayer, LanguageModelConfig, TextEncoder, TextEncoderConfig
from ..models.tokenizer import H3_EXTRA_FIRST_ID, H3_EXTRA_TOKENS, TOKENIZER_FILE, H3Tokenizer
from ..models.vision_tower import ImageProcessorConfig, VisionTowerConfig
from ..runtime.chunking import check_chunk_size
from ..runtime.file_reads import FileReader
from ..runtime.host_store import HostTensor
from ..runtime.platform import Platform
from ..runtime.residency import Residency
from .checkpoint import (QUANTISED_NEEDS_FORMAT, Checkpoint, HeaderSizes, WeightSpec, check_config_sizes,
                         compute_dtype, count_indexed, not_a_checkpoint, open_folder_files, read_json, resolve_source,
                         shape_reader)
from .placement import attach_layerwise, residency_manager, set_tensor
from .gguf_io import GGUF_SUFFIX
from .quantised import detect_quantised
from .text_encoder_gguf import missing_vision_message, resolve_gguf_text_encoder
from .safetensors_io import SafetensorsFile

HF_CLASS_NAME = "Qwen3VLForConditionalGeneration"
# Longest first: "model." alone is the ComfyUI repack's language-model prefix.
LANGUAGE_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")
# A ComfyUI combined checkpoint nests the encoder under one of these.
OUTER_PREFIXES = ("", "text_encoders.qwen3vl_32b.transformer.", "qwen3vl_32b.transformer.")
# Tensors of quantisation formats that are not ComfyUI's (bitsandbytes, GPTQ): refused by name.
FOREIGN_QUANTISATION_SUFFIXES = (".qweight", ".qzeros", ".absmax", ".quant_map", ".quant_state")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# Deep-stack taps of the released Qwen3-VL sizes, keyed by (vision depth, number of deep-stack mergers).
KNOWN_DEEPSTACK = {(27, 3): (8, 16, 24), (24, 3): (5, 11, 17)}
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")


# ---- resolving a source ----------------------------------------------------------------------------------------------


def _plan(config: TextEncoderConfig, layer: int, language_prefix: str, vision_prefix: str | None) -> list[WeightSpec]:
    """One stored tensor per parameter, under the checkpoint's prefixes."""
    model = meta_model(TextEncoder, config, layer)
    prefixes = {"language_model.": language_prefix, "vision_tower.": vision_prefix}
    specs = []
    for name, param in model.named_parameters():
        ours, _, rest = name.partition(".")
        specs.append(WeightSpec(name, (prefixes[ours + "."] + rest,), (tuple(param.shape),)))
    return specs


def _layer_parameter_names(config: LanguageModelConfig) -> set[str]:
    return {name for name, _ in meta_model(DecoderLayer, config).named_parameters()}


def never_read_by_h3(key: str, layer: int) -> bool:
    """A stored key H3 never reads when it stops after decoder layer `layer`, in any layout's prefixes: the upper
    decoder layers, the final norm and the LM head. The hub download skips shards that hold only these."""
    for outer in sorted(OUTER_PREFIXES, key=len, reverse=True):
        if not key.startswith(outer):
            continue
        rest = key[len(outer):]
        if rest == "lm_head.weight":
            return True
        prefix = next((p for p in LANGUAGE_PREFIXES if rest.startswith(p)), None)
        if prefix is None:
            return False
        tail = rest[len(prefix):]
        match = _LAYER_KEY.fullmatch(tail)
        return tail == "norm.weight" or (bool(match) and int(match.group(1)) >= layer)
    return False


def _find_prefixes(keys: set[str]) -> tuple[str | None, str | None]:
    for outer in OUTER_PREFIXES:
        for prefix in LANGUAGE_PREFIXES:
            if f"{outer}{prefix}embed_tokens.weight" in keys:
                vision = next((outer + v for v in VISION_PREFIXES
                               if any(k.startswith(outer + v) for k in keys)), None)
                return outer + prefix, vision
    return None, None


def _config_from_shapes(path: Path, files, language_prefix: str, vision_prefix: str | None,
                        num_layers: int) -> TextEncoderConfig:
    """Sizes from the shapes; what shapes cannot tell (norm eps, RoPE, vision heads) is Qwen3-VL-32B's."""
    lp = language_prefix
    shape, need = shape_reader(path, files, "Qwen3-VL text encoder")
    vocab, hidden = need(lp + "embed_tokens.weight")
    head_dim = need(lp + "layers.0.self_attn.q_norm.weight")[0]
    language = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers, head_dim=head_dim,
        intermediate_size=need(lp + "layers.0.mlp.gate_proj.weight")[0],
        num_attention_heads=need(lp + "layers.0.self_attn.q_proj.weight")[0] // head_dim,
        num_key_value_heads=need(lp + "layers.0.self_attn.k_proj.weight")[0] // head_dim,
        attention_bias=f"{lp}layers.0.self_attn.q_proj.bias" in files,
    )
    vision = None
    if vision_prefix is not None:
        vp = vision_prefix
        depth = count_indexed(shape, vp + "blocks.{}.norm1.weight")
        taps = count_indexed(shape, vp + "deepstack_merger_list.{}.norm.weight")
        if (depth, taps) not in KNOWN_DEEPSTACK:
            raise CheckpointError(
                f"{path}: a vision tower of {depth} blocks with {taps} deep-stack mergers is not a released "
                "Qwen3-VL size, so which blocks feed the deep-stack mergers is unknown. Pass config= with the "
                "model's config.json.",
                path=path,
            )
        width, channels, temporal, patch, _ = need(vp + "patch_embed.proj.weight")
        vision = VisionTowerConfig(
            depth=depth, hidden_size=width, in_channels=channels, temporal_patch_size=temporal, patch_size=patch,
            intermediate_size=need(vp + "blocks.0.mlp.linear_fc1.weight")[0],
            out_hidden_size=need(vp + "merger.linear_fc2.weight")[0],
            num_position_embeddings=need(vp + "pos_embed.weight")[0],
            deepstack_visual_indexes=KNOWN_DEEPSTACK[(depth, taps)],
        )
    try:
        return TextEncoderConfig(LanguageModelConfig(**language), vision)
    except H3Error as exc:
        raise CheckpointError(f"{path}: the tensor shapes do not fit Qwen3-VL-32B's fixed settings ({exc}). For "
                              "another Qwen3-VL size pass config= with the model's config.json.", path=path) from None


def _config_from_option(config, path: Path) -> TextEncoderConfig:
    source = path
    if isinstance(config, TextEncoderConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        source = Path(config).expanduser()
        if source.is_dir():
            source = source / "config.json"
        if not source.is_file():
            raise CheckpointError(f"{source}: config= names no such file.", path=source)
        config = read_json(source)
    if not isinstance(config, Mapping):
        raise H3Error(f"config= must be a config.json path, a dict or a TextEncoderConfig, got "
                      f"{type(config).__name__}.")
    try:
        return TextEncoderConfig.from_hf_dict(config)
    except H3Error as exc:
        raise CheckpointError(f"{source}: {exc}", path=source) from None


def resolve_text_encoder_checkpoint(source: str | os.PathLike, layer: int = 50, config=None,
                                    vision=None) -> Checkpoint:
    """Find the layout of `source`, read its config and open (but do not read) the tensors read up to `layer`.
    `vision` is for a GGUF language file only: its mmproj file (None: found beside it; False: text only)."""
    gguf_path = Path(source).expanduser()
    if gguf_path.suffix.lower() == GGUF_SUFFIX and gguf_path.is_file():
        if config is not None and not isinstance(config, TextEncoderConfig):
            config = _config_from_option(config, gguf_path)
        return resolve_gguf_text_encoder(gguf_path, layer, config, vision)
    if vision is not None:
        raise H3Error(f"vision={vision!r}: only a GGUF text encoder takes its vision projector (mmproj) as a "
                      "separate file; the other layouts hold the vision tower with the language model.")
    path, layout, files, raw_config = resolve_source(
        source, "Give the text_encoder/ folder of an H3 download (or its root), a ComfyUI text_encoders "
        ".safetensors file or a Qwen3-VL .gguf (architecture 'qwen3vl').", _open_single_file,
        lambda folder: _open_folder(folder, layer))
    keys = set(files)
    language_prefix, vision_prefix = _find_prefixes(keys)
    if language_prefix is None:
        raise not_a_checkpoint(path, keys, "text_encoder",
                               "a Qwen3-VL text encoder checkpoint: no '...embed_tokens.weight' key")
    foreign = sorted(k for k in keys if k.endswith(FOREIGN_QUANTISATION_SUFFIXES))
    if foreign:
        raise CheckpointError(
            f"{files[foreign[0]].path}: '{foreign[0]}' marks a bitsandbytes / GPTQ quantised text encoder, which "
            "h3-stream cannot read; use the bf16 weights (qwen3vl_32b_minimax_h3_bf16.safetensors) or a ComfyUI "
            "quantised repack (int8 ConvRot, fp8, NVFP4).", path=files[foreign[0]].path, key=foreign[0])
    # ComfyUI quantised layers (int8 ConvRot, fp8, NVFP4, ...): sizes are read from their dequantised shapes, and
    # an unsupported format is refused here, naming the tensor.
    quantised, _ = detect_quantised(path, files)
    stored = count_indexed(shape_reader(path, files, "Qwen3-VL text encoder", quantised=quantised)[0],
                           language_prefix + "layers.{}.input_layernorm.weight")
    config_path = None  # where the config came from, when not from the shapes
    if config is not None:
        encoder_config = _config_from_option(config, path)
        config_path = _option_config_path(config)
    elif raw_config is not None:
        config_path = path / "config.json"
        try:
            encoder_config = TextEncoderConfig.from_hf_dict(raw_config)
        except H3Error as exc:
            raise CheckpointError(f"{config_path}: {exc}", path=config_path) from None
    else:
        encoder_config = _config_from_shapes(path, files, language_prefix, vision_prefix, stored)
    if config_path is not None:
        _check_config_against_header(encoder_config, config_path, HeaderSizes(path, files, "Qwen3-VL text encoder",
                                                                              quantised=quantised),
                                     language_prefix, vision_prefix)
    if vision_prefix is None:
        encoder_config = encoder_config.without_vision()
    elif encoder_config.vision is None:
        raise CheckpointError(f"{path}: the weights hold a vision tower ('{vision_prefix}...') but the config has no "
                              "vision_config; pass the model's full config.json.", path=path)
    if layout == "comfy":
        # The repack is truncated: the file, not the original config, says how many layers exist.
        encoder_config = replace(encoder_config, language=replace(encoder_config.language, num_hidden_layers=stored))
    return _check(path, layout, encoder_config, files, layer, language_prefix, vision_prefix, stored)


def _option_config_path(config) -> str | Path:
    if isinstance(config, (str, os.PathLike)):
        source = Path(config).expanduser()
        return source / "config.json" if source.is_dir() else source
    return "config="


def _check_config_against_header(config: TextEncoderConfig, config_path, sizes: HeaderSizes, lp: str,
                                 vp: str | None) -> None:
    """The sizes the config implies against the tensor shapes, before any module is built (a vision depth of 10^6
    would take hours to build)."""
    c = config.language
    checks = [
        ("text_config.vocab_size", c.vocab_size, sizes.dim(lp + "embed_tokens.weight", 0)),
        ("text_config.hidden_size", c.hidden_size, sizes.dim(lp + "embed_tokens.weight", 1)),
        ("text_config.intermediate_size", c.intermediate_size, sizes.dim(lp + "layers.0.mlp.gate_proj.weight", 0)),
        ("text_config.head_dim", c.head_dim, sizes.dim(lp + "layers.0.self_attn.q_norm.weight", 0)),
        ((("text_config.num_attention_heads", c.num_attention_heads), ("text_config.head_dim", c.head_dim)),
         c.num_attention_heads * c.head_dim, sizes.dim(lp + "layers.0.self_attn.q_proj.weight", 0)),
        ((("text_config.num_key_value_heads", c.num_key_value_heads), ("text_config.head_dim", c.head_dim)),
         c.num_key_value_heads * c.head_dim, sizes.dim(lp + "layers.0.self_attn.k_proj.weight", 0)),
    ]
    v = config.vision
    if v is not None and vp is not None:
        checks += [
            ("vision_config.depth", v.depth, sizes.count(vp + "blocks.", "vision blocks")),
            ("vision_config.hidden_size", v.hidden_size, sizes.dim(vp + "patch_embed.proj.weight", 0)),
            ("vision_config.in_channels", v.in_channels, sizes.dim(vp + "patch_embed.proj.weight", 1)),
            ("vision_config.temporal_patch_size", v.temporal_patch_size, sizes.dim(vp + "patch_embed.proj.weight", 2)),
            ("vision_config.patch_size", v.patch_size, sizes.dim(vp + "patch_embed.proj.weight", 3)),
            ("vision_config.intermediate_size", v.intermediate_size,
             sizes.dim(vp + "blocks.0.mlp.linear_fc1.weight", 0)),
            ("vision_config.out_hidden_size", v.out_hidden_size, sizes.dim(vp + "merger.linear_fc2.weight", 0)),
            # the merger concatenates merge x merge patches
            ((("vision_config.hidden_size", v.hidden_size), ("vision_config.spatial_merge_size (squared)",
                                                               v.spatial_merge_size)),
             v.hidden_size * v.spatial_merge_size ** 2, sizes.dim(vp + "merger.linear_fc1.weight", 1)),
            ("vision_config.num_position_embeddings", v.num_position_embeddings,
             sizes.dim(vp + "pos_embed.weight", 0)),
            ("vision_config.deepstack_visual_indexes (their number)", len(v.deepstack_visual_indexes),
             sizes.count(vp + "deepstack_merger_list.", "deep-stack mergers")),
        ]
    check_config_sizes(config_path, checks)


def _open_single_file(path: Path):
    file = SafetensorsFile(path)
    return path, "comfy", {k: file for k in file.keys()}, None


def _open_folder(folder: Path, layer: int = 50):
    """The text-encoder folder (`folder` or its `text_encoder/`), its layout, tensors and raw config.json. Shards
    holding only what is never read up to `layer` may be absent (a hub download skips them)."""
    layout = "official"
    if not (folder / "config.json").is_file() and (folder / "text_encoder" / "config.json").is_file():
        folder = folder / "text_encoder"  # the root of the official repo or of a partition
    if (folder.parent / "model_index.json").is_file() and (folder.parent / "transformer").is_dir():
        index = read_json(folder.parent / "model_index.json")
        layout = "partition" if "_minimax_h3" in index else "official"
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{folder}: not a text-encoder folder: no config.json. Expected the text_encoder/ folder of an H3 "
            "download (config.json + model*.safetensors) or a ComfyUI text_encoders .safetensors file.",
            path=folder,
        )
    raw_config = read_json(config_path)
    architectures = raw_config.get("architectures") or []
    if HF_CLASS_NAME not in architectures and raw_config.get("model_type") != "qwen3_vl":
        raise CheckpointError(
            f"{config_path}: describes {architectures or raw_config.get('model_type')!r}, not a Qwen3-VL model "
            f"('{HF_CLASS_NAME}'). Point at the text_encoder/ folder of an H3 download.",
            path=config_path,
            key="architectures",
        )
    may_be_absent = (lambda key: never_read_by_h3(key, layer)) if isinstance(layer, int) else None
    return folder, layout, open_folder_files(folder, "model", may_be_absent), raw_config


def _check(source: Path, layout: str, config: TextEncoderConfig, files: dict[str, SafetensorsFile], layer: int,
           language_prefix: str, vision_prefix: str | None, num_layers_stored: int) -> Checkpoint:
    """Strict checks of everything that will be read, and no unknown keys; one error naming the file and key."""
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 1:
        raise H3Error(f"layer={layer!r}: must be a positive integer (H3 reads hidden_states[50]).")
    if layer > num_layers_stored:
        raise CheckpointError(
            f"{source}: holds {num_layers_stored} decoder layers ('{language_prefix}layers.N...') but "
            f"layer={layer} needs {layer}. The checkpoint is truncated too far or incomplete; H3 needs layers "
            "0-49 (layer=50).",
            path=source,
        )
    if layer > config.language.num_hidden_layers:
        raise CheckpointError(f"{source}: its config has {config.language.num_hidden_layers} decoder layers, "
                              f"fewer than layer={layer}.", path=source)
    layer_names = _layer_parameter_names(config.language)
    lp = language_prefix
    outer = next(o for o in reversed(OUTER_PREFIXES) if lp.startswith(o))

    def never_read(key: str) -> bool:
        """Parts of Qwen3-VL that H3 does not use: upper layers, final norm, LM head, cached RoPE tables."""
        if key in (outer + "lm_head.weight", lp + "norm.weight") or key.endswith("rotary_emb.inv_freq"):
            return True
        match = _LAYER_KEY.fullmatch(key[len(lp):]) if key.startswith(lp) else None
        return bool(match) and int(match.group(1)) >= layer and match.group(2) in layer_names

    ckpt = Checkpoint("text_encoder", source, layout, config, files, _plan(config, layer, lp, vision_prefix),
                      allowed_extra={k for k in files if never_read(k)})
    return ckpt.check(f"a {layout} Qwen3-VL text encoder read up to layer {layer}", accept_quantised=True,
                      dtype_rule=f"the text encoder must be bf16, fp16 or fp32; {QUANTISED_NEEDS_FORMAT}. Use "
                                 "qwen3vl_32b_minimax_h3_bf16.safetensors or the official text_encoder/ folder")


# ---- tokenizer and image processor beside the model ------------------------------------------------------------------


def _candidate_folders(ckpt: Checkpoint) -> list[Path]:
    base = ckpt.source if ckpt.source.is_dir() else ckpt.source.parent
    return [base, base.parent / "tokenizer", base.parent / "processor"] if ckpt.source.is_dir() else \
        [base, base / "tokenizer"]


def _find_tokenizer(ckpt: Checkpoint, tokenizer) -> H3Tokenizer:
    if tokenizer is not None:
        return tokenizer if isinstance(tokenizer, H3Tokenizer) else H3Tokenizer(tokenizer)
    candidates = [folder / TOKENIZER_FILE for folder in _candidate_folders(ckpt)]
    for candidate in candidates:
        if candidate.is_file():
            return H3Tokenizer(candidate)
    raise CheckpointError(
        f"{ckpt.source}: no tokenizer.json beside the model (looked at {', '.join(str(c) for c in candidates)}). "
        "Pass tokenizer= with the H3 release's tokenizer/tokenizer.json (it carries H3's 7 extra tokens).",
        path=ckpt.source,
    )


def _find_processor(ckpt: Checkpoint, tokenizer: H3Tokenizer, processor) -> tuple[ImageProcessorConfig,
                                                                                             Path | None]:
    if isinstance(processor, ImageProcessorConfig):
        return processor, None
    if processor is not None:
        path = Path(processor).expanduser()
        candidates = [path / name for name in PROCESSOR_FILES] if path.is_dir() else [path]
        if not any(c.is_file() for c in candidates):
            raise CheckpointError(f"{path}: processor= names no preprocessor_config.json.", path=path)
    else:
        folders = [ckpt.source.parent / "processor"] if ckpt.source.is_dir() else []
        folders += [tokenizer.path.parent, *_candidate_folders(ckpt)]
        candidates = [folder / name for folder in folders for name in PROCESSOR_FILES]
    for candidate in candidates:
        if candidate.is_file():
            raw = read_json(candidate)
            if isinstance(raw.get("image_processor"), Mapping):
                raw = raw["image_processor"]  # processor_config.json nests each modality
            try:
                return ImageProcessorConfig.from_dict(raw), candidate
            except H3Error as exc:
                raise CheckpointError(f"{candidate}: {exc}", path=candidate) from None
    # No processor folder: what the checkpoint says (a GGUF mmproj's metadata), else the released Qwen3-VL values.
    return ckpt.defaults.get("processor", ImageProcessorConfig()), None


# ---- building the module ---------------------------------------------------------------------------------------------


# With layerwise residency: streamed per decoder layer, or materialised only for one phase of each forward.
STREAMED_LAYER_PREFIX = "language_model.layers."
PHASE_SCOPED = {"embeddings": ("language_model.embed_tokens.",), "vision": ("vision_tower.",)}


def _offloaded(name: str) -> bool:
    return name.startswith(STREAMED_LAYER_PREFIX) or any(name.startswith(p) for ps in PHASE_SCOPED.values()
                                                         for p in ps)


def load_text_encoder(source: str | os.PathLike, *, tokenizer=None, layer: int = 50, device="cpu",
                      dtype: torch.dtype | None = None, residency: Residency | str = Residency.RESIDENT,
                      prefetch: int | None = None, resident_blocks: int | list[int] | None = None,
                      config=None, processor=None, chunk_size: int | None = None, vision=None) -> TextEncoder:
    """H3 Loader's Qwen3-VL text encoder, truncated after decoder layer `layer` (H3: 50).

    `source`: the official `text_encoder/` folder (or the repo root), a partition's `text_encoder/` (or the
    partition root), or a ComfyUI single file. `tokenizer`: a `tokenizer.json` or a folder holding one; found
    beside the model when omitted. `dtype=None` keeps the checkpoint's dtype (bf16 for the release; a tensor stored
    in another dtype is cast to the file's); resident weights are read into the process's own memory.

    `config` — a config.json path / dict for a single file that is not Qwen3-VL-32B (the ComfyUI repack
    carries no config); `processor` — a `preprocessor_config.json` (or its folder) for the keyframe preprocessing,
    found beside the model when omitted (else the released Qwen3-VL values); `chunk_size` — rows per chunk of the
    attention queries and the MLP for long prompts (None: fused), bounding the activations to keys, values and one
    chunk; the same numbers as the fused path up to rounding.

    `residency="layerwise"` streams the decoder layers: they stay in the memory maps (no copy at load) and at most
    `prefetch + 1` of them are materialised on the device during a forward (`prefetch` default 0, 1 on CUDA);
    `resident_blocks` (the first N layers, or indices) stay on the device. The token embedding and the vision tower
    are materialised only for their phase of each forward ("embeddings", "vision"). `encoder.close()` releases it.

    `vision` — for a GGUF language file: its vision projector (`mmproj-*.gguf`), found beside it when omitted (of
    several, the one named most like the language file); `False` loads it text-only. Without one the encoder
    serves text-only prompts and keyframes or references are one error saying where to put the mmproj.

    Returns a `TextEncoder`; `encoder.encode(prompt, images=())` gives `(states [L, hidden], tags [L])`.
    """
    chunk_size = check_chunk_size(chunk_size)  # checked before any reading
    dtype = compute_dtype(dtype, "text encoder")
    device = torch.device(device)
    manager = residency_manager("text_encoder", device, residency, prefetch, resident_blocks)
    layerwise = manager is not None
    ckpt = resolve_text_encoder_checkpoint(source, layer, config, vision)
    h3_tokenizer = _find_tokenizer(ckpt, tokenizer)
    vocab = ckpt.config.language.vocab_size
    if H3_EXTRA_FIRST_ID + len(H3_EXTRA_TOKENS) > vocab:
        raise CheckpointError(f"{ckpt.source}: the embedding has {vocab} rows but the H3 tokenizer "
                              f"({h3_tokenizer.path}) uses ids up to {H3_EXTRA_FIRST_ID + len(H3_EXTRA_TOKENS) - 1}; "
                              "the weights are not a Qwen3-VL text encoder.", path=ckpt.source)
    image_processor, processor_path = _find_processor(ckpt, h3_tokenizer, processor)
    vision = ckpt.config.vision
    if vision is not None and (image_processor.patch_size, image_processor.merge_size,
                               image_processor.temporal_patch_size) != (vision.patch_size, vision.spatial_merge_size,
                                                                        vision.temporal_patch_size):
        where = processor_path or "the default image processor settings"
        raise CheckpointError(
            f"{where}: patch {image_processor.patch_size} / merge {image_processor.merge_size} / temporal "
            f"{image_processor.temporal_patch_size} do not match the vision tower's {vision.patch_size} / "
            f"{vision.spatial_merge_size} / {vision.temporal_patch_size}; pass processor= with the model's "
            "preprocessor_config.json.",
            path=processor_path or ckpt.source,
        )

    main = ckpt.main_dtype()  # what dtype=None computes in; a tensor stored in another dtype is cast to it
    with torch.device("meta"):
        model = TextEncoder(ckpt.config, layer)
    recipes: dict[str, HostTensor] = {}
    with closing(FileReader()) as reader:
        for spec in ckpt.specs:
            # A quantised weight's recipe holds its stored payloads and dequantises them where it is materialised.
            recipe = ckpt.recipe(spec, lambda stored: dtype or main, tuple(spec.shapes[0]), Platform.for_device(device))
            if layerwise and _offloaded(spec.name):
                # The memory-mapped tensor is the host store; the cast to `dtype` happens when it is materialised.
                recipes[spec.name] = recipe
                set_tensor(model, spec.name, torch.empty(0, dtype=recipe.dtype, device=device))
                continue
            set_tensor(model, spec.name, recipe.resident_value(device, reader))
    if layerwise:
        blocks = [(f"{STREAMED_LAYER_PREFIX}{i}.",) for i in range(len(model.language_model.layers))]
        model.language_model.block_residency, model.weight_phases = attach_layerwise(
            model, recipes, manager, blocks=blocks, phases=PHASE_SCOPED, device=device)
    model.eval()
    model.language_model.chunk_size = chunk_size
    model.tokenizer = h3_tokenizer
    model.image_processor = image_processor
    model.checkpoint_layout = ckpt.layout
    model.checkpoint_files = ckpt.paths
    if ckpt.layout == "gguf" and ckpt.config.vision is None:
        model.missing_vision = missing_vision_message(ckpt.source)
    return model
