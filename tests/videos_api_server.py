"""A local stand-in for an SGLang diffusion server, for the failure cases a real one cannot be made to show on cue
(error answers, 5xx, a failing or endless job, a cut-short download, a server that echoes credentials, a video of
another size). The protocol itself is tested against SGLang's own server code (tests/test_remote_sglang.py); this
stand-in answers as that code does where it answers at all — `GET /v1/models` (a card owned by "sglang"),
`POST /v1/videos`, `GET /v1/videos/{id}`, `DELETE /v1/videos/{id}`, `GET /v1/videos/{id}/content`, FastAPI-style
`{"detail": ...}` errors.

Its mp4s are written with PyAV directly (the reference library), not with h3-stream's writer.
"""

from __future__ import annotations

import functools
import io
import json
import re
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

# serve_forever polls for shutdown every 0.5 s by default: half a second of every test's teardown.
QUICK_SHUTDOWN = {"poll_interval": 0.01}

# The card SGLang 0.5.23's GET /v1/models answers for H3 (common_api.py), on 4 GPUs.
H3_INFO = {"id": "MiniMaxAI/MiniMax-H3", "object": "model", "owned_by": "sglang", "root": "MiniMaxAI/MiniMax-H3",
           "num_gpus": 4, "task_type": "TI2V", "supported_task_types": ["TI2V"], "dit_precision": "bf16",
           "vae_precision": "fp32", "pipeline_name": "MiniMaxH3Pipeline", "pipeline_class": "MiniMaxH3Pipeline"}
# The smallest request an SGLang H3 server serves: 16:9 at short edge 64 (128x64), 4.46 s (107 frames).
WIDTH, HEIGHT, FRAMES = 128, 64, 107


def source_frames(num_frames: int, height: int, width: int) -> np.ndarray:
    """Smooth colour ramps that move a little every frame: easy for H.264, easy to compare after decoding."""
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for index in range(num_frames):
        red = (x / max(width - 1, 1)) * 200 + 20
        green = (y / max(height - 1, 1)) * 200 + 20
        blue = np.full_like(red, 60 + 20 * index)
        frames.append(np.stack([red, green, blue], axis=-1))
    return np.clip(np.stack(frames), 0, 255).astype(np.uint8)


def source_audio(num_samples: int, rate: int, soundtrack: str = "tones") -> np.ndarray:
    """Two test tones; or a bad soundtrack for the audio health check (what a broken server decoder would send):
    "constant-1" (every sample -1.0), "zeros", "dc" (the tones on a +0.3 offset), "clipped" (the tones 1.5 x over full
    scale, a third of the samples on the rails), "quiet" (the tones at -70 dBFS)."""
    t = np.arange(num_samples) / rate
    tones = np.stack([0.4 * np.sin(2 * np.pi * 440 * t), 0.4 * np.sin(2 * np.pi * 660 * t)])
    shaped = {"tones": lambda: tones, "constant-1": lambda: np.full_like(tones, -1.0),
              "zeros": lambda: np.zeros_like(tones), "dc": lambda: tones + 0.3,
              "clipped": lambda: np.clip(tones * 3.75, -1.0, 1.0), "quiet": lambda: tones * 10 ** (-70 / 20) / 0.4}
    return shaped[soundtrack]().astype(np.float32)


