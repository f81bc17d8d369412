"""Conformance of the remote engine against SGLang 0.5.23's own server code (tests/real_servers/sglang_h3_server.py:
its real `create_app`, routers, request models, MiniMax H3 lowering, validation, pre-queue probes of the references
with ffprobe, job store, progress listener and output checks; only the GPU scheduler behind it is a stand-in).

Every request path goes through it — the Python API, the CLI and the node; t2va, fl2va (first, last, both) and
ref2va with each reference type — and each limit the server enforces is shown refused here, before sending.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from reference_media import picture, tone

from h3_core.errors import H3Error, RemoteError
from h3_core.remote import RemoteEngine
from h3_core.request.grid import audio_samples_for_frames

# 16:9 at short edge 64 makes 128x64 on the server; 107 frames are 4.46 s, the shortest it makes.
REQUEST = dict(width=128, height=64, num_frames=107, steps=3, seed=7)


@pytest.fixture(scope="module")
def fl2va(sglang_servers):  # tests/conftest.py starts the servers
    return sglang_servers["fl2va"]


@pytest.fixture(scope="module")
def ref2va(sglang_servers):
    return sglang_servers["ref2va"]


def engine(server, **options) -> RemoteEngine:
    return RemoteEngine(server.url, **{"poll_interval": 0.02, **options})


def wait_for_jobs(server, count: int, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(server.jobs()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.jobs()


# ---- the Python API ---------------------------------------------------------------------------------------------


def test_t2va_completes_and_decodes_with_the_servers_progress(fl2va):
    seen, statuses = [], []
    before = len(fl2va.jobs())
    result = engine(fl2va).generate("A fox in the snow.", **REQUEST, progress=lambda d, t: seen.append(d),
                                    on_status=statuses.append)
    assert result.frames.shape == (107, 64, 128, 3) and result.fps == 24
    assert result.waveform.shape == (2, audio_samples_for_frames(107))
    # the stand-in's picture is a ramp from black to white, its sound a 440 Hz tone
    assert result.frames[0].mean() < 0.05 and result.frames[-1].mean() > 0.95
    assert result.waveform.abs().max() > 0.1
    assert seen[-1] == 100 and seen == sorted(seen) and any(0 < d < 100 for d in seen)
    assert statuses[0].startswith("queued") and any(s.startswith("in_progress") for s in statuses)
    job = fl2va.jobs()[before]
    assert job["task"] == "t2va" and job["conditions"] == []
    assert job["target"] == {"short_edge": 64, "aspect_ratio": "16:9", "duration_seconds": 107 / 24}
    assert (job["width"], job["height"], job["frame_count"]) == (128, 64, 107)
    assert (job["num_inference_steps"], job["seed"], job["flow_shift"], job["audio_flow_shift"]) == (2, 7, 12.0, 3.0)


def test_the_released_canvas_and_the_longest_duration_are_asked_exactly(fl2va):
    """1344x768 is 16:9 at short edge 768 (the area cap rounds it there); 362 frames are 15 s."""
    from h3_core.remote import serving_rules
    from h3_core.request.generation_request import GenerationRequest

    request = GenerationRequest("x", width=1344, height=768, num_frames=362)
    target = serving_rules.server_target(request, "SGLang")
    assert target.as_json() == {"short_edge": 768, "aspect_ratio": "16:9", "duration_seconds": 15.0}
    # and the server resolves that target to exactly the request (a 15 s job at a small canvas, to stay quick)
    before = len(fl2va.jobs())
    result = engine(fl2va).generate("x", **{**REQUEST, "num_frames": 362, "steps": 2})
    assert result.frames.shape[0] == 362 and fl2va.jobs()[before]["frame_count"] == 362


@pytest.mark.parametrize("anchors", [("first", "last"), ("first",), ("last",)])
def test_fl2va_keyframes_complete_as_keyframe_conditions(fl2va, anchors):
    """fl2va takes any aspect ratio: 96x64 goes as 3:2 at short edge 64."""
    keyframes = {f"{anchor}_frame": picture(300, 200, seed=i) for i, anchor in enumerate(anchors)}
    before = len(fl2va.jobs())
    result = engine(fl2va).generate("A door opens.", **{**REQUEST, "width": 96}, **keyframes)
    assert result.frames.shape == (107, 64, 96, 3)
    job = fl2va.jobs()[before]
    assert job["task"] == "fl2va" and job["target"]["aspect_ratio"] == "3:2"
    assert job["conditions"] == [{"type": "image", "role": "keyframe", "frame_index": 0 if a == "first" else -1}
                                 for a in anchors]


@pytest.mark.parametrize("kind", ["image", "video_with_soundtrack", "video", "audio_with_image"])
def test_ref2va_each_reference_type_completes(ref2va, kind):
    frames = np.stack([np.asarray(picture(96, 64, seed=i)) for i in range(30)])  # 2.5 s at 12 fps
    references = {
        "image": dict(reference_images=[picture(120, 80)]),
        "video_with_soundtrack": dict(reference_videos=[(frames, tone(2.5, 44100), 12.0, 44100)]),
        "video": dict(reference_videos=[(frames, None, 12.0)]),
        "audio_with_image": dict(reference_images=[picture(120, 80)], reference_audios=[(tone(3.0), 32000)],
                                 reference_image_size="match"),
    }[kind]
    before = len(ref2va.jobs())
    result = engine(ref2va).generate("The same fox sings.", **REQUEST, **references)
    assert result.frames.shape == (107, 64, 128, 3)
    job = ref2va.jobs()[before]
    assert job["task"] == "ref2va"
    expected = {"image": ["image"], "video_with_soundtrack": ["video_audio"], "video": ["video"],
                "audio_with_image": ["image", "audio"]}[kind]
    assert job["conditions"] == [{"type": t, "role": "reference"} for t in expected]
    assert job["reference_resize_mode"] == ("match" if kind == "audio_with_image" else "diffusers")


def test_a_result_in_cloud_storage_is_fetched_from_its_url(ref2va):
    """SGLang uploads the result and answers `/content` with 400 naming the URL; the job carries it as `url`."""
    logged = []
    result = engine(ref2va, log=logged.append).generate("x", **REQUEST, reference_images=[picture(64, 64)])
    assert result.frames.shape == (107, 64, 128, 3)
    stored = [line for line in logged if line.startswith("the server stored the video at ")]
    assert stored and "/h3-results/" in stored[0]
    assert ref2va.requests("GET", "/v1/videos/") and not any(line for line in ref2va.requests("GET", "/v1/videos/")
                                                             if "/content" in line)


def test_a_task_of_the_other_partition_fails_on_the_server_with_the_fix(ref2va):
    """Neither card nor endpoint says the partition, so a t2va request to a Ref2VA server is sent; SGLang's GPU
    pipeline refuses it, and the message says what to do."""
    with pytest.raises(RemoteError) as caught:
        engine(ref2va).generate("x", **REQUEST)
    message = str(caught.value)
    assert "task 't2va' is not served by MiniMax H3 partition 'ref2va'" in message
    assert message.endswith("point at a server started with sglang serve --model-path MiniMaxAI/MiniMax-H3 "
                            "--model-variant fl2va --port 30010)")


# ---- what the server would refuse, refused here before sending ---------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    (dict(num_frames=22), "num_frames: 22 frames (0.92 s) is outside what SGLang makes: 4 to 15 s, 107 to 362 frames "
                          "on the 17n+5 grid. Ask for at least 107 frames (4.46 s), or run locally."),
    (dict(width=192), "width 192 / height 64: SGLang makes a t2va canvas from a short edge and one of the aspect "
                      "ratios 21:9, 16:9, 4:3, 1:1, 3:4, 9:16, and cannot make 192x64; it would make 160x64 (21:9 at "
                      "short edge 64) or 128x64 (16:9 at short edge 64). Set width and height to one of these, or run "
                      "locally."),
    (dict(width=1536, height=1024, first_frame=True), "width 1536 / height 1024: SGLang caps the canvas at 1,032,192 "
                                                      "pixels (768 x 1344) and would make 1248x832 for short edge "
                                                      "1024 at 3:2; set width 1248 and height 832, or run locally."),
    (dict(seed=2**63), "seed 9223372036854775808: SGLang takes seeds up to 2**63 - 1 (9223372036854775807); use a "
                       "smaller seed."),
])
def test_a_request_the_server_would_refuse_is_refused_before_sending(fl2va, fields, message):
    if fields.pop("first_frame", None):
        fields["first_frame"] = picture(48, 32)
    posts = len(fl2va.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error) as caught:
        engine(fl2va).generate("x", **{**REQUEST, **fields})
    assert not isinstance(caught.value, RemoteError)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert len(fl2va.requests("POST", "/v1/videos")) == posts  # nothing was sent


def test_a_per_request_lora_is_refused_before_sending_saying_where_sglang_takes_one(fl2va, run_cli, tmp_path):
    posts = len(fl2va.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error, match=r"^server_lora /models/loras/turbo.safetensors: SGLang applies LoRAs to the "
                                      r"whole server, not per request \(sglang serve --lora-path PATH, or its POST "
                                      r"/v1/set_lora endpoint\)"):
        engine(fl2va).generate("x", **REQUEST, server_lora="/models/loras/turbo.safetensors")
    done = run_cli(["generate", "x", "--server", fl2va.url, "--size", "128x64", "--frames", "107", "--server-lora",
                    "/models/loras/turbo.safetensors:0.8", "--out", "x.mp4"], tmp_path)
    assert done.returncode == 2 and done.stderr.splitlines()[-1].startswith(
        "error: --server-lora /models/loras/turbo.safetensors: SGLang applies LoRAs to the whole server")
    assert len(fl2va.requests("POST", "/v1/videos")) == posts


def test_references_for_a_server_stated_fl2va_are_refused_before_sending(fl2va):
    posts = len(fl2va.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error, match=r"^references need H3's REF2VA partition but partition is FL2VA; point at a "
                                      r"server started with sglang serve --model-path MiniMaxAI/MiniMax-H3 "
                                      r"--model-variant ref2va --port 30010, and set partition ref2va\.$"):
        engine(fl2va, partition="fl2va").generate("x", **REQUEST, reference_images=[picture(64, 64)])
    assert len(fl2va.requests("POST", "/v1/videos")) == posts


# ---- guides (request.guides) ------------------------------------------------------------------------------------


def frames_of(image) -> torch.Tensor:
    """A PIL picture as a guide's frames [1, H, W, 3] in [0, 1] (exact in uint8: what goes is the picture)."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255)[None]


