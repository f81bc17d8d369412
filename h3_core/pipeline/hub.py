"""Hugging Face downloads: only the folders of one partition, offline mode respected."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError


def download_partition(repo_id: str, partition: str, offline: bool | None, cache_dir) -> Path:
    from huggingface_hub import snapshot_download

    transformer = "transformer" if partition == "fl2va" else "transformer_ref"
    patterns = ["model_index.json"] + [f"{name}/*" for name in
                                       (transformer, "text_encoder", "tokenizer", "processor", "vae", "audio_vae")]
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=bool(offline),
                                   cache_dir=cache_dir)
    except Exception as exc:  # the hub raises many types; one message says what to do
        raise CheckpointError(
            f"{repo_id}: could not get the model from Hugging Face ({type(exc).__name__}: {exc}). "
            + ("Offline mode is on and it is not in the local cache; download it first or unset HF_HUB_OFFLINE."
               if offline else "Check the repo id and your network, or download it and pass the folder."),
            path=repo_id,
        ) from None
    return Path(folder)
