"""GGUF checkpoint files, read through the `gguf` package's reader (header only) and memory-mapped like safetensors.

`GGUFFile` offers what the loaders ask of a `SafetensorsFile` (keys, shapes, dtypes, zero-copy tensors tagged with
their file segment, so streamed reads `pread` them), and the header's small metadata values (`metadata`: the
architecture, hyper-parameters; the tokenizer's long arrays are stepped over). Tensor names are the file's: the
state-dict keys for a DiT (as ComfyUI-GGUF writes them), llama.cpp's for a Qwen3-VL text encoder
(`text_encoder_gguf`); shapes are ggml's dimensions reversed (torch order). F32 / F16 / BF16 tensors are plain tensors; every other
ggml type is quantised: `tensor(key)` is its raw blocks (uint8, one row of blocks per logical row) and
`quantised.QuantisedWeight` dequantises them (`gguf_dequant`, in torch). Each tensor's size, from its type and shape,
is checked against the space the data section gives it (`_check_layout`), so a wrong type or shape field is refused
instead of reading a neighbour's bytes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator

import torch

from ..errors import CheckpointError
from ..runtime.file_reads import FileIdentity, FileSegment, tag_segment
from .quantised import gguf_package

GGUF_SUFFIX = ".gguf"
# Metadata arrays longer than this (token lists) are not kept in `GGUFFile.metadata`.
METADATA_ARRAY_LIMIT = 4096


_READER_CLASS = None


def _reader_class(gguf):
    """gguf's `GGUFReader`, except that metadata arrays longer than `METADATA_ARRAY_LIMIT` (a published language
    model's 151k tokens, types and merges) are stepped over instead of being split into one NumPy view per entry,
    which takes seconds on every open; their fields keep no values (`GGUFFile` does not read them)."""
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    import sys

    import numpy as np

    array_type, string_type = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class Reader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == array_type:
                item, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
                if int(length[0]) > METADATA_ARRAY_LIMIT:
                    size = self._array_bytes(orig_offs + 12, int(item[0]), int(length[0]))
                    if size is not None:
                        return 12 + size, [item, length], [], [array_type, gguf.GGUFValueType(int(item[0]))]
            return super()._get_field_parts(orig_offs, raw_type)

        def _array_bytes(self, offset: int, item: int, length: int) -> int | None:
            if item == string_type:
                order = "big" if (self.byte_order == "S") == (sys.byteorder == "little") else "little"
                view, start = memoryview(self.data), offset
                for _ in range(length):
                    offset += 8 + int.from_bytes(view[offset:offset + 8], order)
                if offset > len(self.data):
                    raise ValueError("a metadata array runs past the end of the file")
                return offset - start
            scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item))
            return None if scalar is None else np.dtype(scalar).itemsize * length  # nested arrays: gguf's own way

    _READER_CLASS = Reader
    return Reader


class GGUFFile:
    """One `.gguf` file; `tensor(key)` returns a zero-copy, memory-mapped view (raw blocks for quantised types)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file.", path=self.path)
        gguf = gguf_package(self.path)
        stat = self.path.stat()
        self.file_size = stat.st_size
        self.identity = FileIdentity.of_stat(stat)
        try:
            reader = _reader_class(gguf)(self.path, "r")
        except (ValueError, IndexError, KeyError, OSError) as exc:
            raise CheckpointError(f"{self.path}: cannot read it as a GGUF file ({exc}); the file is truncated or "
                                  "not a GGUF file. Download it again.", path=self.path) from None
        types = gguf.GGMLQuantizationType
        plain = {types.F32: torch.float32, types.F16: torch.float16, types.BF16: torch.bfloat16,
                 types.F64: torch.float64, types.I8: torch.int8, types.I16: torch.int16, types.I32: torch.int32,
                 types.I64: torch.int64}
        # The small metadata values (hyper-parameters, the architecture); the tokenizer's long arrays are skipped.
        self.metadata: dict[str, object] = {}
        for name, value in reader.fields.items():
            long_array = (value.types[:1] == [gguf.GGUFValueType.ARRAY] and len(value.parts) > 4
                          and int(value.parts[4][0]) > METADATA_ARRAY_LIMIT)
            if name.startswith(("GGUF.", "tokenizer.")) or long_array:
                continue
            try:
                self.metadata[name] = value.contents()
            except (IndexError, TypeError, ValueError, UnicodeDecodeError):
                pass
        self._check_layout(reader)
        # key -> (dtype, torch shape, byte offset, nbytes, ggml type or None, stored (byte) shape, type name)
        self._entries: dict[str, tuple] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            ggml_type = types(int(t.tensor_type))
            if ggml_type in plain:
                self._entries[t.name] = (plain[ggml_type], shape, t.data_offset, int(t.n_bytes), None, shape,
                                         ggml_type.name)
            else:
                stored = tuple(int(d) for d in t.data.shape)
                self._entries[t.name] = (torch.uint8, shape, t.data_offset, int(t.n_bytes), int(ggml_type), stored,
                                         ggml_type.name)
        del reader  # its NumPy map closes with it; tensors are mapped by torch below
        self._storage: torch.UntypedStorage | None = None

    def _check_layout(self, reader) -> None:
        """Each tensor's bytes, as its type and shape size them (`n_bytes`), against where the data section puts it:
        at an aligned offset, ending before the next tensor (or the end of the file) with at most the alignment's
        padding after it, as GGUF writers lay the tensors out. A type or shape field that does not match the data
        would otherwise read a neighbour's bytes, or only part of its own, without a word."""
        alignment = int(reader.alignment)
        spans = sorted(reader.tensors, key=lambda t: int(t.data_offset))
        for t, following in zip(spans, spans[1:] + [None]):
            offset, nbytes = int(t.data_offset), int(t.n_bytes)
            described = (f"tensor '{t.name}' is GGUF type {t.tensor_type.name} with shape "
                         f"{[int(d) for d in reversed(t.shape.tolist())]}, {nbytes} bytes at offset {offset},")
            if offset + nbytes > self.file_size:
                raise CheckpointError(f"{self.path}: {described} past the end of the file ({self.file_size} bytes); "
                                      "the file is truncated. Download it again.", path=self.path, key=t.name)
            if (offset - int(reader.data_offset)) % alignment:
                problem = (f"not at a multiple of the file's {alignment}-byte alignment: its offset field is "
                           "wrong")
            else:
                end = int(following.data_offset) if following is not None else self.file_size
                room = end - offset
                if nbytes <= room < nbytes + alignment:
                    continue
                upto = (f"the next tensor, '{following.name}', starts" if following is not None else
                        "the file ends")
                problem = (f"but {upto} {room} bytes after its offset" + (
                           "" if room < nbytes else f", more than the {alignment}-byte alignment pads") +
                           ": its type or shape field does not match its data")
            raise CheckpointError(f"{self.path}: {described} {problem}; the file is corrupt. Download it again.",
                                  path=self.path, key=t.name)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's logical (dequantised) shape."""
        return self._entries[key][1]

    def stored_shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][5]

    def dtype(self, key: str) -> torch.dtype:
        return self._entries[key][0]

    def quant_type(self, key: str) -> int | None:
        """The ggml quantisation type of a quantised tensor; None for F32 / F16 / BF16 (plain) tensors."""
        return self._entries[key][4]

    def type_name(self, key: str) -> str:
        return self._entries[key][6]

    def nbytes(self, key: str) -> int:
        return self._entries[key][3]

    def tensor(self, key: str) -> torch.Tensor:
        dtype, shape, offset, nbytes, ggml_type, stored, _ = self._entries[key]
        if ggml_type is not None:
            shape = stored
        if self._storage is None:
            self._storage = torch.UntypedStorage.from_file(str(self.path), shared=False, nbytes=self.file_size)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize == 0:
            view = torch.empty(0, dtype=dtype).set_(self._storage, offset // itemsize, shape)
            return tag_segment(view, FileSegment(str(self.path), offset, nbytes, self.identity))
        raw = torch.empty(0, dtype=torch.uint8).set_(self._storage, offset, (nbytes,))
        return raw.clone().view(dtype).reshape(shape)

    def numel(self, key: str) -> int:
        return math.prod(self.shape(key))