def pixels_sha256(image) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(image.convert("RGB")).tobytes()).hexdigest()


def test_image_guides_at_the_first_and_last_frame_go_as_sglangs_keyframe_conditions(fl2va):
    """SGLang 0.5.23 takes keyframe images at frame_index [0], [-1] or [0, -1]: a guide at frame 106 of 107 is its
    -1, given in any order they go 0 then -1, and the server holds the guides' own pixels (at the canvas size they go
    as they are)."""
    from h3_core.request.guides import Guide

    start, end = picture(128, 64, seed=1), picture(128, 64, seed=2)
    guides = (Guide(frame=106, frames=frames_of(end), label="H3 Guide #4 (frame 106)"),
              Guide(frame=-107, frames=frames_of(start), label="H3 Guide #3 (frame -107)"))
    before = len(fl2va.jobs())
    result = engine(fl2va).generate("A door opens.", **REQUEST, guides=guides)
    assert result.frames.shape == (107, 64, 128, 3)
    job = fl2va.jobs()[before]
    assert job["task"] == "fl2va"
    assert job["conditions"] == [{"type": "image", "role": "keyframe", "frame_index": 0},
                                 {"type": "image", "role": "keyframe", "frame_index": -1}]
    assert [m["size"] for m in job["media"]] == [[128, 64], [128, 64]]
    assert [m["pixels_sha256"] for m in job["media"]] == [pixels_sha256(start), pixels_sha256(end)]


