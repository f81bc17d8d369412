"""What the sampler node attaches to the transformer for one sampling run, and detaches afterwards however the run
ends: a per-block interruption check, and the run's chunking (a chunk-size override, a between-chunks reclaim).

Only public torch and h3_core APIs are used: forward pre-hooks on the transformer's blocks and
`H3DiT.configure_chunking`.
"""

from __future__ import annotations

import contextlib
from typing import Callable


@contextlib.contextmanager
def sampling_session(transformer, *, check_interrupt: Callable[[], None], chunk_size: int = 0,
                     memory_budget: int | None = None, reclaim: Callable[[], None] | None = None,
                     reclaim_every: int = 0):
    """Within the block: `check_interrupt()` runs before every transformer block, so Cancel stops a step within one
    block rather than at the end of the step. `chunk_size > 0` overrides the row chunking for this run;
    `reclaim_every > 0` calls `reclaim()` after every that many row chunks."""
    handles = [block.register_forward_pre_hook(lambda module, args: check_interrupt())
               for block in transformer.blocks]
    saved_chunking = None
    try:
        if chunk_size > 0 or reclaim_every > 0:
            from h3_core.chunking import EveryNChunks

            saved_chunking = transformer.chunking
            between = EveryNChunks(reclaim_every, reclaim) if reclaim_every > 0 else None
            transformer.configure_chunking(chunk_size if chunk_size > 0 else saved_chunking.chunk_size,
                                           saved_chunking.memory_budget if memory_budget is None else memory_budget,
                                           between)
        yield transformer
    finally:
        for handle in handles:
            handle.remove()
        if saved_chunking is not None:
            transformer.chunking = saved_chunking
