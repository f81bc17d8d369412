"""The pack's H3 components in ComfyUI's model management (issue 27 item 4), against the comfy test double, whose
`free_memory` / `unload_all_models` drive the entries of `current_loaded_models` the way ComfyUI's own do (read
from kat3ri/ComfyUI 0f1fa67; the calls' signatures are recorded in tests/comfy_double/contract): every loaded
component is an entry with the bytes it holds, "Unload models" and other nodes' `free_memory` release it (its
parameters freed, its pins given back), the next prompt loads it again and gives bitwise the same output; before a
node's phases ComfyUI is asked for what they allocate (the memory plan), not 0 for a streamed component; and the
process's pin budget counts ComfyUI's pinned memory."""

from __future__ import annotations

import gc
import threading
import weakref

import comfy_double
import pytest
import torch

W, H = 96, 64
TINY = "tiny test model (embedded)"
RESIDENT, LAYERWISE = "RESIDENT", "LAYERWISE_OFFLOAD"
LOADER = dict(source=TINY, partition="FL2VA", prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0,
              dtype="auto", device="cpu")
DURATION = dict(seconds=1.0, frames=5)
SAMPLER = dict(steps=3, seed=7, video_shift=12.0, audio_shift=3.0, chunk_size=0)


@pytest.fixture
def pack(tmp_path, monkeypatch):
    from h3_core.runtime import host_store

    monkeypatch.setattr(host_store, "_SHARED_BUDGET", None)  # each test's pin budget starts fresh
    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


@pytest.fixture
def mm(pack):
    import comfy.model_management

    return comfy.model_management


def run(node_class, node_id="1", **inputs):
    from comfy_double.executor import run_node

    return run_node(node_class, node_id, **inputs)


def load(pack, residency):
    """The legacy loader with one residency for every component (RESIDENT components are kept across phases)."""
    return run(pack["H3StreamLoader"], "1", **LOADER, **{f"{c}_residency": residency for c in
                                                          ("transformer", "text_encoder", "video_vae", "audio_vae")})[0]


def encode(pack, handle):
    return run(pack["H3StreamEncodePrompt"], "2", h3_model=handle, prompt="A fox in the snow.", width=W, height=H,
               **DURATION)[0]


def prompt(pack, handle, seed=7):
    """One whole prompt: encode, sample, decode video and audio."""
    cond = encode(pack, handle)
    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **{**SAMPLER, "seed": seed})
    images, _ = run(pack["H3StreamDecodeVideo"], "4", h3_model=handle, h3_latent=latents)
    audio, = run(pack["H3StreamDecodeAudio"], "5", h3_model=handle, h3_latent=latents)
    return latents, images, audio["waveform"]


def h3_entries(mm):
    runtime = comfy_double.pack_module("nodes.comfy_runtime")
    return [e for e in mm.current_loaded_models if isinstance(e, runtime.H3LoadedComponent)]


def parameter_refs(pipeline) -> list:
    return [weakref.ref(next(pipeline.loaded_component(name).parameters())) for name in pipeline.loaded]


def own_bytes(plan, phase: str) -> int:
    """What the plan says `phase` allocates for its own component (kept idle ones excluded), at its largest part;
    on the CPU host and device memory are one."""
    estimate = plan.phase(phase)
    return max(sum(i.nbytes for i in estimate.items if not i.kept and i.during in (None, part))
               for part in estimate.parts)


# ---- registration --------------------------------------------------------------------------------------------------


def test_loaded_components_are_entries_with_the_bytes_they_hold(pack, mm):
    handle = load(pack, RESIDENT)
    assert h3_entries(mm) == []  # the loader loads nothing
    encode(pack, handle)
    entries = h3_entries(mm)
    assert [e.model.name for e in entries] == ["text_encoder"] and entries[0].device == mm.get_torch_device()
    encoder = handle.pipeline.loaded_component("text_encoder")
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*encoder.parameters(), *encoder.buffers())}
    # A resident component on the CPU holds its weights: every distinct storage, nothing else.
    assert entries[0].model_memory() == sum(storages.values()) > 10 << 20
    assert entries[0].model.model is encoder and not entries[0].currently_used and not entries[0].is_dead()
    assert mm.loaded_models() == [entries[0].model] and mm.loaded_models(only_currently_used=True) == []