@functools.lru_cache(maxsize=16)
def make_mp4(num_frames: int = FRAMES, width: int = WIDTH, height: int = HEIGHT, fps: int = 24,
             sample_rate: int = 32000, audio: bool = True, soundtrack: str = "tones") -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "h264"
        video = container.add_stream(codec, rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = None
        if audio:
            sound = container.add_stream("aac", rate=sample_rate)
            sound.layout = "stereo"
        for image in source_frames(num_frames, height, width):
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if sound is not None:
            samples = int(np.ceil(sample_rate / fps * num_frames))
            block = av.AudioFrame.from_ndarray(source_audio(samples, sample_rate, soundtrack), format="fltp", layout="stereo")
            block.sample_rate = sample_rate
            for packet in sound.encode(block):
                container.mux(packet)
            for packet in sound.encode():
                container.mux(packet)
    return buffer.getvalue()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a reset connection makes the handler's last flush fail
        if not isinstance(sys.exc_info()[1], (OSError, ValueError)):
            super().handle_error(request, client_address)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict
    body: dict | None


@dataclass
class Behaviour:
    """What the server does; lists of (status, body) are answered first, one per request, then it behaves."""

    info: dict = field(default_factory=lambda: dict(H3_INFO))
    mp4: bytes = b""
    polls_until_done: int = 2  # GET /v1/videos/{id} answers "in_progress" this many times, then "completed"
    job_failure: str | None = None  # the job ends "failed" with this message
    endless: bool = False  # the job never finishes
    create_errors: list = field(default_factory=list)
    poll_errors: list = field(default_factory=list)
    content_errors: list = field(default_factory=list)
    truncated_downloads: int = 0  # this many content answers stop halfway
    required_key: str | None = None  # answer 401 (echoing the header received) without this Bearer key
    drip_seconds: float = 0.0  # JSON answers are sent one byte every this many seconds
    result_url: str | None = None  # the completed job carries this `url` and /content refuses, as SGLang's does
    #                                with cloud storage
    models_answer: tuple | None = None  # (body bytes, Content-Length or None) for GET /v1/models: a body longer
    #                                     than it says, or one without a length, ended by closing the connection
    resets: int = 0  # this many requests are answered by a TCP reset (a dropped connection)


class VideosApiServer:
    def __init__(self, behaviour: Behaviour | None = None):
        self.behaviour = behaviour or Behaviour()
        if not self.behaviour.mp4:
            self.behaviour.mp4 = make_mp4()
        self.seen: list[Seen] = []
        self.jobs: dict[str, dict] = {}
        self.deleted: list[str] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def requests(self, method: str | None = None, pattern: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if (method is None or s.method == method) and re.search(pattern, s.path)]

    # -- the handler ---------------------------------------------------------------------------------------------

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _body(self):
                length = int(self.headers.get("Content-Length") or 0)
                if not length:
                    return None
                try:
                    return json.loads(self.rfile.read(length))
                except ValueError:
                    return None

            def _send(self, status: int, payload, content_type="application/json", headers=None):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                if server.behaviour.drip_seconds and status == 200 and content_type == "application/json":
                    for byte in data:  # a byte now and then: each read is quick, the answer never ends in time
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(server.behaviour.drip_seconds)
                    return
                self.wfile.write(data)

            def _route(self, method):
                body = self._body() if method == "POST" else None
                with server._lock:
                    server.seen.append(Seen(method, self.path, dict(self.headers), body))
                b = server.behaviour
                if b.resets:
                    b.resets -= 1
                    self.close_connection = True
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    return None
                if method == "GET" and self.path == "/v1/models" and b.models_answer is not None:
                    data, length = b.models_answer
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    if length is not None:
                        self.send_header("Content-Length", str(length))
                    self.end_headers()
                    try:
                        self.wfile.write(data)
                        self.wfile.flush()
                    except OSError:  # the client stopped reading
                        pass
                    self.close_connection = True
                    return None
                if b.required_key and self.headers.get("Authorization") != f"Bearer {b.required_key}":
                    # Echoes what it received, as a careless server might: the client must not repeat it.
                    return self._send(401, {"detail": f"bad credentials: {self.headers.get('Authorization')}"})
                if method == "GET" and self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [b.info]})
                if method == "POST" and self.path == "/v1/videos":
                    if b.create_errors:
                        return self._send(*b.create_errors.pop(0))
                    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
                        return self._send(400, {"detail": "Invalid request body: prompt is required"})
                    with server._lock:
                        video_id = f"video_{len(server.jobs) + 1}"
                        server.jobs[video_id] = {"id": video_id, "object": "video", "status": "queued",
                                                 "progress": 0, "polls": 0}
                    return self._send(200, server._public(video_id))
                match = re.fullmatch(r"/v1/videos/([^/]+)(/content)?", self.path)
                if not match or match.group(1) not in server.jobs:
                    return self._send(404, {"detail": "Video not found"})
                video_id, content = match.group(1), bool(match.group(2))
                job = server.jobs[video_id]
                if method == "DELETE":
                    with server._lock:
                        server.deleted.append(video_id)
                        job["status"] = "deleted"
                    return self._send(200, server._public(video_id))
                if content:
                    if b.result_url:
                        return self._send(400, {"detail": "Video has been uploaded to cloud storage. Please use the "
                                                          f"cloud URL: {b.result_url}"})
                    if b.content_errors:
                        return self._send(*b.content_errors.pop(0))
                    if job["status"] != "completed":
                        return self._send(404, {"detail": "Generation is still in-progress"})
                    if b.truncated_downloads:
                        b.truncated_downloads -= 1
                        self.send_response(200)
                        self.send_header("Content-Type", "video/mp4")
                        self.send_header("Content-Length", str(len(b.mp4)))
                        self.end_headers()
                        self.wfile.write(b.mp4[: len(b.mp4) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        return None
                    return self._send(200, b.mp4, "video/mp4")
                if b.poll_errors:
                    return self._send(*b.poll_errors.pop(0))
                with server._lock:
                    if job["status"] in ("queued", "in_progress"):
                        job["polls"] += 1
                        if b.endless or job["polls"] <= b.polls_until_done:
                            job["status"] = "in_progress"
                            job["progress"] = min(95, 100 * job["polls"] // (b.polls_until_done + 1))
                        elif b.job_failure:
                            job["status"], job["error"] = "failed", {"message": b.job_failure}
                        else:
                            job["status"], job["progress"] = "completed", 100
                            if b.result_url:
                                job["url"] = b.result_url
                return self._send(200, server._public(video_id))

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_DELETE(self):
                self._route("DELETE")

        return Handler

    def _public(self, video_id: str) -> dict:
        return {k: v for k, v in self.jobs[video_id].items() if k != "polls"}
