"""Explicit reads of checkpoint bytes: where a tensor lives in its file, the file's identity, and a reader that
turns a file changed under us into an error instead of a SIGBUS.

A memory-mapped tensor faults its pages in on first touch; when the file was truncated meanwhile the kernel kills
the process with SIGBUS (in ComfyUI, the whole server). `pread` into our own buffer gets a short read instead, and
an `fstat` before each read catches a file rewritten in place (size, inode or mtime changed).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError

# Bytes per pread call: large enough for the kernel's read-ahead to stream, small enough to cancel between calls.
READ_CHUNK_BYTES = 32 * 1024 * 1024

_FADVISE = hasattr(os, "posix_fadvise")


def _preadv_into(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


_seek_lock = threading.Lock()


def _seek_read_into(fd: int, view: memoryview, offset: int) -> int:
    """Windows' Python has neither preadv nor pread: seek and read on the descriptor. The descriptor's position is
    shared by every thread reading this file, so the seek and the read are one step under a lock."""
    with _seek_lock:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.readv(fd, [view]) if hasattr(os, "readv") else _read_into(fd, view)


def _read_into(fd: int, view: memoryview) -> int:
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)


def _positioned_read() -> "Callable[[int, memoryview, int], int]":
    """The positioned read this OS offers, chosen once: preadv (no copy), pread (one copy), seek + read (Windows)."""
    if hasattr(os, "preadv"):
        return _preadv_into
    if hasattr(os, "pread"):
        return _pread_into
    return _seek_read_into


_read_at = _positioned_read()


@dataclass(frozen=True)
class FileIdentity:
    """What must not change while a file is in use: device, inode, size, modification time and status-change time.

    The status-change time (ctime) is what catches a same-size rewrite in place that restores the modification time
    (`rsync --inplace -t`, `cp --preserve=timestamps` onto the file, a `touch -r`): no program can set it. It also
    moves on a chmod or a new hard link (then the file is reported rewritten: load it again), and when the file is
    replaced by a rename, which is ignored: an unlinked inode (`linked` false) can no longer be written by path, and
    our descriptor still reads the bytes that were loaded."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    linked: bool = field(default=True, compare=False)

    @classmethod
    def of_stat(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink > 0)

    @classmethod
    def of(cls, path: str | os.PathLike) -> "FileIdentity":
        return cls.of_stat(os.stat(path))

    def changed(self, now: "FileIdentity") -> str | None:
        """How `now` differs from this identity, in words; None when it does not."""
        if now.size != self.size:
            return f"its size changed from {self.size} to {now.size} bytes"
        if (now.device, now.inode, now.mtime_ns) != (self.device, self.inode, self.mtime_ns):
            return "it was rewritten"
        if now.ctime_ns != self.ctime_ns and now.linked:
            return "it was rewritten (its status-change time moved)"
        return None


@dataclass(frozen=True)
class FileSegment:
    """The bytes of one stored tensor: `nbytes` at `offset` of `path`, as the file was when it was opened."""

    path: str
    offset: int
    nbytes: int
    identity: FileIdentity


def map_file(path: str | os.PathLike, nbytes: int) -> torch.UntypedStorage:
    """The file's `nbytes` as a lazily paged memory map: a private (copy-on-write) mapping, and where the system
    refuses that, a read-only shared one. A private writable mapping is charged against the commit limit, so Linux
    (heuristic overcommit) refuses one larger than RAM + swap: a single 32.9 GiB GGUF or a 61.7 GiB ComfyUI repack
    with 23.6 GiB of RAM ("Cannot allocate memory"). The read-only mapping is charged nothing; the loaders never write
    into mapped tensors (they are read by `pread`, or copied), so both serve them alike."""
    try:
        return torch.UntypedStorage.from_file(str(path), shared=False, nbytes=nbytes)
    except RuntimeError as exc:
        if "Cannot allocate memory" not in str(exc):
            raise
    import mmap
    import warnings

    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), nbytes, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # "not writable": known, and kept so (the tensor holds the map alive)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()


def tag_segment(tensor: torch.Tensor, segment: FileSegment) -> torch.Tensor:
    """Remember where `tensor` (a memory-mapped view) lives in its file, so stores can read it explicitly."""
    tensor._h3_file_segment = segment
    return tensor


def segment_of(tensor: torch.Tensor) -> FileSegment | None:
    """The file bytes of a tagged memory-mapped tensor; None for any other tensor (a copy, a slice, RAM)."""
    return getattr(tensor, "_h3_file_segment", None)


def changed_file_error(path: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: the checkpoint changed while it was loaded ({why}). Replacing a model file while it is in use "
        "is not supported: load the model again (in ComfyUI, re-run the loader node) once the new file is "
        "complete.",
        path=path,
    )


def read_private(tensor: torch.Tensor, reader: "FileReader") -> torch.Tensor:
    """A tagged memory-mapped checkpoint tensor read into the process's own memory with explicit reads, so nothing
    faults pages of the map (a file truncated or rewritten since it was opened is a `CheckpointError`, never a
    SIGBUS, and later changes to the file cannot reach the copy); any other tensor as it is."""
    segment = segment_of(tensor)
    if segment is None:
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    reader.read_into(segment, out)
    return out


