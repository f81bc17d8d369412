"""Where weights live and how work is shaped on a device: the platform object, residency (host stores, offload
backends, the layerwise manager, phase-scoped weights), row chunking and admission.

Imports nothing from `h3_core.models`, `h3_core.checkpoints` or `h3_core.pipeline`: it works on any stack of blocks.
"""

from .admission import AdmissionError, ComponentPlan, admission_violations, check_admission
from .chunking import (CHUNK_ROW_MULTIPLE, FUSED, ChunkingError, ChunkingPolicy, EveryNChunks, RowChunks,
                       check_chunk_size, check_memory_budget, chunk_rows_for_budget, no_reclaim,
                       projection_elements_per_row)
from .host_store import HostTensor
from .layerwise import LayerwiseOffloadManager, layerwise_manager, resolve_resident_blocks
from .offload_backends import AsyncBackend, OffloadBackend, SynchronousBackend, offload_backend
from .phase_scoped import PhaseScopedWeights
from .platform import ChunkingBackend, Platform, PlatformError, peak_rss_bytes
from .residency import AllResident, BlockResidency, Residency, ResidencyError
from .slots import SlotState, SlotStateError, SlotTable
from .telemetry import PassStats, ResidencyStats
