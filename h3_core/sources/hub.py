"""Hugging Face downloads: only the files one request needs, into the normal Hugging Face cache.

The repo's file list and sizes come from the Hub's API (`HfApi.model_info(files_metadata=True)`); the text encoder's
index is read before its shards, and shards holding only layers H3 never reads are skipped. Free disk space is checked
before any weight byte. Each file's bytes go to `blobs/<etag>.h3-partial` in the cache and continue with an HTTP Range
request after a failure, in this run or the next (huggingface_hub 2.x deletes its partial file when a download
fails, so it cannot resume across attempts); huggingface_hub itself then links the finished blob into the snapshot
and writes the ref, so the cache layout is exactly its own and later offline runs find the files. Transient failures
(connection resets, 5xx, a closed client) are retried with capped exponential backoff; 401/403/404 never are.

Every file is checked against its ETag before it becomes a blob (huggingface_hub 2.x checks only the size): an LFS
file's is the sha256 of its bytes (X-Linked-Etag on the resolve answer, `lfs.sha256` in the file list), a file stored
in git has git's blob sha1 (`sha1(b"blob <size>\\0" + bytes)`, the list's `blobId`). The hash is taken as the bytes
arrive; a resumed partial file hashes what it already holds first. A mismatch deletes the file and fetches it whole
once more; a second one is an error, and nothing of the file is cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable
from urllib.parse import urlsplit

from ..checkpoints.text_encoder_loader import never_read_by_h3
from ..errors import CheckpointError

DEFAULT_TEXT_ENCODER_LAYER = 50
TEXT_ENCODER_INDEX = "model.safetensors.index.json"
# Files worth fetching inside a needed folder: weights (safetensors only), configs, tokenizer files.
KEPT_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken")
PARTIAL_SUFFIX = ".h3-partial"
GIB = 1 << 30
# Progress is reported about this many times per download (and at its end), not per chunk.
PROGRESS_STEPS = 1000
HASH_CHUNK_BYTES = 8 << 20
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
GIT_SHA1_HEX = re.compile(r"[0-9a-f]{40}")

Progress = Callable[[int, int], None]


def text_encoder_layer(block: dict, index) -> int:
    """The hidden layer H3 reads text features from (`_minimax_h3.text_encoder_layer`): a whole number >= 1, refused
    otherwise rather than cast (int(1.7) would silently read another layer than the file names)."""
    value = block.get("text_encoder_layer", DEFAULT_TEXT_ENCODER_LAYER)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{index}: _minimax_h3.text_encoder_layer must be a whole number of layers >= 1 (the "
                              f"released model uses {DEFAULT_TEXT_ENCODER_LAYER}), got {value!r}. Fix the file, or "
                              "download model_index.json again.", path=index, key="text_encoder_layer")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried: delays double from `first_delay_s` up to
    `max_delay_s`; `sleep` is injectable so tests do not wait."""

    attempts: int = 6
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    sleep: Callable[[float], None] = time.sleep

    def delay(self, failures: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2 ** (failures - 1))


DEFAULT_RETRY = RetryPolicy()


class _TransferIncomplete(OSError):
    """The server closed a body early: transient, and the partial file continues next time."""


class _ContentHash:
    """The hash a file's ETag is: sha256 of the bytes for a 64-hex ETag (an LFS file), git's blob sha1 for a 40-hex
    one (a file stored in git: it hashes `blob <size>\\0` first, so it needs the size before the bytes)."""

    def __init__(self, expected: str, size: int | None):
        self.expected = expected
        self.kind = "sha256" if SHA256_HEX.fullmatch(expected) else "git-sha1"
        self.size = size
        self.reset()

    @staticmethod
    def for_etag(etag: str | None, listed: str | None, size: int | None) -> _ContentHash | None:
        """From the resolve answer's ETag; from the file list when the ETag is not a hash (a proxy that rewrites
        it); None when neither is (the file cannot be checked). A git file of unknown size cannot be hashed as it
        arrives: it is hashed once complete (such files are small, the Hub keeps files over 10 MB in LFS)."""
        for value in (etag, listed):
            value = (value or "").lower()
            if SHA256_HEX.fullmatch(value) or GIT_SHA1_HEX.fullmatch(value):
                return _ContentHash(value, size)
        return None

    def reset(self) -> None:
        if self.kind == "sha256":
            self.hasher = hashlib.sha256()
        else:
            self.hasher = hashlib.sha1()  # git's object name, not a security choice: the Hub's ETag is this
            if self.size is not None:
                self.hasher.update(f"blob {self.size}\0".encode())

    def update(self, chunk: bytes) -> None:
        self.hasher.update(chunk)

    def update_from(self, path: Path) -> None:
        with open(path, "rb") as source:
            while chunk := source.read(HASH_CHUNK_BYTES):
                self.hasher.update(chunk)

    def digest_of(self, path: Path) -> str:
        """The hash of the complete file at `path` (its bytes were fed as they arrived, except for a git file of
        unknown size, hashed now)."""
        if self.kind == "git-sha1" and self.size is None:
            self.size = path.stat().st_size
            self.reset()
            self.update_from(path)
        return self.hasher.hexdigest()


