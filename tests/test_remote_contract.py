"""The remote engine's failure handling (h3_core.remote): retries, backoff, timeouts, cut-short downloads, refused
videos, cancels, the API key — against tests/videos_api_server.py, a stand-in that can misbehave on cue. The protocol
itself (what is sent, what comes back) is tested against SGLang's own server code in tests/test_remote_sglang.py.
No test reaches the internet.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from videos_api_server import (FRAMES, HEIGHT, QUICK_SHUTDOWN, WIDTH, Behaviour, VideosApiServer, make_mp4,
                               source_frames)

from h3_core.errors import H3Error, RemoteError
from h3_core.remote import RemoteEngine, protocol
from h3_core.remote.videos_client import VideosClient, check_server_url
from h3_core.request.grid import audio_samples_for_frames

REQUEST = dict(width=WIDTH, height=HEIGHT, num_frames=FRAMES, steps=3, seed=7)
KEY = "sk-h3-contract-0123456789"


def engine(server, **options) -> RemoteEngine:
    return RemoteEngine(server.url, **{"poll_interval": 0.01, "backoff": 0.01, "attempts": 3, **options})


@pytest.fixture
def work_dir(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


# ---- the happy path ---------------------------------------------------------------------------------------------


def test_a_completed_job_decodes_to_frames_in_0_1_and_32k_stereo_and_leaves_no_download(work_dir):
    with VideosApiServer() as server:
        result = engine(server, work_dir=work_dir).generate("A fox in the snow.", **REQUEST)
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and result.frames.dtype == torch.float32
    assert 0.0 <= result.frames.min() and result.frames.max() <= 1.0
    reference = torch.from_numpy(source_frames(FRAMES, HEIGHT, WIDTH)).float() / 255  # what it encoded (H.264)
    assert (result.frames - reference).abs().mean() < 0.03
    assert result.waveform.shape == (2, audio_samples_for_frames(FRAMES)) and result.sample_rate == 32000
    assert result.fps == 24 and result.waveform.abs().max() > 0.2  # the test tones, not silence
    assert list(work_dir.iterdir()) == []  # the download is gone once decoded


def test_audio_in_another_rate_is_resampled_to_32k():
    with VideosApiServer(Behaviour(mp4=make_mp4(sample_rate=48000))) as server:
        result = engine(server).generate("x", **REQUEST)
    assert result.waveform.shape == (2, audio_samples_for_frames(FRAMES)) and result.waveform.abs().max() > 0.2


# ---- failures: each one message, nothing retried that should not be ---------------------------------------------


def test_a_4xx_shows_the_error_body_once_and_is_not_retried():
    behaviour = Behaviour(create_errors=[(422, {"detail": "num_frames must be 17n+5"})])
    with VideosApiServer(behaviour) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server).generate("x", **REQUEST)
        assert len(server.requests("POST")) == 1
    message = str(caught.value)
    assert message == (f"the server refused POST {server.url}/v1/videos (HTTP 422): num_frames must be 17n+5")
    assert caught.value.status == 422


def test_5xx_answers_are_retried_with_backoff_then_succeed():
    behaviour = Behaviour(create_errors=[(503, {"detail": "busy"}), (500, b"Internal Server Error")])
    with VideosApiServer(behaviour) as server:
        result = engine(server).generate("x", **REQUEST)
        assert len(server.requests("POST")) == 3
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)


def test_5xx_past_the_attempts_is_one_message_naming_the_last_answer():
    behaviour = Behaviour(poll_errors=[(502, {"detail": "bad gateway"})] * 3)
    with VideosApiServer(behaviour) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server).generate("x", **REQUEST)
        assert server.deleted == ["video_1"]  # the job it could not follow is cancelled
    assert str(caught.value).startswith(f"GET {server.url}/v1/videos/video_1 failed 3 time(s), last: HTTP 502: "
                                        "bad gateway. Check that the server runs there")


def test_429_is_retried_after_the_servers_retry_after():
    """Part of issue 28: 429 (too many requests) is retried, waiting at least the server's Retry-After."""
    waits = []
    behaviour = Behaviour(poll_errors=[(429, {"detail": "slow down"}, "application/json", {"Retry-After": "7"})])
    with VideosApiServer(behaviour) as server:
        remote = engine(server)
        remote.client.wait = waits.append
        result = remote.generate("x", **REQUEST)
    assert result.frames.shape[0] == FRAMES and 7.0 in waits


