"""H3 Loader (H3StreamModelLoader): a source that brings only its own inputs and a memory profile, as ComfyUI runs them
from API-format prompts (`source`, `source.partition`, `memory_profile`, `memory_profile.<widget>` keys: what the
real frontend queues, see tests/test_workflows.py for the UI format) through the test double's executor."""

from __future__ import annotations

import pytest
import torch

import comfy_double

TINY = "tiny test model (embedded)"
AUTO = "auto (from free memory)"


@pytest.fixture
def pack(tmp_path):
    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


@pytest.fixture
def executor(pack):
    from comfy_double.core_nodes import CORE_NODES
    from comfy_double.executor import PromptExecutor

    return PromptExecutor({**pack, **CORE_NODES})


def loader_inputs(**changes) -> dict:
    return {"source": TINY, "source.partition": "FL2VA", "memory_profile": AUTO, "dtype": "auto", "device": "cpu",
            **changes}


CUSTOM = {"memory_profile": "custom", "memory_profile.transformer_residency": "LAYERWISE_OFFLOAD",
          "memory_profile.text_encoder_residency": "LAYERWISE_OFFLOAD", "memory_profile.video_vae_residency": "RESIDENT",
          "memory_profile.audio_vae_residency": "RESIDENT", "memory_profile.prefetch": -1,
          "memory_profile.resident_blocks": 0, "memory_profile.chunk_size": 0, "memory_profile.memory_budget_mib": 0,
          "memory_profile.mps_reclaim_every": 0}


def prompt_with(loader: dict, width=96, height=64) -> dict:
    return {
        "1": {"class_type": "H3StreamModelLoader", "inputs": loader},
        "2": {"class_type": "H3StreamEncodePrompt", "inputs": {"h3_model": ["1", 0], "prompt": "a fox", "width": width,
                                                                "height": height, "seconds": 1.0, "frames": 5}},
        "3": {"class_type": "H3StreamAVSampler", "inputs": {"h3_model": ["1", 0], "h3_cond": ["2", 0], "steps": 2,
                                                             "seed": 1, "video_shift": 12.0, "audio_shift": 3.0,
                                                             "chunk_size": 0}},
        "4": {"class_type": "H3StreamUnload", "inputs": {"h3_model": ["1", 0], "after": ["3", 0]}},
    }


def texts(node: str) -> list[str]:
    import server

    return [data["text"] for event, data, sid in server.PromptServer.instance.messages
            if event == "progress_text" and data["node"] == node and sid == "browser-tab"]


def test_the_auto_profile_plans_from_the_free_memory_and_shows_the_preflight_on_the_node(pack, executor):
    import comfy.model_management

    comfy.model_management.state.free_bytes = 256 << 20
    result = executor.run(prompt_with(loader_inputs()))
    handle = result.outputs["1"][0]
    settings = handle.settings
    assert settings.profile == AUTO and settings.profile_budget_bytes == int(0.9 * (256 << 20))
    # The tiny model's weights fit 230 MiB with the text encoder resident beside the rest.
    assert dict(settings.residency) == {"transformer": "RESIDENT", "text_encoder": "RESIDENT",
                                        "video_vae": "RESIDENT", "audio_vae": "RESIDENT"}
    preflight, = texts("1")
    # Also the node's UI output: ComfyUI sends it again on runs that take the loader from its cache.
    assert result.ui["1"] == {"h3_stream_preflight": [preflight]}
    assert pack["H3StreamModelLoader"].GET_SCHEMA().has_intermediate_output
    assert preflight.startswith(f"memory_profile {AUTO}, planned for 0.22 GiB free: all weights stay loaded. "
                                "Estimated peak ") and preflight.endswith(
        "at the weights alone (1344x768, 5 s does not fit); each run is planned again for its own size.")
    sampler, = [text for text in texts("3") if text.startswith("memory_profile")]
    assert sampler.startswith(f"memory_profile {AUTO}: this request needs about ") and "transformer fused" in sampler


def test_a_request_too_large_for_the_profile_is_refused_by_the_sampler_in_its_widgets_words(pack, executor):
    import comfy.model_management
    from h3_core.errors import H3Error

    comfy.model_management.state.free_bytes = 256 << 20
    with pytest.raises(H3Error) as refused:
        executor.run(prompt_with(loader_inputs(), width=1024, height=1024))
    message = str(refused.value)
    assert message.startswith(f"width 1024, height 1024, 5 frames do not fit the loader's memory_profile '{AUTO}': "
                              "this request does not fit a 0.22 GiB budget: the video decode phase needs about")
    assert message.endswith(". Set a smaller width / height / seconds, or a larger memory_profile on the loader.")
    assert "\n" not in message
    # Its first line stands alone: no plan "below" that the node does not show, one piece of advice.
    assert "below" not in message and "raise the budget" not in message


