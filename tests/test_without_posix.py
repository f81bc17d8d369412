"""Windows' Python has no os.preadv / os.pread / os.posix_fadvise and no `resource`: h3_core must run without them.

The child-process tests run the README's first command in the no-POSIX mode (tests/no_posix.py) from the normal
suite, so a POSIX-only call that comes back fails here cheaply; the unit tests run the fallback read directly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3_core.runtime import file_reads
from h3_core.runtime.file_reads import FileIdentity, FileReader, FileSegment

TESTS = Path(__file__).parent
FIRST_COMMAND = ["generate", "a red fox runs through snow", "--seconds", "1", "--size", "96x64", "--steps", "3"]


@pytest.mark.parametrize("residency", ["resident", "layerwise"])
def test_readme_first_command_without_posix(tmp_path, residency):
    env = dict(os.environ, H3_WITHOUT_POSIX="1")
    out = tmp_path / "out.mp4"
    run = subprocess.run(
        [sys.executable, str(TESTS / "no_posix.py"), "-m", "h3_core", *FIRST_COMMAND, "--residency", residency,
         "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert out.stat().st_size > 0


def test_layerwise_streamed_forward_without_posix_is_bitwise_resident():
    """The layerwise DiT from a safetensors file (memory-mapped and slot backends) equals the resident one bit for
    bit, and the staging reader's units (FileReader: the seek + read fallback) equal what the recipes make."""
    bitwise = "tests/test_residency.py::test_offloaded_equals_resident_bitwise_with_bounded_residency"
    nodes = [f"{bitwise}[1-some-sync]", f"{bitwise}[1-some-slots]",
             "tests/test_staged_reads.py::test_staged_units_are_bitwise_what_the_recipes_make"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes],
                         cwd=TESTS.parent, env=dict(os.environ, H3_WITHOUT_POSIX="1"), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


def test_mode_removes_posix_calls():
    code = ("import sys; sys.path.insert(0, %r); import no_posix; no_posix.apply(); import os\n"
            "assert not any(hasattr(os, n) for n in ('preadv', 'pread', 'posix_fadvise', 'sysconf', "
            "'POSIX_FADV_WILLNEED'))\n"
            "try:\n import resource\nexcept ImportError: pass\nelse: raise SystemExit('resource imported')\n"
            "from h3_core.runtime import file_reads\n"
            "assert file_reads._read_at is file_reads._seek_read_into\n"
            "assert not file_reads._FADVISE\n"
            "from h3_core.runtime.host_store import PinBudget\n"  # RAM known without sysconf: pinning stays on
            "assert PinBudget.default().limit_bytes > 0\n" % str(TESTS))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def _segment(path: Path, offset: int, nbytes: int) -> FileSegment:
    return FileSegment(str(path), offset, nbytes, FileIdentity.of(path))


@pytest.fixture(params=["pread", "seek"])
def fallback(request, monkeypatch):
    """The reader with preadv (and, for `seek`, pread) removed, the way Windows' os lacks them."""
    monkeypatch.delattr(os, "preadv", raising=False)
    if request.param == "seek":
        monkeypatch.delattr(os, "pread", raising=False)
    monkeypatch.setattr(file_reads, "_read_at", file_reads._positioned_read())
    return request.param


def test_fallback_read_is_exact(tmp_path, fallback, monkeypatch):
    data = bytes(range(256)) * 40
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    monkeypatch.setattr(file_reads, "READ_CHUNK_BYTES", 1000)  # several calls per read
    reader = FileReader()
    try:
        target = torch.empty(5000, dtype=torch.uint8)
        reader.read_into(_segment(path, 100, 9000), target, start=7)
        assert bytes(target.numpy()) == data[107:5107]
    finally:
        reader.close()


def test_fallback_short_read_is_a_changed_file(tmp_path, fallback):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 4096)
    segment = _segment(path, 0, 4096)
    reader = FileReader()
    try:
        reader.check(segment)
        # Simulate the file shrinking under an identity that still matches: the read comes back short.
        with open(path, "r+b") as f:
            f.truncate(1000)
        big = FileSegment(segment.path, 0, 4096, FileIdentity.of(path))  # the identity matches; the bytes are short
        with pytest.raises(Exception, match="shorter than when it was opened"):
            reader.read_into(big, torch.empty(4096, dtype=torch.uint8))
    finally:
        reader.close()


def test_fallback_changed_file_is_refused(tmp_path, fallback):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 4096)
    segment = _segment(path, 0, 4096)
    path.write_bytes(b"y" * 2048)
    reader = FileReader()
    try:
        with pytest.raises(Exception, match="size changed"):
            reader.read_into(segment, torch.empty(4096, dtype=torch.uint8))
    finally:
        reader.close()