def test_a_server_that_sends_a_byte_now_and_then_is_cut_off():
    """Part of issue 28: each read returns within the read timeout, but the answer as a whole is bounded."""
    with VideosApiServer(Behaviour(drip_seconds=0.05)) as server:
        started = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            engine(server, answer_timeout=0.5, attempts=2).generate("x", **REQUEST)
        took = time.monotonic() - started
    assert str(caught.value).startswith(f"GET {server.url}/v1/models failed 2 time(s), last: the answer took over "
                                        "0.5 s.")
    assert took < 5


def test_the_backoff_doubles_and_is_capped():
    client = VideosClient("http://127.0.0.1:9", backoff=1.0, max_backoff=30.0)
    assert [client._delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_refused_connection_fails_at_once_naming_the_address():
    """Part of issue 28: nothing listens there, so no attempt can succeed; before, it was retried (five times and 15 s
    of backoff by default) and ended 'failed 5 time(s), last: Connection refused'."""
    waits = []
    with VideosApiServer() as server:
        url, port = server.url, server.url.rsplit(":", 1)[1]
    client = VideosClient(url, attempts=3, backoff=0.5, wait=waits.append)  # the port is closed now
    started = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        client.get_json("/v1/models")
    assert time.monotonic() - started < 2 and waits == []
    assert str(caught.value) == (f"GET {url}/v1/models: the connection to 127.0.0.1:{port} was refused: is the "
                                 "server running? Nothing listens on that port; start the server (sglang serve ... "
                                 "--port), or check the address and port.")


def test_a_dropped_connection_is_still_retried():
    waits = []
    with VideosApiServer(Behaviour(resets=2)) as server:
        client = VideosClient(server.url, attempts=3, backoff=0.5, wait=waits.append)
        assert client.get_json("/v1/models")["data"][0]["owned_by"] == "sglang"
    assert waits == [0.5, 1.0]


def test_an_unknown_host_fails_at_once(monkeypatch):
    import socket

    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)  # no resolver is asked: no network in tests
    waits = []
    client = VideosClient("http://gpu-bxo:30010", attempts=3, wait=waits.append)
    with pytest.raises(RemoteError) as caught:
        client.get_json("/v1/models")
    assert waits == [] and str(caught.value) == ("GET http://gpu-bxo:30010/v1/models: no host named 'gpu-bxo' is "
                                                 "known here (Name or service not known); check the address.")


def test_https_to_a_plain_http_server_fails_at_once_saying_use_http():
    """Before: the TLS 'wrong version number' was retried five times like a dropped connection."""
    waits = []
    with VideosApiServer() as server:
        address = server.url.removeprefix("http://")
        client = VideosClient(f"https://{address}", attempts=3, wait=waits.append)
        with pytest.raises(RemoteError) as caught:
            client.get_json("/v1/models")
        assert server.seen == []  # the TLS hello was no request
    assert waits == [] and str(caught.value) == (f"GET https://{address}/v1/models: the server at {address} speaks "
                                                 f"plain HTTP, not TLS; use http://{address} instead of https://.")