def test_a_guide_and_a_first_frame_go_together(fl2va):
    from h3_core.request.guides import Guide

    end = picture(128, 64, seed=3)
    before = len(fl2va.jobs())
    engine(fl2va).generate("x", **REQUEST, first_frame=picture(128, 64, seed=4),
                           guides=(Guide(frame=-1, frames=frames_of(end), label="guide"),))
    job = fl2va.jobs()[before]
    assert [c["frame_index"] for c in job["conditions"]] == [0, -1]
    assert job["media"][1]["pixels_sha256"] == pixels_sha256(end)


def test_guides_beside_references_are_refused_before_sending_as_keyframes_are(ref2va):
    """SGLang's ref2va takes one keyframe signature beside references (its hybrid layout), but a request with both is
    refused as first_frame with references is (the local Ref2VA layout has no keyframes): one rule for both engines."""
    from h3_core.request.guides import Guide

    posts = len(ref2va.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error, match=r"^guides cannot be combined with reference_images / reference_videos / "
                                      r"reference_audios: the Ref2VA layout with guides is not implemented"):
        engine(ref2va).generate("The same fox.", **REQUEST, reference_images=[picture(120, 80)],
                                guides=(Guide(frame=0, frames=frames_of(picture(128, 64, seed=5)), label="guide"),))
    assert len(ref2va.requests("POST", "/v1/videos")) == posts