def byte_view(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (kept valid by the caller holding `buffer`)."""
    nbytes = buffer.numel() * buffer.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(buffer.data_ptr())).cast("B")


class FileReader:
    """Open files of one store, read by explicit `pread` with identity checks; counts what it read."""

    def __init__(self):
        self._fds: dict[str, tuple[int, FileIdentity]] = {}
        self._lock = threading.Lock()  # the reader and the disk advisor threads open files
        self.bytes_read = 0
        self.cancelled = False

    def _open(self, segment: FileSegment) -> int:
        with self._lock:
            return self._open_locked(segment)

    def _open_locked(self, segment: FileSegment) -> int:
        entry = self._fds.get(segment.path)
        if entry is None:
            try:
                fd = os.open(segment.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as exc:
                raise changed_file_error(segment.path, f"it can no longer be opened: {exc.strerror}") from None
            entry = (fd, segment.identity)
            self._fds[segment.path] = entry
        return entry[0]

    def check(self, segment: FileSegment) -> int:
        """The open descriptor of the segment's file, after checking the file is still the one that was loaded."""
        fd = self._open(segment)
        # A rename-replacement leaves our descriptor on the loaded inode (still consistent); an in-place rewrite or a
        # truncation shows in its fstat.
        why = segment.identity.changed(FileIdentity.of_stat(os.fstat(fd)))
        if why is not None:
            raise changed_file_error(segment.path, why)
        return fd

    def read_into(self, segment: FileSegment, target: torch.Tensor, start: int = 0) -> None:
        """Read the segment's bytes from `start` on into `target` (a contiguous CPU tensor; as many bytes as it
        holds, which must lie inside the segment)."""
        fd = self.check(segment)
        view = byte_view(target)
        nbytes = len(view)
        if start < 0 or start + nbytes > segment.nbytes:
            raise ValueError(f"bytes {start}..{start + nbytes} are outside the {segment.nbytes}-byte segment")
        done = 0
        while done < nbytes:
            if self.cancelled:
                return
            step = min(READ_CHUNK_BYTES, nbytes - done)
            got = _read_at(fd, view[done: done + step], segment.offset + start + done)
            if got <= 0:
                raise changed_file_error(
                    segment.path, f"reading {segment.nbytes} bytes at offset {segment.offset} stopped after "
                    f"{start + done}: the file is shorter than when it was opened")
            done += got
        self.bytes_read += done

    def will_need(self, segment: FileSegment) -> None:
        """Ask the kernel to start reading the segment now (asynchronously): its disk time then overlaps our casts."""
        if _FADVISE:
            os.posix_fadvise(self._open(segment), segment.offset, segment.nbytes, os.POSIX_FADV_WILLNEED)

    def drop_cached(self, segment: FileSegment) -> None:
        """Tell the kernel the segment's pages will not be needed soon (they come back last, so keep others)."""
        if _FADVISE and segment.path in self._fds:
            os.posix_fadvise(self._fds[segment.path][0], segment.offset, segment.nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd, _ in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _windows_memory_status() -> tuple[int, int] | None:
    """(available, total) physical memory from Windows' GlobalMemoryStatusEx; None elsewhere."""
    if not hasattr(ctypes, "WinDLL"):
        return None

    class Status(ctypes.Structure):  # MEMORYSTATUSEX
        _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32)] + [
            (name, ctypes.c_uint64) for name in ("ullTotalPhys", "ullAvailPhys", "ullTotalPageFile",
                                                 "ullAvailPageFile", "ullTotalVirtual", "ullAvailVirtual",
                                                 "ullAvailExtendedVirtual")]

    status = Status(dwLength=ctypes.sizeof(Status))
    try:
        if ctypes.WinDLL("kernel32").GlobalMemoryStatusEx(ctypes.byref(status)):
            return status.ullAvailPhys, status.ullTotalPhys
    except OSError:
        pass
    return None


def available_memory_bytes() -> int | None:
    """Memory the kernel can give without swapping (Linux MemAvailable: free + reclaimable page cache; Windows'
    available physical memory; None on macOS, which has no cheap equivalent)."""
    found = _meminfo("MemAvailable")
    if found is None and (status := _windows_memory_status()) is not None:
        found = status[0]
    return found


def total_memory_bytes() -> int | None:
    """Physical RAM: Linux MemTotal, else the OS's page count (macOS), else Windows' GlobalMemoryStatusEx."""
    found = _meminfo("MemTotal")
    if found is None:
        try:
            found = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            status = _windows_memory_status()
            found = None if status is None else status[1]
    return found


READ_AHEAD_PIECE_BYTES = 8 << 20


def read_ahead_files(paths, *, limit_bytes: int | None) -> threading.Thread | None:
    """Read `paths` in the background, in 8 MiB pieces into one reused buffer, so that they are in the page cache
    when they are loaded, when their total size is at most `limit_bytes` (None: memory unknown, nothing done);
    returns the reading thread, or None. Real reads, not a `posix_fadvise(WILLNEED)` hint: overlay file systems
    drop that hint (measured here: the file was read from disk again). The pages stay the kernel's to evict; a file
    that vanished or fails meanwhile is skipped."""
    if limit_bytes is None:
        return None
    files = [Path(p) for p in paths]
    try:
        total = sum(f.stat().st_size for f in files)
    except OSError:
        return None
    if total > limit_bytes:
        return None

    def read_all() -> None:
        buffer = bytearray(READ_AHEAD_PIECE_BYTES)
        # Twice: pages read a second time go to the kernel's active list, so a phase streaming tens of GiB of use-once
        # blocks meanwhile (the transformer) evicts its own pages first (read once, a 4.9 GiB VAE was gone by the end
        # of sampling). The second pass reads memory.
        for _ in range(2):
            for file in files:
                try:
                    with open(file, "rb", buffering=0) as handle:
                        while handle.readinto(buffer):
                            pass
                except OSError:
                    continue

    thread = threading.Thread(target=read_all, name="h3-read-ahead", daemon=True)
    thread.start()
    return thread


def disk_read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage (Linux /proc/self/io `read_bytes`)."""
    try:
        with open("/proc/self/io") as io:
            for line in io:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
