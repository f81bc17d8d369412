"""h3_core: a pure-PyTorch implementation of MiniMax H3 with bounded memory. Never imports ComfyUI.

The package is layered; each layer imports only those before it (tests/test_architecture.py checks it):

* `errors`, `components` — the shared vocabulary;
* `runtime/` — the platform object, residency, row chunking, admission, the memory plan;
* `models/` — the networks and their configs (one forward each);
* `checkpoints/` — safetensors reading and one loader per component;
* `pipeline/` — model sources, the generation phases, planning, media writing, the CLI.

This module is the public facade: the names below stay importable from `h3_core` whatever moves inside.
"""

from .checkpoints.audio_vae_loader import load_audio_vae
from .checkpoints.dit_loader import load_dit, resolve_dit_checkpoint
from .checkpoints.lora_loader import LoraError, read_lora, set_loras
from .checkpoints.text_encoder_loader import load_text_encoder
from .checkpoints.video_vae_loader import load_video_vae
from .errors import CheckpointError, H3Error, PickleCheckpointError
from .models.dit import H3DiT
from .models.dit_config import H3DiTConfig
from .step_cache_settings import STEP_CACHE_PRESETS, StepCacheSettings, step_cache_settings
from .models.text_encoder import TextEncoder
from .models.tokenizer import H3Tokenizer
from .pipeline.layout import PackedLayout, build_packed_layout, patchify, unpatchify
from .pipeline.sampler import Schedule, denoise, euler_step, initial_noise, row_timesteps, sigma_schedule
from .planning.phase_plans import plan_for_budget
from .request.grid import LatentShape, frames_for_seconds
from .runtime.admission import AdmissionError, ComponentPlan, check_admission
from .runtime.chunking import ChunkingError, ChunkingPolicy, EveryNChunks, chunk_rows_for_budget
from .runtime.layerwise import LayerwiseOffloadManager, layerwise_manager
from .runtime.phase_scoped import PhaseScopedWeights
from .runtime.platform import ChunkingBackend, Platform
from .runtime.residency import AllResident, BlockResidency, Residency, ResidencyError
from .sources.tiny_default import ensure_tiny_model

__version__ = "0.1.0"

__all__ = [
    "AdmissionError",
    "AllResident",
    "BlockResidency",
    "CheckpointError",
    "ComponentPlan",
    "ChunkingBackend",
    "ChunkingError",
    "ChunkingPolicy",
    "EveryNChunks",
    "H3DiT",
    "H3DiTConfig",
    "H3Error",
    "H3Tokenizer",
    "LatentShape",
    "LayerwiseOffloadManager",
    "LoraError",
    "PackedLayout",
    "PhaseScopedWeights",
    "PickleCheckpointError",
    "Platform",
    "Residency",
    "ResidencyError",
    "STEP_CACHE_PRESETS",
    "Schedule",
    "StepCacheSettings",
    "TextEncoder",
    "build_packed_layout",
    "check_admission",
    "chunk_rows_for_budget",
    "denoise",
    "ensure_tiny_model",
    "euler_step",
    "frames_for_seconds",
    "initial_noise",
    "layerwise_manager",
    "load_audio_vae",
    "load_dit",
    "load_text_encoder",
    "load_video_vae",
    "patchify",
    "plan_for_budget",
    "read_lora",
    "resolve_dit_checkpoint",
    "row_timesteps",
    "step_cache_settings",
    "set_loras",
    "sigma_schedule",
    "unpatchify",
]
