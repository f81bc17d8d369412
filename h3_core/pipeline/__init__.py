"""Generation on this machine: the phases (`pipeline.py`: text encode, keyframe and reference encode, sampling,
decode), the sampler (`sampler.py`), live previews of its steps (`preview.py`), the packed sequence layout (`layout.py`) and ComfyUI core's latent format
(`core_latent.py`)."""

from .pipeline import Conditioning, H3Pipeline, Latents

__all__ = ["Conditioning", "H3Pipeline", "Latents"]