def test_a_certificate_this_machine_does_not_trust_fails_at_once(tmp_path):
    import datetime
    import ssl
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))

    class Quiet(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.handle_error = lambda request, address: None  # the refused handshake
    threading.Thread(target=server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()
    waits = []
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(RemoteError) as caught:
            VideosClient(url, attempts=3, wait=waits.append).get_json("/v1/models")
    finally:
        server.shutdown()
        server.server_close()
    assert waits == [] and str(caught.value) == (
        f"GET {url}/v1/models: the server's TLS certificate is not trusted (self-signed certificate). Give it a "
        "certificate this machine trusts, or point SSL_CERT_FILE at the CA bundle that signed it.")


def test_a_json_answer_announcing_5_gb_is_refused_before_reading_it():
    """Before: read as it came (here the server closes after 1 MiB: 'cut short', retried three times)."""
    behaviour = Behaviour(models_answer=(b"{" + b" " * (1 << 20), 5 * 10**9))
    with VideosApiServer(behaviour) as server:
        started = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            engine(server).generate("x", **REQUEST)
        assert len(server.requests("GET", "/v1/models$")) == 1 and time.monotonic() - started < 2
    assert str(caught.value) == (f"GET {server.url}/v1/models announces 5,000,000,000 bytes where a JSON answer of a "
                                 "few KB is expected (at most 16,777,216 are read); is this an H3 videos server "
                                 "(SGLang / vLLM-Omni)?")


def test_a_json_answer_without_a_length_is_read_up_to_the_limit_only(monkeypatch):
    from h3_core.remote import videos_client

    monkeypatch.setattr(videos_client, "MAX_JSON_BYTES", 1 << 20)
    card = json.dumps({"object": "list", "data": [{"id": "MiniMaxAI/MiniMax-H3", "owned_by": "sglang",
                                                   "pad": "x" * (3 << 20)}]}).encode()
    with VideosApiServer(Behaviour(models_answer=(card, None))) as server:
        with pytest.raises(RemoteError) as caught:
            VideosClient(server.url, attempts=1).get_json("/v1/models")
    assert str(caught.value) == (f"GET {server.url}/v1/models sent over 1,048,577 bytes where a JSON answer of a few "
                                 "KB is expected (at most 1,048,576 are read); is this an H3 videos server (SGLang / "
                                 "vLLM-Omni)?")


def test_a_video_its_folder_has_no_room_for_is_refused_before_the_first_byte(work_dir, monkeypatch):
    import shutil

    from h3_core.remote import videos_client

    real = shutil.disk_usage
    monkeypatch.setattr(videos_client.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with VideosApiServer() as server:
        with pytest.raises(RemoteError) as caught:
            engine(server, work_dir=work_dir).generate("x", **REQUEST)
        size = len(server.behaviour.mp4)
    assert str(caught.value).startswith(f"GET {server.url}/v1/videos/video_1/content announces {size / 2**30:.2f} GiB "
                                        "but only 0.00 GiB is free in ")
    assert str(caught.value).endswith("; free some space there, or give another work_dir (TMPDIR).")
    assert list(work_dir.iterdir()) == []


def test_a_stored_results_signed_query_never_reaches_a_message():
    """A pre-signed storage URL carries its signature (and access key id) in the query: messages show it as '?...'.
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refusing(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

    storage = ThreadingHTTPServer(("localhost", 0), Refusing)
    threading.Thread(target=storage.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()
    secret = "X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=0123abcd"
    try:
        url = f"http://localhost:{storage.server_address[1]}/bucket/video_1.mp4?{secret}"
        with VideosApiServer(Behaviour(result_url=url, polls_until_done=0)) as server:
            with pytest.raises(RemoteError) as caught:
                engine(server).generate("x", **REQUEST)
    finally:
        storage.shutdown()
        storage.server_close()
    assert "AKIAEXAMPLE" not in str(caught.value) and "0123abcd" not in str(caught.value)
    assert str(caught.value).startswith(f"the server refused GET http://localhost:{storage.server_address[1]}"
                                        "/bucket/video_1.mp4?... (HTTP 403)")


def test_a_failed_job_says_what_the_server_said_and_is_not_cancelled():
    with VideosApiServer(Behaviour(job_failure="CUDA out of memory on rank 3")) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server).generate("x", **REQUEST)
        assert server.deleted == [] and server.requests("GET", "/content$") == []
    assert str(caught.value) == (f"the server at {server.url} could not make the video (job video_1 failed): "
                                 "CUDA out of memory on rank 3")


class Cancelled(BaseException):
    """What a UI's cancel raises (ComfyUI's InterruptProcessingException, the CLI's KeyboardInterrupt)."""


def test_a_cancelled_slow_job_is_deleted_on_the_server_and_leaves_nothing(work_dir):
    checks = []

    def check_interrupt():
        checks.append(1)
        if len(checks) > 5:
            raise Cancelled

    with VideosApiServer(Behaviour(endless=True)) as server:
        with pytest.raises(Cancelled):
            engine(server, work_dir=work_dir).generate("x", **REQUEST, check_interrupt=check_interrupt)
        assert server.deleted == ["video_1"] and server.requests("GET", "/content$") == []
    assert list(work_dir.iterdir()) == []


def test_a_job_past_its_timeout_is_cancelled_with_one_message():
    with VideosApiServer(Behaviour(endless=True)) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server, job_timeout=0.2).generate("x", **REQUEST)
        assert server.deleted == ["video_1"]
    assert str(caught.value) == (f"the job video_1 on {server.url} did not finish within 0.2 s (job_timeout); it "
                                 "was cancelled. Give a longer job_timeout for long videos.")


def test_a_download_cut_short_once_is_fetched_again():
    with VideosApiServer(Behaviour(truncated_downloads=1)) as server:
        result = engine(server).generate("x", **REQUEST)
        assert len(server.requests("GET", "/content$")) == 2
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)


def test_a_download_always_cut_short_is_one_message_and_leaves_nothing(work_dir):
    with VideosApiServer(Behaviour(truncated_downloads=10)) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server, work_dir=work_dir).generate("x", **REQUEST)
        size = len(server.behaviour.mp4)
    assert str(caught.value).startswith(f"GET {server.url}/v1/videos/video_1/content failed 3 time(s), last: the "
                                        f"response was cut short (got {size // 2} of {size} bytes).")
    assert list(work_dir.iterdir()) == []


