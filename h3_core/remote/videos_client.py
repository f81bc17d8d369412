"""VideosClient: HTTP to one videos-API server (standard library only), with timeouts, capped exponential backoff on
what can recover (dropped connections, timeouts, 429 and 5xx answers; never 4xx, a refused connection, an unknown
host or a TLS mismatch), bounded answers, downloads streamed to disk, and an API key that never reaches a message.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import shutil
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from ..errors import H3Error, RemoteError
from . import protocol

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CHUNK_BYTES = 1 << 20
# Whole-answer limits (each read also has `timeout`): a server that sends a byte now and then is cut off all the same.
ANSWER_SECONDS = 120.0
DOWNLOAD_SECONDS = 3600.0
# The longest Retry-After honoured (a longer one is waited this long, then the attempt is made).
RETRY_AFTER_CAP = 120.0
# The largest JSON answer read (job objects and model cards are a few KB): a longer one is refused from its
# Content-Length before any byte, or after MAX_JSON_BYTES + 1 bytes without one. Error bodies are read up to
# ERROR_BODY_BYTES (only their message is shown).
MAX_JSON_BYTES = 16 << 20
ERROR_BODY_BYTES = 64 << 10
# OpenSSL's reasons when an https:// client meets a server that speaks plain HTTP (it reads "HTTP/1.x" as a record).
PLAIN_HTTP_REASONS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG",
                      "HTTP_REQUEST")


def check_server_url(url, name: str = "server URL") -> str:
    """`http(s)://host[:port][/prefix]`, without a trailing slash; credentials in the URL are refused (they would be
    echoed in messages: the key belongs in the environment)."""
    if not isinstance(url, str) or not url.strip():
        raise H3Error(f"{name} is empty; give the server's address, e.g. http://gpu-box:30010.")
    text = url.strip()
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise H3Error(f"{name} {text!r}: not an http:// or https:// address; write it as http://HOST:PORT, e.g. "
                      "http://gpu-box:30010 (sglang serve's --port).")
    if parsed.username or parsed.password:
        raise H3Error(f"{name}: do not put credentials in the address; set the API key in the {protocol.API_KEY_ENV} "
                      "environment variable instead.")
    try:
        parsed.port
    except ValueError:
        raise H3Error(f"{name} {text!r}: the port is not a number from 1 to 65535.") from None
    if parsed.query or parsed.fragment:
        raise H3Error(f"{name} {text!r}: give the server's base address only (no ?query or #fragment).")
    return text.rstrip("/")


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    if isinstance(reason, BaseException):
        exc = reason
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    if isinstance(exc, (socket.timeout, TimeoutError)):
        text = str(exc) if str(exc) and str(exc) != "timed out" else "timed out"
    return text


TRANSIENT = (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, http.client.HTTPException, OSError)


def shown_url(url: str) -> str:
    """A URL as messages show it: without its query (a stored result's pre-signed address carries its signature and
    access key id there) or any user:password."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")) + ("?..." if parts.query else "")


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


