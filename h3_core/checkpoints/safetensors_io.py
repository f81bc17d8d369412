"""Memory-mapped, validated safetensors reading.

Tensors are views into a private (copy-on-write) memory map of the file, so loading never copies the weights into
anonymous memory: the pages stay file-backed and the OS can evict them. The header is validated before any tensor is
touched, so a truncated or corrupt file fails with a message naming the file and key instead of a crash.
Only safetensors are read; pickle-based checkpoints are refused without being opened.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import torch

from ..errors import CheckpointError, PickleCheckpointError
from ..json_values import is_whole
from ..runtime.file_reads import FileIdentity, FileSegment, map_file, tag_segment

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}
# Sub-byte formats the safetensors library knows (bits per element) but no torch tensor can view element by element:
# only quantised checkpoints use them.
_PACKED_DTYPE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
# The safetensors library's own limits: the header length (100 MB) and serde_json's nesting depth.
MAX_HEADER_BYTES = 100_000_000
MAX_HEADER_DEPTH = 128


class _DuplicateKey(ValueError):
    pass


def _unique_pairs(pairs):
    """`object_pairs_hook` that refuses a key repeated inside one JSON object (plain `json` keeps the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _nesting_depth(value) -> int:
    """Depth of nested lists / objects in `value` (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _is_count(value) -> bool:
    """A JSON non-negative integer."""
    return is_whole(value, 0)


def refuse_pickle(path: Path) -> None:
    """Raise if `path` names a pickle-based checkpoint. Never opens the file."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise PickleCheckpointError(
            f"{path}: '{path.suffix}' checkpoints are pickle files, which can run arbitrary code when loaded; "
            "h3-stream reads safetensors only. Convert the file to .safetensors (or download the safetensors "
            "release) and point at that instead.",
            path=path,
        )


