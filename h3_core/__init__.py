"""h3_core: a pure-PyTorch implementation of MiniMax H3 with bounded memory. Never imports ComfyUI."""

from .admission import AdmissionError, ComponentPlan, Platform, check_admission
from .chunking import ChunkingBackend, ChunkingError, ChunkingPolicy, EveryNChunks, chunk_rows_for_budget
from .config import H3DiTConfig
from .dit import H3DiT
from .dit_loader import load_dit, resolve_dit_checkpoint
from .errors import CheckpointError, H3Error, PickleCheckpointError
from .layout import LatentShape, PackedLayout, build_packed_layout, frames_for_seconds, patchify, unpatchify
from .residency import (AllResident, BlockHooks, BlockResidency, LayerwiseOffloadManager, PhaseScopedWeights,
                        Residency, ResidencyError, layerwise_manager)
from .sampler import Schedule, euler_step, initial_noise, row_timesteps, sigma_schedule
from .text_encoder import TextEncoder
from .text_encoder_loader import load_text_encoder
from .tokenizer import H3Tokenizer
from .vae_loader import load_audio_vae, load_video_vae

__version__ = "0.1.0"

__all__ = [
    "AdmissionError",
    "AllResident",
    "BlockHooks",
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
    "PackedLayout",
    "PhaseScopedWeights",
    "PickleCheckpointError",
    "Platform",
    "Residency",
    "ResidencyError",
    "Schedule",
    "TextEncoder",
    "build_packed_layout",
    "check_admission",
    "chunk_rows_for_budget",
    "euler_step",
    "frames_for_seconds",
    "initial_noise",
    "layerwise_manager",
    "load_audio_vae",
    "load_dit",
    "load_text_encoder",
    "load_video_vae",
    "patchify",
    "resolve_dit_checkpoint",
    "row_timesteps",
    "sigma_schedule",
    "unpatchify",
]
