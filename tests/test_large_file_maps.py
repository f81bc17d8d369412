"""Checkpoint files larger than the machine's memory open and read: a single 35 GB GGUF transformer or a 66 GB
ComfyUI repack on a 24 GB machine. A private writable memory map of such a file is refused by Linux's heuristic
overcommit ("Cannot allocate memory"); `file_reads.map_file` then maps it read-only (charged nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from h3_core.checkpoints.gguf_io import GGUFFile
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_core.runtime.file_reads import map_file, total_memory_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import synthetic_h3 as synth  # noqa: E402

pytest.importorskip("gguf")


def larger_than_memory() -> int:
    """Elements of a bf16 tensor twice the machine's memory (at least 64 GiB): no swap makes up for that."""
    return max(2 * (total_memory_bytes() or 0), 64 << 30) // 2


def test_a_sparse_safetensors_file_twice_the_memory_opens_and_reads(tmp_path):
    numel = larger_than_memory()
    path = tmp_path / "huge.safetensors"
    specs = [synth.TensorSpec("small", (4,), torch.float32, "constant", 1.0),
             synth.TensorSpec("huge", (numel,), torch.bfloat16)]
    synth.write_safetensors(path, specs, values=False, sync=False)
    file = SafetensorsFile(path)
    assert file.tensor("huge").shape == (numel,)
    assert torch.equal(file.tensor("huge")[-8:], torch.zeros(8, dtype=torch.bfloat16))  # the hole reads as zeros
    assert file.tensor("small").shape == (4,)


def test_a_sparse_gguf_file_twice_the_memory_opens_and_reads(tmp_path):
    import gguf

    rows = larger_than_memory() // 4096
    path = tmp_path / "huge.gguf"
    spec = synth.TensorSpec("huge.weight", (rows, 4096), torch.bfloat16, "normal", 0.01)
    synth.write_gguf(path, "minimax_h3", [synth.GGUFTensor("huge.weight", (rows, 4096),
                                                           gguf.GGMLQuantizationType.Q8_0, spec)],
                     values=False, sync=False)
    file = GGUFFile(path)
    raw = file.tensor("huge.weight")
    assert raw.shape == (rows, 4096 // 32 * 34) and int(raw[-1].sum()) == 0


def test_when_a_private_map_is_refused_the_file_is_mapped_read_only_with_the_same_bytes(tmp_path, monkeypatch):
    path = tmp_path / "data.bin"
    data = torch.arange(4096, dtype=torch.int32)
    path.write_bytes(data.numpy().tobytes())

    def refused(*args, **kwargs):
        raise RuntimeError(f"unable to mmap {path.stat().st_size} bytes from file <{path}>: Cannot allocate memory "
                           "(12)")

    monkeypatch.setattr(torch.UntypedStorage, "from_file", refused)
    storage = map_file(path, path.stat().st_size)
    view = torch.empty(0, dtype=torch.int32).set_(storage, 0, (4096,))
    assert torch.equal(view, data)


def test_another_mapping_failure_is_not_hidden(tmp_path, monkeypatch):
    path = tmp_path / "data.bin"
    path.write_bytes(b"\0" * 64)

    def broken(*args, **kwargs):
        raise RuntimeError("unable to open shared memory object")

    monkeypatch.setattr(torch.UntypedStorage, "from_file", broken)
    with pytest.raises(RuntimeError, match="shared memory"):
        map_file(path, 64)
