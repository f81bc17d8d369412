"""Make a quantised text encoder from a bf16 one, a tensor at a time:
`python -m h3_core quantize --component text_encoder SRC DST --format F`.

SRC is any unquantised layout `text_encoder_loader` reads (the official `text_encoder/` folder or the repo root, an
original partition, a ComfyUI single file); only what H3 reads is read and written: the token embedding, decoder
layers below `layer` (H3: 50) and the vision tower. As for the transformer (`quantiser`), every name, type and shape
is known before any weight is read, each parameter is read, quantised, written and dropped in turn, and the files are
written under staging names, synced and renamed into place only when complete. Formats:

* `fp8` / `int8` -> a `.safetensors` in the ComfyUI repack's naming (`model.embed_tokens.weight`,
  `model.layers.N.*`, `visual.*`), ComfyUI mixed precision (`comfy_quant` JSON, `weight_scale`) by comfy-kitchen's
  own quantisers: the 2-D linear weights of the decoder layers and of the vision tower are quantised; the embedding,
  the vision position embedding, the patch embedding (5-D), norms and biases are written as stored.
* `q8_0` / `q6_k` / `q4_k` -> a `.gguf` in llama.cpp's published Qwen3-VL layout (`text_encoder_gguf`): the
  language file DST (`qwen3vl`, its `qwen3vl.*` metadata; every matrix whose rows are whole blocks quantised,
  `token_embd` too, as llama-quantize does; matrices of other widths as stored) and, when the source has a vision
  tower, its vision file `mmproj-<DST stem>.gguf` beside it (`clip`, projector `qwen3vl_merger`): its linear
  weights are Q8_0 for every format (llama.cpp's converter writes mmproj files in F16 / BF16 / Q8_0 and
  llama-quantize does not quantise them), the patch and position embeddings F16 (F32 from an fp32 source). Norms
  and biases are F32 in both files.
"""

from __future__ import annotations

import os
from contextlib import closing
from pathlib import Path
from typing import Callable, Mapping

import torch

from ..errors import CheckpointError, H3Error
from ..models.vision_tower import ImageProcessorConfig
from ..runtime.file_reads import FileReader
from . import text_encoder_gguf as published
from .checkpoint import read_json
from .quantised import gguf_package, kitchen_eager
from .quantiser import (GGUF_TYPES, GGUFTensor, check_paths, gguf_suits, read_for_quantising, staged_outputs,
                        unquantised_source, write_gguf, write_safetensors)
from .text_encoder_loader import PROCESSOR_FILES, resolve_text_encoder_checkpoint

H3_LAYER = 50  # H3 reads hidden_states[50]
# Our parameter prefixes -> the ComfyUI repack's (text_encoder_loader's "comfy" layout).
COMFY_KEYS = {"language_model.": "model.", "vision_tower.": "visual."}
# 2-D weights that are not linear layers: looked up by row, never quantised in the .safetensors formats.
EMBEDDINGS = ("language_model.embed_tokens.weight", "vision_tower.pos_embed.weight")
MMPROJ_QUANTISATION = "Q8_0"
# Published tensors llama.cpp's converter keeps F16 / F32 in an mmproj file.
MMPROJ_KEPT = ("v.patch_embd.", "v.position_embd.")


def mmproj_path(target: Path) -> Path:
    """The vision file written beside a `.gguf` text encoder `target`."""
    return target.with_name(f"mmproj-{target.stem}.gguf")


def comfy_key(name: str) -> str:
    """The ComfyUI repack's key of our parameter `name`."""
    for ours, theirs in COMFY_KEYS.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise ValueError(name)


def _linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and name not in EMBEDDINGS


def _processor(ckpt) -> ImageProcessorConfig:
    """The image processor settings beside the source (its mean and std go into the mmproj metadata); the released
    Qwen3-VL values when there is none."""
    base = ckpt.source if ckpt.source.is_dir() else ckpt.source.parent
    for folder in (base, base.parent / "processor", base / "processor", base.parent / "tokenizer"):
        for name in PROCESSOR_FILES:
            candidate = folder / name
            if candidate.is_file():
                raw = read_json(candidate)
                if isinstance(raw.get("image_processor"), Mapping):
                    raw = raw["image_processor"]
                try:
                    return ImageProcessorConfig.from_dict(raw)
                except H3Error as exc:
                    raise CheckpointError(f"{candidate}: {exc}", path=candidate) from None
    return ImageProcessorConfig()