def test_custom_brings_the_hand_set_widgets_and_refuses_resident_components_on_mps(pack):
    from comfy_double.executor import run_node
    from h3_core.errors import H3Error
    import comfy.model_management

    custom = {key.split(".", 1)[1]: value for key, value in CUSTOM.items() if "." in key}
    handle, = run_node(pack["H3StreamModelLoader"], "1", source={"source": TINY, "partition": "FL2VA"},
                       memory_profile={"memory_profile": "custom", **custom, "resident_blocks": 2, "chunk_size": 64},
                       dtype="float32", device="cpu")
    assert handle.settings.profile is None and handle.settings.profile_budget_bytes is None
    assert handle.pipeline.component_options["transformer"] == {"residency": "layerwise", "resident_blocks": 2,
                                                                "chunk_size": 64}
    assert handle.pipeline.dtype == torch.float32
    comfy.model_management.state.device = torch.device("mps")  # "auto" follows ComfyUI's device
    with pytest.raises(H3Error) as refused:
        run_node(pack["H3StreamModelLoader"], "1", source={"source": TINY, "partition": "FL2VA"},
                 memory_profile={"memory_profile": "custom", **custom}, dtype="auto", device="auto")
    message = str(refused.value)
    assert message.startswith("memory_profile custom: MPS runs need every component to stream")
    assert "set video_vae_residency to LAYERWISE_OFFLOAD (it is RESIDENT)" in message


def test_a_gpu_profile_on_mps_is_refused_before_anything_loads(pack):
    from comfy_double.executor import run_node
    from h3_core.errors import H3Error
    import comfy.model_management

    comfy.model_management.state.device = torch.device("mps")
    with pytest.raises(H3Error, match=r"^memory_profile '24 GB GPU' is for a discrete GPU, but device is mps; choose "
                                      r"a Mac profile"):
        run_node(pack["H3StreamModelLoader"], "1", source={"source": TINY, "partition": "FL2VA"},
                 memory_profile={"memory_profile": "24 GB GPU"}, dtype="auto", device="auto")


@pytest.mark.parametrize("mistake, key", [
    ({"source.partition": "ref2va"}, "source.partition"),  # the widget value is Ref2VA
    ({**CUSTOM, "memory_profile.transformer_residency": "layerwise"}, "memory_profile.transformer_residency"),
    ({**CUSTOM, "memory_profile.prefetch": 99}, "memory_profile.prefetch"),
    ({"device": "cuda"}, "device"),  # not a device of this (CPU-only) machine
    ({"dtype": "fp8"}, "dtype"),
])
def test_each_mistake_in_an_api_prompt_is_one_error_on_its_input(pack, executor, mistake, key):
    from comfy_double.executor import PromptError

    with pytest.raises(PromptError) as refused:
        executor.validate(prompt_with(loader_inputs(**mistake)))
    (node, message), = refused.value.errors
    assert node == "1" and message.startswith(f"{key}: ")


@pytest.mark.parametrize("name, value, choices", [
    ("source", "tiny", "['tiny test model (embedded)', 'models/h3 folder', 'ComfyUI repack files', 'Hugging Face repo']"),
    ("memory_profile", "24GB", "['auto (from free memory)', '12 GB GPU', '16 GB GPU', '24 GB GPU', '32 GB Mac', "
                               "'64 GB Mac', '128 GB Mac', 'custom']"),
])
def test_an_unknown_source_or_profile_passes_comfyuis_validation_and_is_named_when_the_loader_runs(
        pack, executor, name, value, choices):
    """ComfyUI validates neither dynamic combo's own value (verify_server.py shows the real server accepting it) and
    then leaves the input out: the loader names the input and the value the prompt gave."""
    from h3_core.errors import H3Error

    prompt = prompt_with(loader_inputs(**{name: value}))
    executor.validate(prompt)
    with pytest.raises(H3Error) as refused:
        executor.run(prompt)
    assert str(refused.value) == f"{name} {value!r} is not one of {choices}; choose one on H3 Loader."


def test_a_source_shows_only_its_own_inputs_and_a_missing_one_is_named(pack, executor):
    from comfy_api.latest._io import node_info
    from comfy_double.executor import PromptError

    source = node_info(pack["H3StreamModelLoader"])["input"]["required"]["source"]
    options = {option["key"]: list(option["inputs"]["required"]) for option in source[1]["options"]}
    assert options == {TINY: ["partition"], "models/h3 folder": ["h3_folder", "partition"],
                       "ComfyUI repack files": ["diffusion_model", "text_encoder", "video_vae", "audio_vae"],
                       "Hugging Face repo": ["repo_id", "partition"]}
    with pytest.raises(PromptError) as refused:
        executor.validate(prompt_with(loader_inputs(source="models/h3 folder")))
    assert refused.value.errors == [("1", "required input 'source.h3_folder' is missing")]


def test_the_legacy_loader_is_deprecated_and_the_examples_use_the_new_one(pack):
    assert pack["H3StreamLoader"].GET_SCHEMA().is_deprecated
    assert not pack["H3StreamModelLoader"].GET_SCHEMA().is_deprecated
