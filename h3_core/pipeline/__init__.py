"""A generation request end to end: where the weights are (`sources`), the phases (`pipeline`), memory planning,
media writing and the CLI. The top layer of h3_core: it may import every other layer."""

from .keyframes import prepare_keyframes
from .pipeline import Conditioning, GenerationResult, H3Pipeline, Latents
from .planning import plan_components, plan_for_budget
from .sources import ModelSources, is_repo_id, resolve_model

__all__ = ["Conditioning", "GenerationResult", "H3Pipeline", "Latents", "ModelSources", "is_repo_id",
           "plan_components", "plan_for_budget", "prepare_keyframes", "resolve_model"]
