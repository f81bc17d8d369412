"""The engines' own H3 servers in processes of their own, for the conformance tests: SGLang 0.5.23
(tests/real_servers/sglang_h3_server.py) and vLLM-Omni 0.30.0 (tests/real_servers/vllm_omni_h3_server.py). Each runs
in the venv its `tests/real_servers/build_*_venv.sh` builds (`H3_STREAM_SGLANG_VENV`, default
~/.cache/h3-stream/sglang-0.5.23; `H3_STREAM_VLLM_OMNI_VENV`, default ~/.cache/h3-stream/vllm-omni-0.30.0) and needs
ffprobe on PATH. Without them the tests skip, saying how to build them; with `H3_STREAM_REQUIRE_REAL_SERVERS=1` (CI
sets it) they fail instead, so CI cannot pass without running them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "h3-stream"
STARTUP_SECONDS = 180
# The conformance tests start vLLM-Omni's server with --api-key: /v1/* then needs this Bearer token.
VLLM_OMNI_KEY = "sk-vllm-omni-conformance-7"
# engine -> (venv variable, default venv, its build script, the server script)
ENGINES = {
    "sglang": ("H3_STREAM_SGLANG_VENV", CACHE / "sglang-0.5.23", "build_sglang_venv.sh", "sglang_h3_server.py"),
    "vllm-omni": ("H3_STREAM_VLLM_OMNI_VENV", CACHE / "vllm-omni-0.30.0", "build_vllm_omni_venv.sh",
                  "vllm_omni_h3_server.py"),
}


def venv_python(engine: str) -> Path:
    variable, default, _, _ = ENGINES[engine]
    return Path(os.environ.get(variable, default)) / "bin" / "python"


def unavailable(engine: str) -> str | None:
    if not venv_python(engine).is_file():
        return (f"{engine}'s server venv is not built ({venv_python(engine)}); run bash "
                f"tests/real_servers/{ENGINES[engine][2]}")
    if shutil.which("ffprobe") is None:
        return "ffprobe is not on PATH (the servers probe references with it); apt-get install ffmpeg"
    return None


def require(engine: str) -> None:
    import pytest  # (the rest of this module runs without it: verify_server.py uses it in ComfyUI's venv)

    reason = unavailable(engine)
    if reason:
        if os.environ.get("H3_STREAM_REQUIRE_REAL_SERVERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class EngineServer:
    """`with SGLangServer(tmp, "fl2va") as server: server.url ...`; `server.jobs()` lists what the GPU stand-in was
    handed and ran to its end (task, target or shape, conditions without their data, seed, steps, shifts)."""

    engine = ""

    def __init__(self, work: Path, *, step_seconds: float = 0.05, env: dict | None = None):
        self.work, self.step_seconds, self.env = Path(work), step_seconds, env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def arguments(self) -> list[str]:
        return ["--port", str(self.port), "--work", str(self.work), "--step-seconds", str(self.step_seconds)]

    def start(self) -> EngineServer:
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_path = self.work / "server.log"
        with open(self.log_path, "wb") as log:
            script = HERE / "real_servers" / ENGINES[self.engine][3]
            self.process = subprocess.Popen([str(venv_python(self.engine)), str(script), *self.arguments()],
                                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                            stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self) -> EngineServer:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{self.engine}'s server did not start:\n{self.log_tail()}")

    def __enter__(self) -> EngineServer:
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _log(self) -> list[dict]:
        path = self.work / "jobs.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def jobs(self) -> list[dict]:
        return [job for job in self._log() if "aborted" not in job]

    def get(self, path: str):
        """(status, parsed JSON) of a GET on the server itself, not through the client under test."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def aborted(self) -> list[str]:
        return [job["aborted"] for job in self._log() if "aborted" in job]

    def ctrl_c_during_job(self, cli_args: list[str], cwd: Path, **environment) -> subprocess.CompletedProcess:
        """`python -m h3_core generate ... --server <this>` in a child with the default SIGINT, sent Ctrl-C once it
        polls its job; returns its exit code and output."""
        from cli_fixtures import default_sigint

        polls = len(self.requests("GET", "/v1/videos/"))
        env = dict(os.environ, PYTHONPATH=str(HERE.parent), LC_ALL="C.UTF-8", **environment)
        args = [sys.executable, "-m", "h3_core", "generate", *cli_args, "--server", self.url]
        process = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=default_sigint)
        try:
            deadline = time.monotonic() + 60
            while len(self.requests("GET", "/v1/videos/")) == polls and time.monotonic() < deadline:
                time.sleep(0.05)
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=60)
        finally:
            process.kill()
        return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)

    def requests(self, method: str, path_prefix: str) -> list[str]:
        """uvicorn's access lines for `method path...`: what reached the server."""
        return [line for line in self.log_tail(100000).splitlines() if f'"{method} {path_prefix}' in line]


