"""The ComfyUI nodes against the comfy test double (tests/comfy_double) and the embedded tiny H3 model.

The double is held to the real ComfyUI by recorded contracts (signatures and `/object_info`, from ComfyUI 0.33.0);
the nodes run the real h3_core pipeline on the tiny random-weight model.
"""

from __future__ import annotations

import gc
import json
import shutil
import tomllib
import weakref
from pathlib import Path

import comfy_double
import pytest
import torch
from comfy_double.record_contract import describe, resolve

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = comfy_double.CONTRACT
TINY = "tiny test model (embedded)"
W, H = 96, 64
LOADER = dict(source=TINY, partition="FL2VA", transformer_residency="LAYERWISE_OFFLOAD",
              text_encoder_residency="LAYERWISE_OFFLOAD", video_vae_residency="RESIDENT",
              audio_vae_residency="RESIDENT",
              prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu")
# 5 frames (2 latent frames, 8 audio latents) keep the tiny model's decoders fast; the example workflows run 1 s.
SAMPLER = dict(steps=3, seed=7, video_shift=12.0, audio_shift=3.0, chunk_size=0)
DURATION = dict(seconds=1.0, frames=5)
# The legacy sampler (saved workflows) takes its own canvas and duration.
LEGACY_SAMPLER = dict(width=W, height=H, **DURATION, **SAMPLER)
TINY_LORA = "h3_tiny_turbo_lora.safetensors"
# Options of these combos are the files on the machine that recorded the contract.
MACHINE_DEPENDENT_OPTIONS = {"h3_folder", "diffusion_model", "text_encoder", "video_vae", "audio_vae"}


@pytest.fixture
def pack(tmp_path):
    """The pack loaded the way ComfyUI loads it, with fresh recorders and ComfyUI folders under tmp_path."""
    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


@pytest.fixture
def recorders(pack):
    import comfy.model_management
    import comfy.utils
    import server

    return {"mm": comfy.model_management.state, "progress": comfy.utils.UPDATES,
            "messages": server.PromptServer.instance.messages}


def run(node_class, node_id="1", **inputs):
    from comfy_double.executor import run_node

    return run_node(node_class, node_id, **inputs)


def load(pack, **changes):
    return run(pack["H3StreamLoader"], "1", **{**LOADER, **changes})[0]


def encode(pack, handle, prompt="A fox in the snow.", **extra):
    return run(pack["H3StreamEncodePrompt"], "2", h3_model=handle, prompt=prompt,
               **{"width": W, "height": H, **DURATION, **extra})[0]


# ---- the double is faithful to ComfyUI ---------------------------------------------------------------------------


def test_double_shares_the_recorded_comfyui_signatures(pack):
    recorded = json.loads((CONTRACT / "signatures.json").read_text())
    entry = comfy_double.pack_module("nodes.comfy_runtime").H3LoadedComponent
    for name, parameters in recorded["callables"].items():
        module, dotted = name.split(":")
        if dotted.startswith("LoadedModel."):  # ComfyUI calls these on the pack's own entries of its registry
            assert describe(getattr(entry, dotted.split(".")[1])) == parameters, name
        else:
            assert describe(resolve(module, dotted)) == parameters, name
    values = recorded["values"]
    import comfy.model_management
    import folder_paths
    from comfy_api.latest import io

    assert [c.__name__ for c in comfy.model_management.InterruptProcessingException.__mro__] == \
        values["comfy.model_management:InterruptProcessingException"]
    for name in ("current_loaded_models", "TOTAL_PINNED_MEMORY", "MAX_PINNED_MEMORY"):
        assert type(getattr(comfy.model_management, name)).__name__ == values[f"comfy.model_management:{name}"]
    assert {m.name: m.value for m in io.Hidden} == values["comfy_api.latest._io:Hidden"]
    assert type(folder_paths.models_dir).__name__ == values["folder_paths:models_dir"]


def test_schemas_serialise_as_the_real_server_lists_them(pack):
    """Every node's schema builds, and the double reads it exactly as ComfyUI's /object_info does (recorded from a
    real server with the pack installed): input types, options, defaults, order, outputs."""
    from comfy_api.latest._io import node_info

    recorded = json.loads((CONTRACT / "object_info.json").read_text())
    assert sorted(pack) == sorted(k for k in recorded if k.startswith("H3Stream"))
    for node_id, node_class in pack.items():
        ours, real = node_info(node_class), recorded[node_id]
        for group in ("required", "optional"):
            for name in MACHINE_DEPENDENT_OPTIONS & set(ours["input"].get(group, {})):
                assert ours["input"][group][name][1].pop("options")[0] == "(none)"
                assert real["input"][group][name][1].pop("options")[0] == "(none)"
            if node_id == "H3StreamLoRA" and group == "required":  # the loras folders: the tiny LoRA on any machine
                assert TINY_LORA in ours["input"][group]["lora_name"][1].pop("options")
                assert TINY_LORA in real["input"][group]["lora_name"][1].pop("options")
        for key in ours:
            assert ours[key] == real[key], f"{node_id}.{key}: re-record with tests/comfy_double/record_contract.py"


def test_node_ids_and_inputs_are_append_only(pack):
    """Saved workflows address inputs by position: a recorded input may never move, vanish or change kind."""
    from comfy_api.latest._io import node_info

    recorded = json.loads((CONTRACT / "object_info.json").read_text())
    for node_id, real in recorded.items():
        if not node_id.startswith("H3Stream"):
            continue
        assert node_id in pack, f"node id {node_id} was renamed or removed"
        ours = node_info(pack[node_id])
        for group, names in real["input_order"].items():
            assert ours["input_order"][group][:len(names)] == names, (node_id, group)
        assert ours["output"][:len(real["output"])] == real["output"], node_id


def test_entry_point_is_v3_only_and_ships_its_web_folder(pack):
    import sys

    module = sys.modules[comfy_double.PACK_MODULE]
    assert not hasattr(module, "NODE_CLASS_MAPPINGS")  # it would make ComfyUI ignore comfy_entrypoint
    assert (ROOT / module.WEB_DIRECTORY / "h3_stream.js").is_file()
    # h3_core becomes importable by its own name without shadowing ComfyUI's top-level `nodes` module.
    assert sys.path.index(str(ROOT)) > sys.path.index(str(comfy_double.MODULES))


# ---- loader --------------------------------------------------------------------------------------------------------


def test_memory_settings_become_h3_core_loader_options(pack):
    MemorySettings = comfy_double.pack_module("nodes.memory_settings").MemorySettings
    offloaded = MemorySettings.build(transformer="LAYERWISE_OFFLOAD", text_encoder="LAYERWISE_OFFLOAD",
                                     video_vae="RESIDENT", audio_vae="LAYERWISE_OFFLOAD", prefetch=2,
                                     resident_blocks=3, chunk_size=512, memory_budget_mib=64, dtype="bfloat16")
    assert offloaded.component_options() == {
        "transformer": {"residency": "layerwise", "prefetch": 2, "resident_blocks": 3, "chunk_size": 512,
                        "memory_budget": 64 << 20},
        "text_encoder": {"residency": "layerwise", "prefetch": 2},
        "audio_vae": {"residency": "layerwise", "prefetch": 2},
    }
    assert not offloaded.keep_text_encoder and offloaded.torch_dtype is torch.bfloat16
    assert {name: plan.residency for name, plan in offloaded.admission_plan().items()} == {
        "transformer": "layerwise", "text_encoder": "layerwise", "video_vae": "resident", "audio_vae": "layerwise"}
    auto_prefetch = MemorySettings.build(transformer="LAYERWISE_OFFLOAD", text_encoder="RESIDENT",
                                         video_vae="RESIDENT", audio_vae="RESIDENT")
    assert auto_prefetch.component_options() == {"transformer": {"residency": "layerwise"}}  # h3_core's default
    resident = MemorySettings.build(transformer="RESIDENT", text_encoder="RESIDENT", video_vae="RESIDENT",
                                    audio_vae="RESIDENT", prefetch=2, resident_blocks=3)
    assert resident.component_options() == {} and resident.keep_text_encoder  # loaders' defaults: nothing passed


def test_loader_refuses_resident_components_on_mps_in_the_widgets_words(pack):
    """On MPS every component must stream: refused when the loader runs (before anything loads), naming each
    RESIDENT widget and the value to choose, in the loader's own vocabulary."""
    from h3_core.errors import H3Error

    loader = pack["H3StreamLoader"]
    assert loader.validate_inputs("cpu") is True and loader.validate_inputs("auto") is True
    assert loader.validate_inputs(None) is True  # linked: checked when the node runs
    assert loader.validate_inputs("tpu") == "device 'tpu' is not one of ['auto', 'cpu', 'cuda', 'mps']."
    import comfy.model_management

    comfy.model_management.state.device = torch.device("mps")  # "auto" follows ComfyUI's device
    with pytest.raises(H3Error) as refused:
        load(pack, device="auto", transformer_residency="RESIDENT", video_vae_residency="RESIDENT")
    message = str(refused.value)
    assert message.startswith("MPS runs need every component to stream")
    assert "set transformer_residency to LAYERWISE_OFFLOAD (it is RESIDENT)" in message
    assert "set video_vae_residency to LAYERWISE_OFFLOAD" in message and "text_encoder_residency" not in message
    assert "residency='layerwise'" not in message  # h3_core's spelling never reaches the user


def test_prompt_validation_reports_each_mistake_once_on_its_input(pack):
    """What ComfyUI does with an API prompt: a residency that is not a widget value, a device the machine lacks,
    seconds 0: one error each, on that input."""
    from comfy_double.core_nodes import CORE_NODES
    from comfy_double.executor import PromptError, PromptExecutor

    executor = PromptExecutor({**pack, **CORE_NODES})
    base = json.loads((ROOT / "example_workflows" / "api" / "H3 - Text to Video and Audio.json").read_text())
    # A workflow saved with the legacy loader (the new one's mistakes: tests/test_model_loader.py).
    loader = next(k for k, v in base.items() if v["class_type"] == "H3StreamModelLoader")
    base[loader] = {"class_type": "H3StreamLoader", "inputs": dict(LOADER)}
    executor.validate(json.loads(json.dumps(base)))  # the example itself is valid
    encoder = next(k for k, v in base.items() if v["class_type"] == "H3StreamEncodePrompt")
    cases = [(loader, "video_vae_residency", "layerwise", "video_vae_residency: 'layerwise' not in"),
             (loader, "transformer_residency", "GPU", "transformer_residency: 'GPU' not in"),
             (loader, "device", "cuda", "device - custom validation failed: device 'cuda': this PyTorch build has no "
                                        "CUDA support"),
             (encoder, "seconds", 0.0, "seconds: 0.0 is smaller than min 0.1"),
             (encoder, "width", 8192, "width: 8192 is bigger than max 4096"),
             (encoder, "frames", 40, "frames - custom validation failed: frames 40 is off the 17n + 5 frame grid")]
    for node, name, value, expected in cases:
        prompt = json.loads(json.dumps(base))
        prompt[node]["inputs"][name] = value
        with pytest.raises(PromptError) as caught:
            executor.validate(prompt)
        assert len(caught.value.errors) == 1, (name, caught.value.errors)
        (where, message), = caught.value.errors
        assert where == node and message.startswith(expected), (name, message)


def test_ref2va_with_the_tiny_model_loads_its_ref2va_transformer(pack):
    handle = load(pack, partition="Ref2VA")
    assert handle.pipeline.sources.transformer.name == "minimax_h3_tiny_ref2va_fp32.safetensors"


def test_model_sources_h3_folder_and_comfyui_repack(pack, tmp_path):
    import folder_paths

    from h3_core.errors import CheckpointError, H3Error
    from h3_core.sources.tiny_default import ensure_tiny_model

    model_sources = comfy_double.pack_module("nodes.model_sources")

    tiny = ensure_tiny_model()
    models = Path(folder_paths.models_dir)
    assert model_sources.h3_folder_choices() == ["(none)"]
    shutil.copytree(tiny, models / "h3" / "tiny-copy")
    assert model_sources.h3_folder_choices() == ["(none)", "tiny-copy"]
    sources = model_sources.resolve_sources(model_sources.H3_FOLDER, "FL2VA", h3_folder="tiny-copy")
    assert sources.transformer == models / "h3" / "tiny-copy" / "diffusion_models" / tiny.joinpath(
        "diffusion_models").glob("*fl2va*.safetensors").__next__().name
    with pytest.raises(H3Error, match="h3_folder: no model folder chosen"):
        model_sources.resolve_sources(model_sources.H3_FOLDER, "FL2VA")

    for key, name in (("diffusion_models", "minimax_h3_tiny_fl2va_fp32.safetensors"),
                      ("vae", "minimax_h3_video_vae_tiny_fp32.safetensors"),
                      ("vae", "minimax_h3_audio_vae_tiny_fp32.safetensors")):
        shutil.copy(tiny / key / name, models / key / name)
    (models / "vae" / "unrelated_vae.safetensors").write_bytes(b"")
    assert model_sources.video_vae_choices()[:2] == ["(none)", "minimax_h3_video_vae_tiny_fp32.safetensors"]
    assert model_sources.video_vae_choices()[-1] == "unrelated_vae.safetensors"
    repack = dict(diffusion_model="minimax_h3_tiny_fl2va_fp32.safetensors",
                  video_vae="minimax_h3_video_vae_tiny_fp32.safetensors",
                  audio_vae="minimax_h3_audio_vae_tiny_fp32.safetensors")
    with pytest.raises(H3Error, match="no file chosen in 'text_encoder'"):
        model_sources.resolve_sources(model_sources.COMFY_REPACK, "FL2VA", **repack)
    with pytest.raises(CheckpointError, match="text_encoder: 'gone.safetensors' is not in ComfyUI's 'text_encoders'"):
        model_sources.resolve_sources(model_sources.COMFY_REPACK, "FL2VA", text_encoder="gone.safetensors", **repack)
    before = model_sources.fingerprint(model_sources.COMFY_REPACK, **repack)
    (models / "vae" / repack["video_vae"]).write_bytes(b"changed")
    assert model_sources.fingerprint(model_sources.COMFY_REPACK, **repack) != before  # the loader re-runs


def test_quantised_repacks_and_gguf_files_are_listed(pack):
    import folder_paths

    model_sources = comfy_double.pack_module("nodes.model_sources")
    models = Path(folder_paths.models_dir)
    for name in ("minimax_h3_fl2va_bf16.safetensors", "minimax_h3_fl2va_int8_convrot.safetensors",
                 "minimax_h3_fl2va_Q8_0.gguf", "other.gguf"):
        (models / "diffusion_models" / name).write_bytes(b"")
    (models / "unet" / "sub").mkdir()
    (models / "unet" / "sub" / "minimax_h3_ref2va_Q4_K.gguf").write_bytes(b"")
    (models / "text_encoders" / "qwen3vl_32b_minimax_h3_int8_convrot.safetensors").write_bytes(b"")
    assert model_sources.diffusion_model_choices() == [
        "(none)", "minimax_h3_fl2va_Q8_0.gguf", "minimax_h3_fl2va_bf16.safetensors",
        "minimax_h3_fl2va_int8_convrot.safetensors", "sub/minimax_h3_ref2va_Q4_K.gguf", "other.gguf"]
    assert "qwen3vl_32b_minimax_h3_int8_convrot.safetensors" in model_sources.text_encoder_choices()
    assert folder_paths.get_full_path("diffusion_models", "sub/minimax_h3_ref2va_Q4_K.gguf") is not None


def test_hugging_face_source_respects_offline_mode(pack, monkeypatch, tmp_path):
    from h3_core.errors import CheckpointError, H3Error

    model_sources = comfy_double.pack_module("nodes.model_sources")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing may be fetched
    with pytest.raises(CheckpointError, match="nobody/nothing: .*Offline mode is on"):
        model_sources.resolve_sources(model_sources.HUGGING_FACE, "FL2VA", repo_id="nobody/nothing")
    with pytest.raises(H3Error, match="repo_id is empty"):
        model_sources.resolve_sources(model_sources.HUGGING_FACE, "FL2VA", repo_id="  ")


# ---- the generation nodes on the tiny model ------------------------------------------------------------------------


def test_telemetry_goes_only_to_the_client_that_queued_the_prompt(pack, recorders):
    """The badge and the progress text are addressed to the running prompt's client (ComfyUI's `client_id`), as
    core's own execution messages are: another tab never sees them, and an API prompt queued without a client id
    sends nothing (the log still has the summary)."""
    import server

    server.PromptServer.instance.client_id = "tab-a"
    handle = load(pack)
    encode(pack, handle)
    sent = recorders["messages"]
    assert {event for event, _, _ in sent} == {"h3_stream.memory", "progress_text"}
    assert {sid for _, _, sid in sent} == {"tab-a"}
    sent.clear()
    server.PromptServer.instance.client_id = None
    encode(pack, handle)
    assert sent == []


def test_nodes_generate_comfyui_image_and_audio(pack, recorders):
    from h3_core.request.grid import audio_samples_for_frames

    handle = load(pack)
    cond = encode(pack, handle)
    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    assert tuple(latents.video.shape) == (1, 24, 2, H // 16, W // 16) and tuple(latents.audio.shape) == (1, 32, 2, 8)
    images, fps = run(pack["H3StreamDecodeVideo"], "4", h3_model=handle, h3_latent=latents)
    audio, = run(pack["H3StreamDecodeAudio"], "5", h3_model=handle, h3_latent=latents)
    assert images.shape == (5, H, W, 3) and images.dtype == torch.float32 and images.device.type == "cpu"
    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0 and fps == 24.0
    assert audio["sample_rate"] == 32000 and audio["waveform"].dtype == torch.float32
    # 8 latents x 800 samples decode 6400 per channel: shorter than 5 frames' 6667, so nothing is trimmed.
    assert audio["waveform"].shape == (1, 2, min(8 * 800, audio_samples_for_frames(5)))

    # The bar appears at 0 when sampling starts, then one update per transformer step (steps - 1 = 2).
    assert recorders["progress"] == [("3", 0, 2), ("3", 1, 2), ("3", 2, 2)]
    # The memory report: one message per H3 node, the sampler's with the block counts; its plain-words line is the
    # progress text.
    badges = [data for event, data, _ in recorders["messages"] if event == "h3_stream.memory"]
    assert [b["node"] for b in badges] == ["2", "3", "4", "5"]
    sampler_badge = badges[1]
    assert sampler_badge["phase"] == "sampling" and sampler_badge["total_blocks"] == 2
    assert sampler_badge["resident_blocks"] == 0  # layerwise offload, no resident blocks
    assert all(b["peak_host_bytes"] > 0 for b in badges)
    texts = [data for event, data, _ in recorders["messages"] if event == "progress_text"]
    assert [t["node"] for t in texts] == ["2", "3", "4", "5"]
    assert "0 of 2 blocks kept loaded, the rest streamed" in texts[1]["text"]
    # Model management: the device cache is emptied after every phase; ComfyUI is asked to free room before each
    # node's phases, the streamed ones included (what each allocates: tests/test_model_management.py).
    assert recorders["mm"].soft_empty_cache_calls == 4
    freed = [size for size, _ in recorders["mm"].free_memory_calls]
    assert len(freed) == 4 and all(size > 0 for size in freed)


def test_decode_nodes_name_a_corrupt_vae_tensor(pack):
    """The decode nodes go through the pipeline's decode, so NaN/Inf output is caught and its tensor named."""
    import folder_paths
    from safetensors.torch import load_file, save_file

    from h3_core.errors import H3Error
    from h3_core.sources.tiny_default import ensure_tiny_model

    root = Path(folder_paths.models_dir) / "h3" / "poisoned"
    shutil.copytree(ensure_tiny_model(), root)
    for pattern, key, value in (("minimax_h3_video_vae*", "decoder.transformer_blocks.0.ff.w2.weight", float("inf")),
                                ("minimax_h3_audio_vae*", "decoder.conv_post.weight", float("nan"))):
        path = next((root / "vae").glob(pattern))
        state = load_file(path)
        state[key] = torch.full_like(state[key], value)
        save_file(state, path)
    handle = load(pack, source="models/h3 folder", h3_folder="poisoned")
    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=encode(pack, handle), **SAMPLER)
    with pytest.raises(H3Error, match=r"tensor 'decoder\.transformer_blocks\.0\.ff\.w2\.weight' contains NaN or "
                                      r"Inf values, so the video VAE produced NaN/Inf at decoding"):
        run(pack["H3StreamDecodeVideo"], "4", h3_model=handle, h3_latent=latents)
    with pytest.raises(H3Error, match=r"tensor 'decoder\.conv_post\.weight' contains NaN or Inf values, so the "
                                      r"audio VAE produced NaN/Inf at decoding"):
        run(pack["H3StreamDecodeAudio"], "5", h3_model=handle, h3_latent=latents)


def test_same_seed_same_latents_and_other_seed_other_latents(pack):
    handle = load(pack)
    cond = encode(pack, handle)
    sample = pack["H3StreamAVSampler"]
    first = run(sample, "3", h3_model=handle, h3_cond=cond, **SAMPLER)[0]
    again = run(sample, "3", h3_model=handle, h3_cond=cond, **SAMPLER)[0]
    other = run(sample, "3", h3_model=handle, h3_cond=cond, **{**SAMPLER, "seed": 8})[0]
    assert torch.equal(first.video, again.video) and torch.equal(first.audio, again.audio)
    assert not torch.equal(first.video, other.video)


def test_offloaded_text_encoder_is_released_before_sampling_and_resident_one_kept(pack, monkeypatch):
    import h3_core

    loaded = []
    real_loader = h3_core.load_text_encoder

    def counting_loader(*args, **kwargs):
        encoder = real_loader(*args, **kwargs)
        loaded.append(weakref.ref(encoder))
        return encoder

    monkeypatch.setattr(h3_core.pipeline.pipeline, "load_text_encoder", counting_loader)
    offloaded = load(pack)
    encode(pack, offloaded)
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is None  # gone before the sampler runs
    encode(pack, offloaded)
    assert len(loaded) == 2  # loaded again for the next prompt

    loaded.clear()
    resident = load(pack, text_encoder_residency="RESIDENT")
    encode(pack, resident)
    encode(pack, resident, prompt="Another prompt.")
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is not None


def test_offloaded_components_are_released_by_the_next_phase_and_resident_ones_kept(pack, monkeypatch):
    """In ComfyUI the graph keeps the H3_MODEL handle across prompts: a RESIDENT component stays loaded, a
    LAYERWISE_OFFLOAD one (here the keyframe encoder and the transformer) is released when a phase that does not run
    it starts and loaded again from its files when next needed."""
    import h3_core

    loads = {"load_dit": [], "load_video_vae": []}
    for loader, refs in loads.items():
        real = getattr(h3_core.pipeline.pipeline, loader)
        monkeypatch.setattr(h3_core.pipeline.pipeline, loader,
                            lambda *a, _real=real, _refs=refs, **kw: _refs.append(weakref.ref(m := _real(*a, **kw)))
                            or m)
    MemorySettings = comfy_double.pack_module("nodes.memory_settings").MemorySettings
    for residency, kept in (("LAYERWISE_OFFLOAD", False), ("RESIDENT", True)):
        for refs in loads.values():
            refs.clear()
        handle = load(pack, transformer_residency=residency, video_vae_residency=residency)
        assert handle.pipeline.kept == ({"transformer", "video_vae", "audio_vae"} if kept else {"audio_vae"})
        assert MemorySettings.build(transformer=residency, text_encoder="RESIDENT", video_vae=residency,
                                    audio_vae="RESIDENT").keep_options()["keep_transformer"] == kept
        cond = encode(pack, handle, first_frame=torch.rand(1, 40, 50, 3))
        latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
        gc.collect()
        assert (loads["load_video_vae"][0]() is not None) == kept  # the keyframe encoder, during sampling
        run(pack["H3StreamDecodeVideo"], "4", h3_model=handle, h3_latent=latents)
        gc.collect()
        assert (loads["load_dit"][0]() is not None) == kept  # the transformer, during decoding
        run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **{**SAMPLER, "seed": 8})
        # Released: loaded again (the video VAE that decoded is still there for the next keyframe encode).
        assert (len(loads["load_dit"]), len(loads["load_video_vae"])) == ((1, 1) if kept else (2, 2))
        handle.pipeline.release_all()