def test_a_streamed_component_counts_what_it_holds_not_its_whole_weights(pack, mm):
    from h3_core.runtime.held_memory import stacks_of

    handle = load(pack, LAYERWISE)
    cond = encode(pack, handle)
    pipeline = handle.pipeline
    assert h3_entries(mm) == []  # a streamed text encoder is released right after encoding, and unregistered
    pipeline.component("transformer")  # loaded as the sampler would: registered by the pipeline's listener
    entry, = h3_entries(mm)
    dit = pipeline.loaded_component("transformer")
    assert len(stacks_of(dit)) == 3  # blocks, AdaLN projections, the text refiner's phase-scoped weights
    streamed = dit.streamed_parameter_names()
    params = dict(dit.named_parameters())
    fixed = sum(p.numel() * p.element_size() for name, p in params.items() if name not in streamed)
    whole = pipeline.plan(width=W, height=H, num_frames=5).components[1].total_bytes  # the transformer's weights
    held = pipeline.held_memory("transformer")
    assert held.host_bytes == 0  # the CPU: host and device memory are one
    assert fixed <= entry.model_memory() == held.device_bytes < whole
    run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    # Measured again after the phase (slots and rings are allocated by the first pass).
    entry, = h3_entries(mm)
    assert fixed <= entry.model_memory() == pipeline.held_memory("transformer").device_bytes < whole


# ---- eviction ------------------------------------------------------------------------------------------------------


def test_unload_models_releases_every_component_and_the_next_prompt_loads_them_again(pack, mm):
    """What "Unload models" (POST /free {"unload_models": true}) runs between prompts: `unload_all_models`. Every H3
    component goes (its parameters are freed); the next prompt loads them again and makes the same output."""
    handle = load(pack, RESIDENT)
    first = prompt(pack, handle)
    pipeline = handle.pipeline
    assert set(pipeline.loaded) == {"text_encoder", "transformer", "video_vae", "audio_vae"}  # kept: resident
    assert {e.model.name for e in h3_entries(mm)} == set(pipeline.loaded)
    refs = parameter_refs(pipeline)
    sizes = {e.model.name: e.model_memory() for e in h3_entries(mm)}
    assert all(size > 0 for size in sizes.values())

    mm.unload_all_models()
    gc.collect()
    assert pipeline.loaded == () and h3_entries(mm) == [] and mm.current_loaded_models == []
    assert {e.model.name for e in mm.state.unloaded} == set(sizes)
    assert all(ref() is None for ref in refs), "an unloaded component's weights are still alive"

    again = prompt(pack, handle)
    for before, after in zip(first, again):
        video_or_audio = (before.video, before.audio) if hasattr(before, "video") else (before,)
        redone = (after.video, after.audio) if hasattr(after, "video") else (after,)
        for x, y in zip(video_or_audio, redone):
            assert torch.equal(x, y)
    assert {e.model.name for e in h3_entries(mm)} == set(sizes)


def test_another_nodes_free_memory_evicts_what_it_needs_and_spares_what_it_keeps(pack, mm):
    handle = load(pack, RESIDENT)
    encode(pack, handle)
    pipeline = handle.pipeline
    pipeline.component("video_vae")
    entries = {e.model.name: e for e in h3_entries(mm)}
    assert set(entries) == {"text_encoder", "video_vae"}
    device = mm.get_torch_device()
    mm.free_memory(1 << 20, device)  # 16 GiB free: nothing to do
    assert set(pipeline.loaded) == {"text_encoder", "video_vae"}
    mm.state.free_bytes = 0  # a core node needs more than is free: everything not kept goes
    unloaded = mm.free_memory(1 << 20, device, keep_loaded=[entries["video_vae"]])
    assert unloaded == [entries["text_encoder"]] and pipeline.loaded == ("video_vae",)
    assert h3_entries(mm) == [entries["video_vae"]]
    mm.free_memory(1 << 20, torch.device("cuda", 0))  # another device's shortage leaves ours alone
    assert pipeline.loaded == ("video_vae",)


def test_an_entry_is_not_unloaded_while_its_pipeline_runs_on_another_thread(pack, mm):
    handle = load(pack, RESIDENT)
    encode(pack, handle)
    pipeline = handle.pipeline
    entry, = h3_entries(mm)
    started, finish = threading.Event(), threading.Event()

    def busy():
        with pipeline._lock:
            started.set()
            finish.wait(10)

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    started.wait(10)
    try:
        mm.state.free_bytes = 0
        assert mm.free_memory(1 << 20, mm.get_torch_device()) == []  # not waiting for a whole phase
        assert pipeline.loaded == ("text_encoder",) and h3_entries(mm) == [entry]
    finally:
        finish.set()
        worker.join(10)
    assert mm.free_memory(1 << 20, mm.get_torch_device()) == [entry] and pipeline.loaded == ()