class SGLangServer(EngineServer):
    engine = "sglang"

    def __init__(self, work: Path, variant: str, **options):
        super().__init__(work, **options)
        self.variant, self.scheduler_port = variant, free_port()

    def arguments(self) -> list[str]:
        return [*super().arguments(), "--scheduler-port", str(self.scheduler_port), "--model-variant", self.variant]


class VllmOmniServer(EngineServer):
    engine = "vllm-omni"

    def __init__(self, work: Path, *, api_key: str | None = None, **options):
        super().__init__(work, **options)
        self.api_key = api_key

    def arguments(self) -> list[str]:
        return [*super().arguments(), *(["--api-key", self.api_key] if self.api_key else [])]


class MotoS3:
    """moto's S3 server (in the SGLang venv) with one bucket: somewhere for SGLang's cloud storage to upload results
    to, so that a job carries a `url` and `/content` refuses, as on a server configured so."""

    bucket = "h3-results"

    def __init__(self, work: Path):
        self.work, self.port = Path(work), free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MotoS3:
        return self.start().wait_ready()

    def start(self) -> MotoS3:
        self.work.mkdir(parents=True, exist_ok=True)
        with open(self.work / "moto.log", "wb") as log:
            self.process = subprocess.Popen([str(venv_python("sglang")), "-m", "moto.server", "-H", "127.0.0.1",
                                             "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self) -> MotoS3:
        # the bucket, readable by anyone (as results must be for a client to fetch them from the URL SGLang gives)
        setup = ("import boto3, json, sys, time\n"
                 "c = boto3.client('s3', endpoint_url=sys.argv[1], aws_access_key_id='test',\n"
                 "                 aws_secret_access_key='test', region_name='us-east-1')\n"
                 "for _ in range(300):\n"
                 "    try:\n"
                 "        c.create_bucket(Bucket=sys.argv[2]); break\n"
                 "    except Exception:\n"
                 "        time.sleep(0.2)\n"
                 "c.put_bucket_policy(Bucket=sys.argv[2], Policy=json.dumps({'Version': '2012-10-17', 'Statement': [\n"
                 "    {'Effect': 'Allow', 'Principal': '*', 'Action': 's3:GetObject',\n"
                 "     'Resource': f'arn:aws:s3:::{sys.argv[2]}/*'}]}))\n")
        done = subprocess.run([str(venv_python("sglang")), "-c", setup, self.url, self.bucket], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            self.__exit__()
            raise RuntimeError(f"moto's S3 server did not take the bucket:\n{done.stderr[-2000:]}")
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)

    def sglang_environment(self) -> dict:
        return {"SGLANG_CLOUD_STORAGE_TYPE": "s3", "SGLANG_S3_BUCKET_NAME": self.bucket,
                "SGLANG_S3_ENDPOINT_URL": self.url, "SGLANG_S3_ACCESS_KEY_ID": "test",
                "SGLANG_S3_SECRET_ACCESS_KEY": "test", "SGLANG_S3_REGION_NAME": "us-east-1"}