def test_cancel_stops_within_one_transformer_block(pack, recorders):
    """Cancel pressed while block 0 of the first step computes: the next block never starts (without the per-block
    check the whole step would finish first). The check comes off and the next run is unaffected."""
    import comfy.model_management as mm

    handle = load(pack)
    cond = encode(pack, handle)
    transformer = handle.pipeline.component("transformer")
    finished_blocks = []
    counters = [block.register_forward_hook(lambda module, args, out, i=i: finished_blocks.append(i))
                for i, block in enumerate(transformer.blocks)]
    press_cancel = transformer.blocks[0].register_forward_hook(lambda *a: mm.interrupt_current_processing(True))
    attributes = {name: id(value) for name, value in vars(transformer).items()}
    with pytest.raises(mm.InterruptProcessingException):
        run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    assert finished_blocks == [0]
    assert recorders["progress"] == [("3", 0, 2)]  # sampling started, not one step finished
    # The check and this run's chunking were options of the call: nothing on the model changed, however it ended.
    assert {name: id(value) for name, value in vars(transformer).items()} == attributes
    press_cancel.remove()
    finished_blocks.clear()
    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    assert finished_blocks == [0, 1, 0, 1] and latents.video.isfinite().all()
    for handle_ in counters:
        handle_.remove()


