"""H3StreamGenerateRemote: one request to an SGLang diffusion server running H3 (h3_core.remote.RemoteEngine) ->
IMAGE frames, AUDIO and the frame rate, as the local Decode Video / Decode Audio nodes give them."""

from __future__ import annotations

from comfy_api.latest import io

from . import comfy_runtime
from .request_inputs import canvas_inputs, duration_inputs, frame_count_error, names_for, num_frames, sampler_inputs


class H3StreamGenerateRemote(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from h3_core.remote.protocol import API_KEY_ENV

        return io.Schema(
            node_id="H3StreamGenerateRemote",
            display_name="H3 Generate (remote server)",
            category="H3 Stream",
            description="Sends the request to an SGLang diffusion server running MiniMax H3 across its GPUs (the "
                        "OpenAI-style videos API) and decodes its mp4 into IMAGE frames and 32 kHz stereo AUDIO. "
                        "Progress follows the server's status; Cancel cancels the job on the server. The API key "
                        f"is read from the {API_KEY_ENV} environment variable, never stored in the workflow.",
            inputs=[
                io.String.Input("server_url", default="http://127.0.0.1:30010",
                                tooltip="The server's address: sglang serve --model-path MiniMaxAI/MiniMax-H3 "
                                        "--model-variant fl2va ... --port 30010."),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="Shots, camera and the sound (dialogue, effects, music) in one text."),
                *canvas_inputs(),
                *duration_inputs(),
                # chunk_size is this machine's memory setting: a server has its own
                *[widget for widget in sampler_inputs() if widget.id != "chunk_size"],
                io.Image.Input("first_frame", optional=True, tooltip="FL2VA: the video starts on this image."),
                io.Image.Input("last_frame", optional=True, tooltip="FL2VA: the video ends on this image."),
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
                first_frame=None, last_frame=None) -> io.NodeOutput:
        from h3_core.remote import RemoteEngine
        from h3_core.remote.videos_client import check_server_url
        from h3_core.request.generation_request import GenerationRequest
        from h3_core.request.grid import AUDIO_SAMPLE_RATE

        request = GenerationRequest(prompt=prompt, width=width, height=height, num_frames=num_frames(seconds, frames),
                                    steps=steps, seed=seed, video_shift=video_shift, audio_shift=audio_shift,
                                    first_frame=first_frame, last_frame=last_frame, names=names_for(frames))
        url = check_server_url(server_url, "server_url")
        node_id = cls.hidden.unique_id
        engine = RemoteEngine(url, partition="fl2va",
                              log=lambda message: comfy_runtime.log.info("h3-stream node %s: %s", node_id, message))
        comfy_runtime.check_interrupt()
        comfy_runtime.send_progress_text(node_id, f"{url}: {engine.describe_server()}")
        bar = comfy_runtime.progress_bar(100, node_id=node_id)
        result = engine.generate(request, progress=lambda done, total: bar.update_absolute(done, total),
                                 check_interrupt=comfy_runtime.check_interrupt,
                                 on_status=lambda text: comfy_runtime.send_progress_text(node_id, f"remote job {text}"))
        return io.NodeOutput(result.frames, {"waveform": result.waveform[None], "sample_rate": AUDIO_SAMPLE_RATE},
                             float(result.fps))
