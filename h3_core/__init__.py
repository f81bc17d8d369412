"""h3_core: a pure-PyTorch implementation of MiniMax H3 with bounded memory. Never imports ComfyUI."""

from .chunking import ChunkingBackend, ChunkingError, ChunkingPolicy, EveryNChunks, chunk_rows_for_budget
from .config import H3DiTConfig
from .dit import H3DiT
from .dit_loader import load_dit, resolve_dit_checkpoint
from .errors import CheckpointError, H3Error, PickleCheckpointError
from .layout import LatentShape, PackedLayout, build_packed_layout, frames_for_seconds, patchify, unpatchify
from .sampler import Schedule, euler_step, initial_noise, row_timesteps, sigma_schedule

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ChunkingBackend",
    "ChunkingError",
    "ChunkingPolicy",
    "EveryNChunks",
    "H3DiT",
    "H3DiTConfig",
    "H3Error",
    "LatentShape",
    "PackedLayout",
    "PickleCheckpointError",
    "Schedule",
    "build_packed_layout",
    "chunk_rows_for_budget",
    "euler_step",
    "frames_for_seconds",
    "initial_noise",
    "load_dit",
    "patchify",
    "resolve_dit_checkpoint",
    "row_timesteps",
    "sigma_schedule",
    "unpatchify",
]
