"""Conformance of the remote engine against vLLM-Omni 0.30.0's own server code (tests/real_servers/
vllm_omni_h3_server.py: vllm's `build_app`, vLLM-Omni's router, multipart form parsing, request lowering, job store,
storage and muxing, and MiniMax H3's own request checks with ffprobe on the references; only the GPU engine behind it
is a stand-in). The Python API, the CLI and the node; t2va, fl2va, ref2va with each reference type; the limits it
enforces refused here first; a cancel that aborts; a job the server fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_servers import VLLM_OMNI_KEY as KEY
from reference_media import picture, tone

from h3_core.errors import H3Error, RemoteError
from h3_core.remote import RemoteEngine
from h3_core.request.grid import audio_samples_for_frames

# vLLM-Omni takes the canvas as given (multiples of 32); keyframes and references need 256 px a side at least.
REQUEST = dict(width=128, height=64, num_frames=107, steps=3, seed=7)
KEYFRAME_REQUEST = dict(REQUEST, width=448, height=256)


@pytest.fixture(scope="module")
def server(vllm_omni_server):
    return vllm_omni_server


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("H3_STREAM_API_KEY", KEY)


def engine(server, **options) -> RemoteEngine:
    return RemoteEngine(server.url, **{"poll_interval": 0.02, **options})


def test_t2va_completes_with_the_card_told_apart_and_the_canvas_exact(server):
    remote = engine(server)
    assert remote.describe_server() == "MiniMaxAI/MiniMax-H3, vLLM-Omni"  # its card is owned by "vllm"
    before = len(server.jobs())
    result = remote.generate("A fox in the snow.", **REQUEST)
    assert result.frames.shape == (107, 64, 128, 3) and result.waveform.shape == (2, audio_samples_for_frames(107))
    assert result.frames[0].mean() < 0.05 and result.frames[-1].mean() > 0.95  # the stand-in's ramp
    job = server.jobs()[before]
    assert (job["task"], job["width"], job["height"], job["num_frames"]) == ("t2va", 128, 64, 107)
    assert (job["seed"], job["num_inference_steps"]) == (7, 2)
    assert job["extra_args"]["flow_shift"] == 12.0 and job["extra_args"]["audio_flow_shift"] == 3.0
    assert job["extra_args"]["aspect_ratio"] == "16:9" and job["extra_args"]["duration_seconds"] == 107 / 24


def test_without_the_key_the_server_refuses_in_one_message(server, monkeypatch):
    monkeypatch.delenv("H3_STREAM_API_KEY")
    with pytest.raises(RemoteError) as caught:
        engine(server).generate("x", **REQUEST)
    assert caught.value.status == 401 and str(caught.value) == (f"the server refused GET {server.url}/v1/models "
                                                                "(HTTP 401): Unauthorized")


@pytest.mark.parametrize("anchors", [("first", "last"), ("first",), ("last",)])
def test_fl2va_keyframes_complete(server, anchors):
    keyframes = {f"{anchor}_frame": picture(600, 300, seed=i) for i, anchor in enumerate(anchors)}
    before = len(server.jobs())
    result = engine(server).generate("A door opens.", **KEYFRAME_REQUEST, **keyframes)
    assert result.frames.shape == (107, 256, 448, 3)
    job = server.jobs()[before]
    assert job["task"] == "fl2va" and job["media"] == {"image": len(anchors)}
    assert job["extra_args"]["frame_indices"] == [0 if a == "first" else -1 for a in anchors]


def test_image_guides_at_the_ends_go_as_its_keyframes_and_others_are_refused_naming_it(server):
    """vLLM-Omni takes keyframes at `frame_indices` [0], [-1] or [0, -1] only: an image guide at an end goes as one;
    a guide in between, a clip or an audio is refused before sending."""
    from h3_core.request.guides import Guide

    frames = torch.from_numpy(np.asarray(picture(448, 256, seed=3), dtype=np.float32) / 255)[None]
    before = len(server.jobs())
    engine(server).generate("x", **KEYFRAME_REQUEST, guides=(Guide(frame=106, frames=frames, label="g"),))
    job = server.jobs()[before]
    assert job["task"] == "fl2va" and job["media"] == {"image": 1} and job["extra_args"]["frame_indices"] == [-1]
    posts = len(server.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error) as caught:
        engine(server).generate("x", **KEYFRAME_REQUEST, guides=(Guide(frame=40, frames=frames, label="H3 Guide #2 "
                                                                                                      "(frame 40)"),))
    assert str(caught.value).startswith("H3 Guide #2 (frame 40): vLLM-Omni takes guides only as one image at the "
                                        "first or the last frame (frame 0 or -1, its keyframes), and this is an image "
                                        "at frame 40 (of 107 frames); run this request locally")
    assert len(server.requests("POST", "/v1/videos")) == posts


@pytest.mark.parametrize("kind", ["image", "video_with_soundtrack", "audio_with_image"])
def test_ref2va_each_reference_type_completes(server, kind):
    frames = np.stack([np.asarray(picture(256, 256, seed=i % 4)) for i in range(72)])  # 3 s at 24 fps, the smallest
    references = {
        "image": dict(reference_images=[picture(384, 256)]),
        "video_with_soundtrack": dict(reference_videos=[(frames, tone(3.0, 44100), 24.0, 44100)]),
        "audio_with_image": dict(reference_images=[picture(384, 256)], reference_audios=[(tone(3.0), 32000)]),
    }[kind]
    before = len(server.jobs())
    result = engine(server).generate("The same fox sings.", **REQUEST, **references)
    assert result.frames.shape == (107, 64, 128, 3)
    job = server.jobs()[before]
    assert job["task"] == "ref2va" and job["extra_args"]["task"] == "ref2va"
    assert job["media"] == {"image": {"image": 1}, "video_with_soundtrack": {"video": 1},
                            "audio_with_image": {"image": 1, "audio": 1}}[kind]


@pytest.mark.parametrize("fields,message", [
    (dict(num_frames=22), "num_frames: 22 frames (0.92 s) is outside what vLLM-Omni makes: 4 to 15 s"),
    (dict(seed=2**63), "seed 9223372036854775808: vLLM-Omni takes seeds up to 2**63 - 1"),
    (dict(steps=202), "steps 202: vLLM-Omni takes at most 200 model calls (201 steps)."),
    (dict(first_frame=True), "width 128 / height 64: keyframes are sent at the canvas size, which is 128x64; "
                             "vLLM-Omni takes images of 256 to 5760 px a side"),
    (dict(reference_images=["wide"]), "reference_images[0]: the image is 768x256; vLLM-Omni takes images from 2:5 to "
                                      "5:2."),
    (dict(reference_images=["big"], reference_image_size="match"),
     "reference_image_size 'match': vLLM-Omni sizes reference images one way only"),
    (dict(reference_images=["big"], reference_audios=["short"]),
     "reference_audios[0]: the audio is 1.00 s; vLLM-Omni takes reference audios of 2 to 15 s."),
])
def test_a_request_the_server_would_refuse_is_refused_before_sending(server, fields, message):
    media = {"wide": picture(768, 256), "big": picture(384, 256), "short": (tone(1.0), 32000)}
    for key in ("reference_images", "reference_audios"):
        if key in fields:
            fields[key] = [media[name] for name in fields[key]]
    if fields.pop("first_frame", None):
        fields["first_frame"] = picture(256, 128)
    posts = len(server.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error) as caught:
        engine(server).generate("x", **{**REQUEST, **fields})
    assert not isinstance(caught.value, RemoteError) and "\n" not in str(caught.value)
    assert str(caught.value).startswith(message)
    assert len(server.requests("POST", "/v1/videos")) == posts


def test_a_video_the_server_would_refuse_goes_as_a_local_run_normalised_it():
    """vLLM-Omni takes reference videos of 256 px a side and 23.976 fps at least: a smaller or slower one is sent at
    24 fps on its canvas, as a local run conditions on it (no server needed to see the choice)."""
    from h3_core.remote import vllm_omni_api
    from h3_core.request.generation_request import GenerationRequest

    small = np.zeros((30, 64, 96, 3), dtype=np.uint8)  # 2.5 s at 12 fps
    fitting = np.zeros((72, 256, 384, 3), dtype=np.uint8)  # 3 s at 24 fps
    request = GenerationRequest("x", **REQUEST, reference_videos=[(small, None, 12.0), (fitting, None, 24.0)])
    (sent_small, rate_small), (sent_fitting, rate_fitting) = vllm_omni_api._reference_videos(
        request, request.normalised_references())
    assert sent_small.shape == (60, 768, 1152, 3) and rate_small == 24.0  # resampled onto 24 fps, on its canvas
    assert sent_fitting is not None and sent_fitting.shape == (72, 256, 384, 3) and rate_fitting == 24.0


def test_a_lora_on_the_server_goes_with_the_request(server, run_cli, tmp_path):
    """vLLM-Omni applies a LoRA per request (its `lora` form object): its parser hands the engine the adapter."""
    before = len(server.jobs())
    engine(server).generate("x", **REQUEST, server_lora="/models/loras/h3-turbo.safetensors:0.75")
    assert server.jobs()[before]["lora"] == {"name": "h3-turbo", "path": "/models/loras/h3-turbo.safetensors",
                                             "scale": 0.75}
    done = run_cli(["generate", "x", "--server", server.url, "--size", "128x64", "--frames", "107", "--steps", "2",
                    "--server-lora", "/models/loras/style.safetensors", "--out", "x.mp4"], tmp_path,
                   H3_STREAM_API_KEY=KEY)
    assert done.returncode == 0, done.stderr
    assert server.jobs()[-1]["lora"] == {"name": "style", "path": "/models/loras/style.safetensors", "scale": 1.0}


def test_a_job_the_server_fails_is_one_message_with_its_reason(server, monkeypatch):
    """A failed job answers GET with HTTP 400 and the job as the body: read as the job's failure, not as a refusal
    of the poll (and not cancelled). The server's own keyframe check is reached by lifting this client's copy of
    it."""
    from h3_core.remote import vllm_omni_api

    monkeypatch.setattr(vllm_omni_api, "IMAGE_SIDES", (1, 100000))
    deletes = len(server.requests("DELETE", "/v1/videos/"))
    with pytest.raises(RemoteError) as caught:
        engine(server).generate("x", **REQUEST, first_frame=picture(256, 128))
    assert "could not make the video (job video_gen_" in str(caught.value)
    assert "reference image dimensions must be in [256, 5760] pixels, got 128x64" in str(caught.value)
    assert len(server.requests("DELETE", "/v1/videos/")) == deletes


def test_the_cli_completes_and_ctrl_c_aborts_the_job(server, run_cli, tmp_path):
    done = run_cli(["generate", "A fox.", "--server", server.url, "--size", "128x64", "--seconds", "5", "--steps",
                    "3", "--out", "fox.mp4"], tmp_path, H3_STREAM_API_KEY=KEY)
    assert done.returncode == 0, done.stderr
    assert f"server {server.url}: MiniMaxAI/MiniMax-H3, vLLM-Omni, FL2VA (as set" in done.stdout
    assert (tmp_path / "fox.mp4").stat().st_size > 0 and KEY not in done.stdout + done.stderr

    done = server.ctrl_c_during_job(["x", "--size", "128x64", "--frames", "107", "--steps", "200", "--out", "x.mp4"],
                                    tmp_path, H3_STREAM_API_KEY=KEY)
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 130, stderr
    assert ": vLLM-Omni aborted it" in stdout and stderr.strip().splitlines()[-1] == "interrupted; nothing was written"
    assert len(server.aborted()) >= 1 and not (tmp_path / "x.mp4").exists()


def test_the_node_completes_ref2va_from_h3_references(server, tmp_path):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    pack = comfy_double.load_pack()
    from comfy_double.executor import run_node

    image = torch.from_numpy(np.asarray(picture(384, 256), dtype=np.float32) / 255)[None]
    (refs,) = run_node(pack["H3StreamReferenceMedia"], "3", ref_image_size="reference", ref_image_1=image)
    images, _, fps = run_node(pack["H3StreamGenerateRemote"], "9", server_url=server.url,
                                  prompt="A fox in the snow.", width=128, height=64, seconds=4.5, frames=107, steps=3,
                                  seed=7, video_shift=12.0, audio_shift=3.0, h3_refs=refs, backend="vllm-omni",
                                  server_lora="/models/loras/style.safetensors:0.5")
    assert images.shape == (107, 64, 128, 3) and fps == 24.0 and server.jobs()[-1]["task"] == "ref2va"
    assert server.jobs()[-1]["lora"] == {"name": "style", "path": "/models/loras/style.safetensors", "scale": 0.5}
