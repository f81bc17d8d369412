"""H3 Long Video and H3 Extend through the ComfyUI test double (tests/comfy_double) on the tiny model with a lighter
audio decoder (tests/long_video_fixtures.py), as ComfyUI runs an API prompt: the node text says how many windows,
one progress bar runs across them, the VIDEO output is a file-backed core VIDEO in ComfyUI's temp folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import comfy_double
import numpy as np
import pytest

from long_video_fixtures import tinier_audio_model

av = pytest.importorskip("av")

SAMPLER = {"steps": 2, "seed": 3, "video_shift": 12.0, "audio_shift": 3.0}


@pytest.fixture
def pack(tmp_path):
    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


LOADER = {"source": "models/h3 folder", "source.h3_folder": "tinier", "source.partition": "FL2VA",
          "memory_profile": "auto (from free memory)", "dtype": "auto", "device": "cpu"}


@pytest.fixture
def h3_model(pack, tiny, tmp_path_factory):
    """H3 Loader on the tinier model, copied into ComfyUI's models/h3 folder."""
    import folder_paths
    from comfy_double.executor import nested_inputs, run_node

    model = tinier_audio_model(tiny, tmp_path_factory.mktemp("tinier") / "model")
    shutil.copytree(model, Path(folder_paths.models_dir) / "h3" / "tinier")
    loader = pack["H3StreamModelLoader"]
    return run_node(loader, "1", **nested_inputs(loader.GET_SCHEMA().inputs, LOADER))[0]


def run(node_class, node_id, **inputs):
    from comfy_double.executor import run_node

    return run_node(node_class, node_id, **inputs)


def texts(node: str) -> list[str]:
    import server

    return [data["text"] for event, data, sid in server.PromptServer.instance.messages
            if event == "progress_text" and data["node"] == node]


def frames_of(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_long_video_node_makes_windows_and_returns_a_file_backed_video(pack, h3_model):
    import comfy.utils
    import folder_paths

    from h3_core.request.windows import long_frame_count

    (video,) = run(pack["H3StreamLongVideo"], "2", h3_model=h3_model, prompt="a beach", width=64, height=32,
                   seconds=16.0, **SAMPLER, prompt_schedule="0: dawn\n10: noon")
    path = Path(video.get_stream_source())
    assert path.parent == Path(folder_paths.get_temp_directory()) and path.suffix == ".mp4"
    assert len(frames_of(path)) == long_frame_count(16)
    shown = texts("2")
    assert any("in 2 windows of at most 15 s" in text for text in shown)
    assert any("window 2 of 2" in text for text in shown)
    assert any("preflight: 2 windows, each planned as its own request" in text for text in shown)
    assert f"done: {long_frame_count(16)} frames" in shown[-1]
    bar = [(value, total) for node, value, total in comfy.utils.UPDATES if node == "2"]
    assert bar[-1] == (2, 2) and len({total for _, total in bar}) == 1  # one bar across both windows' model calls


def test_extend_node_keeps_the_clip_and_refuses_another_frame_rate(pack, h3_model, tmp_path):
    from comfy_api.latest import InputImpl

    from h3_core.errors import H3Error
    from test_long_video import write_clip

    clip = write_clip(tmp_path / "clip.mp4", frames=39)
    inputs = dict(h3_model=h3_model, prompt="more", seconds=0.5, **SAMPLER)
    (video,) = run(pack["H3StreamExtend"], "2", video=InputImpl.VideoFromFile(str(clip)), **inputs)
    frames = frames_of(video.get_stream_source())
    assert len(frames) == 39 + 17 and np.array_equal(frames[:39], frames_of(clip))
    assert any("the clip's frames are copied unchanged" in text for text in texts("2"))
    clip25 = write_clip(tmp_path / "c25.mp4", fps=25)
    with pytest.raises(H3Error, match="video .*c25.mp4: the clip is 25 fps; H3 makes 24 fps"):
        run(pack["H3StreamExtend"], "3", video=InputImpl.VideoFromFile(str(clip25)), **inputs)
