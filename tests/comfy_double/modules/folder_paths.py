"""Test double of ComfyUI's `folder_paths`: the standard model folders under a test's temporary base folder."""

from __future__ import annotations

import os

supported_pt_extensions = {".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft"}
base_path = ""
models_dir = ""
folder_names_and_paths: dict[str, tuple[list[str], set[str]]] = {}
_output_directory = ""
_user_directory = ""


def configure(base: str) -> None:
    """Lay out `base` like a ComfyUI install (models/<key>, output, user) and point every folder at it."""
    global base_path, models_dir, _output_directory, _user_directory
    base_path = base
    models_dir = os.path.join(base, "models")
    folder_names_and_paths.clear()
    for key, names in (("diffusion_models", ["unet", "diffusion_models"]), ("text_encoders", ["text_encoders", "clip"]),
                       ("vae", ["vae"]), ("loras", ["loras"]), ("vae_approx", ["vae_approx"])):
        folder_names_and_paths[key] = ([os.path.join(models_dir, n) for n in names], set(supported_pt_extensions))
        for name in names:
            os.makedirs(os.path.join(models_dir, name), exist_ok=True)
    _output_directory = os.path.join(base, "output")
    _user_directory = os.path.join(base, "user")
    os.makedirs(_output_directory, exist_ok=True)
    os.makedirs(_user_directory, exist_ok=True)


def get_temp_directory() -> str:
    return os.path.join(base_path, "temp")


def add_model_folder_path(folder_name: str, full_folder_path: str, is_default: bool = False) -> None:
    if folder_name not in folder_names_and_paths:
        folder_names_and_paths[folder_name] = ([full_folder_path], set())
        return
    paths = folder_names_and_paths[folder_name][0]
    if full_folder_path in paths:
        if is_default:
            paths.remove(full_folder_path)
            paths.insert(0, full_folder_path)
    elif is_default:
        paths.insert(0, full_folder_path)
    else:
        paths.append(full_folder_path)


def get_folder_paths(folder_name: str) -> list[str]:
    return folder_names_and_paths[folder_name][0][:]


def get_filename_list(folder_name: str) -> list[str]:
    paths, extensions = folder_names_and_paths[folder_name]
    found = set()
    for root in paths:
        for folder, _, files in os.walk(root, followlinks=True):
            for name in files:
                if not extensions or os.path.splitext(name)[1].lower() in extensions:
                    found.add(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/"))
    return sorted(found)


def get_full_path(folder_name: str, filename: str) -> str | None:
    if folder_name not in folder_names_and_paths:
        return None
    # As the real folder_paths does: the name is anchored at "/" first, so ".." cannot climb out of the folder.
    filename = os.path.relpath(os.path.join("/", filename), "/")
    for root in folder_names_and_paths[folder_name][0]:
        candidate = os.path.join(root, filename)
        if os.path.isfile(candidate):
            return candidate
    return None


def get_full_path_or_raise(folder_name: str, filename: str) -> str:
    path = get_full_path(folder_name, filename)
    if path is None:
        raise FileNotFoundError(f"Model in folder '{folder_name}' with filename '{filename}' not found.")
    return path


def get_output_directory() -> str:
    return _output_directory


def get_user_directory() -> str:
    return _user_directory