def quantise_text_encoder(source: str | os.PathLike, target: str | os.PathLike, fmt: str, *,
                          layer: int = H3_LAYER, config=None, log: Callable[[str], None] | None = None) -> Path:
    """Write `target` (and, for a `.gguf` of an encoder with a vision tower, `mmproj_path(target)`), the text encoder
    at `source` quantised as `fmt` ("fp8", "int8", "q8_0", "q6_k", "q4_k") up to decoder layer `layer`; returns
    `target`. `config`: a config.json for a single file that is not Qwen3-VL-32B (as `load_text_encoder`'s). Files
    already there are replaced only by complete ones. See the module docstring."""
    source, target = Path(source).expanduser(), Path(target).expanduser()
    check_paths(source, target, fmt)
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 1:
        raise H3Error(f"layer={layer!r}: must be a positive integer (H3 reads hidden_states[{H3_LAYER}]).")
    ckpt = unquantised_source(lambda: resolve_text_encoder_checkpoint(source, layer, config), source,
                              "the bf16 text encoder")
    gguf = gguf_package(target) if fmt in GGUF_TYPES else None
    kitchen = kitchen_eager(source, "(output)") if gguf is None else None
    specs = {spec.name: spec for spec in ckpt.specs}
    say = log or (lambda message: None)
    targets = [target]
    vision = mmproj_path(target)
    if gguf is not None and ckpt.config.vision is not None:
        targets.append(vision)
        if vision.exists() and not vision.is_file():
            raise H3Error(f"{vision}: exists and is not a regular file (a folder, a device or a pipe); the vision "
                          "tower is written there: move it, or name the output otherwise.")
    elif gguf is not None and vision.exists():
        # the loader would pair the new text-only file with it
        raise H3Error(f"{vision}: is beside {target.name} but {source} has no vision tower, so it would be read as "
                      "the new file's vision tower; move it, or name the output otherwise.")

    def stored_dtype(name: str) -> torch.dtype:
        key = specs[name].keys[0]
        return ckpt.files[key].dtype(key)

    with staged_outputs(targets) as stagings, closing(FileReader()) as reader:
        def value(name: str, dtype: torch.dtype, quantise: bool = False) -> torch.Tensor:
            spec = specs[name]
            return read_for_quantising(ckpt, spec, dtype, spec.shapes[0], reader, source, quantise,
                                       spec.keys[0])

        if gguf is None:
            plan = [(s.name, s, tuple(s.shapes[0]), stored_dtype(s.name), _linear_weight(s.name, s.shapes[0]))
                    for s in ckpt.specs]
            write_safetensors(stagings[0], plan, lambda spec, dtype, shape, quantise: value(spec.name, dtype,
                                                                                           quantise),
                              fmt, kitchen, say, key_of=comfy_key)
        else:
            _write_published(stagings, ckpt, layer, fmt, gguf, value, stored_dtype, say)
    return target


def _write_published(stagings, ckpt, layer, fmt, gguf, value, stored_dtype, say) -> None:
    """The language file (and the mmproj file, `stagings[1]`) in llama.cpp's published naming."""
    quantisation = GGUF_TYPES[fmt]
    files: dict[str, list[GGUFTensor]] = {published.TEXT_FILE: [], published.MMPROJ_FILE: []}
    for t in published_tensors_checked(ckpt.config, layer):
        (name,) = t.sources  # each published tensor is made from one of ours
        dtype = stored_dtype(name)
        if len(t.shape) == 1:
            stored = torch.float32  # norms and biases, as llama.cpp keeps them
        elif t.file == published.MMPROJ_FILE and t.name.startswith(MMPROJ_KEPT):
            stored = torch.float32 if dtype == torch.float32 else torch.float16
        else:
            wanted = quantisation if t.file == published.TEXT_FILE else MMPROJ_QUANTISATION
            stored = wanted if gguf_suits(gguf, wanted, t.shape) else dtype
        quantise = isinstance(stored, str)

        def read(t=t, name=name, dtype=dtype, quantise=quantise):
            # at the stored dtype: the quantiser converts a few rows at a time, not the whole matrix to float32
            return t.make(value(name, dtype, quantise))

        files[t.file].append(GGUFTensor(t.name, tuple(t.shape), stored, read))
    write_gguf(stagings[0], published.TEXT_ARCH, files[published.TEXT_FILE], gguf, say,
               published.text_metadata(ckpt.config, layer), published.add_metadata)
    if len(stagings) > 1:
        write_gguf(stagings[1], published.MMPROJ_ARCH, files[published.MMPROJ_FILE], gguf, say,
                   published.mmproj_metadata(ckpt.config, _processor(ckpt)), published.add_metadata)


def published_tensors_checked(config, layer: int):
    """`text_encoder_gguf.published_tensors`, each from exactly one of our parameters (what `_write_published`
    reads one at a time)."""
    out = published.published_tensors(config, layer)
    several = [t.name for t in out if len(t.sources) != 1]
    if several:
        raise H3Error(f"{several[0]}: made from {len(several)} parameters; the quantiser reads one at a time.")
    return out