def test_a_dropped_model_handle_leaves_no_entry(pack, mm):
    """ComfyUI's cache drops a loader's output when the loader runs again with other inputs: the entries of the
    old pipeline go with it, and nothing keeps its components alive."""
    handle = load(pack, RESIDENT)
    encode(pack, handle)
    assert len(h3_entries(mm)) == 1
    ref = weakref.ref(handle.pipeline)
    del handle
    gc.collect()
    assert ref() is None and h3_entries(mm) == []


def test_the_h3_unload_node_unregisters_too(pack, mm):
    handle = load(pack, RESIDENT)
    encode(pack, handle)
    run(pack["H3StreamUnload"], "9", h3_model=handle)
    assert handle.pipeline.loaded == () and h3_entries(mm) == []


# ---- what ComfyUI is asked to free ---------------------------------------------------------------------------------


def test_free_memory_is_asked_for_what_each_phase_allocates(pack, mm):
    """A streamed component is not 0 bytes: its resident weights, slots, the AdaLN slot and activations, from the
    request's memory plan; a component the phase releases, or its own already loaded, is subtracted."""
    from h3_core.request.generation_request import GenerationRequest

    handle = load(pack, LAYERWISE)
    pipeline = handle.pipeline
    request = GenerationRequest(prompt="A fox in the snow.", width=W, height=H, num_frames=5, steps=3)
    plan = pipeline.plan_request(request)
    device = mm.get_torch_device()

    cond = encode(pack, handle)
    assert mm.state.free_memory_calls == [(own_bytes(plan, "text encode"), device)]
    assert own_bytes(plan, "text encode") > 0

    latents, = run(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, **SAMPLER)
    sampling = plan.phase("sampling")
    planned = own_bytes(plan, "sampling")
    assert mm.state.free_memory_calls[1] == (planned, device)
    slots = {i.what: i.nbytes for i in sampling.items if i.during == "blocks"}
    assert planned >= slots["slots"] + slots["activations"] > 0
    assert any(i.what == "AdaLN slots" and i.nbytes > 0 for i in sampling.items)  # the AdaLN part is planned too

    # The video decode releases the streamed transformer (not kept): what it holds now comes off the request.
    held = pipeline.held_memory("transformer").device_bytes
    run(pack["H3StreamDecodeVideo"], "4", h3_model=handle, h3_latent=latents)
    assert mm.state.free_memory_calls[2] == (own_bytes(plan, "video decode") - held, device)


def test_a_resident_component_already_loaded_asks_for_its_activations_only(pack, mm):
    handle = load(pack, RESIDENT)
    pipeline = handle.pipeline
    encode(pack, handle)
    mm.state.free_memory_calls.clear()
    encoder_bytes = pipeline.held_memory("text_encoder").device_bytes
    encode(pack, handle)  # a new prompt text: the node runs again, the encoder is still loaded (kept)
    from h3_core.request.generation_request import GenerationRequest

    plan = pipeline.plan_request(GenerationRequest(prompt="x", width=W, height=H, num_frames=5))
    estimate = plan.phase("text encode")
    activations = max(sum(i.nbytes for i in estimate.items if i.what == "activations" and i.during in (None, p))
                      for p in estimate.parts)
    (asked, _), = mm.state.free_memory_calls
    assert asked == own_bytes(plan, "text encode") - encoder_bytes
    assert asked <= activations + (1 << 20)


# ---- the pin budget ------------------------------------------------------------------------------------------------


def test_the_pin_budget_counts_comfyuis_pinned_memory(pack, mm):
    from h3_core.runtime.host_store import PinBudget

    mm.MAX_PINNED_MEMORY, mm.TOTAL_PINNED_MEMORY = 1000 << 20, 600 << 20  # ComfyUI's limit, and its own pins
    handle = load(pack, RESIDENT)
    budget = PinBudget.shared()
    assert budget.ledger is not None and budget.own_limit_bytes > 0
    assert budget.limit_bytes == min(budget.own_limit_bytes, 400 << 20)  # ours and ComfyUI's within its limit
    assert budget.try_reserve(300 << 20) and mm.TOTAL_PINNED_MEMORY == 900 << 20  # ComfyUI sees our pins
    assert not budget.try_reserve(200 << 20)  # its limit, not our 40 % of RAM, is the bound now
    mm.TOTAL_PINNED_MEMORY -= 50 << 20  # ComfyUI unpinned some of its own
    assert budget.try_reserve(150 << 20) and mm.TOTAL_PINNED_MEMORY == 1000 << 20
    budget.give_back(450 << 20)
    assert budget.used_bytes == 0 and mm.TOTAL_PINNED_MEMORY == 550 << 20
    mm.MAX_PINNED_MEMORY = -1  # --disable-pinned-memory (or a device ComfyUI does not pin for): nothing is pinned
    assert budget.limit_bytes == 0 and not budget.try_reserve(1)
    del handle