def test_sampler_chunk_override_is_for_one_run_and_keeps_the_numbers(pack, recorders):
    handle = load(pack, mps_reclaim_every=2)
    cond = encode(pack, handle)
    sample = pack["H3StreamAVSampler"]
    fused, = run(sample, "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    transformer = handle.pipeline.component("transformer")
    policy = transformer.chunking
    empties = recorders["mm"].soft_empty_cache_calls
    chunked, = run(sample, "3", h3_model=handle, h3_cond=cond, **{**SAMPLER, "chunk_size": 16})
    assert transformer.chunking is policy  # restored after the run
    # Chunked attention sums in another order: equal to rounding (the chunking issue's own tolerance).
    assert torch.allclose(chunked.video, fused.video, atol=1e-5, rtol=0)
    assert torch.allclose(chunked.audio, fused.audio, atol=1e-5, rtol=0)
    # mps_reclaim_every=2 empties the cache every second row chunk, on top of the one call after the phase.
    assert recorders["mm"].soft_empty_cache_calls - empties > 1
    # The loader's own chunking reaches load_dit.
    budgeted = load(pack, chunk_size=32, memory_budget_mib=8).pipeline.component("transformer").chunking
    assert (budgeted.chunk_size, budgeted.memory_budget) == (32, 8 << 20)


def test_the_canvas_and_duration_are_typed_once_and_travel_with_the_conditioning(pack):
    """H3 Sampler makes what H3 Text Encode encoded (it has no canvas or duration of its own); the legacy sampler's
    own canvas must equal the keyframes' canvas."""
    from h3_core.errors import H3Error

    handle = load(pack)
    cond = encode(pack, handle, first_frame=torch.rand(1, 40, 50, 3))
    assert cond.keyframes and cond.anchors == ("first",)
    assert (cond.request.width, cond.request.height, cond.request.num_frames) == (W, H, 5)
    assert not {"width", "height", "seconds", "frames"} & {i.id for i in pack["H3StreamAVSampler"].GET_SCHEMA().inputs}
    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    assert latents.shape == cond.request.shape and latents.video.shape[2] == 2
    legacy = pack["H3StreamSampler"]
    with pytest.raises(H3Error, match=r"width / height 128x64: the keyframes were fitted to 96x64"):
        run(legacy, "3", h3_model=handle, h3_cond=cond, **{**LEGACY_SAMPLER, "width": 128})
    again, = run(legacy, "3", h3_model=handle, h3_cond=cond, **LEGACY_SAMPLER)
    assert torch.equal(again.video, latents.video)  # the same request, made by either sampler


def test_request_mistakes_are_one_error_in_the_widgets_words(pack):
    """validate_inputs takes the frames widget alone (ComfyUI reports a failed check under every input the check
    takes); the canvas and the rest are the request's rules, one error naming the widget when the node runs,
    before anything loads."""
    from h3_core.errors import H3Error

    encoder, sampler = pack["H3StreamEncodePrompt"], pack["H3StreamSampler"]
    for node in (encoder, sampler):
        assert node.validate_inputs(0) is True and node.validate_inputs(39) is True
        assert node.validate_inputs(None) is True  # linked values are checked when it runs
        off_grid = node.validate_inputs(40)
        assert off_grid.startswith("frames 40 is off the 17n + 5 frame grid") and "use 56" in off_grid
    handle = load(pack)
    for change, message in (({"width": 100}, "width 100 is not a positive multiple of 32 pixels; use 96 or 128."),
                            ({"height": 8192}, "height 8192 is past the 4096-pixel limit"),
                            ({"seconds": 0.0, "frames": 0}, "seconds 0: must be more than 0 and at most 15")):
        with pytest.raises(H3Error) as caught:
            encode(pack, handle, **change)
        assert str(caught.value).startswith(message)
        assert handle.pipeline.loaded == ()  # refused before the text encoder loaded
    with pytest.raises(H3Error, match="width 100 is not a positive multiple of 32"):  # the legacy sampler's canvas
        run(sampler, "3", h3_model=handle, h3_cond=encode(pack, handle), **{**LEGACY_SAMPLER, "width": 100})


# ---- step cache ------------------------------------------------------------------------------------------------
# 30 steps (29 calls): enough for "quality" to cache on the tiny model (at 13 steps its first block's change stays
# just above the 0.04 threshold); both kinds of call happen.
CACHED_STEPS = 30


@pytest.mark.parametrize("node_id", ["H3StreamAVSampler", "H3StreamSampler"])
def test_both_samplers_end_with_an_optional_step_cache_combo_of_the_presets(pack, node_id):
    from h3_core.step_cache_settings import STEP_CACHE_PRESETS

    widget = pack[node_id].GET_SCHEMA().inputs[-1]
    assert widget.id == "step_cache" and widget.get_io_type() == "COMBO"
    assert widget.options == list(STEP_CACHE_PRESETS) == ["off", "quality", "fast"]
    # Optional and last: a prompt saved before it has no value (ComfyUI would refuse a missing required input).
    assert widget.default == "off" and widget.optional
    for words in ("off: exactly the uncached output", 'quality="high"', "SSIM 0.971 / PSNR 34.98 dB",
                  "fast: SGLang's generic Cache-DiT default"):
        assert words in widget.tooltip


def test_the_sampler_samples_with_the_chosen_preset_and_off_is_todays_output(pack, recorders):
    from h3_core.step_cache_settings import STEP_CACHE_PRESETS

    handle = load(pack)
    cond = encode(pack, handle)
    settings = {**SAMPLER, "steps": CACHED_STEPS}
    legacy_settings = {**LEGACY_SAMPLER, "steps": CACHED_STEPS}
    before, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **settings)  # no widget value
    off, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **settings, step_cache="off")
    assert before.step_cache is None and off.step_cache is None
    assert torch.equal(off.video, before.video) and torch.equal(off.audio, before.audio)
    for preset in ("quality", "fast"):
        latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **settings, step_cache=preset)
        legacy, = run(pack["H3StreamSampler"], "3", h3_model=handle, h3_cond=cond, **legacy_settings,
                      step_cache=preset)
        assert latents.step_cache.settings == legacy.step_cache.settings == STEP_CACHE_PRESETS[preset]
        assert latents.step_cache.decisions == legacy.step_cache.decisions
        assert 0 < latents.step_cache.hits < CACHED_STEPS - 1
        assert torch.equal(latents.video, legacy.video)
        assert not torch.equal(latents.video, off.video)  # cached calls reuse residuals: other numbers


