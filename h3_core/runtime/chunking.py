"""Row chunking of the DiT forward: how many packed rows one chunk holds, and what runs between chunks.

At 768p the packed sequence has 30-50k rows and one block's temporaries (fused QKV output, SwiGLU input
projection, per-row AdaLN modulation) weigh more than its weights. The blocks therefore run their projections, their
attention queries and their MLP over row chunks (see `TransformerBlock` in `dit.py`); this module decides the chunk
size and carries the hooks that run between chunks: the backend's reclaim policy and the caller's interrupt check.
The model code never asks which device it runs on: everything device-specific about chunking is in one
`ChunkingBackend` value, which the `Platform` gives.

An interrupt check can only land between calls, so no call may run for long: where the backend bounds the work of
one attention call (`max_attention_work`, the CPU), the query pass is split into calls of at most that much work even
on the fused path (exact: each query row attends to all keys on its own), and where it bounds the rows of a chunk
(`max_chunk_rows`) a longer sequence is chunked even without a memory budget.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from ..errors import H3Error
from .platform import ChunkingBackend, Platform

# Budget-derived chunk sizes are multiples of this many rows (GEMM tiles on every backend divide it).
CHUNK_ROW_MULTIPLE = 64


class RowWidths(Protocol):
    """The widths a block's per-row temporaries are made of (an `H3DiTConfig` has them)."""

    hidden_size: int
    inner_dim: int
    ffn_dim: int
    num_attention_heads: int


class ChunkingError(H3Error):
    """A chunking option (chunk size, memory budget, hook) is invalid."""


def no_reclaim() -> None:
    """The default between-chunks hook: nothing to give back (CPU, CUDA's caching allocator reuses blocks)."""


class EveryNChunks:
    """A between-chunks hook that runs `action` after every `every`-th chunk (e.g. MPS synchronise + empty_cache).

    Draining the Metal queue is expensive, so a reclaim policy usually runs every few chunks, not after each one.
    """

    def __init__(self, every: int, action: Callable[[], None]):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ChunkingError(f"EveryNChunks: every must be a positive integer number of chunks, got {every!r}.")
        if not callable(action):
            raise ChunkingError(f"EveryNChunks: action must be callable, got {action!r}.")
        self.every = every
        self.action = action
        self.chunks_seen = 0

    def __call__(self) -> None:
        self.chunks_seen += 1
        if self.chunks_seen % self.every == 0:
            self.action()


# ---- chunk size from a memory budget -------------------------------------------------------------------------------


def projection_elements_per_row(config: RowWidths) -> int:
    """Elements of the per-chunk temporaries one packed row costs at the peak of the most expensive block phase.

    Counts what `TransformerBlock` keeps alive at once (an estimate, not an allocator trace):
    pass 1 (keys/values): modulated input and its two intermediates (3 hidden), the K/V projection (2 inner), the
    k-norm and the rotary halves and their concatenation (3 inner); pass 2 (queries): q projection, q-norm, rotary (3
    inner), the attention output and its flattened copy (2 inner), output projection, gated output, residual sum
    (3 hidden); MLP: modulated input (3 hidden), the fc1 output (2 ffn), silu(gate) and the product (2 ffn), fc2
    output, gated output and residual sum (3 hidden).
    """
    hidden, inner, ffn = config.hidden_size, config.inner_dim, config.ffn_dim
    keys_values = 3 * hidden + 5 * inner
    queries = 5 * inner + 3 * hidden
    mlp = 3 * hidden + 4 * ffn
    return max(keys_values, queries, mlp)


def largest_buffer_elements_per_row(config: RowWidths, key_rows: int, backend: ChunkingBackend) -> int:
    """Elements per chunk row of the single largest temporary: the score matrix if materialised, else fc1's output."""
    largest = max(2 * config.ffn_dim, 2 * config.inner_dim)
    if backend.materializes_scores:
        largest = max(largest, config.num_attention_heads * key_rows)
    return largest