def _guide(kind, frame):
    from h3_core.request.guides import Guide

    frames = {"image": frames_of(picture(128, 64)), "video": torch.rand(22, 64, 128, 3), "audio": None,
              "video_audio": torch.rand(22, 64, 128, 3)}[kind]
    audio = tone(0.5) if kind in ("audio", "video_audio") else None  # fits the 22 frames (0.92 s) left at -22
    return Guide(frame=frame, frames=frames, audio=audio, label=f"H3 Guide #6 (frame {frame})")


@pytest.mark.parametrize("kind,frame,what", [
    ("image", 40, "an image at frame 40 (of 107 frames)"),
    ("image", -2, "an image at frame -2 (of 107 frames)"),
    ("video", 0, "a clip at the first frame"),
    ("video_audio", -22, "a clip with its soundtrack at frame -22 (of 107 frames)"),
    ("audio", 40, "an audio at frame 40 (of 107 frames)"),
])
def test_a_guide_sglang_cannot_take_is_refused_before_sending_naming_the_engine(fl2va, kind, frame, what):
    posts = len(fl2va.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error) as caught:
        engine(fl2va).generate("x", **REQUEST, guides=(_guide(kind, frame),))
    assert str(caught.value) == (f"H3 Guide #6 (frame {frame}): SGLang takes guides only as one image at the first or "
                                 f"the last frame (frame 0 or -1, its keyframes), and this is {what}; run this "
                                 "request locally, where a guide may be an image, a clip or an audio at any frame.")
    assert not isinstance(caught.value, RemoteError)
    assert len(fl2va.requests("POST", "/v1/videos")) == posts  # nothing was sent


def test_a_guide_outside_the_video_is_refused_saying_the_frames_it_has(fl2va):
    posts = len(fl2va.requests("POST", "/v1/videos"))
    for frame in (107, -108):
        with pytest.raises(H3Error, match=rf"^H3 Guide #6 \(frame {frame}\): frame {frame} is outside the video's 107 "
                                          r"frames \(0 to 106, or -1 to -107 from the end\)\.$"):
            engine(fl2va).generate("x", **REQUEST, guides=(_guide("image", frame),))
    assert len(fl2va.requests("POST", "/v1/videos")) == posts


def test_two_images_for_one_end_are_refused_before_sending(fl2va):
    posts = len(fl2va.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error, match=r"^H3 Guide #6 \(frame 0\) overlaps first_frame: first_frame holds frame 0"):
        engine(fl2va).generate("x", **REQUEST, first_frame=picture(128, 64), guides=(_guide("image", 0),))
    assert len(fl2va.requests("POST", "/v1/videos")) == posts


# ---- the CLI --------------------------------------------------------------------------------------------------------