def test_a_step_cache_that_is_not_a_preset_is_one_error_naming_the_widget(pack):
    from h3_core.errors import H3Error

    handle = load(pack)
    cond = encode(pack, handle)
    for node, inputs in ((pack["H3StreamAVSampler"], SAMPLER), (pack["H3StreamSampler"], LEGACY_SAMPLER)):
        with pytest.raises(H3Error) as caught:
            run(node, "3", h3_model=handle, h3_cond=cond, **inputs, step_cache="turbo")
        assert str(caught.value) == "step_cache 'turbo' is not a preset; use one of off, quality, fast."


def test_the_progress_text_shows_each_call_and_the_badge_the_cached_steps(pack, recorders):
    import server

    server.PromptServer.instance.client_id = "tab-a"
    handle = load(pack)
    cond = encode(pack, handle)
    recorders["messages"].clear()
    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond,
                   **{**SAMPLER, "steps": CACHED_STEPS}, step_cache="quality")
    stats, calls = latents.step_cache, CACHED_STEPS - 1
    texts = [data["text"] for event, data, _ in recorders["messages"] if event == "progress_text"]
    # One line after each transformer call, then the phase's report (the same text as the badge's message).
    assert len(texts) == calls + 1
    for call, text in enumerate(texts[:-1], start=1):
        hit = stats.decisions[call - 1]
        so_far = sum(stats.decisions[:call])
        read = stats.bytes_read[call - 1]  # the transformer is streamed here: a call reads the blocks not yet held
        assert text == (f"step {call}/{calls}: {'cached' if hit else 'computed'} ({so_far} of {call} cached so far), "
                        f"{1 if hit else 2} of 2 blocks run" + (f", {read / 2**20:.1f} MiB read" if read else ""))
    assert any(stats.bytes_read)
    assert stats.hits > 0 and any(": cached (" in text for text in texts)
    assert texts[-1].startswith("sampling: ") and texts[-1].endswith(stats.summary())
    assert f"{stats.hits} of {calls} steps cached" in texts[-1]
    badge, = [data for event, data, _ in recorders["messages"] if event == "h3_stream.memory"]
    assert (badge["step_cache_hits"], badge["step_cache_calls"]) == (stats.hits, calls)
    assert badge["step_cache"] == stats.summary()
    # Off: today's report, no step lines.
    recorders["messages"].clear()
    run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER, step_cache="off")
    off_badge, = [data for event, data, _ in recorders["messages"] if event == "h3_stream.memory"]
    assert not {key for key in off_badge if key.startswith("step_cache")}
    assert [data["text"] for event, data, _ in recorders["messages"] if event == "progress_text"] == \
        [f"sampling: peak RAM {off_badge['peak_host_bytes'] / 2**30:.2f} GiB, 0 of 2 blocks kept loaded, "
         "the rest streamed"]