class CredentialsStayHome(urllib.request.HTTPRedirectHandler):
    """Redirects are followed, but the API key goes only where it was given: a redirect to another host, port or
    scheme drops `Authorization` (urllib's own handler copies every header to the new address)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for store in (new.headers, new.unredirected_hdrs):
                for name in [key for key in store if key.lower() == protocol.AUTHORIZATION_HEADER.lower()]:
                    del store[name]
        return new


def _announced_length(response) -> int | None:
    length = (response.headers.get("Content-Length") or "").strip() if response.headers else ""
    return int(length) if length.isdigit() else None


def _read_within(response, seconds: float, limit: int | None = None) -> bytes:
    """The whole body, or TimeoutError once it has taken `seconds` (each read has the socket's own timeout). With
    `limit`, a body longer than `limit` bytes raises _TooLong: from its Content-Length before any byte is read,
    otherwise after `limit + 1` bytes."""
    if limit is not None:
        announced = _announced_length(response)
        if announced is not None and announced > limit:
            raise _TooLong(announced, limit, announced=True)
    deadline = time.monotonic() + seconds
    chunks, got = [], 0
    while True:
        size = 1 << 16 if limit is None else min(1 << 16, limit + 1 - got)
        chunk = response.read1(size) if hasattr(response, "read1") else response.read(size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if limit is not None and got > limit:
            raise _TooLong(got, limit, announced=False)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the answer took over {seconds:g} s")


def _read_capped(response, limit: int) -> bytes:
    """At most `limit` bytes of a body (an error answer: only its message is wanted); b"" when it cannot be read."""
    try:
        return response.read(limit) or b""
    except (OSError, http.client.HTTPException):
        return b""


def _retry_after(value) -> float:
    """Retry-After in seconds (a number of seconds or an HTTP date); 0 when absent or unreadable."""
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime

        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return 0.0


def _json_or_none(raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


class _Truncated(Exception):
    def __init__(self, got: int, expected: int):
        super().__init__(f"got {got} of {expected} bytes")
        self.got, self.expected = got, expected


class _TooLong(Exception):
    def __init__(self, size: int, limit: int, announced: bool):
        super().__init__(f"{size} bytes")
        self.size, self.limit, self.announced = size, limit, announced


def _unrecoverable(exc: BaseException, target: str) -> str | None:
    """What to tell the user when `exc` (opening `target`) cannot be mended by another attempt; None when it may
    (a reset, a timeout, a 5xx)."""
    reason = getattr(exc, "reason", None)
    cause = reason if isinstance(reason, BaseException) else exc
    parts = urllib.parse.urlsplit(target)
    address = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
        return (f"the connection to {address} was refused: is the server running? Nothing listens on that port; "
                "start the server (sglang serve ... --port), or check the address and port.")
    if isinstance(cause, socket.gaierror) and cause.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
        return f"no host named {parts.hostname!r} is known here ({cause.strerror}); check the address."
    if isinstance(cause, ssl.SSLCertVerificationError):
        return (f"the server's TLS certificate is not trusted ({cause.verify_message or cause.reason}). Give it a "
                "certificate this machine trusts, or point SSL_CERT_FILE at the CA bundle that signed it.")
    if isinstance(cause, ssl.SSLError) and str(cause.reason).upper() in PLAIN_HTTP_REASONS:
        return f"the server at {address} speaks plain HTTP, not TLS; use http://{parts.netloc} instead of https://."
    return None


class VideosClient:
    """`attempts` tries per request in all; the wait before try n+1 is `backoff * 2**(n-1)` seconds, capped at
    `max_backoff`. `timeout` bounds each connect and each read. `wait(seconds)` does the waiting (the engine's checks
    for a cancel while it waits)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 30.0, attempts: int = 5,
                 backoff: float = 1.0, max_backoff: float = 30.0, wait: Callable[[float], None] = time.sleep,
                 answer_timeout: float = ANSWER_SECONDS, download_timeout: float = DOWNLOAD_SECONDS):
        self.base_url = check_server_url(base_url)
        self._api_key = api_key or None
        self.timeout, self.attempts, self.backoff, self.max_backoff = timeout, max(1, int(attempts)), backoff, max_backoff
        self.wait = wait
        self.answer_timeout, self.download_timeout = float(answer_timeout), float(download_timeout)
        host = urllib.parse.urlsplit(self.base_url).hostname
        # Loopback needs no proxy (and an HTTP_PROXY set for the internet must not capture it).
        handlers = [urllib.request.ProxyHandler({})] if host in LOOPBACK_HOSTS else []
        self._opener = urllib.request.build_opener(*handlers, CredentialsStayHome())

    # -- messages --------------------------------------------------------------------------------------------------

    def redact(self, text: str) -> str:
        """`text` with the API key (should a server echo it) replaced."""
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return text

    def _error(self, message: str, status: int | None = None, body=None) -> RemoteError:
        return RemoteError(self.redact(message), status=status, body=body)

    # -- requests --------------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body, timeout: float, *, url: str | None = None):
        """`body`: a dict (sent as JSON) or a `Multipart`. `url` (absolute) replaces base URL + path; the API key
        goes only to the server's own host."""
        headers = {"Accept": "application/json"}
        data = None
        if isinstance(body, Multipart):
            data, headers["Content-Type"] = body.encoded()
        elif body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        target = url or self.base_url + path
        same_host = urllib.parse.urlsplit(target).netloc == urllib.parse.urlsplit(self.base_url).netloc
        if self._api_key and same_host:
            headers[protocol.AUTHORIZATION_HEADER] = protocol.authorization_value(self._api_key)
        request = urllib.request.Request(target, data=data, headers=headers, method=method)
        opener = self._opener if same_host else urllib.request.build_opener(CredentialsStayHome())
        return opener.open(request, timeout=timeout)

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 1))

    def _with_retries(self, method: str, path: str, call, attempts: int | None = None, where: str | None = None):
        """Run `call()` (which opens and reads one response) until it succeeds, a 4xx comes back, or the attempts
        are spent; dropped connections, timeouts, truncated bodies, 429 and 5xx are retried after a backoff (at
        least the server's Retry-After, up to RETRY_AFTER_CAP). A refused connection, an unknown host and a TLS
        mismatch fail at once (`_unrecoverable`)."""
        attempts = attempts or self.attempts
        target = where or self.base_url + path
        where = f"{method} {shown_url(target)}"
        last = ""
        status = None
        for attempt in range(1, attempts + 1):
            retry_after = 0.0
            try:
                return call()
            except urllib.error.HTTPError as exc:
                raw = _read_capped(exc, ERROR_BODY_BYTES)
                message = protocol.error_body_message(raw) or exc.reason or ""
                if exc.code < 500 and exc.code != 429:  # 429: too many requests, come back later
                    raise self._error(f"the server refused {where} (HTTP {exc.code}): {message}", exc.code,
                                      _json_or_none(raw)) from None
                status, last = exc.code, f"HTTP {exc.code}: {message}"
                retry_after = _retry_after(exc.headers.get("Retry-After") if exc.headers else None)
            except _Truncated as exc:
                last = f"the response was cut short ({exc})"
            except TRANSIENT as exc:
                final = _unrecoverable(exc, target)
                if final is not None:
                    raise self._error(f"{where}: {final}") from None
                last = _reason(exc)
            if attempt < attempts:
                self.wait(max(self._delay(attempt), min(retry_after, RETRY_AFTER_CAP)))
        raise self._error(f"{where} failed {attempts} time(s), last: {last}. Check that the server runs there "
                          "(sglang serve ... --port) and is reachable from this machine.", status)

    def get_json(self, path: str, *, attempts: int | None = None) -> dict:
        return self._json("GET", path, None, attempts)

    def post_json(self, path: str, body: dict) -> dict:
        return self._json("POST", path, body, None)

    def post_form(self, path: str, form: Multipart) -> dict:
        """A multipart/form-data POST (vLLM-Omni's `POST /v1/videos` takes no JSON) answered with JSON."""
        return self._json("POST", path, form, None)

    def delete(self, path: str, *, attempts: int = 1) -> None:
        """Best effort (a cancel must not hang on a server that is gone): one try by default; a 404 (gone already)
        and a 409 (vLLM-Omni: the abort is under way) are fine."""
        def call():
            with self._request("DELETE", path, None, self.timeout) as response:
                _read_capped(response, ERROR_BODY_BYTES)  # the answer is not used
        try:
            self._with_retries("DELETE", path, call, attempts)
        except RemoteError as exc:
            if exc.status not in (404, 409):
                raise

    def _json(self, method: str, path: str, body, attempts) -> dict:
        def call():
            with self._request(method, path, body, self.timeout) as response:
                try:
                    raw = _read_within(response, self.answer_timeout, MAX_JSON_BYTES)
                except _TooLong as exc:
                    said = "announces" if exc.announced else "sent over"
                    raise self._error(f"{method} {self.base_url}{path} {said} {exc.size:,} bytes where a JSON answer "
                                      f"of a few KB is expected (at most {exc.limit:,} are read); is this an H3 "
                                      "videos server (SGLang / vLLM-Omni)?") from None
            try:
                parsed = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise self._error(f"{method} {self.base_url}{path} answered something that is not JSON "
                                  f"({raw[:80]!r}); is this an SGLang diffusion server?") from None
            if not isinstance(parsed, dict):
                raise self._error(f"{method} {self.base_url}{path} answered JSON that is not an object; is this an "
                                  "SGLang diffusion server?")
            return parsed
        return self._with_retries(method, path, call, attempts)

    def download_url(self, url: str, destination, check: Callable[[], None] | None = None) -> int:
        """As `download`, from an absolute http(s) URL (a result the server stored elsewhere)."""
        return self.download("", destination, check, url=url)

    def download(self, path: str, destination, check: Callable[[], None] | None = None, *,
                 url: str | None = None) -> int:
        """Stream the body of `GET path` into the open binary file `destination` (rewound and truncated before each
        try); a body shorter than its Content-Length is retried like a dropped connection. Returns the bytes
        written. `check()` runs between chunks (a cancel)."""
        def call():
            destination.seek(0)
            destination.truncate()
            with self._request("GET", path, None, self.timeout, url=url) as response:
                expected = _announced_length(response)
                self._check_room(expected, destination, shown_url(url or self.base_url + path))
                got = 0
                deadline = time.monotonic() + self.download_timeout
                while True:
                    if check is not None:
                        check()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the download took over {self.download_timeout:g} s")
                    try:
                        chunk = response.read(CHUNK_BYTES)
                    except http.client.IncompleteRead as exc:
                        raise _Truncated(got + len(exc.partial), expected or 0) from None
                    if not chunk:
                        break
                    destination.write(chunk)
                    got += len(chunk)
            if expected is not None and got != expected:
                raise _Truncated(got, expected)
            if got == 0:
                raise self._error(f"GET {shown_url(url or self.base_url + path)} answered an empty body instead of "
                                  "the video.")
            destination.flush()
            return got
        return self._with_retries("GET", path, call, where=url)

    def _check_room(self, announced: int | None, destination, source: str) -> None:
        """Refuse a download its folder has no room for, from its Content-Length, before any byte is written."""
        name = getattr(destination, "name", None)
        if announced is None or not isinstance(name, (str, bytes, os.PathLike)):
            return
        folder = os.path.dirname(os.path.abspath(name))
        free = shutil.disk_usage(folder).free
        if announced > free:
            raise self._error(f"GET {source} announces {announced / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB "
                              f"is free in {folder}; free some space there, or give another work_dir (TMPDIR).")


class Multipart:
    """A multipart/form-data body: text fields and files, in order (a field may repeat)."""

    def __init__(self):
        self.parts: list[tuple[str, str | bytes, str | None, str | None]] = []

    def field(self, name: str, value) -> Multipart:
        self.parts.append((name, str(value), None, None))
        return self

    def file(self, name: str, data: bytes, filename: str, media_type: str) -> Multipart:
        self.parts.append((name, data, filename, media_type))
        return self

    def encoded(self) -> tuple[bytes, str]:
        import uuid

        boundary = f"h3stream{uuid.uuid4().hex}"
        chunks = []
        for name, value, filename, media_type in self.parts:
            disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
            head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
            if media_type:
                head += f"Content-Type: {media_type}\r\n"
            chunks += [head.encode("utf-8"), b"\r\n", value if isinstance(value, bytes) else value.encode("utf-8"),
                       b"\r\n"]
        chunks.append(f"--{boundary}--\r\n".encode("ascii"))
        return b"".join(chunks), f"multipart/form-data; boundary={boundary}"
