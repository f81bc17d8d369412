"""H3 Generate (remote server) against the comfy test double and the videos-API stand-in (tests/videos_api_server.py):
the node's own side (progress per client, failures, the widget names, the key); the node against SGLang's own server
code is in tests/test_remote_sglang.py."""

from __future__ import annotations

import json

import pytest

import comfy_double
from videos_api_server import FRAMES, HEIGHT, WIDTH, Behaviour, VideosApiServer

KEY = "sk-node-contract-42"
REQUEST = dict(prompt="A fox in the snow.", width=WIDTH, height=HEIGHT, seconds=4.5, frames=FRAMES, steps=3, seed=7,
               video_shift=12.0, audio_shift=3.0)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    """The node polls a job every 2 s, as it should a real server; the stand-in answers at once, so poll it often."""
    from h3_core.remote import RemoteEngine

    monkeypatch.setitem(RemoteEngine.__init__.__kwdefaults__, "poll_interval", 0.01)
    monkeypatch.setitem(RemoteEngine.__init__.__kwdefaults__, "backoff", 0.01)


@pytest.fixture
def pack(tmp_path):
    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


def run(pack, node_id="9", **inputs):
    from comfy_double.executor import run_node

    return run_node(pack["H3StreamGenerateRemote"], node_id, **inputs)


def test_the_node_gives_image_audio_and_fps_with_the_servers_progress(pack):
    import comfy.utils
    import server as comfy_server

    comfy_server.PromptServer.instance.client_id = "tab-a"
    try:
        with VideosApiServer(Behaviour(polls_until_done=2)) as api:
            images, audio, fps = run(pack, server_url=api.url, **REQUEST)
    finally:
        comfy_server.PromptServer.instance.client_id = None
    assert images.shape == (FRAMES, HEIGHT, WIDTH, 3) and 0 <= images.min() and images.max() <= 1
    assert audio["sample_rate"] == 32000 and audio["waveform"].shape == (1, 2, 142667) and fps == 24.0
    updates = [(node, done, total) for node, done, total in comfy.utils.UPDATES if node == "9"]
    assert updates[-1] == ("9", 100, 100) and len(updates) >= 3  # 0 %, the server's in-between percent, 100 %
    texts = [data["text"] for event, data, client in comfy_server.PromptServer.instance.messages
             if event == "progress_text" and data["node"] == "9" and client == "tab-a"]
    assert texts[0] == f"{api.url}: MiniMaxAI/MiniMax-H3, SGLang, 4 GPU(s), transformer bf16"
    assert "remote job in_progress 33%" in texts and "remote job completed 100%" in texts
    assert texts[-1] == f"downloaded 0.1 MiB from {api.url}"  # the engine's own lines are shown on the node too


def test_cancel_in_comfyui_cancels_the_job_on_the_server(pack):
    import comfy.model_management as mm

    with VideosApiServer(Behaviour(endless=True)) as api:
        mm.state.interrupt_at_check = 8
        with pytest.raises(mm.InterruptProcessingException):
            run(pack, server_url=api.url, **REQUEST)
        assert api.deleted == ["video_1"] and api.requests("GET", "/content$") == []


def test_the_job_time_limit_is_a_node_input_in_minutes(pack, monkeypatch):
    """Part of issue 28: job_timeout_minutes bounds the job (scaled down here: 1 minute -> 0.2 s)."""
    from h3_core.errors import RemoteError
    from h3_core.remote import RemoteEngine

    seen, original = [], RemoteEngine.__init__

    def scaled(self, url, **options):
        seen.append(options["job_timeout"])
        original(self, url, **{**options, "job_timeout": options["job_timeout"] / 300})

    monkeypatch.setattr(RemoteEngine, "__init__", scaled)
    with VideosApiServer(Behaviour(endless=True)) as api:
        with pytest.raises(RemoteError) as caught:
            run(pack, server_url=api.url, **REQUEST, job_timeout_minutes=1)
        assert api.deleted == ["video_1"]
    assert seen == [60.0]
    assert str(caught.value) == (f"the job video_1 on {api.url} did not finish within 0.2 s (job_timeout_minutes); it "
                                 "was cancelled. Give a longer job_timeout_minutes for long videos.")


def test_a_failed_job_is_one_message_naming_the_server(pack):
    from h3_core.errors import RemoteError

    with VideosApiServer(Behaviour(job_failure="out of memory", polls_until_done=0)) as api:
        with pytest.raises(RemoteError) as caught:
            run(pack, server_url=api.url, **REQUEST)
    assert str(caught.value) == (f"the server at {api.url} could not make the video (job video_1 failed): out of "
                                 "memory")


def test_a_bad_server_url_names_the_widget(pack):
    from h3_core.errors import H3Error

    with pytest.raises(H3Error, match="^server_url 'gpu-box': not an http:// or https:// address"):
        run(pack, server_url="gpu-box", **REQUEST)


def test_the_key_comes_from_the_environment_and_stays_out_of_the_workflow(pack, monkeypatch):
    from comfy_api.latest._io import node_info

    monkeypatch.setenv("H3_STREAM_API_KEY", KEY)
    with VideosApiServer(Behaviour(required_key=KEY, polls_until_done=0)) as api:
        images, _, _ = run(pack, server_url=api.url, **REQUEST)
    assert images.shape[0] == FRAMES
    schema = node_info(pack["H3StreamGenerateRemote"])
    assert not any("key" in name for group in schema["input"].values() for name in group)  # no widget holds it
    assert KEY not in json.dumps(schema)