def test_a_cancelled_cached_run_leaves_the_sampler_usable(pack, recorders):
    """Cancel pressed in the middle of a cached run (after the first hit): the next cached run is bitwise a run that
    was never cancelled (no residual of the cancelled run is reused)."""
    import comfy.model_management as mm

    handle = load(pack)
    cond = encode(pack, handle)
    sample = pack["H3StreamAVSampler"]
    inputs = {**SAMPLER, "steps": CACHED_STEPS}
    clean, = run(sample, "3", h3_model=handle, h3_cond=cond, **inputs, step_cache="quality")
    first_hit = clean.step_cache.decisions.index(True)
    transformer = handle.pipeline.component("transformer")
    calls = []

    def cancel_after_the_first_hit(module, args, output):
        calls.append(1)
        if len(calls) == first_hit + 2:  # block 0 of the call after the first hit
            mm.interrupt_current_processing(True)

    press_cancel = transformer.blocks[0].register_forward_hook(cancel_after_the_first_hit)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            run(sample, "3", h3_model=handle, h3_cond=cond, **inputs, step_cache="quality")
    finally:
        press_cancel.remove()
    assert len(calls) == first_hit + 2
    again, = run(sample, "3", h3_model=handle, h3_cond=cond, **inputs, step_cache="quality")
    assert again.step_cache.decisions == clean.step_cache.decisions
    assert torch.equal(again.video, clean.video) and torch.equal(again.audio, clean.audio)


