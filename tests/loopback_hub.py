"""A loopback HTTP server standing in for the Hugging Face Hub, with failures injected on request.

It serves what huggingface_hub 2.x calls for a model download, with the headers it reads (its `hf_api.py`,
`file_download.py` `get_hf_file_metadata`, `utils/_http.py`):
* `GET /api/models/<repo>[/revision/<rev>]?blobs=true`: the file list; each file's `size` and `blobId` (git's blob
  sha1), and for an LFS file (`Repo.lfs_suffixes`) an `lfs` object with its `sha256` and `size` (its `blobId` is then
  the pointer file's);
* `HEAD` / `GET /<repo>/resolve/<rev>/<file>`: a file stored in git is answered here (200, `ETag` its git sha1,
  `Content-Length`, `X-Repo-Commit`); an LFS file is a 302 to a second server on another port standing in for the
  CDN (another origin: huggingface_hub stops there and reads `X-Linked-Etag` (the sha256), `X-Linked-Size` and
  `X-Repo-Commit` from the 302; its `ETag` is the pointer's, which a client must not take for the file's);
* the CDN: `GET /lfs/<sha256>` with Range support.
Every request is logged under the repo file it is for, with its Range and Authorization headers; bytes of file bodies
served are counted per file.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from videos_api_server import QUICK_SHUTDOWN

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # an injected reset makes the handler's last flush fail
        pass


@dataclass
class Request:
    method: str
    path: str  # the repo file for /resolve/ and CDN requests, "api" for the file list
    range: str | None
    authorization: str | None
    cdn: bool = False  # sent to the CDN stand-in, not the Hub


def git_blob_sha1(data: bytes) -> str:
    """git's object name of a file (`git hash-object`): the Hub's ETag and `blobId` of a file stored in git."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The pointer file git stores for an LFS file."""
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = COMMIT
    status: int | None = None  # answer every request of this repo with this status (401, 403, ...)
    ranges: bool = True  # False: ignore Range headers and send whole files, as some proxies do
    lfs_suffixes: tuple = (".safetensors", ".bin", ".mp4")  # what .gitattributes sends to LFS

    def is_lfs(self, name: str) -> bool:
        return name.endswith(self.lfs_suffixes)

    def etag(self, name: str) -> str:
        """The file's content hash as the Hub gives it: sha256 for LFS files, git's blob sha1 otherwise."""
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(name) else git_blob_sha1(data)


