"""Where the four H3 components are: an official diffusers folder, an original release folder or partition, a ComfyUI
`models/` folder, or a Hugging Face repo id (only the needed folders are downloaded)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, H3Error
from .hub import DEFAULT_TEXT_ENCODER_LAYER, download_partition, text_encoder_layer

PARTITIONS = ("fl2va", "ref2va")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@dataclass(frozen=True)
class ModelSources:
    """The four components (a folder or a single file each) and the tokenizer, as `h3_core.load_*` take them."""

    transformer: Path
    text_encoder: Path
    video_vae: Path
    audio_vae: Path
    tokenizer: Path | None = None
    text_encoder_layer: int = DEFAULT_TEXT_ENCODER_LAYER
    root: Path | None = None

    def replace(self, **changes) -> "ModelSources":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update({k: Path(v) if isinstance(v, (str, os.PathLike)) and k != "text_encoder_layer" else v
                       for k, v in changes.items() if v is not None})
        return ModelSources(**values)


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and ".." not in text


def _minimax_block(folder: Path) -> dict:
    index = folder / "model_index.json"
    if not index.is_file():
        return {}
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: cannot read JSON ({exc}).", path=index) from None
    block = data.get("_minimax_h3") if isinstance(data, dict) else None
    return block if isinstance(block, dict) else {}


def _first_existing(folder: Path, names) -> Path | None:
    for name in names:
        if (folder / name).exists():
            return folder / name
    return None


def _comfy_file(folder: Path, pattern: str, what: str, exclude=("pruned", "int8", "fp8", "nvfp4")) -> Path:
    """The first file (or folder, for text encoders in the official layout) matching `pattern`, preferring the
    full-precision release over quantised variants (taken when they are all there is) and never a pruned one,
    which h3-stream does not run."""
    def matching(skip):
        return sorted(p for p in folder.glob(pattern) if not any(x in p.name for x in skip)
                      and (p.suffix == ".safetensors" or p.is_dir()))

    candidates = matching(exclude) or matching(("pruned",))
    if not candidates:
        raise CheckpointError(f"{folder}: no {what} file matching '{pattern}'. Put the ComfyUI repack file there or "
                              "point at an official / partition folder instead.", path=folder)
    return candidates[0]


def _comfy_text_encoder(folder: Path) -> Path:
    """The text encoder of a ComfyUI `text_encoders/` folder: the repack's file (`_comfy_file`), else a published
    Qwen3-VL GGUF language file (architecture `qwen3vl` in its header, whatever its name; its mmproj is found beside
    it by the loader), the first by name."""
    try:
        return _comfy_file(folder, "qwen3vl*minimax_h3*", "H3 text encoder")
    except CheckpointError:
        from ..checkpoints.text_encoder_gguf import gguf_kind

        published = sorted(p for p in folder.glob("*.gguf") if p.is_file() and gguf_kind(p) == "text")
        if published:
            return published[0]
        raise


def resolve_model(model: str | os.PathLike, *, partition: str = "fl2va", offline: bool | None = None,
                  cache_dir: str | os.PathLike | None = None, hub_only: bool = False,
                  progress=None) -> ModelSources:
    """Find the four components of an H3 download.

    `model` is an official diffusers folder (`transformer/`, `text_encoder/`, `vae/`, `audio_vae/`, `tokenizer/`), an
    original release folder or one of its partitions (`FL2VA/`, `Ref2VA/`: `transformer/`, `video_vae/`,
    `audio_vae/`, `text_encoder/`), a ComfyUI `models/` folder (`diffusion_models/`, `text_encoders/`, `vae/`), or a
    Hugging Face repo id, of which only the needed folders are downloaded (offline mode is respected).
    `hub_only=True` accepts a repo id only, never a local path (for inputs that must not reach arbitrary folders).
    `progress(done_bytes, total_bytes)` follows a download (see `hub.download_partition`).
    """
    if partition not in PARTITIONS:
        raise H3Error(f"partition must be one of {PARTITIONS}, got {partition!r}.")
    if hub_only:
        if not is_repo_id(str(model)):
            raise H3Error(f"{model!r} is not a Hugging Face repo id ('owner/name', letters, digits, '.', '_', '-'); "
                          "local folders go in ComfyUI's models/h3 folder instead.")
        return resolve_model(download_partition(str(model), partition, offline, cache_dir, progress=progress),
                             partition=partition)
    path = Path(model).expanduser()
    if not path.exists():
        text = str(model)
        if not is_repo_id(text):
            raise CheckpointError(f"{text}: no such folder, and not a Hugging Face repo id ('owner/name').",
                                  path=path)
        path = download_partition(text, partition, offline, cache_dir, progress=progress)
    if path.is_file():
        raise CheckpointError(f"{path}: a single file holds one component; give the folder of the whole model (or "
                              "pass the component files separately).", path=path)
    block = _minimax_block(path)
    layer = text_encoder_layer(block, path / "model_index.json")
    transformer_name = "transformer" if partition == "fl2va" else "transformer_ref"
    if (path / "vae").is_dir() and (path / "audio_vae").is_dir() and (path / transformer_name).is_dir():
        return ModelSources(path / transformer_name, path / "text_encoder", path / "vae", path / "audio_vae",
                            _first_existing(path, ["tokenizer", "processor"]), layer, path)
    partition_dir = _first_existing(path, ["FL2VA", "fl2va"] if partition == "fl2va" else ["Ref2VA", "ref2va"])
    if partition_dir is not None and not (path / "video_vae").is_dir():
        return resolve_model(partition_dir, partition=partition, offline=offline)
    if (path / "video_vae").is_dir() and (path / "transformer").is_dir():
        return ModelSources(path / "transformer", path / "text_encoder", path / "video_vae", path / "audio_vae",
                            _first_existing(path, ["tokenizer", "processor"]), layer, path)
    if (path / "diffusion_models").is_dir() and (path / "vae").is_dir():
        te_folder = path / "text_encoders"
        return ModelSources(
            _comfy_file(path / "diffusion_models", f"minimax_h3*{partition}*.safetensors", "H3 transformer"),
            _comfy_text_encoder(te_folder),
            _comfy_file(path / "vae", "minimax_h3_video_vae*.safetensors", "H3 video VAE"),
            _comfy_file(path / "vae", "minimax_h3_audio_vae*.safetensors", "H3 audio VAE"),
            _first_existing(te_folder, ["tokenizer.json", "tokenizer"]), layer, path)
    raise CheckpointError(
        f"{path}: not an H3 model folder. Expected an official diffusers folder (transformer/, text_encoder/, vae/, "
        "audio_vae/), an original release folder (FL2VA/ or Ref2VA/ with transformer/, video_vae/, audio_vae/, "
        "text_encoder/), or a ComfyUI models folder (diffusion_models/, text_encoders/, vae/).",
        path=path,
    )


def safetensors_files(source: Path) -> list[Path]:
    source = Path(source)
    return [source] if source.is_file() else sorted(source.rglob("*.safetensors"))


def check_components_match(sources: ModelSources, text_encoder_config=None) -> None:
    """The four components belong to one H3 model: the widths where they meet agree, read from their headers and
    configs (no weight is read). A mismatch is one `CheckpointError` naming both files and the two numbers, here
    instead of at the first forward (a text encoder of the wrong width) or after all the sampling (a VAE with the
    wrong latent channels). `text_encoder_config` is the text encoder's `config=` option, if any."""
    from ..checkpoints.audio_vae_loader import resolve_audio_vae_checkpoint
    from ..checkpoints.dit_loader import resolve_dit_checkpoint
    from ..checkpoints.text_encoder_loader import resolve_text_encoder_checkpoint
    from ..checkpoints.video_vae_loader import resolve_video_vae_checkpoint

    transformer = resolve_dit_checkpoint(sources.transformer)
    text_encoder = resolve_text_encoder_checkpoint(sources.text_encoder, sources.text_encoder_layer,
                                                   text_encoder_config)
    video_vae = resolve_video_vae_checkpoint(sources.video_vae)
    audio_vae = resolve_audio_vae_checkpoint(sources.audio_vae)
    dit = transformer.config
    for other, what, theirs, ours, meaning in (
            (text_encoder, "text encoder", text_encoder.config.language.hidden_size, dit.text_dim,
             "text features of width"),
            (video_vae, "video VAE", video_vae.config.latent_channels, dit.in_channels, "video latents of"),
            (audio_vae, "audio VAE", audio_vae.config.latent_channels, dit.audio_in_channels, "audio latents of")):
        if theirs != ours:
            gives = "produces text features of width" if what == "text encoder" else "has latents of"
            unit = "" if what == "text encoder" else " channels"
            raise CheckpointError(
                f"the transformer ({transformer.source}) takes {meaning} {ours}{unit} but the {what} "
                f"({other.source}) {gives} {theirs}{unit}: they are not parts of the same H3 model. Use the {what} "
                "released with this transformer.", path=other.source)