def test_unload_releases_every_component(pack):
    handle = load(pack)
    cond = encode(pack, handle)
    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    transformer = weakref.ref(handle.pipeline.component("transformer"))
    vae = weakref.ref(handle.pipeline.component("video_vae"))
    text, = run(pack["H3StreamMemoryReport"], "6", h3_model=handle, after=latents)
    assert "transformer layerwise_offload" in text and "host: process peak" in text
    run(pack["H3StreamUnload"], "7", h3_model=handle, after=latents)
    gc.collect()
    assert transformer() is None and vae() is None


# ---- H3 LoRA -------------------------------------------------------------------------------------------------------


def add_lora(pack, handle, strength=1.0, name=TINY_LORA, node_id="9"):
    return run(pack["H3StreamLoRA"], node_id, h3_model=handle, lora_name=name, strength=strength)[0]


def test_lora_nodes_chain_on_copies_of_the_handle(pack, recorders, tmp_path):
    import folder_paths

    base = load(pack)
    second_file = Path(folder_paths.get_folder_paths("loras")[0]) / "second.safetensors"
    shutil.copy(Path(folder_paths.get_full_path("loras", TINY_LORA)), second_file)
    first = add_lora(pack, base, 0.5)
    both = add_lora(pack, first, -1.25, name="second.safetensors", node_id="10")
    assert base.loras == () and first.loras == ((first.loras[0][0], 0.5),)  # upstream handles never change
    assert [(path.name, strength) for path, strength in both.loras] == [(TINY_LORA, 0.5), ("second.safetensors",
                                                                                          -1.25)]
    assert both.pipeline is base.pipeline and both.settings is base.settings  # nothing reloaded
    assert not base.pipeline._loaded  # and nothing loaded: the sampler applies the set
    texts = [data["text"] for event, data, _ in recorders["messages"] if event == "progress_text"]
    assert texts[0].startswith(f"LoRA {TINY_LORA} at strength 0.5;")
    assert "recommends steps 9" in texts[0]  # shown, not set
    assert "module names" not in texts[0]  # the model's own key names: nothing converted, nothing said


