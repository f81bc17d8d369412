"""What the sampler node attaches to the transformer for one sampling run, and detaches afterwards however the run
ends: an interruption check before every block, and the run's chunking (a chunk-size override, a between-chunks
reclaim). Uses the transformer's own hooks: `H3DiT.before_block` and `H3DiT.configure_chunking`.
"""

from __future__ import annotations

import contextlib
from typing import Callable


@contextlib.contextmanager
def sampling_session(transformer, *, check_interrupt: Callable[[], None], chunk_size: int = 0,
                     reclaim: Callable[[], None] | None = None, reclaim_every: int = 0):
    """`check_interrupt()` runs before every transformer block (before the block is even fetched to the device), so
    Cancel stops a step within one block rather than at the end of the step. `chunk_size > 0` overrides the row
    chunking for this run; `reclaim_every > 0` calls `reclaim()` after every that many row chunks."""
    from h3_core.chunking import EveryNChunks

    saved_hook, saved_chunking = transformer.before_block, transformer.chunking
    try:
        transformer.before_block = lambda index: check_interrupt()
        if chunk_size > 0 or reclaim_every > 0:
            transformer.configure_chunking(chunk_size if chunk_size > 0 else saved_chunking.chunk_size,
                                           saved_chunking.memory_budget,
                                           EveryNChunks(reclaim_every, reclaim) if reclaim_every > 0 else None)
        yield transformer
    finally:
        transformer.before_block, transformer.chunking = saved_hook, saved_chunking
