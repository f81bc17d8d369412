"""SGLang 0.5.23's own diffusion HTTP server for MiniMax H3, on loopback, with only the GPU side replaced.

Run with the Python of the venv `tests/real_servers/build_sglang_venv.sh` builds (never the project's):

    python sglang_h3_server.py --port P --model-variant fl2va|ref2va --work DIR [--step-seconds S]

What is SGLang's own code: the command line (`sglang serve`'s parser and `ServerArgs.from_cli_args`, with the
arguments MiniMax's README gives), `http_server.create_app` with every router, the request models, MiniMax H3's
request lowering and validation, the pre-queue material probes (ffprobe on the references, which must be on PATH),
the canvas and frame-count resolution, the job store, the progress listener and the final output checks (an mp4 of
another size or length, or without AAC 32 kHz stereo, fails the job there).

What is replaced: the scheduler transport (`async_scheduler_client.initialize / forward / close`), which would hand
the request to GPU workers over ZMQ. The stand-in checks the task against the partition the way the GPU pipeline's
admission stage does (with SGLang's own `MiniMaxH3ReleaseMetadata`), pushes per-step progress to the server's own
progress endpoint as the workers do, and writes a small mp4 of the resolved shape where SGLang expects the output.
A marker file records every job the stand-in ran to its end (a DELETE does not stop it: that is SGLang's behaviour).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path


def _define_torchvision_schemas() -> None:
    # PyPI's torchvision links CUDA, so its C ops do not register here; sglang's imports only need the schemas.
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _define_torchvision_schemas.library = library  # keep it alive


def _write_mp4(path: str, width: int, height: int, frames: int, fps: int = 24, sample_rate: int = 32000) -> None:
    """H.264 yuv420p + AAC stereo: what SGLang's H3 output check accepts. The picture is a ramp the client can see."""
    from fractions import Fraction

    import av
    import numpy as np

    with av.open(path, "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.options = {"preset": "ultrafast"}
        audio = container.add_stream("aac", rate=sample_rate, layout="stereo")
        for index in range(frames):
            level = int(255 * index / max(1, frames - 1))
            picture = np.full((height, width, 3), level, dtype=np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        samples = round(frames / fps * sample_rate)
        t = np.arange(samples, dtype=np.float32) / sample_rate
        tone = (0.2 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
        block = 1024
        for start in range(0, samples, block):
            chunk = np.stack([tone[start:start + block]] * 2)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk), format="fltp", layout="stereo")
            frame.sample_rate = sample_rate
            frame.pts = start
            frame.time_base = Fraction(1, sample_rate)
            for packet in audio.encode(frame):
                container.mux(packet)
        for packet in audio.encode():
            container.mux(packet)


def _media_summary(condition: dict) -> dict:
    """What the server holds for a condition's `uri` (a `data:` URI or a path SGLang saved): its bytes' SHA-256 and,
    for an image, its size and decoded RGB pixels' SHA-256, so that a test can check the media, not only the fields."""
    import base64
    import hashlib
    import io

    uri = str(condition.get("uri", ""))
    if uri.startswith("data:"):
        data = base64.b64decode(uri.split(",", 1)[1])
    elif os.path.exists(uri):
        with open(uri, "rb") as file:
            data = file.read()
    else:
        return {"uri": uri[:64]}
    summary = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if condition.get("type") == "image":
        import numpy as np
        from PIL import Image

        picture = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        summary.update(size=[picture.shape[1], picture.shape[0]],
                       pixels_sha256=hashlib.sha256(picture.tobytes()).hexdigest())
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--scheduler-port", type=int, required=True)
    parser.add_argument("--model-variant", required=True, choices=("fl2va", "ref2va"))
    parser.add_argument("--work", required=True, help="a folder for outputs, uploads and the job log")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="time per denoising step of the stand-in")
    options = parser.parse_args(argv)
    work = Path(options.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    _define_torchvision_schemas()
    import uvicorn
    import zmq
    import zmq.asyncio
    from sglang.multimodal_gen.runtime import scheduler_client
    from sglang.multimodal_gen.runtime.entrypoints import http_server
    from sglang.multimodal_gen.runtime.entrypoints.cli.serve import (
        add_multimodal_gen_serve_args,
    )
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3.release_metadata import (
        MiniMaxH3ReleaseMetadata,
    )
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3.resolved_plan import (
        minimax_h3_plan_from_batch,
    )
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3.task_profiles import (
        MINIMAX_H3_TASK_PARTITIONS,
    )
    from sglang.multimodal_gen.runtime.server_args import (
        ServerArgs,
        set_global_server_args,
    )
    from sglang.multimodal_gen.runtime.utils.argparse import FlexibleArgumentParser

    # `sglang serve --model-path MiniMaxAI/MiniMax-H3 --model-variant fl2va ...`, parsed by SGLang's own parser.
    serve_argv = ["--model-path", "MiniMaxAI/MiniMax-H3", "--model-variant", options.model_variant,
                  "--host", "127.0.0.1", "--port", str(options.port), "--scheduler-port", str(options.scheduler_port),
                  "--output-path", str(work / "outputs"), "--input-save-path", str(work / "uploads")]
    serve_parser = FlexibleArgumentParser()
    add_multimodal_gen_serve_args(serve_parser)
    args, unknown = serve_parser.parse_known_args(serve_argv)
    server_args = ServerArgs.from_cli_args(args, unknown, default_args={"warmup_mode": "server"}, argv=serve_argv)
    set_global_server_args(server_args)

    partition = server_args.model_variant
    release = MiniMaxH3ReleaseMetadata(
        schema_version=1, partition=partition,
        tasks=tuple(task for task, part in MINIMAX_H3_TASK_PARTITIONS.items() if part == partition),
        task_aliases={}, video_sigma_shift=12.0, audio_sigma_shift=3.0, dmd_denoising_steps=None,
        pdd_fused_heads=None)
    jobs_log = work / "jobs.jsonl"
    context = zmq.asyncio.Context()
    progress = context.socket(zmq.PUSH)
    progress.connect(server_args.progress_endpoint)

    async def forward(batches, timeout_ms=None):
        batches = batches if isinstance(batches, list) else [batches]
        paths = []
        for batch in batches:
            if getattr(batch, "is_warmup", False):
                continue
            try:
                release.canonical_task(batch.sampling_params.task)  # the GPU pipeline's partition admission
            except ValueError as exc:
                return OutputBatch(error=str(exc))
            shape = minimax_h3_plan_from_batch(batch).shape
            steps = int(batch.num_inference_steps)
            for step in range(1, steps + 1):
                await asyncio.sleep(options.step_seconds)
                await progress.send_json([batch.request_id, step, steps])
            path = str(batch.output_file_path())
            os.makedirs(os.path.dirname(path), exist_ok=True)
            await asyncio.to_thread(_write_mp4, path, int(shape["width"]), int(shape["height"]),
                                    int(shape["frame_count"]))
            paths.append(path)
            sampling = batch.sampling_params
            record = {"request_id": batch.request_id, "task": sampling.task, "target": sampling.target,
                      "conditions": [{key: value for key, value in condition.items() if key != "uri"}
                                     for condition in (sampling.conditions or [])],
                      "media": [_media_summary(condition) for condition in (sampling.conditions or [])],
                      "seed": sampling.seed, "num_inference_steps": steps, "flow_shift": sampling.flow_shift,
                      "audio_flow_shift": sampling.audio_flow_shift,
                      "reference_resize_mode": sampling.reference_resize_mode,
                      "width": int(shape["width"]), "height": int(shape["height"]),
                      "frame_count": int(shape["frame_count"])}
            with open(jobs_log, "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")
        return OutputBatch(output_file_paths=paths)

    client = scheduler_client.async_scheduler_client
    client.initialize = lambda server_args: None
    client.forward = forward
    client.close = lambda: None

    app = http_server.create_app(server_args)
    print(f"sglang H3 server ({partition}) on 127.0.0.1:{options.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host="127.0.0.1", port=options.port, log_level="info")  # access lines: what was sent


if __name__ == "__main__":
    main()