def transformer_partition(transformer: os.PathLike) -> str | None:
    """Which released partition a transformer source is, from where it lies: "ref2va" (`transformer_ref/`,
    `Ref2VA/transformer/`, a `*ref2va*` file), "fl2va" (`transformer/` of an official folder, `FL2VA/transformer/`,
    a `*fl2va*` file), None when its place does not say."""
    path = Path(transformer)
    name, parent = path.name.lower(), path.parent.name.lower()
    if "ref2va" in name or name == "transformer_ref" or parent == "ref2va":
        return "ref2va"
    if "fl2va" in name or parent == "fl2va":
        return "fl2va"
    if name == "transformer" and (path.parent / "vae").is_dir() and (path.parent / "audio_vae").is_dir():
        return "fl2va"
    return None


# The canvas rules of the released model (`h3-components.md` §5); a model's `model_index.json` `_minimax_h3` block may
# set its own (`canvas_short_edge`, `canvas_max_pixels`, `reference_image_short_edge`), as the tiny default does.
CANVAS_RULES = {"canvas_short_edge": 768, "canvas_max_pixels": 768 * 1344, "reference_image_short_edge": 2048}


def canvas_rules(sources: ModelSources) -> dict:
    """The canvas rules Ref2VA references are normalised with: the released ones, or the model folder's own."""
    block = _minimax_block(sources.root) if sources.root is not None and Path(sources.root).is_dir() else {}
    rules = dict(CANVAS_RULES)
    for name in rules:
        value = block.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 32:
                raise CheckpointError(f"{Path(sources.root) / 'model_index.json'}: _minimax_h3.{name} must be a whole "
                                      f"number of pixels >= 32, got {value!r}.", path=sources.root, key=name)
            rules[name] = value
    return rules
