"""H3StreamGenerateRemote: one request to an H3 serving engine — SGLang diffusion or vLLM-Omni — (h3_core.remote.
RemoteEngine) -> IMAGE frames, AUDIO and the frame rate, as the local Decode Video / Decode Audio nodes give them."""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from . import comfy_runtime
from .request_inputs import canvas_inputs, duration_inputs, frame_count_error, names_for, num_frames, sampler_inputs
from .sockets import H3Guides, H3Refs


def _remote_sampler_inputs() -> list:
    """The sampler's widgets without chunk_size (this machine's memory setting: a server has its own) and step_cache
    (this machine's sampling loop: a server's cache is set when it starts), the seed within the servers' signed
    64-bit range (so that ComfyUI's randomize never picks one they refuse)."""
    from h3_core.remote.serving_rules import SERVER_SEED_MAX

    widgets = []
    for widget in sampler_inputs():
        if widget.id in ("chunk_size", "step_cache"):
            continue
        if widget.id == "seed":
            widget = io.Int.Input("seed", default=0, min=0, max=SERVER_SEED_MAX, control_after_generate=True,
                                  tooltip="Initial noise, 0 to 2**63 - 1 (the servers' range); each engine draws "
                                          "its own noise from it.")
        widgets.append(widget)
    return widgets


class H3StreamGenerateRemote(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from h3_core.remote.protocol import API_KEY_ENV

        return io.Schema(
            node_id="H3StreamGenerateRemote",
            display_name="H3 Generate (remote server)",
            category="H3 Stream/remote",
            description="Sends the request to an SGLang diffusion or vLLM-Omni server running MiniMax H3 across its "
                        "GPUs (the OpenAI-style videos API) and decodes its mp4 into IMAGE frames and 32 kHz stereo "
                        "AUDIO: text (t2va), first / last frames (fl2va) or H3 References (ref2va, on a server "
                        "started with --model-variant ref2va). The server's limits (4 to 15 s, its canvases) are "
                        "checked before anything is sent. Progress follows the server's status; Cancel aborts the job "
                        "on vLLM-Omni, while SGLang cannot abort: its job runs on to its end, and the node says so. "
                        f"The API key is read from the {API_KEY_ENV} environment variable, never stored in the "
                        "workflow.",
            inputs=[
                io.String.Input("server_url", default="http://127.0.0.1:30010",
                                tooltip="The server's address: sglang serve --model-path MiniMaxAI/MiniMax-H3 "
                                        "--model-variant fl2va ... --port 30010 (or vLLM-Omni's, see the README)."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="Shots, camera and the sound (dialogue, effects, music) in one text."),
                *canvas_inputs(),
                *duration_inputs(),
                *_remote_sampler_inputs(),
                io.Image.Input("first_frame", optional=True, tooltip="FL2VA: the video starts on this image."),
                io.Image.Input("last_frame", optional=True, tooltip="FL2VA: the video ends on this image."),
                H3Refs.Input("h3_refs", optional=True,
                             tooltip="Ref2VA: references from H3 References (a server started with --model-variant "
                                     "ref2va)."),
                io.Combo.Input("backend", options=["auto", "sglang", "vllm-omni"], default="auto", optional=True,
                               tooltip="The server's engine; auto: as its model card says."),
                io.Int.Input("job_timeout_minutes", default=120, min=1, max=10080, optional=True,
                             tooltip="How long the job may take on the server; past it, it is cancelled there."),
                io.String.Input("server_lora", default="", optional=True,
                                tooltip="A LoRA file already on the server, PATH[:STRENGTH] (its path there), for this "
                                        "request: vLLM-Omni. An SGLang server's LoRA is set when it starts "
                                        "(sglang serve --lora-path). Empty: none."),
                H3Guides.Input("h3_guides", optional=True,
                               tooltip="Guides from H3 Guide. The servers take image guides at the first or the last "
                                       "frame only (0 or -1, as their keyframes); other guides run locally."),
            ],
            outputs=[io.Image.Output(display_name="images"), io.Audio.Output(display_name="audio"),
                     io.Float.Output(display_name="fps")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, frames) -> bool | str:
        # One input only (ComfyUI reports a failed check under every input the check takes); the canvas and the
        # rest are the request's rules, checked when the node runs.
        return frame_count_error(frames) or True

    @classmethod
    def execute(cls, server_url, prompt, width, height, seconds, frames, steps, seed, video_shift, audio_shift,
                first_frame=None, last_frame=None, h3_refs=None, backend="auto", job_timeout_minutes=120,
                server_lora="", h3_guides=None) -> io.NodeOutput:
        from h3_core.remote import RemoteEngine
        from h3_core.remote.videos_client import check_server_url
        from h3_core.request.generation_request import GenerationRequest
        from h3_core.request.grid import AUDIO_SAMPLE_RATE

        count = num_frames(seconds, frames)
        references = h3_refs.request_fields(count) if h3_refs is not None else {}
        request = GenerationRequest(prompt=prompt, width=width, height=height, num_frames=count, steps=steps,
                                    seed=seed, video_shift=video_shift, audio_shift=audio_shift,
                                    first_frame=first_frame, last_frame=last_frame, guides=tuple(h3_guides or ()),
                                    names=dataclasses.replace(names_for(frames), job_timeout="job_timeout_minutes"),
                                    **references)
        url = check_server_url(server_url, "server_url")
        node_id = cls.hidden.unique_id

        def log(message: str) -> None:  # the console, and the node's text (a cancel's outcome is read there)
            comfy_runtime.log.info("h3-stream node %s: %s", node_id, message)
            comfy_runtime.send_progress_text(node_id, message)

        engine = RemoteEngine(url, backend=backend, job_timeout=60.0 * job_timeout_minutes, log=log)
        comfy_runtime.check_interrupt()
        comfy_runtime.send_progress_text(node_id, f"{url}: {engine.describe_server()}")
        bar = comfy_runtime.progress_bar(100, node_id=node_id)
        result = engine.generate(request, server_lora=server_lora or None,
                                 progress=lambda done, total: bar.update_absolute(done, total),
                                 check_interrupt=comfy_runtime.check_interrupt,
                                 on_status=lambda text: comfy_runtime.send_progress_text(node_id, f"remote job {text}"))
        if result.audio_warnings:  # the engine raised on an audio health error; warnings go in the node's text
            from h3_core.request.audio_health import warning_line

            comfy_runtime.send_progress_text(node_id, "\n".join(warning_line(f) for f in result.audio_warnings))
        return io.NodeOutput(result.frames, {"waveform": result.waveform[None], "sample_rate": AUDIO_SAMPLE_RATE},
                             float(result.fps))