class _ProgressRaised(Exception):
    """The progress callback raised (ComfyUI's Cancel does): passed on as it is, never retried."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


def offline_requested(offline: bool | None) -> bool:
    if offline is not None:
        return bool(offline)
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def progress_text(repo_id: str, done: int, total: int) -> str:
    """One line for a node's progress text or a log."""
    percent = 100.0 * done / total if total else 100.0
    return f"downloading {repo_id}: {done / GIB:.2f} / {total / GIB:.2f} GiB ({percent:.0f}%)"


def gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


# ---- which files a request needs -------------------------------------------------------------------------------------


def _partition_root(files: list[str], partition: str) -> str | None:
    """The folder of the original release's partition (`FL2VA/`, `Ref2VA/`), when the repo is laid out that way."""
    wanted = "fl2va" if partition == "fl2va" else "ref2va"
    tops = {PurePosixPath(f).parts[0] for f in files if "/" in f}
    return next((top + "/" for top in sorted(tops) if top.lower() == wanted), None)


def _component_root(files: list[str], partition: str) -> str:
    return _partition_root(files, partition) or ""


def needed_files(files: list[str], partition: str, weight_map: dict | None = None,
                 layer: int = DEFAULT_TEXT_ENCODER_LAYER) -> list[str]:
    """The repo files a `partition` request reads: the official layout's `model_index.json`, its transformer (not the
    other partition's), text encoder, tokenizer, processor and the two VAEs; or the release layout's partition folder.
    Only safetensors weights, configs and tokenizer files. The shards of an indexed text encoder come only with its
    index's `weight_map` (read it first): those holding anything below decoder layer `layer`."""
    root = _component_root(files, partition)
    if root:
        chosen = [f for f in files if f.startswith(root) or f == "model_index.json"]
    else:
        transformer = "transformer" if partition == "fl2va" else "transformer_ref"
        folders = (transformer, "text_encoder", "tokenizer", "processor", "vae", "audio_vae")
        chosen = [f for f in files if f == "model_index.json" or PurePosixPath(f).parts[0] in folders]
    chosen = [f for f in chosen if f.endswith(KEPT_SUFFIXES)]
    shard_folder = f"{root}text_encoder/"
    if shard_folder + TEXT_ENCODER_INDEX not in files:
        return chosen
    needed_shards = {shard_folder + str(shard) for key, shard in (weight_map or {}).items()
                     if not never_read_by_h3(key, layer)}

    def is_shard(name: str) -> bool:
        return name.startswith(shard_folder) and name.endswith(".safetensors") and "/" not in name[len(shard_folder):]

    return [f for f in chosen if not is_shard(f) or f in needed_shards]


def text_encoder_index_name(files: list[str], partition: str) -> str | None:
    name = f"{_component_root(files, partition)}text_encoder/{TEXT_ENCODER_INDEX}"
    return name if name in files else None


def model_index_name(files: list[str], partition: str) -> str | None:
    for name in (f"{_component_root(files, partition)}model_index.json", "model_index.json"):
        if name in files:
            return name
    return None


# ---- failures --------------------------------------------------------------------------------------------------------


