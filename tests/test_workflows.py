"""The example workflows: UI format (workflow JSON 1.0) and API-format twins.

Checked against the node schemas recorded from a real ComfyUI (tests/comfy_double/contract/object_info.json), converted
UI -> API independently of how the files were written, and run through the test double's prompt executor on the
embedded tiny model.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import comfy_double
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "example_workflows"
OBJECT_INFO = json.loads((comfy_double.CONTRACT / "object_info.json").read_text())
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3"}
CONTROL_AFTER_GENERATE = {"fixed", "increment", "decrement", "randomize"}
UI_FILES = sorted(EXAMPLES.glob("*.json"))
API_FILES = sorted((EXAMPLES / "api").glob("*.json"))
# The examples that run on this machine (the remote-engine example runs on a server: its own test below).
LOCAL_API_FILES = [p for p in API_FILES if "H3StreamAVSampler" in p.read_text()]
REMOTE_API_FILES = [p for p in API_FILES if "H3StreamGenerateRemote" in p.read_text()]
SEMVER = re.compile(r"^\d+\.\d+\.\d+$")
FRONTEND_ONLY = {"MarkdownNote", "Note"}  # drawn by the frontend, never queued


def is_widget(spec) -> bool:
    return isinstance(spec[0], list) or spec[0] in WIDGET_TYPES


def inputs_in_order(node_type: str):
    """(name, spec, required) in the order the frontend lays them out: required first, then optional."""
    info = OBJECT_INFO[node_type]
    for group in ("required", "optional"):
        for name in info["input_order"].get(group, []):
            yield name, info["input"][group][name], group == "required"


def _take_widgets(specs, values: list, inputs: dict, node_id, prefix: str = "", saved_before: bool = False) -> None:
    """Widget values in the frontend's order: each widget, and right after a dynamic combo the widgets of the
    option it holds (their prompt keys `<combo>.<input>`). `saved_before`: the workflow was saved before its last
    widgets existed; the frontend sets the values it has by position, and the widgets past them keep their defaults."""
    for name, spec in specs:
        if not is_widget(spec):
            continue
        if not values and saved_before:
            inputs[prefix + name] = spec[1]["default"]
            continue
        assert values, f"node {node_id}: no widget value left for {prefix}{name}"
        value = inputs[prefix + name] = values.pop(0)
        if spec[1].get("control_after_generate"):
            assert values.pop(0) in CONTROL_AFTER_GENERATE, (node_id, name)
        if spec[0] == "COMFY_DYNAMICCOMBO_V3":
            option, = [o for o in spec[1]["options"] if o["key"] == value]
            nested = [(n, s) for group in ("required", "optional") for n, s in option["inputs"].get(group, {}).items()]
            _take_widgets(nested, values, inputs, node_id, f"{prefix}{name}.", saved_before)


def ui_to_api(workflow: dict, saved_before: bool = False) -> dict:
    """What the frontend queues for a UI workflow: widget values by widget order, links as [origin id, slot];
    notes (frontend-only nodes) are not queued. `saved_before`: see `_take_widgets`."""
    links = {link["id"]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY:
            continue
        assert node["type"] in OBJECT_INFO, f"node type {node['type']} has no recorded schema"
        assert node["mode"] == 0, f"node {node['id']} is muted or bypassed"
        values = list(node.get("widgets_values", []))
        inputs = {}
        _take_widgets([(name, spec) for name, spec, _ in inputs_in_order(node["type"])], values, inputs, node["id"],
                      saved_before=saved_before)
        assert not values, f"node {node['id']} ({node['type']}): {len(values)} widget values too many"
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                link = links[slot["link"]]
                inputs[slot["name"]] = [str(link["origin_id"]), link["origin_slot"]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def test_every_ui_workflow_has_an_api_twin_and_both_kinds_exist():
    assert [p.name for p in UI_FILES] == [p.name for p in API_FILES]
    names = " ".join(p.name for p in UI_FILES)
    assert "Text to Video and Audio" in names and "First and Last Frame" in names
    # This frontend titles a custom pack's template cards by file name alone (no metadata is read): readable names.
    assert all(p.stem.startswith("H3 - ") and "_" not in p.stem for p in UI_FILES)


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_is_valid_workflow_json_1_0(path):
    workflow = json.loads(path.read_text())
    assert workflow["version"] == 1
    nodes = {node["id"]: node for node in workflow["nodes"]}
    assert len(nodes) == len(workflow["nodes"])
    state = workflow["state"]
    assert set(state) >= {"lastGroupId", "lastNodeId", "lastLinkId", "lastRerouteId"}
    assert state["lastNodeId"] == max(nodes) and state["lastLinkId"] == max(link["id"] for link in workflow["links"])
    for node in workflow["nodes"]:
        for key in ("id", "type", "pos", "size", "flags", "order", "mode", "properties"):
            assert key in node, (node["id"], key)
        assert len(node["pos"]) == 2 and len(node["size"]) == 2
        if node["type"] in FRONTEND_ONLY:
            assert node["widgets_values"][0].startswith("## "), "a workflow's note opens with its title"
            continue
        properties = node["properties"]
        assert properties["Node name for S&R"] == node["type"]
        assert properties["cnr_id"] == ("h3-stream" if node["type"].startswith("H3Stream") else "comfy-core")
        assert SEMVER.match(properties["ver"])
        info = OBJECT_INFO[node["type"]]
        assert [(o["name"], o["type"]) for o in node["outputs"]] == list(zip(info["output_name"], info["output"]))
    seen = set()
    for link in workflow["links"]:
        assert link["id"] not in seen
        seen.add(link["id"])
        origin, target = nodes[link["origin_id"]], nodes[link["target_id"]]
        assert link["id"] in origin["outputs"][link["origin_slot"]]["links"]
        slot = target["inputs"][link["target_slot"]]
        assert slot["link"] == link["id"]
        assert link["type"] == origin["outputs"][link["origin_slot"]]["type"] == slot["type"]
    for node in workflow["nodes"]:
        for output in node["outputs"]:
            assert all(link_id in seen for link_id in output["links"] or [])  # the frontend writes null: none


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_each_example_has_a_thumbnail_for_the_template_browser(path):
    """ComfyUI's template browser shows `<name>.jpg` beside a custom node's example workflow: a designed card,
    readable at card size, drawn by example_workflows/make_thumbnails.py (the committed one is what it draws)."""
    from PIL import Image, ImageChops

    sys.path.insert(0, str(EXAMPLES))
    from make_thumbnails import SIZE, card

    with Image.open(path.with_suffix(".jpg")) as thumbnail:
        assert thumbnail.format == "JPEG" and thumbnail.size == SIZE
        difference = ImageChops.difference(thumbnail.convert("RGB"), card(path.stem)).convert("L")
        assert sum(difference.histogram()[40:]) < 0.01 * SIZE[0] * SIZE[1]  # JPEG noise only
    assert path.with_suffix(".jpg").stat().st_size < 200_000


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_and_its_api_twin_are_the_same_graph(path):
    converted = ui_to_api(json.loads(path.read_text()))
    twin = json.loads((EXAMPLES / "api" / path.name).read_text())
    assert {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in twin.items()} == converted


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_api_workflow_matches_the_recorded_node_schemas(path):
    """Node ids, input names, link types and widget values valid for the real nodes (ours and core's)."""
    prompt = json.loads(path.read_text())
    for node_id, node in prompt.items():
        info = OBJECT_INFO[node["class_type"]]
        known = {name: (spec, required) for name, spec, required in inputs_in_order(node["class_type"])}
        top = {name for name in node["inputs"] if "." not in name or name.split(".")[0] not in known}
        assert top <= set(known), (node_id, top - set(known))
        for name, (spec, required) in known.items():
            if name not in node["inputs"]:
                assert not required, f"node {node_id}: required input {name} missing"
                continue
            value, options = node["inputs"][name], spec[1]
            if isinstance(value, list):
                source = prompt[value[0]]
                assert OBJECT_INFO[source["class_type"]]["output"][value[1]] == spec[0], (node_id, name)
            elif spec[0] == "COMBO":
                assert value in options["options"], (node_id, name, value)
            elif spec[0] == "COMFY_DYNAMICCOMBO_V3":
                assert value in [option["key"] for option in options["options"]], (node_id, name, value)
                option, = [o for o in options["options"] if o["key"] == value]
                for inner, inner_spec in option["inputs"].get("required", {}).items():
                    key = f"{name}.{inner}"
                    assert key in node["inputs"], f"node {node_id}: {key} missing"
                    if inner_spec[0] == "COMBO":
                        assert node["inputs"][key] in inner_spec[1]["options"], (node_id, key)
            elif spec[0] in ("INT", "FLOAT"):
                assert options.get("min", value) <= value <= options.get("max", value), (node_id, name, value)
        assert info["name"] == node["class_type"]
    types = [node["class_type"] for node in prompt.values()]
    assert {"CreateVideo", "SaveVideo", "SaveAudioAdvanced"} <= set(types)
    assert {"H3StreamModelLoader", "H3StreamGenerateRemote"} & set(types)  # a local model, or a remote server
    assert not any(OBJECT_INFO[t].get("deprecated") for t in types), "examples use current nodes only"
    saves = {node["class_type"]: node for node in prompt.values()
             if node["class_type"] in ("SaveVideo", "SaveAudioAdvanced")}
    assert prompt[saves["SaveVideo"]["inputs"]["video"][0]]["class_type"] == "CreateVideo"


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    """One executor for all example prompts: like a ComfyUI server, it keeps unchanged nodes' outputs (the loaded
    model) between prompts."""
    comfy_double.install(tmp_path_factory.mktemp("comfyui"))
    from comfy_double.core_nodes import CORE_NODES
    from comfy_double.executor import PromptExecutor

    return PromptExecutor({**comfy_double.load_pack(), **CORE_NODES})


@pytest.mark.parametrize("path", LOCAL_API_FILES, ids=lambda p: p.stem)
def test_api_workflow_runs_and_saves_image_frames_and_audio(path, executor):
    from comfy_double.core_nodes import SAVED

    from h3_core.request.grid import audio_samples_for_frames, frames_for_seconds

    prompt = json.loads(path.read_text())
    SAVED.clear()
    result = executor.run(prompt)
    encoder = next(node["inputs"] for node in prompt.values() if node["class_type"] == "H3StreamEncodePrompt")
    frames = encoder["frames"] or frames_for_seconds(encoder["seconds"])
    video, audio = SAVED
    assert video["node"] == "SaveVideo" and audio["node"] == "SaveAudioAdvanced" and audio["format"] == "flac"
    assert tuple(video["images"].shape) == (frames, encoder["height"], encoder["width"], 3)
    assert video["frame_rate"] == 24
    assert video["audio"] is audio["audio"]  # the same AUDIO feeds the video and the audio file
    waveform = audio["audio"]["waveform"]
    assert waveform.shape == (1, 2, audio_samples_for_frames(frames)) and audio["audio"]["sample_rate"] == 32000
    assert torch.isfinite(waveform).all() and torch.isfinite(video["images"]).all()
    output_nodes = {node_id for node_id, node in prompt.items()
                    if node["class_type"] in ("SaveVideo", "SaveAudioAdvanced")}
    assert output_nodes <= set(result.ui)


LEGACY_API_FILES = sorted((Path(__file__).parent / "legacy_workflows").glob("*.api.json"))


@pytest.mark.parametrize("path", LEGACY_API_FILES, ids=lambda p: p.stem)
def test_examples_saved_before_the_request_moved_still_validate(path, executor):
    """Today's examples as they were saved before the canvas and duration moved to H3 Text Encode (the legacy text
    encode, sampler and references nodes): ComfyUI still accepts them (the real server runs them all:
    tests/comfy_double/verify_server.py)."""
    prompt = json.loads(path.read_text())
    assert {"H3StreamTextEncode", "H3StreamSampler"} <= {node["class_type"] for node in prompt.values()}
    executor.validate(prompt)


LEGACY_UI_FILES = sorted(p for p in (Path(__file__).parent / "legacy_workflows").glob("*.json")
                         if not p.name.endswith(".api.json"))


@pytest.mark.parametrize("path", LEGACY_UI_FILES, ids=lambda p: p.stem)
def test_a_workflow_saved_before_the_step_cache_loads_with_it_off(path):
    """The sampler's step_cache came after these were saved: their sampler has no value for it (the strict
    conversion says so), the frontend leaves the widget at its default, off, and queues the rest as saved."""
    workflow = json.loads(path.read_text())
    with pytest.raises(AssertionError, match="no widget value left for step_cache"):
        ui_to_api(workflow)
    prompt = ui_to_api(workflow, saved_before=True)
    sampler, = [node["inputs"] for node in prompt.values() if node["class_type"] == "H3StreamSampler"]
    assert sampler["step_cache"] == "off"
    twin = json.loads(path.with_name(path.stem + ".api.json").read_text())
    saved = {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in twin.items()}
    assert all("step_cache" not in node["inputs"] for node in saved.values())  # the API twin predates it too
    del sampler["step_cache"]
    assert prompt == saved


def test_an_api_prompt_saved_before_the_step_cache_samples_as_with_it_off(executor):
    """ComfyUI passes no value for an optional input a prompt lacks: the sampler's default, off, bitwise."""
    prompt = json.loads((Path(__file__).parent / "legacy_workflows" / "h3_stream_t2va_tiny.api.json").read_text())
    sampler = next(k for k, node in prompt.items() if node["class_type"] == "H3StreamSampler")
    assert "step_cache" not in prompt[sampler]["inputs"]
    before = executor.run(prompt).outputs[sampler][0]
    prompt[sampler]["inputs"]["step_cache"] = "off"
    off = executor.run(prompt).outputs[sampler][0]
    assert off is not before  # a new input value: the sampler ran again
    assert before.step_cache is None and off.step_cache is None
    assert torch.equal(before.video, off.video) and torch.equal(before.audio, off.audio)


def test_the_ref2va_example_saved_before_the_request_moved_still_runs(executor):
    from comfy_double.core_nodes import SAVED

    from h3_core.request.grid import audio_samples_for_frames, frames_for_seconds

    prompt = json.loads((Path(__file__).parent / "legacy_workflows" / "h3_stream_ref2va_tiny.api.json").read_text())
    SAVED.clear()
    executor.run(prompt)
    video, audio = SAVED
    frames = frames_for_seconds(1.0)  # the legacy sampler's and references' own 1 s
    assert tuple(video["images"].shape) == (frames, 64, 96, 3)
    assert audio["audio"]["waveform"].shape[-1] == audio_samples_for_frames(frames)


def test_turbo_example_samples_with_the_tiny_lora_at_its_recommended_steps(executor):
    from h3_core import read_lora

    prompt = json.loads((EXAMPLES / "api" / "H3 - Turbo LoRA Text to Video.json").read_text())
    lora_node = next(k for k, node in prompt.items() if node["class_type"] == "H3StreamLoRA")
    sampler = next(node for node in prompt.values() if node["class_type"] == "H3StreamAVSampler")
    sampler["inputs"]["seed"] += 1  # the sampler runs again (after the example's own run), asking for the LoRA's output
    import server

    server.PromptServer.instance.messages.clear()
    result = executor.run(prompt)
    assert sampler["inputs"]["h3_model"] == [lora_node, 0]
    handle = result.outputs[lora_node][0]
    (path, strength), = handle.loras
    assert path.name == "h3_tiny_turbo_lora.safetensors" and strength == 1.0
    assert read_lora(path).recommended == {"steps": sampler["inputs"]["steps"]} == {"steps": 9}
    # What the transformer sampled with, as the sampler's memory report saw it (an offloaded transformer is released
    # when decoding starts, so the pipeline no longer holds it).
    sampling, = [data for event, data, _ in server.PromptServer.instance.messages
                 if event == "h3_stream.memory" and data["phase"] == "sampling"]
    assert sampling["lora_files"] == 1 and sampling["lora_bytes_moved"] > 0


def test_the_guides_example_chains_its_guides_into_the_request(executor):
    """The guides example's two H3 Guide nodes reach H3 Text Encode's request in chain order, named by their nodes
    (how h3_core's errors about a guide name it)."""
    from comfy_double.executor import PromptExecutor

    prompt = json.loads((EXAMPLES / "api" / "H3 - Guides at Any Frame.json").read_text())
    result = PromptExecutor(executor.node_classes).run(prompt)  # its own cache: every node runs and is seen
    (cond,) = result.outputs["2"]
    guides = cond.request.guides
    assert [g.label for g in guides] == ["H3 Guide #14 (frame 19)", "H3 Guide #15 (frame -1)"]
    assert [(g.kind, g.frame, tuple(g.frames.shape)) for g in guides] == [("image", 19, (1, 64, 96, 3)),
                                                                          ("image", -1, (1, 64, 96, 3))]
    orange, blue = (g.frames[0, 0, 0] for g in guides)  # the Empty Image colours 0xFF8C00 and 0x1E3A8A
    assert torch.allclose(orange, torch.tensor([255, 140, 0]) / 255) and torch.allclose(blue, torch.tensor(
        [30, 58, 138]) / 255)


def test_every_example_is_run_by_a_test():
    assert sorted(LOCAL_API_FILES + REMOTE_API_FILES) == API_FILES and REMOTE_API_FILES


@pytest.mark.parametrize("path", REMOTE_API_FILES, ids=lambda p: p.stem)
def test_remote_example_runs_against_sglangs_own_server(path, executor, sglang_servers):
    """The remote-engine example against SGLang 0.5.23's own server code (tests/engine_servers.py): its server
    address and, to keep the job small, its canvas and length are pointed at the smallest request the server makes;
    the graph, the nodes and the saves are the example's."""
    from comfy_double.core_nodes import SAVED

    from h3_core.request.grid import audio_samples_for_frames

    server = sglang_servers["fl2va"]
    prompt = json.loads(path.read_text())
    remote = next(node["inputs"] for node in prompt.values() if node["class_type"] == "H3StreamGenerateRemote")
    assert remote["server_url"].startswith("http://") and (remote["width"], remote["height"]) == (1344, 768)
    SAVED.clear()
    posts = len(server.requests("POST", "/v1/videos"))
    remote.update(server_url=server.url, width=128, height=64, frames=107)
    result = executor.run(prompt)
    assert len(server.requests("POST", "/v1/videos")) == posts + 1
    video, audio = SAVED
    assert video["node"] == "SaveVideo" and audio["node"] == "SaveAudioAdvanced"
    assert tuple(video["images"].shape) == (107, 64, 128, 3) and video["frame_rate"] == 24
    assert video["audio"] is audio["audio"]
    assert audio["audio"]["waveform"].shape == (1, 2, audio_samples_for_frames(107))
    assert audio["audio"]["sample_rate"] == 32000
    assert {k for k, n in prompt.items() if n["class_type"] in ("SaveVideo", "SaveAudioAdvanced")} <= set(result.ui)
