"""Where the weights and the user's media come from: model folders, single files and Hugging Face repos
(`model_sources.py`, downloads in `hub.py`), the embedded tiny model (`tiny_default.py`), and reference video and
audio files (`reference_files.py`)."""

from .model_sources import ModelSources, is_repo_id, resolve_model

__all__ = ["ModelSources", "is_repo_id", "resolve_model"]