class SafetensorsFile:
    """One validated `.safetensors` file; `tensor(key)` returns a zero-copy, memory-mapped view."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        refuse_pickle(self.path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file.", path=self.path)
        stat = self.path.stat()
        self.file_size = stat.st_size
        # What the file was when its header was read: streamed reads check it is still that file.
        self.identity = FileIdentity.of_stat(stat)
        if self.file_size < 8:
            raise CheckpointError(
                f"{self.path}: {self.file_size} bytes is too small to be a safetensors file (empty or truncated "
                "download?). Download it again.",
                path=self.path,
            )
        with open(self.path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len > self.file_size - 8:
                raise CheckpointError(
                    f"{self.path}: the safetensors header claims {header_len} bytes but the file holds only "
                    f"{self.file_size - 8} after the length field; the file is truncated or not a safetensors file. "
                    "Download it again.",
                    path=self.path,
                )
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{self.path}: the safetensors header claims {header_len} bytes, more than the {MAX_HEADER_BYTES} "
                    "the safetensors format allows; the file is corrupt or not a safetensors file.",
                    path=self.path,
                )
            raw = handle.read(header_len)
        header = self._parse_header(raw)
        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(
                f"{self.path}: the safetensors '__metadata__' must map strings to strings, got "
                f"{str(metadata)[:80]}; the file is corrupt.",
                path=self.path, key="__metadata__")
        self.metadata: dict[str, str] = metadata
        self._data_start = 8 + header_len
        data_size = self.file_size - self._data_start
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            self._entries[key] = self._validate_entry(key, info, data_size)
        self._check_coverage(data_size)
        self._storage: torch.UntypedStorage | None = None

    def _parse_header(self, raw: bytes) -> dict:
        """The header JSON as the safetensors library reads it: UTF-8, one object, no repeated key, nesting bounded."""
        def corrupt(why):
            return CheckpointError(f"{self.path}: the safetensors header {why}; the file is corrupt or not a "
                                   "safetensors file. Download it again.", path=self.path)

        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_pairs)
        except _DuplicateKey as exc:
            raise CheckpointError(
                f"{self.path}: the safetensors header names '{exc.args[0]}' twice, so which tensor it means is "
                "ambiguous; the file is corrupt. Download it again.", path=self.path, key=exc.args[0]) from None
        except RecursionError:
            raise corrupt(f"is nested more than {MAX_HEADER_DEPTH} levels deep") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise corrupt(f"is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise corrupt("is not a JSON object")
        if _nesting_depth(header) > MAX_HEADER_DEPTH:
            raise corrupt(f"is nested more than {MAX_HEADER_DEPTH} levels deep")
        return header

    def _validate_entry(self, key, info, data_size):
        def bad(why):
            return CheckpointError(f"{self.path}: tensor '{key}': {why}; the file is corrupt.", path=self.path,
                                   key=key)

        if not isinstance(info, dict) or "dtype" not in info or "shape" not in info or "data_offsets" not in info:
            raise bad("its header entry lacks dtype, shape or data_offsets")
        name = info["dtype"]
        if isinstance(name, str) and name in _PACKED_DTYPE_BITS:
            raise CheckpointError(
                f"{self.path}: tensor '{key}' has dtype {name}, a packed quantised format; quantised checkpoints are "
                "not supported yet. Use the bf16 (or fp16 / fp32) release files.", path=self.path, key=key)
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise bad(f"unknown dtype {name!r}")
        shape = info["shape"]
        offsets = info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"invalid shape {shape!r} (must be a list of non-negative integers)")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise bad(f"invalid data_offsets {offsets!r} (must be [begin, end] integers, begin <= end)")
        begin, end = offsets
        if end > data_size:
            raise CheckpointError(
                f"{self.path}: tensor '{key}' ends at byte {end} of the data section but the file holds only "
                f"{data_size}; the file is truncated. Download it again.",
                path=self.path,
                key=key,
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise bad(f"shape {shape} of {name} needs {nbytes} bytes but its offsets span {end - begin}")
        return dtype, tuple(shape), begin, end

    def _check_coverage(self, data_size: int) -> None:
        """The tensors tile the data section exactly, as the safetensors library requires: sorted by offset, each
        starts where the previous ends (no overlap, no alias, no hole) and the last ends at the end of the file."""
        def corrupt(key, why):
            return CheckpointError(f"{self.path}: tensor '{key}' {why}; the file is corrupt. Download it again.",
                                   path=self.path, key=key)

        covered, previous = 0, None
        for key, (_, _, begin, end) in sorted(self._entries.items(), key=lambda item: item[1][2:]):
            if begin < covered:
                what = "the same bytes as" if (begin, end) == self._entries[previous][2:] else "bytes that overlap"
                raise corrupt(key, f"(data_offsets [{begin}, {end}]) uses {what} tensor '{previous}' "
                                   f"(data_offsets {list(self._entries[previous][2:])})")
            if begin > covered:
                raise corrupt(key, f"starts at byte {begin} of the data section but the tensors before it end at "
                                   f"{covered}: bytes {covered}-{begin} belong to no tensor")
            covered, previous = end, key
        if covered != data_size:
            raise CheckpointError(
                f"{self.path}: the tensors end at byte {covered} of the data section but the file holds {data_size} "
                "(bytes that belong to no tensor); the file is corrupt. Download it again.", path=self.path)

    # ---- access ----------------------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> torch.dtype:
        return self._entries[key][0]

    def nbytes(self, key: str) -> int:
        _, _, begin, end = self._entries[key]
        return end - begin

    def tensor(self, key: str) -> torch.Tensor:
        """A read-only-by-convention view of `key` backed by the file's private memory map."""
        dtype, shape, begin, _ = self._entries[key]
        if self._storage is None:
            # pages are read lazily and stay evictable (see map_file).
            self._storage = map_file(self.path, self.file_size)
        offset = self._data_start + begin
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize == 0:
            view = torch.empty(0, dtype=dtype).set_(self._storage, offset // itemsize, shape)
            return tag_segment(view, FileSegment(str(self.path), offset, self.nbytes(key), self.identity))
        # Unaligned tensor (possible with a hand-written file): the only case that copies.
        raw = torch.empty(0, dtype=torch.uint8).set_(self._storage, offset, (self.nbytes(key),))
        return raw.clone().view(dtype).reshape(shape)


def first_non_finite(paths) -> tuple[Path, str] | None:
    """The first (file, key) holding a NaN or Inf value, scanning each tensor once; None if all are finite.

    Reading every page of a large checkpoint is slow, so this runs only after an output came out non-finite, to
    name the culprit.
    """
    for path in paths:
        file = SafetensorsFile(path)
        for key in file.keys():
            if not file.dtype(key).is_floating_point or file.nbytes(key) == 0:
                continue
            if not bool(torch.isfinite(file.tensor(key)).all()):
                return file.path, key
    return None
