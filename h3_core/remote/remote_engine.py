"""RemoteEngine: the pipeline's `generate`, run by an SGLang diffusion server (OpenAI-style videos API) instead of
this machine, its mp4 decoded into the same `GenerationResult` a local run returns.

What stays local: every request check (the same as `H3Pipeline.generate`'s, before anything is sent), the keyframes'
fitting to the canvas (the same as a local run's), refusing what the server cannot serve (from `GET /models`), the
decode of the server's mp4 into frames and a 32 kHz stereo waveform, and (in the CLI) the staged mp4 write.
"""

from __future__ import annotations

import base64
import io
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..errors import H3Error, RemoteError
from ..request.generation_request import GenerationRequest
from ..request.generation_result import GenerationResult
from ..request.grid import AUDIO_SAMPLE_RATE, FPS, audio_samples_for_frames
from ..request.keyframes import prepare_keyframes
from ..request.media_files import read_mp4
from . import protocol
from .videos_client import VideosClient

# How often a waiting engine looks for a cancel (seconds).
INTERRUPT_SLICE = 0.1
# A cancel is best effort: it must not keep a cancelled run waiting on a server that has gone.
CANCEL_TIMEOUT = 5.0


class RemoteEngine:
    """`RemoteEngine(url).generate(prompt, width=..., ...)` as `H3Pipeline.generate`.

    `api_key` defaults to the `H3_STREAM_API_KEY` environment variable (sent as a Bearer token; never logged or put in
    a message). `partition` ("fl2va" / "ref2va", None: any) is refused before sending when the server serves the
    other one. `timeout` bounds each HTTP connect and read, `job_timeout` the whole job (it is cancelled past it);
    `attempts`, `backoff` and `max_backoff` set the retries of connection errors and 5xx answers (4xx never retry).
    `poll_interval` is the wait between status polls. `work_dir` holds the download while it is decoded (a temporary
    folder under it, removed whatever happens)."""

    def __init__(self, url: str, *, api_key: str | None = None, partition: str | None = None,
                 timeout: float = 30.0, job_timeout: float = 7200.0, poll_interval: float = 2.0, attempts: int = 5,
                 backoff: float = 1.0, max_backoff: float = 30.0, work_dir=None,
                 log: Callable[[str], None] | None = None):
        if partition is not None and str(partition).lower() not in protocol.PARTITIONS:
            raise H3Error(f"partition {partition!r}: use one of {list(protocol.PARTITIONS)} or None.")
        for name, value in (("timeout", timeout), ("job_timeout", job_timeout), ("poll_interval", poll_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise H3Error(f"{name} {value!r}: must be a number of seconds above 0.")
        key = api_key if api_key is not None else os.environ.get(protocol.API_KEY_ENV)
        self.client = VideosClient(url, api_key=key, timeout=timeout, attempts=attempts, backoff=backoff,
                                   max_backoff=max_backoff, wait=self._wait)
        self.url = self.client.base_url
        self.partition = str(partition).lower() if partition is not None else None
        self.job_timeout, self.poll_interval = float(job_timeout), float(poll_interval)
        self.work_dir = work_dir
        self.log = log or (lambda message: None)
        self._check_interrupt: Callable[[], None] | None = None
        self._info: dict | None = None

    def __repr__(self) -> str:  # never the key
        return f"RemoteEngine({self.url!r}, partition={self.partition!r})"

    # -- waiting (a cancel is seen within INTERRUPT_SLICE) ---------------------------------------------------------

    def _check(self) -> None:
        if self._check_interrupt is not None:
            self._check_interrupt()

    def _wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self._check()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(INTERRUPT_SLICE, left))

    # -- what the server serves ------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        """`GET /models`, once per engine."""
        if self._info is None:
            self._info = self.client.get_json(protocol.MODELS_PATH)
        return self._info

    def describe_server(self) -> str:
        info = self.model_info()
        parts = [str(info.get("model_path") or "an unnamed model")]
        partition = protocol.served_partition(info)
        if partition:
            parts.append(partition.upper())
        if info.get("num_gpus"):
            parts.append(f"{info['num_gpus']} GPU(s)")
        if info.get("dit_precision"):
            parts.append(f"transformer {info['dit_precision']}")
        return ", ".join(parts)

    def check_servable(self, *, keyframes: bool) -> None:
        """Refuse, before sending, a request the server says it cannot serve."""
        info = self.model_info()
        name = info.get("model_path") or info.get("pipeline_class") or "an unnamed model"
        if protocol.serves_h3(info) is False:
            raise RemoteError(f"the server at {self.url} serves {name}, not MiniMax H3; start it with sglang serve "
                              "--model-path MiniMaxAI/MiniMax-H3 --model-variant fl2va.")
        served = protocol.served_partition(info)
        if self.partition and served and served != self.partition:
            raise RemoteError(f"partition {self.partition}: the server at {self.url} serves H3's {served.upper()} "
                              f"partition; point at a server started with --model-variant {self.partition}, or ask "
                              f"for {served}.")
        if served == "ref2va":
            what = "keyframes" if keyframes else "a text-to-video request"
            raise RemoteError(f"the server at {self.url} serves H3's Ref2VA partition, which needs reference media; "
                              f"{what} go to an FL2VA server (sglang serve --model-path MiniMaxAI/MiniMax-H3 "
                              "--model-variant fl2va).")
        if served is None:
            self.log(f"the server at {self.url} does not say which H3 partition it serves; sending the request")

    # -- one request -----------------------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest | str, /, *, progress=None, check_interrupt=None,
                 on_status: Callable[[str], None] | None = None, **fields) -> GenerationResult:
        """As `H3Pipeline.generate` (a `GenerationRequest`, or a prompt and its fields as keywords);
        `progress(done, 100)` follows the server's percent, `check_interrupt()` is called while waiting (whatever it
        raises cancels the job on the server and propagates), `on_status(text)` hears the job's status when it
        changes."""
        request = GenerationRequest.of(request, fields)
        if request.loras:
            raise H3Error(f"{request.names.loras}: a remote server applies its own LoRAs (sglang serve --lora-path, "
                          "or its /v1/set_lora endpoint); LoRA files on this machine are not sent. Remove them, or "
                          "run locally.")
        if request.has_references:
            raise H3Error(f"{' / '.join(request.names.references)}: the remote engine does not send references yet; "
                          "run Ref2VA locally.")
        width, height, num_frames = request.width, request.height, request.num_frames
        fitted = prepare_keyframes(request.keyframe_images, width, height)
        keyframes = {anchor: _png_data_uri(image) for anchor, image in zip(request.anchors, fitted)}
        self._check_interrupt = check_interrupt
        try:
            self._check()
            self.check_servable(keyframes=bool(keyframes))
            body = protocol.create_video_body(prompt=request.prompt, width=width, height=height,
                                              num_frames=num_frames, fps=FPS, steps=request.steps, seed=request.seed,
                                              video_shift=request.video_shift, audio_shift=request.audio_shift,
                                              keyframes=keyframes)
            return self._run_job(body, width, height, num_frames, progress, on_status or (lambda text: None))
        finally:
            self._check_interrupt = None

    def _run_job(self, body, width, height, num_frames, progress, on_status) -> GenerationResult:
        timings = {}
        started = time.perf_counter()
        job = self.client.post_json(protocol.VIDEOS_PATH, body)
        video_id = protocol.job_id(job)
        if video_id is None:
            raise RemoteError(f"POST {self.url}{protocol.VIDEOS_PATH} answered no job id; is this an SGLang "
                              "diffusion server?")
        self.log(f"remote job {video_id} submitted to {self.url}")
        settled = False  # the server finished the job (completed or failed): nothing to cancel
        try:
            job = self._poll(video_id, job, progress, on_status)
            settled = True
            timings["remote_job"] = time.perf_counter() - started
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="h3-remote-", dir=self.work_dir) as folder:
                path = Path(folder) / f"{video_id}.mp4"
                with open(path, "wb") as file:
                    size = self.client.download(protocol.content_path(video_id), file, check=self._check)
                timings["download"] = time.perf_counter() - started
                self.log(f"downloaded {size / 2**20:.1f} MiB from {self.url}")
                started = time.perf_counter()
                frames, waveform, fps = read_mp4(path, AUDIO_SAMPLE_RATE,
                                                 source=f"the video of job {video_id} from {self.url}")
            timings["decode"] = time.perf_counter() - started
        except _Settled:
            raise
        except BaseException:
            if not settled:
                self._cancel(video_id)
            raise
        return self._as_result(frames, waveform, fps, width, height, num_frames, video_id, timings)

    def _poll(self, video_id, job, progress, on_status) -> dict:
        deadline = time.monotonic() + self.job_timeout
        last = None
        while True:
            status = protocol.job_status(job)
            percent = protocol.job_progress(job)
            if (status, percent) != last:
                last = (status, percent)
                on_status(f"{status or 'unknown'}" + (f" {percent:.0f}%" if percent is not None else ""))
                if progress is not None and percent is not None:
                    progress(int(percent), 100)
            if status in protocol.COMPLETED:
                if progress is not None and percent != 100:
                    progress(100, 100)
                return job
            if status in protocol.FAILED:
                reason = protocol.job_error(job) or f"status {status}"
                raise _Settled(self.client.redact(f"the server at {self.url} could not make the video (job "
                                                  f"{video_id} {status}): {reason}"))
            if status not in protocol.RUNNING:
                raise RemoteError(f"the server at {self.url} reports status {status!r} for job {video_id}, which "
                                  f"is none of {sorted(protocol.RUNNING | protocol.COMPLETED | protocol.FAILED)}.")
            if time.monotonic() >= deadline:
                raise RemoteError(f"the job {video_id} on {self.url} did not finish within {self.job_timeout:g} s "
                                  "(job_timeout); it was cancelled. Give a longer job_timeout for long videos.")
            self._wait(self.poll_interval)
            job = self.client.get_json(protocol.video_path(video_id))

    def _cancel(self, video_id: str) -> None:
        """Tell the server to drop the job (DELETE; SGLang has no abort). Never raises: the run is already ending."""
        client = self.client
        saved, client.timeout = client.timeout, min(client.timeout, CANCEL_TIMEOUT)
        try:
            client.delete(protocol.video_path(video_id))
            self.log(f"cancelled remote job {video_id} on {self.url}")
        except Exception as exc:  # noqa: BLE001 - best effort
            self.log(f"could not cancel remote job {video_id} on {self.url}: {exc}")
        finally:
            client.timeout = saved

    def _as_result(self, frames, waveform, fps, width, height, num_frames, video_id, timings) -> GenerationResult:
        source = f"the video of job {video_id} from {self.url}"
        made = f"{frames.shape[2]}x{frames.shape[1]}"
        if made != f"{width}x{height}":
            raise RemoteError(f"{source} is {made} but {width}x{height} was asked; the server does not honour the "
                              "requested size (check its H3 version).")
        if frames.shape[0] != num_frames:
            raise RemoteError(f"{source} has {frames.shape[0]} frames but {num_frames} were asked; the server does "
                              "not honour the requested length (check its H3 version).")
        if abs(fps - FPS) > 0.01:
            raise RemoteError(f"{source} runs at {fps:g} fps; H3 makes {FPS} fps.")
        wanted = audio_samples_for_frames(num_frames)
        if waveform.shape[1] < wanted:  # AAC ends on a 1024-sample frame: pad the last few samples with silence
            import torch

            waveform = torch.cat([waveform, waveform.new_zeros(2, wanted - waveform.shape[1])], dim=1)
        return GenerationResult(frames.contiguous(), waveform[:, :wanted].contiguous(), timings=timings)


class _Settled(RemoteError):
    """The server's own failure of a job: nothing is left to cancel."""


def _png_data_uri(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