def test_a_video_of_another_size_is_refused_not_passed_on():
    with VideosApiServer(Behaviour(mp4=make_mp4(width=64))) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server).generate("x", **REQUEST)
    assert str(caught.value) == (f"the video of job video_1 from {server.url} is 64x64 but 128x64 was asked; the "
                                 "server does not honour the requested size (check its H3 version).")


def test_a_video_without_audio_is_refused():
    with VideosApiServer(Behaviour(mp4=make_mp4(audio=False))) as server:
        with pytest.raises(H3Error, match="the file has no audio track"):
            engine(server).generate("x", **REQUEST)


# ---- refused before sending -------------------------------------------------------------------------------------


def test_a_card_naming_no_pipeline_is_not_refused_for_its_name():
    """vLLM-Omni's card has only `id` / `root` (the served name, perhaps a local path): not proof of another model."""
    info = {"id": "/srv/weights/minimax", "owned_by": "sglang"}
    with VideosApiServer(Behaviour(info=info, polls_until_done=0)) as server:
        assert engine(server).generate("x", **REQUEST).frames.shape[0] == FRAMES


@pytest.mark.parametrize("info,message", [
    ({"id": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "owned_by": "sglang", "pipeline_class": "WanPipeline"},
     "serves Wan-AI/Wan2.1-T2V-1.3B-Diffusers, not MiniMax H3; start it with sglang serve --model-path "
     "MiniMaxAI/MiniMax-H3 --model-variant fl2va --port 30010."),
    ({"id": "MiniMaxAI/MiniMax-H3", "owned_by": "somebody"},
     "does not say which engine it is (its model card is owned by 'somebody'); h3-stream speaks SGLang / vLLM-Omni: "
     "set backend (--backend) to sglang or vllm-omni."),
])
def test_what_the_server_cannot_serve_is_refused_before_sending(info, message):
    with VideosApiServer(Behaviour(info=info)) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server).generate("x", **REQUEST)
        assert server.requests("POST") == []
    assert message in str(caught.value)


def test_local_lora_files_are_refused_before_anything_is_sent(tmp_path):
    with VideosApiServer() as server:
        with pytest.raises(H3Error, match="^loras: LoRA files on this machine are not sent to a server; name one "
                                          "already on the server with server_lora"):
            engine(server).generate("x", **REQUEST, loras=[(tmp_path / "a.safetensors", 1.0)])
        assert server.seen == []


def test_bad_requests_are_refused_as_the_local_pipeline_refuses_them():
    with VideosApiServer() as server:
        with pytest.raises(H3Error, match="^steps 1: must be at least 2"):
            engine(server).generate("x", **{**REQUEST, "steps": 1})
        assert server.seen == []


@pytest.mark.parametrize("url,message", [
    ("gpu-box:30010", "server URL 'gpu-box:30010': not an http:// or https:// address"),
    ("http://user:pw@gpu-box:30010", "server URL: do not put credentials in the address; set the API key in the "
                                     "H3_STREAM_API_KEY environment variable instead."),
    ("http://gpu-box:99999", "server URL 'http://gpu-box:99999': the port is not a number from 1 to 65535."),
    ("", "server URL is empty"),
])
def test_a_bad_server_url_is_one_message(url, message):
    with pytest.raises(H3Error) as caught:
        check_server_url(url)
    assert str(caught.value).startswith(message)


