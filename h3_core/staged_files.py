"""Files written whole or not at all: each output is written under a hidden staging name in its own folder
(`.NAME.PID.partial`), synced, and renamed into place (`os.replace`) once complete, so an interrupted or failed write
leaves no partial file and never touches the file already there. Shared by the mp4 / PNG + WAV outputs and by
`quantize`; the leftovers of a killed writer are removed by the next one."""

from __future__ import annotations

import errno
import math
import os
import shutil
from pathlib import Path


def process_alive(pid: int) -> bool:
    """A process with this id runs on this machine (a staging leftover whose owner is gone may be removed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def staging_path(path: Path) -> Path:
    """Where this process writes `path` before renaming it into place."""
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


def remove(path: Path) -> None:
    """A staging file or folder, gone (missing is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def remove_dead_staging(path: Path) -> None:
    """`.NAME.PID.partial` leftovers of processes that were killed while writing `path`."""
    prefix = f".{path.name}."
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(prefix):-len(".partial")] if entry.name.startswith(prefix) else ""
        if entry.name.endswith(".partial") and pid.isdigit() and not process_alive(int(pid)):
            remove(entry)


def file_size_limit() -> float:
    """The process's file-size limit in bytes (`ulimit -f`), inf when there is none."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return math.inf
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return math.inf if soft == resource.RLIM_INFINITY else soft


def write_failure(exc: BaseException, folder: Path, written: int | None = None) -> str:
    """Why a write into `folder` failed, in words. NumPy reports a short write without an errno; with `written`
    (the bytes that reached the file) the file-size limit or a full disk is then told apart."""
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    code = getattr(exc, "errno", None)
    if code == errno.EFBIG or (code is None and written is not None and written >= file_size_limit()):
        reason += ", past the process's file-size limit (ulimit -f)"
    elif code is None and written is not None and shutil.disk_usage(folder).free < 2**20:
        reason += ": the disk is full"
    return reason
