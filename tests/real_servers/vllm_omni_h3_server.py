"""vLLM-Omni 0.30.0's own OpenAI server for MiniMax H3, on loopback, with only the engine replaced.

Run with the Python of the venv `tests/real_servers/build_vllm_omni_venv.sh` builds (never the project's):

    python vllm_omni_h3_server.py --port P --work DIR [--step-seconds S] [--api-key K]

What is vLLM-Omni's own code: the command line (vllm's `make_arg_parser` on `--model MiniMaxAI/MiniMax-H3`, as
`vllm serve MiniMaxAI/MiniMax-H3 --omni` parses it), vllm's `build_app` (auth middleware, error handlers), vLLM-Omni's
router and `omni_init_app_state` (the pure-diffusion branch), the multipart form parsing of `POST /v1/videos`, the
request lowering (`OmniOpenAIServingVideo`), the job store, the storage, the mp4 muxing, and MiniMax H3's request
checks (`encoder_processing.prepare_encoder_inputs`, which the H3 pipeline runs first: task, counts, duration,
canvas, keyframes, references probed with ffprobe, which must be on PATH).

What is replaced: the engine client (`AsyncOmni`), which would run the GPU pipeline. The stand-in runs the H3 checks
above, emits the pipeline's "request started" event, waits `--step-seconds` per model call (an abort cancels it, as
the engine's does) and returns frames and 32 kHz stereo audio of the resolved shape. A marker file records every job
it ran to its end and every abort.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

MODEL = "MiniMaxAI/MiniMax-H3"


def _define_torchvision_schemas() -> None:
    # PyPI's torchvision links CUDA, so its C ops do not register here; the imports only need the schemas.
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _define_torchvision_schemas.library = library  # keep it alive


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--work", required=True, help="a folder for the storage and the job log")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="time per model call of the stand-in")
    parser.add_argument("--api-key", default=None)
    options = parser.parse_args(argv)
    work = Path(options.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_OMNI_SERVER_STORAGE__PATH"] = str(work / "storage")
    os.environ["VLLM_OMNI_STORAGE_PATH"] = str(work / "storage")

    _define_torchvision_schemas()
    import numpy as np
    import uvicorn
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm_omni.diffusion.data import (
        DIFFUSION_REQUEST_LIFECYCLE_KEY,
        DIFFUSION_REQUEST_STARTED,
    )
    from vllm_omni.entrypoints.cli.serve import _ensure_vllm_platform
    from vllm_omni.entrypoints.openai import api_server
    from vllm_omni.entrypoints.serve.utils.errors import (
        _register_omni_exception_handlers,
    )
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.model_executor.models.minimax_h3.encoder_processing import (
        prepare_encoder_inputs,
    )

    jobs_log = work / "jobs.jsonl"

    def record(entry: dict) -> None:
        with open(jobs_log, "a", encoding="utf-8") as log:
            log.write(json.dumps(entry, default=str) + "\n")

    class StandInEngine:
        """In place of vllm_omni.entrypoints.async_omni.AsyncOmni: one diffusion stage, as `vllm serve
        MiniMaxAI/MiniMax-H3 --omni` builds it."""

        stage_configs = [{"stage_id": 0, "stage_type": "diffusion", "final_output": True,
                          "final_output_type": "video", "diffusion_config": {"model_class_name": "MiniMaxH3Pipeline"}}]
        od_config = SimpleNamespace(model_class_name="MiniMaxH3Pipeline", model=MODEL, revision=None)
        default_sampling_params_list = [OmniDiffusionSamplingParams(seed=42, num_inference_steps=50)]
        endpoint_restrictions = None
        model_config = vllm_config = renderer = input_processor = io_processor = None
        errored = False

        async def get_vllm_config(self):
            return None  # pure diffusion

        async def get_supported_tasks(self):
            return ("generate",)

        async def check_health(self):
            return None

        async def abort(self, request_id, timeout=None):
            record({"aborted": request_id})

        async def generate(self, prompt, request_id, sampling_params_list):
            (sampling,) = [p for p in sampling_params_list if isinstance(p, OmniDiffusionSamplingParams)]
            media = prepare_encoder_inputs(dict(prompt), sampling).media  # H3's own checks, the pipeline's first
            if getattr(sampling, "emit_request_lifecycle", False):
                yield SimpleNamespace(request_id=request_id,
                                      custom_output={DIFFUSION_REQUEST_LIFECYCLE_KEY: DIFFUSION_REQUEST_STARTED})
            steps = int(sampling.num_inference_steps or 50)
            await asyncio.sleep(options.step_seconds * steps)
            frames = np.empty((media.num_frames, media.height, media.width, 3), dtype=np.uint8)
            frames[:] = np.linspace(0, 255, media.num_frames, dtype=np.uint8)[:, None, None, None]
            samples = round(media.num_frames / 24 * 32000)
            t = np.arange(samples, dtype=np.float32) / 32000
            audio = np.stack([0.2 * np.sin(2 * np.pi * 440 * t)] * 2).astype(np.float32)
            mm = prompt.get("multi_modal_data") or {}
            extra = dict(sampling.extra_args or {})
            record({"request_id": request_id, "task": media.task, "width": media.width, "height": media.height,
                    "num_frames": media.num_frames, "seed": sampling.seed, "num_inference_steps": steps,
                    "extra_args": {k: v for k, v in extra.items() if isinstance(v, (int, float, str, list))},
                    "media": {key: (len(value) if isinstance(value, list) else 1) for key, value in mm.items()},
                    "lora": (None if sampling.lora_request is None else
                             {"name": sampling.lora_request.lora_name, "path": sampling.lora_request.lora_path,
                              "scale": sampling.lora_scale})})
            yield SimpleNamespace(request_id=request_id, images=None, custom_output=None,
                                  multimodal_output={"video": frames, "fps": 24, "audio": audio,
                                                     "audio_sample_rate": 32000},
                                  stage_durations={"stand-in": 0.0}, peak_memory_mb=0.0, metrics=None, finished=True)

    _ensure_vllm_platform()  # vLLM-Omni's own CLI does this first (a CPU machine has no platform plugin)
    serve_argv = ["--model", MODEL, "--port", str(options.port), "--host", "127.0.0.1"]
    if options.api_key:
        serve_argv += ["--api-key", options.api_key]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_argv)

    async def serve() -> None:
        # as api_server.omni_run_server_worker builds the app, up to serving it
        app = build_app(args, ("generate",))
        app.state.api_server_count = 1
        for path, methods in (("/v1/chat/completions", {"POST"}), ("/v1/chat/completions/batch", {"POST"}),
                              ("/v1/models", {"GET"}), ("/health", {"GET"})):
            api_server.remove_route_from_app(app, path, methods)
        app.include_router(api_server.router)
        _register_omni_exception_handlers(app)
        await api_server.omni_init_app_state(StandInEngine(), app.state, args)
        await api_server.STORAGE_MANAGER.start()
        print(f"vLLM-Omni H3 server on 127.0.0.1:{options.port}", file=sys.stderr, flush=True)
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=options.port, log_level="info")).serve()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