def _causes(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def failure_kind(exc: BaseException) -> str | None:
    """'transient' (retry), 'closed' (the shared HTTP client was closed: retry with a new one), 'range' (the partial
    file does not fit the file: start it again), 'permanent' (never retried) or None (not a network failure)."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    for cause in _causes(exc):
        if isinstance(cause, OfflineModeIsEnabled):
            return "permanent"
        if isinstance(cause, HfHubHTTPError):
            status = _status(cause)
            if status == 416:
                return "range"
            if status is not None and (status >= 500 or status in (408, 429)):
                return "transient"
            return "permanent"
        if isinstance(cause, RuntimeError) and "client has been closed" in str(cause):
            return "closed"
        if isinstance(cause, (httpx2.TransportError, ConnectionError, TimeoutError, _TransferIncomplete)):
            return "transient"
    return None


def _permanent_error(exc: BaseException, repo_id: str, what: str) -> CheckpointError:
    """One message per refusal, never the token."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cause = next((c for c in _causes(exc) if isinstance(c, (HfHubHTTPError, OfflineModeIsEnabled))), exc)
    status = _status(cause)
    if isinstance(cause, OfflineModeIsEnabled):
        text = ("huggingface_hub is in offline mode (HF_HUB_OFFLINE was set when it was imported); unset it and "
                "restart, or download the model first.")
    elif isinstance(cause, GatedRepoError):
        text = (f"the repo is gated ({status}): accept its conditions on its Hugging Face page, then set HF_TOKEN to "
                "a token of that account.")
    elif isinstance(cause, RepositoryNotFoundError):
        text = (f"no such model repo on Hugging Face, or it is private ({status}). Check the repo id; for a private "
                "repo set HF_TOKEN to a token that can read it.")
    elif isinstance(cause, RevisionNotFoundError):
        text = f"the revision does not exist ({status})."
    elif isinstance(cause, EntryNotFoundError) or status == 404:
        text = f"{what} does not exist in the repo (404), or the repo is private; check the repo id."
    elif status in (401, 403):
        text = (f"Hugging Face refused access to {what} ({status}): the repo needs a token. Set HF_TOKEN to a token "
                "with read access (and accept the model's conditions on its page if it is gated).")
    else:
        text = f"Hugging Face answered {status} for {what}."
    return CheckpointError(f"{repo_id}: {text}", path=repo_id)


def _brief(exc: BaseException) -> str:
    status = _status(exc)
    return f"HTTP {status}" if status is not None else f"{type(exc).__name__}: {exc}"


# ---- the download ----------------------------------------------------------------------------------------------------


def _existing_folder(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_disk_bytes(folder: Path) -> int:
    return shutil.disk_usage(_existing_folder(folder)).free


class _Download:
    def __init__(self, repo_id: str, partition: str, cache_dir: Path, *, progress: Progress | None,
                 retry: RetryPolicy, free_bytes: Callable[[Path], int], token, log: Callable[[str], None]):
        from huggingface_hub.file_download import repo_folder_name

        self.repo_id, self.partition, self.cache_dir = repo_id, partition, cache_dir
        self.progress, self.retry, self.free_bytes, self.token, self.log = progress, retry, free_bytes, token, log
        self.endpoint = hub_endpoint()
        self.storage = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
        self.done = self.total = self.reported = 0
        self.mismatched: set[str] = set()  # files that arrived once with other bytes than their hash
        self.unverified: set[str] = set()  # files without a hash to check (said once)

    # -- retries --

    def attempt(self, what: str, call, failed: Exception | None = None):
        """`call()`, retried after transient failures; `failed`: how a first try (made by the caller) failed."""
        from huggingface_hub.utils import close_session

        failures = 0
        while True:
            if failed is None:
                try:
                    return call()
                except _ProgressRaised as raised:
                    raise raised.original from None
                except CheckpointError:
                    raise
                except Exception as exc:  # classified below: only network failures are retried
                    failed = exc
            exc, failed = failed, None
            kind = failure_kind(exc)
            if kind is None:
                raise CheckpointError(f"{self.repo_id}: could not get {what} from Hugging Face "
                                      f"({type(exc).__name__}: {exc}).", path=self.repo_id) from None
            if kind == "permanent":
                raise _permanent_error(exc, self.repo_id, what) from None
            failures += 1
            if failures >= self.retry.attempts:
                raise CheckpointError(
                    f"{self.repo_id}: {what} still failed after {failures} attempts ({_brief(exc)}). Check the "
                    "network (or the Hub's status) and run again: finished files are kept and a partial file "
                    "continues where it stopped.", path=self.repo_id) from None
            if kind == "closed":
                close_session()  # the next call gets a fresh client
            delay = self.retry.delay(failures)
            self.log(f"{self.repo_id}: {what} failed ({_brief(exc)}); retry {failures} of "
                     f"{self.retry.attempts - 1} in {delay:g} s")
            self.retry.sleep(delay)

    # -- the plan --

    def run(self) -> Path:
        from huggingface_hub import HfApi

        def file_list():
            return HfApi(endpoint=self.endpoint).model_info(self.repo_id, files_metadata=True, token=self.token)

        try:
            info = file_list()
        except Exception as exc:  # classified in `attempt`
            if failure_kind(exc) in ("transient", "closed"):
                # The hub unreachable and a copy in the cache: that copy, as huggingface_hub itself does.
                try:
                    cached = _cached_snapshot(self.repo_id, self.cache_dir)
                except Exception:  # not in the cache (huggingface_hub raises several types): retry the hub
                    cached = None
                if cached is not None:
                    self.log(f"{self.repo_id}: Hugging Face cannot be reached ({_brief(exc)}); using the cached "
                             f"copy {cached}")
                    return cached
            info = self.attempt("the file list", file_list, failed=exc)
        self.commit = info.sha
        siblings = {s.rfilename: s for s in (info.siblings or [])}
        files = sorted(siblings)
        self.sizes = {name: int(s.size or (s.lfs.size if s.lfs else 0) or 0) for name, s in siblings.items()}
        self.blob_ids = {name: (s.lfs.sha256 if s.lfs else s.blob_id) for name, s in siblings.items()}
        first = needed_files(files, self.partition)
        if not first:
            raise CheckpointError(
                f"{self.repo_id}: holds no H3 model files (an official layout's transformer/, text_encoder/, vae/, "
                "audio_vae/, or a release's FL2VA/ / Ref2VA/ folder). Check the repo id.", path=self.repo_id)
        # Before any byte: what is certainly needed (the text encoder's shards are added once its index is read).
        self.check_space(first)
        layer = DEFAULT_TEXT_ENCODER_LAYER
        model_index = model_index_name(files, self.partition)
        if model_index is not None:
            block = self.read_json(model_index).get("_minimax_h3")
            if isinstance(block, dict):  # refused here, before the shards it chooses are fetched
                layer = text_encoder_layer(block, f"{self.repo_id}: {model_index}")
        index_name = text_encoder_index_name(files, self.partition)
        weight_map = None
        if index_name is not None:
            weight_map = self.read_json(index_name).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self.repo_id}: {index_name} has no 'weight_map' object; the repo's index "
                                      "is corrupt.", path=self.repo_id)
        wanted = needed_files(files, self.partition, weight_map, layer)
        missing = self.check_space(wanted)
        self.total = sum(self.sizes[name] - self.partial_bytes(name) for name in missing)
        for name in wanted:
            self.fetch(name)
        self.report(force=True)
        return self.write_ref(wanted[0])

    def blob_path(self, name: str) -> Path | None:
        blob_id = self.blob_ids.get(name)
        return self.storage / "blobs" / blob_id if blob_id else None

    def partial_bytes(self, name: str) -> int:
        blob = self.blob_path(name)
        partial = blob.with_name(blob.name + PARTIAL_SUFFIX) if blob else None
        return partial.stat().st_size if partial is not None and partial.is_file() else 0

    def cached(self, name: str) -> bool:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(self.repo_id, name, cache_dir=self.cache_dir, revision=self.commit),
                      str):
            return True
        blob = self.blob_path(name)
        return blob is not None and blob.is_file()

    def check_space(self, names: list[str]) -> list[str]:
        """The files still to fetch; refuses when they do not fit the cache's disk."""
        missing = [name for name in names if not self.cached(name)]
        needed = sum(max(0, self.sizes[name] - self.partial_bytes(name)) for name in missing)
        free = self.free_bytes(self.cache_dir)
        if needed > free:
            raise CheckpointError(
                f"{self.repo_id}: the download needs {gib(needed)} ({len(missing)} files) but only {gib(free)} is "
                f"free in {self.cache_dir}. Free some space, or set HF_HUB_CACHE (cache_dir) to a disk with room.",
                path=self.cache_dir)
        return missing

    def read_json(self, name: str) -> dict:
        path = self.fetch(name, counted=False)
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.repo_id}: {name} is not valid JSON ({exc}).", path=path) from None
        return data if isinstance(data, dict) else {}

    # -- one file --

    def fetch(self, name: str, counted: bool = True) -> str:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(self.repo_id, name, cache_dir=self.cache_dir, revision=self.commit)
        if isinstance(cached, str):
            return cached
        blob = self.blob_path(name)
        if blob is None or not blob.is_file():
            self.attempt(name, lambda: self.transfer(name, counted))
        # huggingface_hub links the blob into the snapshot (a HEAD, no body: the blob is already there).
        return self.attempt(name, lambda: hf_hub_download(
            self.repo_id, name, revision=self.commit, cache_dir=self.cache_dir, endpoint=self.endpoint,
            token=self.token))

    def transfer(self, name: str, counted: bool) -> None:
        """The file's bytes into `blobs/<etag>`, continuing a partial file with a Range request; under the lock
        huggingface_hub takes for the same blob, so two processes never append to one partial file."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.utils import WeakFileLock

        meta = get_hf_file_metadata(hf_hub_url(self.repo_id, name, revision=self.commit, endpoint=self.endpoint),
                                    token=self.token, endpoint=self.endpoint)
        lock = self.cache_dir / ".locks" / self.storage.name / f"{meta.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):
            self.transfer_locked(name, meta, counted)

    def transfer_locked(self, name: str, meta, counted: bool) -> None:
        blob = self.storage / "blobs" / meta.etag
        if blob.is_file():
            return
        blob.parent.mkdir(parents=True, exist_ok=True)
        partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
        size = meta.size if meta.size is not None else self.sizes.get(name)
        content = _ContentHash.for_etag(meta.etag, self.blob_ids.get(name), size)
        if content is None and name not in self.unverified:
            self.unverified.add(name)
            self.log(f"{self.repo_id}: {name} comes without a content hash (ETag {meta.etag!r}, none in the file "
                     "list), so only its size is checked; is HF_ENDPOINT a Hugging Face Hub?")
        while True:
            self.receive(name, meta, partial, size, content, counted)
            got = partial.stat().st_size
            if size is not None and got != size:
                raise _TransferIncomplete(f"{name}: received {got} of {size} bytes")
            digest = content.digest_of(partial) if content is not None else None
            if digest is None or digest == content.expected:
                os.replace(partial, blob)
                return
            partial.unlink()
            if name in self.mismatched:
                raise CheckpointError(
                    f"{self.repo_id}: {name} arrived twice with other bytes than the Hub lists for it ({content.kind} "
                    f"{content.expected}, received {digest}); it was deleted and nothing of it is cached. Something "
                    "between here and the Hub alters the file (a proxy, a mirror set in HF_ENDPOINT, a failing disk "
                    f"under {self.cache_dir}); run again on another network or with another cache_dir / "
                    "HF_HUB_CACHE.", path=self.repo_id)
            self.mismatched.add(name)
            self.log(f"{self.repo_id}: {name} arrived with other bytes than its {content.kind} says; deleted, "
                     "fetching it again")
            if counted:
                self.total += got  # the bar counts the bytes fetched again

    def receive(self, name: str, meta, partial: Path, size: int | None, content: _ContentHash | None,
                counted: bool) -> None:
        """Append the file's missing bytes to `partial` (all of them when the server ignores the Range), feeding
        `content` the whole file: what `partial` held first, then each chunk as it is written."""
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        start = partial.stat().st_size if partial.is_file() else 0
        if size is not None and start > size:
            partial.unlink()
            start = 0
        if content is not None:
            content.reset()
            if start:
                content.update_from(partial)  # a resumed file is checked over all its bytes
        if size is not None and start == size:
            return
        headers = build_hf_headers(token=self.token)
        if urlsplit(meta.location).netloc != urlsplit(self.endpoint).netloc:
            headers.pop("authorization", None)  # a signed CDN address: the token stays on the Hub
            headers.pop("Authorization", None)
        headers["Accept-Encoding"] = "identity"  # byte offsets must be those of the file
        if start:
            headers["Range"] = f"bytes={start}-"
        with get_session().stream("GET", meta.location, headers=headers, follow_redirects=True,
                                  timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
            if response.status_code == 416:
                partial.unlink(missing_ok=True)  # the partial file does not belong to this file: start again
            hf_raise_for_status(response)
            if start and response.status_code != 206:  # the server ignored the Range: the whole file comes
                if counted:
                    self.total += start
                start = 0
                if content is not None:
                    content.reset()
            with open(partial, "ab" if start else "wb") as out:
                for chunk in response.iter_bytes():  # as received: a cut keeps every byte that arrived
                    out.write(chunk)
                    if content is not None:
                        content.update(chunk)
                    if counted:
                        self.count(len(chunk))

    def count(self, delta: int) -> None:
        self.done += delta
        self.report()

    def report(self, force: bool = False) -> None:
        if self.progress is None or self.total <= 0:
            return
        step = max(1, self.total // PROGRESS_STEPS)
        if force and self.done == self.reported:
            return  # the end was reported already
        if force or self.done - self.reported >= step or self.done < self.reported:
            self.reported = self.done
            try:
                self.progress(min(self.done, self.total), self.total)
            except Exception as exc:  # Cancel in ComfyUI: the partial file stays and resumes next time
                raise _ProgressRaised(exc) from None

    def write_ref(self, name: str) -> Path:
        """Point the `main` ref at the commit just fetched (huggingface_hub writes refs for branch names only), so
        offline runs find it; the snapshot folder."""
        from huggingface_hub import hf_hub_download

        path = Path(self.attempt(name, lambda: hf_hub_download(
            self.repo_id, name, cache_dir=self.cache_dir, endpoint=self.endpoint, token=self.token)))
        snapshot = path.parents[len(PurePosixPath(name).parts) - 1]
        if snapshot.name != self.commit:
            raise CheckpointError(f"{self.repo_id}: the repo changed while downloading (main moved from "
                                  f"{self.commit[:12]} to {snapshot.name[:12]}); run again.", path=self.repo_id)
        return snapshot


def _cached_snapshot(repo_id: str, cache_dir: Path) -> Path:
    """The cached snapshot of `main`, without the network (the loaders check that its files are complete)."""
    from huggingface_hub import snapshot_download

    # Only the small model_index.json files are named: the cached snapshot holds just the needed text-encoder shards.
    return Path(snapshot_download(repo_id, allow_patterns=["model_index.json", "*/model_index.json"],
                                  local_files_only=True, cache_dir=cache_dir))


def download_partition(repo_id: str, partition: str, offline: bool | None, cache_dir, *,
                       progress: Progress | None = None, retry: RetryPolicy | None = None,
                       free_bytes: Callable[[Path], int] | None = None, token=None,
                       log: Callable[[str], None] | None = None) -> Path:
    """The snapshot folder of `repo_id` in the Hugging Face cache holding what a `partition` request reads.

    `progress(done_bytes, total_bytes)` follows the bytes still to fetch; `retry` sets the backoff; `free_bytes(folder)`
    the free-space query (tests inject both); `token` defaults to huggingface_hub's (HF_TOKEN, or the login)."""
    from huggingface_hub import constants

    cache = Path(cache_dir).expanduser() if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    log = log or (lambda text: print(f"h3-stream: {text}", file=sys.stderr))
    offline = offline_requested(offline)
    if offline:
        try:
            return _cached_snapshot(repo_id, cache)
        except Exception as exc:  # the hub raises many types; one message says what to do
            raise CheckpointError(
                f"{repo_id}: Offline mode is on (HF_HUB_OFFLINE) and the model is not in the local cache {cache} "
                f"({type(exc).__name__}); download it first or unset HF_HUB_OFFLINE.", path=repo_id) from None
    download = _Download(repo_id, partition, cache, progress=progress, retry=retry or DEFAULT_RETRY,
                         free_bytes=free_bytes or free_disk_bytes, token=token, log=log)
    try:
        return download.run()
    except _ProgressRaised as raised:
        raise raised.original from None