# ---- the API key --------------------------------------------------------------------------------------------------


def test_the_api_key_comes_from_the_environment_and_never_appears_in_a_message(monkeypatch):
    monkeypatch.setenv(protocol.API_KEY_ENV, KEY)
    with VideosApiServer(Behaviour(required_key=KEY)) as server:
        result = engine(server).generate("x", **REQUEST)
        assert {s.headers.get("Authorization") for s in server.seen} == {f"Bearer {KEY}"}
    assert result.frames.shape[0] == FRAMES
    # A server that echoes the credentials it got (in a 401 body, in a failed job) does not get them repeated.
    monkeypatch.setenv(protocol.API_KEY_ENV, KEY + "-wrong")
    logged = []
    with VideosApiServer(Behaviour(required_key=KEY)) as server:
        remote = engine(server, log=logged.append)
        with pytest.raises(RemoteError) as caught:
            remote.generate("x", **REQUEST)
    assert "***" in str(caught.value) and KEY not in str(caught.value)
    assert KEY not in repr(remote) and not any(KEY in line for line in logged)
    monkeypatch.setenv(protocol.API_KEY_ENV, KEY)
    with VideosApiServer(Behaviour(job_failure=f"token {KEY} has no quota")) as server:
        with pytest.raises(RemoteError) as caught:
            engine(server).generate("x", **REQUEST)
    assert str(caught.value).endswith("token *** has no quota")