def test_sampling_with_a_lora_differs_and_strength_zero_is_the_base_model(pack):
    for residency in ("LAYERWISE_OFFLOAD", "RESIDENT"):
        handle = load(pack, transformer_residency=residency)
        cond = encode(pack, handle)
        sample = pack["H3StreamAVSampler"]
        base, = run(sample, "3", h3_model=handle, h3_cond=cond, **SAMPLER)
        lora, = run(sample, "3", h3_model=add_lora(pack, handle), h3_cond=cond, **SAMPLER)
        assert handle.pipeline.component("transformer").loras == ((lora_file(), 1.0),)
        zero, = run(sample, "3", h3_model=add_lora(pack, handle, 0.0), h3_cond=cond, **SAMPLER)
        again, = run(sample, "3", h3_model=handle, h3_cond=cond, **SAMPLER)  # the base handle takes the LoRA off
        assert not torch.equal(lora.video, base.video) and not torch.equal(lora.audio, base.audio), residency
        for other in (zero, again):
            assert torch.equal(other.video, base.video) and torch.equal(other.audio, base.audio), residency
        assert handle.pipeline.component("transformer").loras == ()


def lora_file() -> Path:
    import folder_paths

    return Path(folder_paths.get_full_path("loras", TINY_LORA))


@pytest.mark.parametrize("name", ["../secrets.safetensors", "../../../../etc/passwd", "/etc/passwd",
                                  "missing.safetensors", ""])
