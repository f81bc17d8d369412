"""Where the loader finds an H3 model: the embedded tiny test model, a folder under `models/h3/`, the ComfyUI repack
files in the standard model folders, or a Hugging Face repo id.

ComfyUI's `folder_paths` lists the choices; `h3_core.sources.resolve_model` understands the layouts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import folder_paths

from h3_core.errors import CheckpointError, H3Error

from . import comfy_runtime

TINY = "tiny test model (embedded)"
H3_FOLDER = "models/h3 folder"
COMFY_REPACK = "ComfyUI repack files"
HUGGING_FACE = "Hugging Face repo"
SOURCES = (TINY, H3_FOLDER, COMFY_REPACK, HUGGING_FACE)
PARTITIONS = {"FL2VA": "fl2va", "Ref2VA": "ref2va"}
TINY_PARTITIONS = ("FL2VA", "Ref2VA")  # the embedded tiny model's transformers
H3_FOLDER_KEY = "h3"
# The first option of every file / folder combo and its default, so that a workflow saved on one machine validates on
# any other (a combo value must be one of the options); it stands for "not chosen".
NONE = "(none)"
DEFAULT_REPO_ID = "MiniMaxAI/MiniMax-H3"
log = logging.getLogger("h3_stream")


def register_h3_folder() -> None:
    """Register `models/h3/` (official or release layouts, one folder per model) with ComfyUI's model folders, and
    the tiny test model's `loras/` folder (its turbo LoRA, written here if missing: a few KB) as a `loras` path, so
    the turbo example workflow finds its LoRA on a fresh machine."""
    os.makedirs(os.path.join(folder_paths.models_dir, H3_FOLDER_KEY), exist_ok=True)
    folder_paths.add_model_folder_path(H3_FOLDER_KEY, os.path.join(folder_paths.models_dir, H3_FOLDER_KEY))
    from h3_core.sources.tiny_default import ensure_tiny_lora

    try:
        folder_paths.add_model_folder_path("loras", str(ensure_tiny_lora().parent))
    except OSError as error:  # a read-only cache: the pack still loads, without the tiny LoRA
        log.warning("h3-stream: the tiny test LoRA could not be written (%s)", error)


def h3_folder_choices() -> list[str]:
    """Sub-folders of every registered `h3` model path (users may add more through extra_model_paths.yaml)."""
    names = set()
    try:
        roots = folder_paths.get_folder_paths(H3_FOLDER_KEY)
    except KeyError:
        roots = []
    for root in roots:
        if os.path.isdir(root):
            names.update(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    return [NONE] + sorted(names)


def gguf_files(key: str, keep=None) -> list[str]:
    """`.gguf` files of a standard model folder, named as ComfyUI names its files (relative, '/'): ComfyUI's own
    listing leaves them out (not one of its torch extensions). `keep(full path)`: which to list (None: all)."""
    found = set()
    for root in folder_paths.get_folder_paths(key):
        for folder, _, names in os.walk(root, followlinks=True):
            found.update(os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in names
                         if n.lower().endswith(".gguf") and (keep is None or keep(os.path.join(folder, n))))
    return sorted(found)


def file_choices(key: str, prefix: str, *, gguf: bool = False, gguf_keep=None) -> list[str]:
    """Files of one standard model folder, the H3 ones (by the repack's naming) first; quantised repacks
    (`..._int8_convrot`, `..._fp8_scaled`, `..._nvfp4`) are listed like the others, and with `gguf` the `.gguf`
    files too (those `gguf_keep(full path)` accepts)."""
    files = [name for name in folder_paths.get_filename_list(key) if name.endswith((".safetensors", ".sft"))]
    files += gguf_files(key, gguf_keep) if gguf else []
    h3 = sorted(name for name in files if os.path.basename(name).startswith(prefix))
    return [NONE] + h3 + sorted(set(files) - set(h3))


def diffusion_model_choices() -> list[str]:
    return file_choices("diffusion_models", "minimax_h3", gguf=True)  # the transformer also reads GGUF files


def text_encoder_choices() -> list[str]:
    """The text encoders: the repack's files and the published Qwen3-VL GGUF language files (architecture
    `qwen3vl` in their header, whatever their name); their mmproj vision files are found beside them, not listed."""
    from h3_core.checkpoints.text_encoder_gguf import gguf_kind

    return file_choices("text_encoders", "qwen3vl", gguf=True, gguf_keep=lambda path: gguf_kind(path) == "text")


def video_vae_choices() -> list[str]:
    return file_choices("vae", "minimax_h3_video_vae")


def audio_vae_choices() -> list[str]:
    return file_choices("vae", "minimax_h3_audio_vae")


def _chosen(value: str, what: str, widget: str) -> str:
    if not value or value == NONE:
        raise H3Error(f"{what}: no file chosen in '{widget}'. Put the file in ComfyUI's models folder, refresh, and "
                      f"pick it.")
    return value


def is_inside(path: str, root: str) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(root))
    except ValueError:
        return False
    return ".." not in Path(os.path.relpath(os.path.abspath(path), os.path.abspath(root))).parts


def download_progress(node_id, repo_id: str):
    """ComfyUI's progress bar and the node's text for a Hugging Face download (`progress(done_bytes, total_bytes)`);
    the text changes once per percent."""
    from h3_core.sources.hub import progress_text

    bar, shown = None, None

    def report(done: int, total: int) -> None:
        nonlocal bar, shown
        if bar is None:
            bar = comfy_runtime.progress_bar(total, node_id=node_id)
        bar.update_absolute(done, total)
        percent = 100 * done // total
        if percent != shown:
            shown = percent
            comfy_runtime.send_progress_text(node_id, progress_text(repo_id, done, total))

    return report


def resolve_sources(source: str, partition: str, *, h3_folder: str = NONE, diffusion_model: str = NONE,
                    text_encoder: str = NONE, video_vae: str = NONE, audio_vae: str = NONE,
                    repo_id: str = DEFAULT_REPO_ID, node_id=None):
    """The `h3_core.sources.ModelSources` of the loader's choice (a Hugging Face repo is fetched here, its progress
    shown on node `node_id`)."""
    from h3_core.sources import ModelSources, resolve_model

    if partition not in PARTITIONS:
        raise H3Error(f"partition {partition!r} is not one of {list(PARTITIONS)}.")
    core_partition = PARTITIONS[partition]
    if source == TINY:
        from h3_core.sources.tiny_default import ensure_tiny_model

        return resolve_model(ensure_tiny_model(), partition=core_partition)  # it has both transformers
    if source == H3_FOLDER:
        name = h3_folder
        if not name or name == NONE:
            raise H3Error(f"h3_folder: no model folder chosen. Put an H3 download (official or release layout) in "
                          f"{os.path.join(folder_paths.models_dir, H3_FOLDER_KEY)}/<name>/, refresh, and pick it.")
        if Path(name).name != name or name in (".", ".."):
            raise H3Error(f"h3_folder: {name!r} must be the name of one folder inside models/h3, not a path.")
        for root in folder_paths.get_folder_paths(H3_FOLDER_KEY):
            candidate = (Path(root) / name).resolve()
            # A symlink inside models/h3 may point anywhere the user put it; '..' tricks may not.
            if candidate.is_dir() and (Path(root) / name).parent.resolve() == Path(root).resolve():
                return resolve_model(candidate, partition=core_partition)
        raise CheckpointError(f"h3_folder: {name!r} is in none of the h3 model folders "
                              f"{folder_paths.get_folder_paths(H3_FOLDER_KEY)}; refresh the node.", path=name)
    if source == COMFY_REPACK:
        def full_path(key: str, value: str, what: str, widget: str) -> Path:
            found = folder_paths.get_full_path(key, _chosen(value, what, widget))
            if found is not None and not any(is_inside(found, root) for root in folder_paths.get_folder_paths(key)):
                found = None  # never a file outside the configured model folders, whatever the ComfyUI version
            if found is None:
                raise CheckpointError(f"{widget}: {value!r} is not in ComfyUI's '{key}' folders "
                                      f"{folder_paths.get_folder_paths(key)}; refresh the node and pick a file that "
                                      "exists.", path=value)
            return Path(found)

        transformer = full_path("diffusion_models", diffusion_model, "transformer", "diffusion_model")
        return ModelSources(
            transformer=transformer,
            text_encoder=full_path("text_encoders", text_encoder, "text encoder", "text_encoder"),
            video_vae=full_path("vae", video_vae, "video VAE", "video_vae"),
            audio_vae=full_path("vae", audio_vae, "audio VAE", "audio_vae"),
            root=transformer.parent,
        )
    if source == HUGGING_FACE:
        repo = (repo_id or "").strip()
        if not repo:
            raise H3Error("repo_id is empty; give a Hugging Face repo id such as 'MiniMaxAI/MiniMax-H3'.")
        return resolve_model(repo, partition=core_partition, hub_only=True,
                             progress=download_progress(node_id, repo))
    raise H3Error(f"source {source!r} is not one of {list(SOURCES)}.")


def fingerprint(source: str, *, h3_folder: str = NONE, diffusion_model: str = NONE, text_encoder: str = NONE,
                video_vae: str = NONE, audio_vae: str = NONE) -> tuple:
    """Size and mtime of the chosen files or folder: a changed file on disk reloads the model."""
    paths = []
    if source == H3_FOLDER and h3_folder != NONE:
        paths = [Path(root) / h3_folder for root in folder_paths.get_folder_paths(H3_FOLDER_KEY)]
    elif source == COMFY_REPACK:
        for key, name in (("diffusion_models", diffusion_model), ("text_encoders", text_encoder), ("vae", video_vae),
                          ("vae", audio_vae)):
            full = folder_paths.get_full_path(key, name) if name and name != NONE else None
            paths.append(Path(full) if full else None)
            if key == "text_encoders" and full and full.lower().endswith(".gguf"):
                from h3_core.checkpoints.text_encoder_gguf import find_mmproj

                paths.append(find_mmproj(Path(full)))  # its vision file, found beside it
    stamps = []
    for path in paths:
        if path is None or not path.exists():
            stamps.append(None)
        elif path.is_file():
            stat = path.stat()
            stamps.append((str(path), stat.st_size, stat.st_mtime_ns))
        else:
            stamps.append((str(path), tuple(sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                                                   for p in path.rglob("*.safetensors")))))
    return tuple(stamps)
