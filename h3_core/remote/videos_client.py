"""VideosClient: HTTP to one videos-API server (standard library only), with timeouts, capped exponential backoff on
connection errors and 5xx answers (never on 4xx), checked downloads, and an API key that never reaches a message.
"""

from __future__ import annotations

import http.client
import json
import socket
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


def _read_within(response, seconds: float) -> bytes:
    """The whole body, or TimeoutError once it has taken `seconds` (each read has the socket's own timeout)."""
    deadline = time.monotonic() + seconds
    chunks = []
    while True:
        chunk = response.read1(1 << 16) if hasattr(response, "read1") else response.read(1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the answer took over {seconds:g} s")


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
        are spent; connection errors, timeouts, truncated bodies, 429 and 5xx are retried after a backoff (at least
        the server's Retry-After, up to RETRY_AFTER_CAP)."""
        attempts = attempts or self.attempts
        where = f"{method} {where or self.base_url + path}"
        last = ""
        status = None
        for attempt in range(1, attempts + 1):
            retry_after = 0.0
            try:
                return call()
            except urllib.error.HTTPError as exc:
                raw = exc.read() or b""
                message = protocol.error_body_message(raw) or exc.reason or ""
                if exc.code < 500 and exc.code != 429:  # 429: too many requests, come back later
                    raise self._error(f"the server refused {where} (HTTP {exc.code}): {message}", exc.code,
                                      _json_or_none(raw)) from None
                status, last = exc.code, f"HTTP {exc.code}: {message}"
                retry_after = _retry_after(exc.headers.get("Retry-After") if exc.headers else None)
            except _Truncated as exc:
                last = f"the response was cut short ({exc})"
            except TRANSIENT as exc:
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
                response.read()
        try:
            self._with_retries("DELETE", path, call, attempts)
        except RemoteError as exc:
            if exc.status not in (404, 409):
                raise

    def _json(self, method: str, path: str, body, attempts) -> dict:
        def call():
            with self._request(method, path, body, self.timeout) as response:
                raw = _read_within(response, self.answer_timeout)
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
                length = response.headers.get("Content-Length")
                expected = int(length) if length and length.isdigit() else None
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
                raise self._error(f"GET {url or self.base_url + path} answered an empty body instead of the video.")
            destination.flush()
            return got
        return self._with_retries("GET", path, call, where=url)


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
