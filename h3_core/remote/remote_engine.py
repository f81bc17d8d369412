"""RemoteEngine: the pipeline's `generate`, run by an H3 serving engine — SGLang diffusion or vLLM-Omni, told apart
by the model card it reports (or named with `backend`) — instead of this machine, its mp4 decoded into the same
`GenerationResult` a local run returns.

What stays local: every request check (the same as `H3Pipeline.generate`'s) and every limit the server enforces
(`serving_rules.py`), both before anything is encoded or sent; the keyframes' fitting and the references'
normalisation (the same as a local run's); refusing a server that serves another model; the decode of the server's
mp4 into frames and a 32 kHz stereo waveform, checked against the request; and (in the CLI) the staged mp4 write.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import H3Error, RemoteError
from ..request.audio_health import check_audio, raise_audio_errors, warning_line
from ..request.generation_request import GenerationRequest
from ..request.generation_result import GenerationResult
from ..request.grid import AUDIO_SAMPLE_RATE, FPS, audio_samples_for_frames
from ..request.media_files import read_mp4
from . import protocol, serving_rules, sglang_api, vllm_omni_api
from .videos_client import ANSWER_SECONDS, DOWNLOAD_SECONDS, VideosClient, shown_url

# The engines h3-stream speaks, by the `owned_by` of their model card (and the `backend` option's names).
APIS = {"sglang": sglang_api, "vllm-omni": vllm_omni_api}
BACKENDS = ("auto", *APIS)

# How often a waiting engine looks for a cancel (seconds).
INTERRUPT_SLICE = 0.1
# A cancel is best effort: it must not keep a cancelled run waiting on a server that has gone.
CANCEL_TIMEOUT = 5.0


class RemoteEngine:
    """`RemoteEngine(url).generate(prompt, width=..., ...)` as `H3Pipeline.generate`.

    `api_key` defaults to the `H3_STREAM_API_KEY` environment variable (sent as a Bearer token; never logged or put in
    a message). `partition` ("fl2va" / "ref2va", None: any) is the partition the server was started with, when its
    card does not say (neither engine's does): a request of the other partition's task is refused before sending.
    `backend` ("auto", "sglang", "vllm-omni") is the engine's API, auto as its model card says. `timeout` bounds each
    HTTP connect and read, `answer_timeout` each whole JSON answer and `download_timeout` each whole download (a
    server that sends a byte now and then is cut off too), `job_timeout` the whole job (it is cancelled past it);
    `attempts`, `backoff` and `max_backoff` set the retries of connection errors, 429 and 5xx answers (other 4xx
    never retry; a Retry-After is honoured). `poll_interval` is the wait between status polls. `work_dir` holds the
    download while it is decoded (a temporary folder under it, removed whatever happens)."""

    def __init__(self, url: str, *, api_key: str | None = None, partition: str | None = None,
                 backend: str = "auto", timeout: float = 30.0, job_timeout: float = 7200.0,
                 poll_interval: float = 2.0, attempts: int = 5, backoff: float = 1.0, max_backoff: float = 30.0,
                 answer_timeout: float = ANSWER_SECONDS, download_timeout: float = DOWNLOAD_SECONDS, work_dir=None,
                 log: Callable[[str], None] | None = None):
        if partition is not None and str(partition).lower() not in protocol.PARTITIONS:
            raise H3Error(f"partition {partition!r}: use one of {list(protocol.PARTITIONS)} or None.")
        if backend not in BACKENDS:
            raise H3Error(f"backend {backend!r}: use one of {list(BACKENDS)} (auto: as the server's model card says).")
        for name, value in (("timeout", timeout), ("job_timeout", job_timeout), ("poll_interval", poll_interval),
                            ("answer_timeout", answer_timeout), ("download_timeout", download_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise H3Error(f"{name} {value!r}: must be a number of seconds above 0.")
        key = (protocol.check_api_key(api_key, "api_key") if api_key is not None else
               protocol.check_api_key(os.environ.get(protocol.API_KEY_ENV), f"${protocol.API_KEY_ENV}"))
        self.client = VideosClient(url, api_key=key, timeout=timeout, attempts=attempts, backoff=backoff,
                                   max_backoff=max_backoff, wait=self._wait, answer_timeout=answer_timeout,
                                   download_timeout=download_timeout)
        self.url = self.client.base_url
        self.partition = str(partition).lower() if partition is not None else None
        self.backend = backend
        self.job_timeout, self.poll_interval = float(job_timeout), float(poll_interval)
        self.work_dir = work_dir
        self.log = log or (lambda message: None)
        self._check_interrupt: Callable[[], None] | None = None
        self._card: dict | None = None

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

    def model_card(self) -> dict:
        """`GET /v1/models`'s first card (SGLang's deprecated `/models` when there is no `/v1/models`), once."""
        if self._card is None:
            try:
                answer = self.client.get_json(protocol.MODELS_PATH)
            except RemoteError as exc:
                if exc.status != 404:
                    raise
                answer = self.client.get_json(protocol.LEGACY_MODELS_PATH)
            self._card = protocol.model_card(answer)
        return self._card

    @property
    def api(self):
        """The engine's API module (`sglang_api` / `vllm_omni_api`): the `backend` given, else the card's."""
        if self.backend != "auto":
            return APIS[self.backend]
        engine = protocol.card_engine(self.model_card())
        for api in APIS.values():
            if engine == api.OWNED_BY:
                return api
        names = " / ".join(api.NAME for api in APIS.values())
        raise RemoteError(f"the server at {self.url} does not say which engine it is (its model card is owned by "
                          f"{engine or 'nobody'!r}); h3-stream speaks {names}: set backend (--backend) to "
                          f"{' or '.join(APIS)}.")

    def describe_server(self) -> str:
        card = self.model_card()
        parts = [str(card.get("id") or card.get("model_path") or "an unnamed model")]
        try:
            parts.append(self.api.NAME)
        except RemoteError:
            pass
        served = protocol.served_partition(card)
        if served:
            parts.append(served.upper())
        elif self.partition:
            parts.append(f"{self.partition.upper()} (as set: the server does not say)")
        if card.get("num_gpus"):
            parts.append(f"{card['num_gpus']} GPU(s)")
        if card.get("dit_precision"):
            parts.append(f"transformer {card['dit_precision']}")
        return ", ".join(parts)

    def check_servable(self, request: GenerationRequest, server_lora=None):
        """Refuse, before anything is encoded or sent, a request the server cannot serve; returns the API."""
        card = self.model_card()
        name = card.get("id") or card.get("model_path") or card.get("pipeline_class") or "an unnamed model"
        api = self.api
        if protocol.serves_h3(card) is False:
            raise RemoteError(f"the server at {self.url} serves {name}, not MiniMax H3; start it with "
                              f"{api.START_COMMAND.format(partition='fl2va')}.")
        serving_rules.server_keyframes(request, api.NAME)  # a guide the engine cannot take, before the partition
        task = serving_rules.task_of(request)
        serving_rules.check_partition(task, protocol.served_partition(card), self.partition, self.url,
                                      api.START_COMMAND)
        api.check(request, server_lora)
        return api

    # -- one request -----------------------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest | str, /, *, progress=None, check_interrupt=None,
                 on_status: Callable[[str], None] | None = None, server_lora=None, **fields) -> GenerationResult:
        """As `H3Pipeline.generate` (a `GenerationRequest`, or a prompt and its fields as keywords);
        `progress(done, 100)` follows the server's percent, `check_interrupt()` is called while waiting (whatever it
        raises cancels the job on the server and propagates), `on_status(text)` hears the job's status when it
        changes. `server_lora` ("PATH[:STRENGTH]" or (path, strength)) is a LoRA file already on the server, applied
        to this request where the engine takes one per request (vLLM-Omni; SGLang's are the whole server's)."""
        request = GenerationRequest.of(request, fields)
        server_lora = serving_rules.parse_server_lora(server_lora, request.names.server_lora)
        if request.loras:
            raise H3Error(f"{request.names.loras}: LoRA files on this machine are not sent to a server; name one "
                          "already on the server with server_lora (vLLM-Omni), or set it on the server (sglang serve "
                          "--lora-path, or its /v1/set_lora endpoint). Remove them, or run locally.")
        if request.step_cache is not None:
            raise H3Error(f"{request.names.step_cache} {request.step_cache.name}: a server runs its own step cache "
                          "(SGLang and vLLM-Omni enable Cache-DiT with quality=\"high\", which they accept only on the "
                          "GPU deployments they audited), so ours cannot be applied there. Set it to off, or run "
                          "locally.")
        self._check_interrupt = check_interrupt
        try:
            self._check()
            api = self.check_servable(request, server_lora)
            materials = api.materials(request)
            self._check()
            return self._run_job(api, request, materials, progress, on_status or (lambda text: None), server_lora)
        finally:
            self._check_interrupt = None

    def _run_job(self, api, request, materials, progress, on_status, server_lora) -> GenerationResult:
        timings = {}
        started = time.perf_counter()
        job = api.post_video(self.client, request, materials, self.model_card().get("id"), server_lora)
        video_id = protocol.job_id(job)
        if video_id is None:
            raise RemoteError(f"POST {self.url}{protocol.VIDEOS_PATH} answered no job id; is this an {api.NAME} "
                              "server?")
        self.log(f"remote job {video_id} submitted to {self.url}")
        settled = False  # the server finished the job (completed or failed): nothing to cancel
        try:
            job = self._poll(api, request, video_id, job, progress, on_status)
            settled = True
            timings["remote_job"] = time.perf_counter() - started
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="h3-remote-", dir=self.work_dir) as folder:
                path = Path(folder) / f"{video_id}.mp4"
                stored = protocol.job_url(job)
                with open(path, "wb") as file:
                    if stored:
                        self.log(f"the server stored the video at {shown_url(self.client.redact(stored))}; downloading it")
                        size = self.client.download_url(stored, file, check=self._check)
                    else:
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
                self._cancel(api, video_id)
            raise
        return self._as_result(frames, waveform, fps, request.width, request.height, request.num_frames, video_id,
                               timings)

    def _poll(self, api, request, video_id, job, progress, on_status) -> dict:
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
                if api.PARTITION_REFUSAL in reason:
                    reason += (f" (the server was started with the other --model-variant; point at a server "
                               f"started with {api.START_COMMAND.format(partition=serving_rules.PARTITION_OF_TASK[serving_rules.task_of(request)])})")
                raise _Settled(self.client.redact(f"the server at {self.url} could not make the video (job "
                                                  f"{video_id} {status}): {reason}"))
            if status not in protocol.RUNNING:
                raise RemoteError(f"the server at {self.url} reports status {status!r} for job {video_id}, which "
                                  f"is none of {sorted(protocol.RUNNING | protocol.COMPLETED | protocol.FAILED)}.")
            if time.monotonic() >= deadline:
                name = request.names.job_timeout
                raise RemoteError(f"the job {video_id} on {self.url} did not finish within {self.job_timeout:g} s "
                                  f"({name}); it was cancelled. Give a longer {name} for long videos.")
            self._wait(self.poll_interval)
            try:
                job = self.client.get_json(protocol.video_path(video_id))
            except RemoteError as exc:  # vLLM-Omni answers a failed job with its error's HTTP code
                if not (isinstance(exc.body, dict) and protocol.job_status(exc.body) in protocol.FAILED):
                    raise
                job = exc.body

    def _cancel(self, api, video_id: str) -> None:
        """DELETE the job. Where the engine aborts on DELETE (vLLM-Omni) the job stops; where it only forgets the job
        (SGLang) the job runs on to its end on the server's GPUs, and the user is told so. Never raises: the run is
        already ending."""
        client = self.client
        saved, client.timeout = client.timeout, min(client.timeout, CANCEL_TIMEOUT)
        try:
            client.delete(protocol.video_path(video_id))
        except Exception as exc:  # noqa: BLE001 - best effort
            self.log(f"could not cancel remote job {video_id} on {self.url}: {exc}")
            return
        finally:
            client.timeout = saved
        if api.CAN_ABORT:
            self.log(f"cancelled remote job {video_id} on {self.url}: {api.NAME} aborted it")
        else:
            self.log(f"cancelled here; sent DELETE for remote job {video_id}, but {api.NAME} cannot abort a job: it "
                     f"goes on running on {self.url} until it ends (its GPUs stay busy meanwhile)")

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
        waveform = waveform[:, :wanted].contiguous()
        # The same audio health check as a local decode, on the server's soundtrack: an error raises before the
        # result exists (nothing is saved); warnings travel with the result and are logged.
        warnings = raise_audio_errors(check_audio(waveform, remote=True), f"the soundtrack of {source}")
        for finding in warnings:
            self.log(warning_line(finding))
        return GenerationResult(frames.contiguous(), waveform, timings=timings, audio_warnings=tuple(warnings))


class _Settled(RemoteError):
    """The server's own failure of a job: nothing is left to cancel."""