@dataclass
class LoopbackHub:
    """`failures[(method, path)]` is a list of what the next requests get, one entry each: "reset" (the connection is
    reset before an answer), "cut:N" (headers and the first N bytes of the body, then the connection closes),
    "corrupt" (the body at its full length, one byte changed), or an HTTP status such as 503. A GET of an LFS file
    is keyed by the repo file's name although the CDN answers it."""

    repos: dict[str, Repo]
    failures: dict[tuple[str, str], list] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    bytes_served: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub.handle(self, "GET")

            def do_HEAD(self):
                hub.handle(self, "HEAD")

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.cdn = _QuietServer(("127.0.0.1", 0), Handler)
        self.threads = []
        for server in (self.server, self.cdn):
            server.daemon_threads = True
            self.threads.append(threading.Thread(target=server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        for server in (self.server, self.cdn):
            server.shutdown()
            server.server_close()

    def fail(self, method: str, path: str, *outcomes) -> None:
        self.failures.setdefault((method, path), []).extend(outcomes)

    def requested(self, method: str | None = None) -> list[str]:
        """The paths asked for, in order (file paths for /resolve/, "api" for the file list)."""
        return [r.path for r in self.requests if method is None or r.method == method]

    # ---- serving ----

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(handler.path)
        path = unquote(parts.path).lstrip("/")
        repo_id, name, kind = None, None, None
        on_cdn = handler.server is self.cdn
        if on_cdn:
            if path.startswith("lfs/"):
                repo_id, name = next(((r, n) for r, repo in self.repos.items() for n in repo.files
                                      if repo.is_lfs(n) and repo.etag(n) == path[4:]), (None, None))
                kind = "cdn" if name else None
        elif path.startswith("api/models/"):
            rest = path[len("api/models/"):].split("/")
            repo_id, kind, name = "/".join(rest[:2]), "api", "api"
        else:
            pieces = path.split("/")
            if len(pieces) >= 5 and pieces[2] == "resolve":
                repo_id, kind, name = "/".join(pieces[:2]), "resolve", "/".join(pieces[4:])
        repo = self.repos.get(repo_id)
        # A GET of an LFS file is answered by the CDN (after the Hub's 302): its failures are injected there.
        redirected = kind == "resolve" and repo is not None and name in repo.files and repo.is_lfs(name)
        with self.lock:
            self.requests.append(Request(method, name or path, handler.headers.get("Range"),
                                         handler.headers.get("Authorization"), on_cdn))
            queue = None if redirected and method == "GET" else self.failures.get((method, name or path))
            outcome = queue.pop(0) if queue else None
        if outcome == "reset":
            self._reset(handler)
            return
        if isinstance(outcome, int):
            self._send(handler, outcome, b"injected failure", {})
            return
        if kind is None:
            self._send(handler, 404, b"not found", {})
        elif repo is None:
            self._send(handler, 404, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
        elif repo.status is not None and not on_cdn:
            self._send(handler, repo.status, b"Access denied", {})
        elif kind == "api":
            siblings = []
            for n, b in sorted(repo.files.items()):
                if repo.is_lfs(n):
                    pointer = lfs_pointer(b)
                    siblings.append({"rfilename": n, "size": len(b), "blobId": git_blob_sha1(pointer),
                                     "lfs": {"sha256": repo.etag(n), "size": len(b), "pointerSize": len(pointer)}})
                else:
                    siblings.append({"rfilename": n, "size": len(b), "blobId": git_blob_sha1(b)})
            body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                               "siblings": siblings}).encode()
            self._send(handler, 200, body, {"Content-Type": "application/json"})
        elif name not in repo.files:
            self._send(handler, 404, b"Entry not found", {"X-Error-Code": "EntryNotFound",
                                                          "X-Repo-Commit": repo.commit})
        elif redirected:
            # The real Hub's answer for an LFS file: a 302 to the CDN carrying the file's metadata.
            data = repo.files[name]
            self._send(handler, 302, b"Found. Redirecting", {
                "Location": f"{self.cdn_url}/lfs/{repo.etag(name)}", "X-Repo-Commit": repo.commit,
                "X-Linked-Etag": f'"{repo.etag(name)}"', "X-Linked-Size": str(len(data)),
                "ETag": f'"{git_blob_sha1(lfs_pointer(data))}"'})
        else:
            self._serve_file(handler, method, repo, name, outcome)

    def _serve_file(self, handler, method, repo: Repo, name: str, outcome) -> None:
        data = repo.files[name]
        if outcome == "corrupt":  # the full length, one byte changed: only a content hash tells
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if handler.server is not self.cdn:
            headers.update({"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(name)}"'})
        start = 0
        wanted = handler.headers.get("Range")
        status = 200
        if wanted and method == "GET" and repo.ranges:
            start = int(wanted.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self._send(handler, 416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if method == "HEAD":
            headers["Content-Length"] = str(len(data))
            handler.send_response(200)
            for key, value in headers.items():
                handler.send_header(key, value)
            handler.end_headers()
            return
        if isinstance(outcome, str) and outcome.startswith("cut:"):
            sent = body[:int(outcome[4:])]
            handler.send_response(status)
            for key, value in headers.items():
                handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(sent)
            handler.wfile.flush()
            self._count(name, len(sent))
            handler.close_connection = True  # a clean close mid-body: the client has the first N bytes
            handler.connection.shutdown(socket.SHUT_WR)
            return
        self._send(handler, status, body, headers)
        self._count(name, len(body))

    def _count(self, name: str, n: int) -> None:
        with self.lock:
            self.bytes_served[name] = self.bytes_served.get(name, 0) + n

    @staticmethod
    def _send(handler, status: int, body: bytes, headers: dict) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    @staticmethod
    def _reset(handler) -> None:
        """Close with a TCP reset (SO_LINGER 0), as a dropped connection looks to the client."""
        handler.close_connection = True
        try:
            handler.wfile.flush()
        except OSError:
            pass
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.connection.close()