def test_the_cli_writes_the_mp4_of_a_t2va_job(fl2va, run_cli, tmp_path):
    import av

    key = "sk-h3-conformance-0123"  # SGLang has no key of its own; one is sent for a gateway in front of it
    done = run_cli(["generate", "A fox.", "--server", fl2va.url, "--size", "128x64", "--seconds", "5", "--steps",
                    "3", "--model", "/models/H3", "--out", "fox.mp4"], tmp_path, H3_STREAM_API_KEY=key)
    assert done.returncode == 0, done.stderr
    assert "note: --model is ignored with --server" in done.stdout and "wrote fox.mp4\n" in done.stdout
    assert key not in done.stdout + done.stderr
    assert f"server {fl2va.url}: MiniMaxAI/MiniMax-H3, SGLang, FL2VA (as set: the server does not say), 1 GPU(s)" in done.stdout
    with av.open(str(tmp_path / "fox.mp4")) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.width, video.height, video.average_rate) == ("h264", 128, 64, 24)
        assert (audio.codec_context.name, audio.rate, audio.layout.name) == ("aac", 32000, "stereo")
        assert sum(1 for _ in container.decode(video=0)) == 124


def test_the_cli_sends_keyframes_and_references(fl2va, ref2va, run_cli, tmp_path):
    from videos_api_server import make_mp4

    picture(200, 100).save(tmp_path / "first.png")
    (tmp_path / "clip.mp4").write_bytes(make_mp4(num_frames=48, width=96, height=64))
    import av

    with av.open(str(tmp_path / "voice.wav"), "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=32000, layout="stereo")
        frame = av.AudioFrame.from_ndarray(tone(2.0).numpy().astype(np.float32), format="fltp", layout="stereo")
        frame.sample_rate = 32000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    common = ["--size", "128x64", "--frames", "107", "--steps", "2"]
    done = run_cli(["generate", "x", "--server", fl2va.url, *common, "--first-frame", "first.png", "--out", "a.mp4"],
                   tmp_path)
    assert done.returncode == 0, done.stderr
    before = len(ref2va.jobs())
    done = run_cli(["generate", "x", "--server", ref2va.url, *common, "--partition", "ref2va", "--ref-image",
                    "first.png", "--ref-video", "clip.mp4", "--ref-audio", "voice.wav", "--out", "b.mp4"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert fl2va.jobs()[-1]["conditions"] == [{"type": "image", "role": "keyframe", "frame_index": 0}]
    assert ref2va.jobs()[before]["conditions"] == [{"type": "image", "role": "reference"},
                                                   {"type": "video_audio", "role": "reference"},
                                                   {"type": "audio", "role": "reference"}]


def test_the_cli_refuses_what_the_server_would_refuse_in_one_line(fl2va, run_cli, tmp_path):
    posts = len(fl2va.requests("POST", "/v1/videos"))
    done = run_cli(["generate", "x", "--server", fl2va.url, "--size", "128x64", "--seconds", "1", "--out", "x.mp4"],
                   tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == ("error: --seconds: 39 frames (1.62 s) is outside what SGLang makes: 4 to "
                                            "15 s, 107 to 362 frames on the 17n+5 grid. Ask for at least 107 frames "
                                            "(4.46 s), or run locally.")
    assert len(fl2va.requests("POST", "/v1/videos")) == posts and not (tmp_path / "x.mp4").exists()


def test_ctrl_c_sends_delete_and_says_the_job_goes_on_running(fl2va, tmp_path):
    """SGLang's DELETE forgets the job but cannot stop it: the CLI says so, and the job does run to its end."""
    before = len(fl2va.jobs())
    done = fl2va.ctrl_c_during_job(["x", "--size", "128x64", "--frames", "107", "--steps", "41", "--out", "x.mp4"],
                                   tmp_path)
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 130, stderr
    assert "but SGLang cannot abort a job: it goes on running on" in stdout
    assert stderr.strip().splitlines()[-1] == "interrupted; nothing was written"
    assert len(fl2va.requests("DELETE", "/v1/videos/")) >= 1 and list(tmp_path.iterdir()) == []
    assert len(wait_for_jobs(fl2va, before + 1)) == before + 1  # the server did finish it


# ---- the node ---------------------------------------------------------------------------------------------------


@pytest.fixture
def pack(tmp_path):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


def run_node(pack, name, node_id="9", **inputs):
    from comfy_double.executor import run_node as run

    return run(pack[name], node_id, **inputs)


NODE_REQUEST = dict(prompt="A fox in the snow.", width=128, height=64, seconds=4.5, frames=107, steps=3, seed=7,
                    video_shift=12.0, audio_shift=3.0)


def test_the_node_completes_t2va_and_fl2va(fl2va, pack):
    images, audio, fps = run_node(pack, "H3StreamGenerateRemote", server_url=fl2va.url, **NODE_REQUEST)
    assert images.shape == (107, 64, 128, 3) and audio["waveform"].shape == (1, 2, audio_samples_for_frames(107))
    first = torch.from_numpy(np.asarray(picture(128, 64), dtype=np.float32) / 255)[None]
    images, _, _ = run_node(pack, "H3StreamGenerateRemote", server_url=fl2va.url, **NODE_REQUEST, last_frame=first)
    assert images.shape[0] == 107 and fl2va.jobs()[-1]["conditions"][0]["frame_index"] == -1 and fps == 24.0


def test_the_node_completes_ref2va_from_h3_references(ref2va, pack):
    image = torch.from_numpy(np.asarray(picture(120, 80), dtype=np.float32) / 255)[None]
    (refs,) = run_node(pack, "H3StreamReferenceMedia", node_id="3", ref_image_size="max", ref_image_1=image,
                       ref_audio_1={"waveform": tone(2.0)[None], "sample_rate": 32000})
    before = len(ref2va.jobs())
    images, _, _ = run_node(pack, "H3StreamGenerateRemote", server_url=ref2va.url, **NODE_REQUEST, h3_refs=refs)
    assert images.shape == (107, 64, 128, 3)
    job = ref2va.jobs()[before]
    assert [c["type"] for c in job["conditions"]] == ["image", "audio"] and job["reference_resize_mode"] == "max"


def test_the_node_sends_h3_guides_as_keyframes_and_refuses_one_in_between_in_its_words(fl2va, pack):
    start, end = picture(128, 64, seed=7), picture(128, 64, seed=8)
    (guides,) = run_node(pack, "H3StreamGuide", node_id="4", frame=-1, image=frames_of(end))
    (guides,) = run_node(pack, "H3StreamGuide", node_id="5", frame=0, image=frames_of(start), h3_guides=guides)
    before = len(fl2va.jobs())
    images, _, _ = run_node(pack, "H3StreamGenerateRemote", server_url=fl2va.url, **NODE_REQUEST, h3_guides=guides)
    assert images.shape == (107, 64, 128, 3)
    job = fl2va.jobs()[before]
    assert [(c["type"], c["role"], c["frame_index"]) for c in job["conditions"]] == [("image", "keyframe", 0),
                                                                                     ("image", "keyframe", -1)]
    assert [m["pixels_sha256"] for m in job["media"]] == [pixels_sha256(start), pixels_sha256(end)]
    (middle,) = run_node(pack, "H3StreamGuide", node_id="6", frame=40, image=frames_of(start))
    posts = len(fl2va.requests("POST", "/v1/videos"))
    with pytest.raises(H3Error, match=r"^H3 Guide #6 \(frame 40\): SGLang takes guides only as one image at the "
                                      r"first or the last frame"):
        run_node(pack, "H3StreamGenerateRemote", server_url=fl2va.url, **NODE_REQUEST, h3_guides=middle)
    assert len(fl2va.requests("POST", "/v1/videos")) == posts


def test_cancel_in_comfyui_sends_delete_and_the_node_says_the_job_goes_on(fl2va, pack):
    import comfy.model_management as mm
    import server as comfy_server

    deletes = len(fl2va.requests("DELETE", "/v1/videos/"))
    mm.state.interrupt_at_check = 30
    with pytest.raises(mm.InterruptProcessingException):
        run_node(pack, "H3StreamGenerateRemote", server_url=fl2va.url, **{**NODE_REQUEST, "steps": 61})
    assert len(fl2va.requests("DELETE", "/v1/videos/")) == deletes + 1
    texts = [data["text"] for event, data, _ in comfy_server.PromptServer.instance.messages
             if event == "progress_text" and data["node"] == "9"]
    assert "SGLang cannot abort a job: it goes on running on" in texts[-1]