def backend_row_limit(rows: int, config: RowWidths, *, batch: int = 1, element_bytes: int,
                      backend: ChunkingBackend) -> int | None:
    """The most query/projection rows per chunk the backend allows for `rows` packed rows; None when it sets no
    limit. These are hard limits (MPS: no Metal buffer over 4 GiB; at most 2048 query rows above 12,288 rows, where
    larger query blocks silently corrupt the attention): every chunk size, explicit or derived, is clamped to them.
    A limit of 64 rows or more is rounded down to a multiple of 64."""
    limit = None
    if backend.max_buffer_bytes is not None:
        largest = largest_buffer_elements_per_row(config, rows, backend)
        limit = max(1, backend.max_buffer_bytes // (batch * element_bytes * largest))
    if backend.long_sequence_rows is not None and rows > backend.long_sequence_rows:
        cap = backend.max_long_sequence_query_rows
        limit = cap if limit is None else min(limit, cap)
    if limit is None or limit >= rows:
        return None
    return limit // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE if limit >= CHUNK_ROW_MULTIPLE else limit


def attention_query_rows(key_rows: int, config: RowWidths, *, batch: int = 1,
                         backend: ChunkingBackend) -> int | None:
    """The most query rows one attention call against `key_rows` keys may take so that it does at most the
    backend's `max_attention_work` (query rows x key rows x inner dim x batch); None when the bound allows all rows.

    A multiple of 64 rows and at least the backend's `min_query_rows` (CPU: 768): every call streams all keys and
    values once, which fewer rows do not pay for (at the released widths 64-row calls cost 50 % more per row than
    768-row ones: 7.2 vs 4.8 ms a row against 12,432 keys on 2 CPU cores). At 1920x1088, 15 s on the tiny model
    (219,506 rows, inner dim 64) the bound allows 256 rows, raised to 768: a call of about a second there, where the
    fused call took 5 minutes.
    """
    if backend.max_attention_work is None:
        return None
    limit = backend.max_attention_work // (batch * key_rows * config.inner_dim)
    if limit >= key_rows:
        return None
    return max(CHUNK_ROW_MULTIPLE, backend.min_query_rows, limit // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)


def chunk_rows_for_budget(rows: int, config: RowWidths, *, batch: int = 1, element_bytes: int,
                          memory_budget: int | None, backend: ChunkingBackend) -> int | None:
    """Query/projection rows per chunk for a sequence of `rows` packed rows; None means one chunk (the fused path).

    `memory_budget` bounds the bytes of one chunk's temporaries (the full-length residual, K, V and output buffers are
    not part of it); None sets no budget, so only the backend's hard limits (`backend_row_limit`) can split the
    sequence. The result is rounded down to a multiple of 64 rows and clamped to at least 64 rows (a budget too small
    for 64 rows is exceeded rather than refused: smaller chunks would only add per-chunk overhead), but never above
    the backend's hard limit. The attention query pass may still take more rows per call on a backend with
    `min_query_rows` (CPU: 768); it adds only q and output rows.
    """
    hard = backend_row_limit(rows, config, batch=batch, element_bytes=element_bytes, backend=backend)
    limit = rows if hard is None else hard
    per_row_bytes = batch * element_bytes
    if memory_budget is not None:
        limit = min(limit, memory_budget // (per_row_bytes * projection_elements_per_row(config)))
        if backend.materializes_scores:
            # Fused kernels keep the score workspace per query block; a materialised score matrix grows with the
            # key rows: query rows <= budget / (heads x key rows x element bytes).
            limit = min(limit, memory_budget // (per_row_bytes * config.num_attention_heads * rows))
    if limit >= rows:
        return None
    size = max(CHUNK_ROW_MULTIPLE, limit // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)
    if hard is not None:
        size = min(size, hard)
    return None if size >= rows else size


# ---- what a forward receives -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowChunks:
    """The row ranges one forward works on at a time. `size=None` is one range over all rows: the fused path.

    `query_size` (default `size`) is the row count of the attention query pass (see `ChunkingBackend.min_query_rows`
    and `max_attention_work`; it may split the queries of the fused path too). `between_chunks` runs after every chunk
    of a loop that has more than one (never where all rows are one chunk), then `check_interrupt` (the caller's
    interrupt check, which may raise to stop the forward; None: none).
    """

    size: int | None = None
    between_chunks: Callable[[], None] = no_reclaim
    query_size: int | None = None
    check_interrupt: Callable[[], None] | None = None

    def ranges(self, rows: int) -> Iterator[tuple[int, int]]:
        return self._ranges(rows, self.size)

    def query_ranges(self, rows: int) -> Iterator[tuple[int, int]]:
        return self._ranges(rows, self.query_size or self.size)

    def _ranges(self, rows: int, size: int | None) -> Iterator[tuple[int, int]]:
        if size is None or size >= rows:
            yield 0, rows
            return
        for start in range(0, rows, size):
            yield start, min(start + size, rows)
            self.between_chunks()
            if self.check_interrupt is not None:
                self.check_interrupt()


FUSED = RowChunks()


def check_chunk_size(chunk_size) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ChunkingError(f"chunk_size must be a positive integer number of packed rows (e.g. 256) or None for the "
                            f"fused full-sequence forward, got {chunk_size!r}.")
    return chunk_size


def check_memory_budget(memory_budget) -> int | None:
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
        raise ChunkingError(f"memory_budget must be a positive integer number of bytes (e.g. 2 * 2**30) or None for "
                            f"no budget, got {memory_budget!r}.")
    return memory_budget


@dataclass
class ChunkingPolicy:
    """The model's chunking setting. An explicit `chunk_size` always wins; otherwise the size comes from the
    `memory_budget` and the backend's limits, per forward (it depends on the sequence length).

    `backend=None` takes the behaviour of the device the forward runs on. `check_interrupt` (no arguments; None:
    none) runs after every chunk, after `between_chunks`: a caller's interrupt check, which may raise to stop.
    """

    chunk_size: int | None = None
    memory_budget: int | None = None
    between_chunks: Callable[[], None] = no_reclaim
    backend: ChunkingBackend | None = None
    check_interrupt: Callable[[], None] | None = None

    def __post_init__(self):
        self.chunk_size = check_chunk_size(self.chunk_size)
        self.memory_budget = check_memory_budget(self.memory_budget)
        if not callable(self.between_chunks):
            raise ChunkingError(f"between_chunks must be a callable taking no arguments, got {self.between_chunks!r}.")
        if self.check_interrupt is not None and not callable(self.check_interrupt):
            raise ChunkingError(f"check_interrupt must be a callable taking no arguments or None, got "
                                f"{self.check_interrupt!r}.")

    def plan(self, rows: int, config: RowWidths, *, batch: int, dtype: torch.dtype,
             device: torch.device | str) -> RowChunks:
        backend = self.backend or Platform.for_device(device).chunking
        element_bytes = torch.empty((), dtype=dtype).element_size()
        # The backend's limits guard against silent corruption (MPS): they bind every size, an explicit one too.
        hard = backend_row_limit(rows, config, batch=batch, element_bytes=element_bytes, backend=backend)
        size = self.chunk_size
        if size is None:
            size = chunk_rows_for_budget(rows, config, batch=batch, element_bytes=element_bytes,
                                         memory_budget=self.memory_budget, backend=backend)
            if backend.max_chunk_rows is not None and (size or rows) > backend.max_chunk_rows:
                size = backend.max_chunk_rows  # an interrupt lands between chunks: none may run for seconds
        elif hard is not None and size > hard:
            warn_chunk_size_clamped(size, hard, rows, backend)
            size = hard
        query_size = None if size is None else max(size, backend.min_query_rows)
        if hard is not None and query_size is not None:
            query_size = min(query_size, hard)
        # The work bound wins over the efficient minimum: a 5-minute call would hold an interrupt for 5 minutes.
        bounded = attention_query_rows(rows, config, batch=batch, backend=backend)
        if bounded is not None and bounded < (query_size or rows):
            query_size = bounded
        return RowChunks(size, self.between_chunks, query_size, self.check_interrupt)


def warn_chunk_size_clamped(asked: int, allowed: int, rows: int, backend: ChunkingBackend) -> None:
    warnings.warn(f"chunk_size {asked} is above what {backend.name} allows for {rows} packed rows; using "
                  f"{allowed} rows per chunk (larger query blocks or buffers corrupt the attention silently there).",
                  ChunkSizeClamped, stacklevel=3)


class ChunkSizeClamped(UserWarning):
    """An explicit chunk size was lowered to the device's hard limit."""


__all__ = [
    "CHUNK_ROW_MULTIPLE",
    "ChunkingBackend",
    "ChunkingError",
    "ChunkingPolicy",
    "ChunkSizeClamped",
    "EveryNChunks",
    "FUSED",
    "RowChunks",
    "attention_query_rows",
    "backend_row_limit",
    "chunk_rows_for_budget",
    "no_reclaim",
]
