"""Paths that come from node inputs stay inside ComfyUI's model folders; repo ids are validated before any use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import comfy_double
from h3_core.errors import CheckpointError, H3Error


@pytest.fixture
def sources(tmp_path):
    comfy_double.install(tmp_path / "comfyui")
    comfy_double.load_pack()
    from nodes import model_sources

    return model_sources


def test_h3_folder_name_cannot_climb_out(sources, tmp_path):
    import folder_paths

    outside = tmp_path / "outside"
    (outside / "vae").mkdir(parents=True)
    for name in ("..", "../outside", "../../outside", str(outside), "a/b"):
        with pytest.raises(H3Error) as info:
            sources.resolve_sources(sources.H3_FOLDER, "FL2VA", h3_folder=name)
        assert "h3_folder" in str(info.value), name
    assert folder_paths.get_folder_paths(sources.H3_FOLDER_KEY)  # the folder the node confines to exists


def unanchored_get_full_path(folder_name: str, filename: str) -> str | None:
    """`folder_paths.get_full_path` as ComfyUI had it before it anchored names at "/" (and as forks still have it):
    the widget's value joined to each model folder, unchecked. Current ComfyUI's anchoring would stop '..' on its
    own, so the pack's guard is tested against this lookup: with it, only the guard stands in the way."""
    import folder_paths

    for root in folder_paths.get_folder_paths(folder_name):
        candidate = os.path.join(root, filename)
        if os.path.isfile(candidate):
            return candidate
    return None


@pytest.mark.parametrize("name", ["../../../secrets.safetensors", "{secret}"])
def test_model_file_names_cannot_climb_out(sources, tmp_path, monkeypatch, name):
    import folder_paths

    secret = tmp_path / "secrets.safetensors"  # next to the ComfyUI base folder, outside every model folder
    secret.write_bytes(b"")
    name = name.format(secret=secret)
    monkeypatch.setattr(folder_paths, "get_full_path", unanchored_get_full_path)
    assert Path(folder_paths.get_full_path("diffusion_models", name)).resolve() == secret  # the lookup climbs out
    with pytest.raises(CheckpointError) as info:
        sources.resolve_sources(sources.COMFY_REPACK, "FL2VA", diffusion_model=name, text_encoder="x",
                                video_vae="x", audio_vae="x")
    assert str(info.value).startswith(f"diffusion_model: {name!r} is not in ComfyUI's 'diffusion_models' folders")


@pytest.mark.parametrize("repo", ["../models", "/etc", "owner/name/extra", "owner/..", "models/h3 folder",
                                  "https://huggingface.co/x/y"])
def test_repo_ids_are_validated_before_use(sources, repo, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: pytest.fail(f"download attempted for {repo!r}"))
    with pytest.raises(H3Error, match="not a Hugging Face repo id"):
        sources.resolve_sources(sources.HUGGING_FACE, "FL2VA", repo_id=repo)


def test_a_local_folder_named_like_a_repo_id_is_not_used(sources, tmp_path, monkeypatch):
    """'owner/name' resolving to a folder relative to ComfyUI's working directory must still go to the hub."""
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="Offline mode is on"):
        sources.resolve_sources(sources.HUGGING_FACE, "FL2VA", repo_id="owner/name")