def test_a_stored_result_is_fetched_from_its_url_without_the_key_when_another_host():
    """SGLang with cloud storage gives the result's URL (tests/test_remote_sglang.py follows a real one); the Bearer
    token is the server's, so it is not sent to the storage host."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Storage(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(dict(self.headers))
            body = make_mp4()
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    storage = ThreadingHTTPServer(("localhost", 0), Storage)  # another host name than the server's 127.0.0.1
    thread = threading.Thread(target=storage.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True)
    thread.start()
    try:
        url = f"http://localhost:{storage.server_address[1]}/bucket/video_1.mp4"
        with VideosApiServer(Behaviour(required_key=KEY, result_url=url, polls_until_done=0)) as server:
            result = engine(server, api_key=KEY).generate("x", **REQUEST)
            assert server.requests("GET", "/content$") == []
    finally:
        storage.shutdown()
        storage.server_close()
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert len(seen) == 1 and "Authorization" not in seen[0]


def test_a_redirect_to_another_host_does_not_carry_the_key():
    """A server (127.0.0.1) that redirects to another address (127.0.0.2): the key stays behind; a redirect within
    the server keeps it. (Part of issue 28.)"""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Recorder(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append((self.server.server_address[0], self.path, self.headers.get("Authorization")))
            if self.path == "/v1/models":  # the first server sends the client elsewhere
                self.send_response(302)
                self.send_header("Location", self.server.redirect_to)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.dumps({"object": "list", "data": [{"id": "MiniMaxAI/MiniMax-H3", "owned_by": "sglang"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    servers = [ThreadingHTTPServer((address, 0), Recorder) for address in ("127.0.0.1", "127.0.0.2")]
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs=QUICK_SHUTDOWN, daemon=True).start()
    home, elsewhere = servers
    try:
        for target, keeps in ((f"http://127.0.0.2:{elsewhere.server_address[1]}/cards", False),
                              (f"http://127.0.0.1:{home.server_address[1]}/cards", True)):
            seen.clear()
            home.redirect_to = target
            client = VideosClient(f"http://127.0.0.1:{home.server_address[1]}", api_key=KEY, attempts=1)
            assert client.get_json("/v1/models")["data"][0]["owned_by"] == "sglang"
            assert seen[0][2] == f"Bearer {KEY}" and seen[1][1] == "/cards"
            assert (seen[1][2] == f"Bearer {KEY}") is keeps
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


# ---- the CLI ------------------------------------------------------------------------------------------------------


CLI_REQUEST = ["--size", f"{WIDTH}x{HEIGHT}", "--frames", str(FRAMES), "--steps", "3"]


def test_the_cli_shows_a_refusal_in_one_line_with_exit_code_2(run_cli, tmp_path):
    behaviour = Behaviour(create_errors=[(400, {"detail": "Invalid request body: seed"})], required_key=None)
    with VideosApiServer(behaviour) as server:
        done = run_cli(["generate", "x", "--server", server.url, *CLI_REQUEST, "--out", "x.mp4"], tmp_path)
    assert done.returncode == 2
    error_lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert error_lines == [f"error: the server refused POST {server.url}/v1/videos (HTTP 400): Invalid request body: "
                           "seed"]
    assert "Traceback" not in done.stderr and not (tmp_path / "x.mp4").exists()


def test_the_job_timeout_flag_bounds_the_job_in_one_line(run_cli, tmp_path):
    """Part of issue 28: the job's time limit is the user's (--job-timeout), and its message names the flag."""
    with VideosApiServer(Behaviour(endless=True)) as server:
        done = run_cli(["generate", "x", "--server", server.url, *CLI_REQUEST, "--job-timeout", "0.3", "--out",
                        "x.mp4"], tmp_path)
        assert server.deleted == ["video_1"]
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"error: the job video_1 on {server.url} did not finish within 0.3 s (--job-timeout); it was cancelled. Give "
        "a longer --job-timeout for long videos.")
    assert not (tmp_path / "x.mp4").exists()
    done = run_cli(["generate", "x", "--server", "http://127.0.0.1:9", *CLI_REQUEST, "--job-timeout", "0"], tmp_path)
    assert done.returncode == 2 and done.stderr == "error: --job-timeout 0: must be a number of seconds above 0.\n"


def test_server_flags_without_a_server_are_one_line_with_exit_code_2(run_cli, tmp_path):
    done = run_cli(["generate", "x", "--backend", "vllm-omni", *CLI_REQUEST], tmp_path)
    assert done.returncode == 2 and done.stderr == ("error: --backend vllm-omni: names a server's engine; give --server "
                                                    "URL too, or drop it.\n")
    done = run_cli(["generate", "x", "--job-timeout", "60", *CLI_REQUEST], tmp_path)
    assert done.returncode == 2 and done.stderr == ("error: --job-timeout 60: is for a server job; give --server URL "
                                                    "too, or drop it.\n")
    done = run_cli(["generate", "x", "--server-lora", "/models/turbo.safetensors", *CLI_REQUEST], tmp_path)
    assert done.returncode == 2 and done.stderr == ("error: --server-lora /models/turbo.safetensors: is for a server; "
                                                    "give --server URL too, or drop it (a LoRA file on this machine "
                                                    "goes with --lora).\n")


def test_the_cli_refuses_local_loras_with_a_server(run_cli, tmp_path):
    lora = tmp_path / "turbo.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(lora))
    done = run_cli(["generate", "x", "--server", "http://127.0.0.1:9", *CLI_REQUEST, "--lora", str(lora)], tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: --lora: LoRA files on this machine are not sent to a "
                                                           "server; name one already on the server with --server-lora")


@pytest.mark.parametrize("server,message", [
    ("gpu-box:30010", "error: --server 'gpu-box:30010': not an http:// or https:// address"),
    ("http://me:secret@gpu-box:30010", "error: --server: do not put credentials in the address; set the API key in "
                                       "the H3_STREAM_API_KEY environment variable instead."),
])
def test_a_bad_server_flag_is_one_line_with_exit_code_2(server, message, run_cli, tmp_path):
    done = run_cli(["generate", "x", "--server", server, *CLI_REQUEST], tmp_path)
    assert done.returncode == 2 and done.stderr.startswith(message) and done.stderr.count("\n") == 1
    assert "secret" not in done.stderr



def test_the_cli_says_a_refused_connection_in_one_line_at_once(run_cli, tmp_path):
    with VideosApiServer() as server:
        url, port = server.url, server.url.rsplit(":", 1)[1]
    started = time.monotonic()
    done = run_cli(["generate", "x", "--server", url, *CLI_REQUEST, "--out", "x.mp4"], tmp_path)
    assert time.monotonic() - started < 5  # before: 15 s of backoff (1 + 2 + 4 + 8), then the error
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"error: GET {url}/v1/models: the connection to 127.0.0.1:{port} was refused: is the server running? Nothing "
        "listens on that port; start the server (sglang serve ... --port), or check the address and port.")
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [done.stderr.splitlines()[-1]]
