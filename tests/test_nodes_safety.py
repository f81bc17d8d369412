"""Paths that come from node inputs stay inside ComfyUI's model folders; repo ids are validated before any use."""

from __future__ import annotations

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


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "../secrets.safetensors", "/etc/passwd"])
def test_model_file_names_cannot_climb_out(sources, tmp_path, name):
    secret = tmp_path / "secrets.safetensors"
    secret.write_bytes(b"")
    with pytest.raises(CheckpointError, match="not in ComfyUI's 'diffusion_models' folders"):
        sources.resolve_sources(sources.COMFY_REPACK, "FL2VA", diffusion_model=name, text_encoder="x",
                                video_vae="x", audio_vae="x")


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
