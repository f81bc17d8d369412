"""The chunking of one sampling run: a chunk-size override and a between-chunks reclaim, attached with
`H3DiT.configure_chunking` and detached afterwards however the run ends. (Interruption needs nothing here: the
pipeline's loop checks the `check_interrupt` it is given before every transformer block.)
"""

from __future__ import annotations

import contextlib
from typing import Callable


@contextlib.contextmanager
def sampling_session(transformer, *, chunk_size: int = 0, reclaim: Callable[[], None] | None = None,
                     reclaim_every: int = 0):
    """`chunk_size > 0` overrides the row chunking for this run; `reclaim_every > 0` calls `reclaim()` after every
    that many row chunks."""
    from h3_core.runtime.chunking import EveryNChunks

    saved = transformer.chunking
    try:
        if chunk_size > 0 or reclaim_every > 0:
            transformer.configure_chunking(chunk_size if chunk_size > 0 else saved.chunk_size, saved.memory_budget,
                                           EveryNChunks(reclaim_every, reclaim) if reclaim_every > 0 else None)
        yield transformer
    finally:
        transformer.chunking = saved