def test_lora_name_outside_the_loras_folders_is_refused(pack, tmp_path, name):
    import folder_paths

    from h3_core.errors import CheckpointError

    (Path(folder_paths.models_dir) / "secrets.safetensors").write_bytes(b"")  # next to loras/, not inside it
    with pytest.raises(CheckpointError, match="lora_name: .* is not in ComfyUI's 'loras' folders"):
        add_lora(pack, load(pack), name=name)


def test_a_bad_lora_file_fails_at_the_lora_node(pack):
    import folder_paths
    from safetensors.torch import save_file

    from h3_core import LoraError

    save_file({"blocks.0.attn.qkv_proj.weight": torch.zeros(2, 2)},
              str(Path(folder_paths.get_folder_paths("loras")[0]) / "broken.safetensors"))
    assert "broken.safetensors" in pack["H3StreamLoRA"].GET_SCHEMA().inputs[1].options
    with pytest.raises(LoraError, match="broken.safetensors.*blocks.0.attn.qkv_proj.weight"):
        add_lora(pack, load(pack), name="broken.safetensors")


# ---- packaging: locales, help pages, registry metadata -------------------------------------------------------------


def test_locales_and_help_pages_cover_every_node_and_input(pack):
    for lang in ("en", "zh"):
        defs = json.loads((ROOT / "locales" / lang / "nodeDefs.json").read_text(encoding="utf-8"))
        assert sorted(defs) == sorted(pack), lang
        for node_id, node_class in pack.items():
            schema = node_class.GET_SCHEMA()
            entry = defs[node_id]
            assert entry["display_name"] and entry["description"]
            assert list(entry["inputs"]) == [i.id for i in schema.inputs], (lang, node_id)
            assert list(entry.get("outputs", {})) == [str(n) for n in range(len(schema.outputs))], (lang, node_id)
            for socket in schema.inputs:
                assert ("tooltip" in entry["inputs"][socket.id]) == bool(socket.tooltip), (lang, node_id, socket.id)
                if lang == "en" and socket.tooltip:
                    assert entry["inputs"][socket.id]["tooltip"] == socket.tooltip, (node_id, socket.id)
            if lang == "en":
                assert entry["display_name"] == schema.display_name and entry["description"] == schema.description
        main = json.loads((ROOT / "locales" / lang / "main.json").read_text(encoding="utf-8"))
        # Nested categories like core's (`H3 Stream/loaders`, ...): every segment core does not name is translated.
        for node_class in pack.values():
            top, *rest = node_class.GET_SCHEMA().category.split("/")
            assert top == "H3 Stream" and len(rest) == 1, node_class
            assert top in main["nodeCategories"]
        # The template browser's name for the pack's folder of templates (its cards are titled by file name).
        assert main["templateWorkflows"]["category"]["h3-stream"]
    for node_id in pack:
        assert (ROOT / "web" / "docs" / f"{node_id}.md").read_text().startswith("# ")
        assert (ROOT / "web" / "docs" / node_id / "zh.md").read_text(encoding="utf-8").startswith("# ")


def test_registry_metadata_and_comfyignore():
    comfy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"] and comfy["Icon"].startswith("https://")
    assert comfy["Icon"].endswith("/web/icon.png") and (ROOT / "web" / "icon.png").is_file()
    assert set(comfy["includes"]) >= {"web", "example_workflows", "locales"}
    # One registration of web/ whatever the folder is called: WEB_DIRECTORY only (ComfyUI keys it by the module's
    # name; a [tool.comfy] web entry is keyed by the project name, so a renamed folder loaded the extension twice).
    assert "web" not in comfy
    assert comfy["requires-comfyui"].startswith(">=0.")  # core is 0.x: a 1.x floor would disable the pack
    ignored = (ROOT / ".comfyignore").read_text().split()
    assert {"tests/", "benchmarks/", ".ci/"} <= set(ignored)
    assert not any(entry.startswith(("web", "example_workflows", "locales", "nodes", "h3_core")) for entry in ignored)
