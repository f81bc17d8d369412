"""Phases hold only what they need (a census of live components at every phase boundary), the keep options keep
them, and the memory plan checks each phase's sum of what coexists in it."""

from __future__ import annotations

import gc
import weakref

import pytest
from PIL import Image

import h3_core.pipeline.pipeline as pipeline_module
from h3_core.pipeline import H3Pipeline
from h3_core.planning import plan_for_budget
from h3_core.planning.memory_plan import (ComponentEstimate, MemoryBudgetError, PhaseSpec, fit_budget, phase_estimates,
                                          touched_ring_bytes)
from h3_core.planning.phase_plans import PHASES
from h3_core.runtime.platform import Platform
from h3_core.sources import resolve_model
from h3_core.sources.tiny_default import ensure_tiny_model

REQUEST = dict(width=64, height=64, num_frames=5, steps=3, seed=5)
LOADERS = {"text_encoder": "load_text_encoder", "transformer": "load_dit", "video_vae": "load_video_vae",
           "audio_vae": "load_audio_vae"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def sources(tiny):
    return resolve_model(tiny)


@pytest.fixture
def census(monkeypatch):
    """Every model object the pipeline loads, by weak reference; `census.live()` is the set of components whose
    loaded objects are still alive (after a collection), `census.loads` the number of loads per component, and
    `census.boundaries` (phase's component, live components) recorded when a phase asks for its component."""

    class Census:
        refs: list = []
        loads: dict = {}
        boundaries: list = []

        def live(self):
            gc.collect()
            return {name for name, ref in self.refs if ref() is not None}

    tracked = Census()
    for name, loader in LOADERS.items():
        real = getattr(pipeline_module, loader)

        def counting(*args, _name=name, _real=real, **kwargs):
            model = _real(*args, **kwargs)
            tracked.refs.append((_name, weakref.ref(model)))
            tracked.loads[_name] = tracked.loads.get(_name, 0) + 1
            return model

        monkeypatch.setattr(pipeline_module, loader, counting)
    real_component = H3Pipeline.component

    def component(self, name):
        tracked.boundaries.append((name, frozenset(tracked.live())))
        return real_component(self, name)

    monkeypatch.setattr(H3Pipeline, "component", component)
    return tracked


def keyframe():
    return Image.new("RGB", (80, 60), (200, 40, 10))


def test_every_phase_holds_only_its_own_component(sources, census):
    pipe = H3Pipeline(sources)
    pipe.generate("a fox", first_frame=keyframe(), **REQUEST)
    # text encode, keyframe encode, sampling, video decode, audio decode: nothing else alive when each starts.
    assert [name for name, _ in census.boundaries] == [component for _, component in PHASES]
    assert all(live == frozenset() for _, live in census.boundaries), census.boundaries
    assert pipe.loaded == ("audio_vae",) and census.live() == {"audio_vae"}
    census.boundaries.clear()
    pipe.generate("a fox", **REQUEST)  # the next prompt's text encode releases the audio VAE; no keyframe phase
    assert census.boundaries == [(c, frozenset()) for c in ("text_encoder", "transformer", "video_vae", "audio_vae")]
    assert census.loads == {"text_encoder": 2, "video_vae": 3, "transformer": 2, "audio_vae": 2}
    pipe.release_all()
    assert census.live() == set() and pipe.loaded == ()


def test_keep_options_keep_their_components_through_every_phase(sources, census):
    pipe = H3Pipeline(sources, keep_transformer=True, keep_video_vae=True)
    assert pipe.kept == {"transformer", "video_vae"}
    pipe.generate("a fox", first_frame=keyframe(), **REQUEST)
    assert census.boundaries == [
        ("text_encoder", frozenset()),
        ("video_vae", frozenset()),  # the text encoder is gone right after encoding
        ("transformer", {"video_vae"}),  # the kept keyframe encoder stays through sampling
        ("video_vae", {"video_vae", "transformer"}),  # the kept transformer stays through decoding
        ("audio_vae", {"video_vae", "transformer"}),
    ]
    pipe.generate("a fox", first_frame=keyframe(), **REQUEST)
    assert census.loads == {"text_encoder": 2, "video_vae": 1, "transformer": 1, "audio_vae": 2}
    assert census.live() == {"video_vae", "transformer", "audio_vae"}
    pipe.release_all()
    assert census.live() == set()


def test_phases_release_at_their_start_and_log_it(sources, census):
    """Repeated sampling reuses the transformer (nothing between the calls needs the memory); decoding starts by
    releasing it, and says so."""
    logged = []
    pipe = H3Pipeline(sources, log=logged.append)
    from h3_core.request.grid import LatentShape

    cond = pipe.encode_prompt("a fox", width=64, height=64)
    shape = LatentShape.for_request(64, 64, 5)
    latents = pipe.sample(cond, num_frames=shape.num_frames, steps=3, seed=1)
    pipe.sample(cond, num_frames=shape.num_frames, steps=3, seed=2)
    assert census.loads["transformer"] == 1 and pipe.residency_summary("transformer") is not None
    pipe.decode_video(latents)
    assert "video decode: releasing transformer (not kept)" in logged
    assert pipe.loaded == ("video_vae",) and census.live() == {"video_vae"}
    with pytest.raises(Exception, match="unknown phase 'decode'"):
        pipe.enter_phase("decode")
    pipe.release_all()


def test_listeners_follow_every_load_and_release_and_held_memory_measures_them(sources, census):
    """A host application's registry (ComfyUI's model management) follows the pipeline through its listener, and
    `held_memory` says what each loaded component holds: a resident one its weights, a streamed one less."""
    import threading

    pipe = H3Pipeline(sources, component_options={"transformer": {"residency": "layerwise"}}, keep_audio_vae=True)
    events = []
    pipe.add_listener(lambda name, loaded: events.append((name, loaded, pipe.held_memory(name))))
    pipe.generate("a fox", **REQUEST)
    assert [(name, loaded) for name, loaded, _ in events] == [
        ("text_encoder", True), ("text_encoder", False), ("transformer", True), ("transformer", False),
        ("video_vae", True), ("video_vae", False), ("audio_vae", True)]
    assert all((held is not None) == loaded for _, loaded, held in events)
    audio = pipe.loaded_component("audio_vae")
    assert pipe.held_memory("audio_vae").device_bytes == sum(
        t.untyped_storage().nbytes() for t in (*audio.parameters(), *audio.buffers()))
    del audio
    streamed = next(held for name, loaded, held in events if name == "transformer" and loaded)
    assert 0 < streamed.device_bytes < pipe.plan(width=64, height=64, num_frames=5).components[1].total_bytes
    assert pipe.held_memory("transformer") is None and pipe.loaded_component("transformer") is None

    # Another thread's call holds the pipeline: a host's unload does not wait for it, and releases nothing.
    inside, leave = threading.Event(), threading.Event()

    def busy():
        with pipe._lock:
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    inside.wait(10)
    assert pipe.try_release("audio_vae") is False and pipe.loaded == ("audio_vae",)
    leave.set()
    worker.join(10)
    assert pipe.try_release("audio_vae") is True and pipe.loaded == () and census.live() == set()
    assert events[-1][:2] == ("audio_vae", False)


def test_room_needed_is_a_phases_own_allocation_less_what_is_loaded(sources):
    """What a host must free before a phase: its component's items of the plan (streamed: weights outside the
    stack, slots, the AdaLN slot, activations), less what that component holds if loaded and what the phase
    releases."""
    pipe = H3Pipeline(sources, component_options={"transformer": {"residency": "layerwise"}}, keep_video_vae=True)
    plan = pipe.plan(width=64, height=64, num_frames=5, steps=3)
    sampling = plan.phase("sampling")
    own = max(sum(i.nbytes for i in sampling.items if not i.kept and i.during in (None, part))
              for part in sampling.parts)
    assert pipe.room_needed(plan, ["sampling"]) == own > 0
    assert {"slots", "AdaLN slots", "activations", "weights"} <= {i.what for i in sampling.items if not i.kept}
    pipe.component("video_vae")  # kept: already allocated, neither asked for nor subtracted
    assert pipe.room_needed(plan, ["sampling"]) == own
    pipe.component("transformer")
    held = pipe.held_memory("transformer").device_bytes
    assert pipe.room_needed(plan, ["sampling"]) == own - held
    decode = plan.phase("video decode")
    assert pipe.room_needed(plan, ["video decode"]) == sum(
        i.nbytes for i in decode.items if not i.kept) - held - pipe.held_memory("video_vae").device_bytes
    assert pipe.room_needed(plan, ["sampling", "video decode"]) == max(
        own - held, pipe.room_needed(plan, ["video decode"]))
    pipe.release_all()


# ---- the plan: per-phase sums ---------------------------------------------------------------------------------------


def estimate(name, total, activations, *, unit=0, fixed=None, streamable=False):
    return ComponentEstimate(name, total, unit, total if fixed is None else fixed, activations, streamable)


def fit(components, budget, *, device="cpu", **options):
    dit = components[0]
    return fit_budget(components, budget, Platform.for_device(device), dit=dit, rows=0, row_bytes=1,
                      chunk_size=None, **options)


def test_each_component_fits_alone_but_a_phase_with_a_kept_one_does_not():
    phases = [PhaseSpec("sampling", "transformer"), PhaseSpec("video decode", "video_vae")]
    components = lambda: [estimate("transformer", 60 * MiB, 10 * MiB),  # noqa: E731
                          estimate("video_vae", 30 * MiB, 20 * MiB)]
    plan = fit(components(), 80 * MiB, phases=phases)  # alone: 70 and 50 MiB
    assert [(p.name, p.total_bytes) for p in plan.phases] == [("sampling", 70 * MiB), ("video decode", 50 * MiB)]
    assert plan.peak_bytes == 70 * MiB and plan.peak_phase.name == "sampling"
    with pytest.raises(MemoryBudgetError) as info:
        fit(components(), 80 * MiB, phases=phases, keep=["transformer"])  # decode: 50 + 60 MiB of kept weights
    message = str(info.value)
    first = message.splitlines()[0]
    assert "the video decode phase needs about 0.11 GiB" in first
    assert "transformer weights (kept) 60.0 MiB" in first and "video_vae activations 20.0 MiB" in first
    assert "do not keep transformer" in message and "raise the budget" in message
    assert "per phase" in message  # the breakdown comes with the refusal


def test_an_over_budget_phase_streams_its_largest_streamable_component():
    phases = [PhaseSpec("text encode", "text_encoder"), PhaseSpec("sampling", "transformer")]
    components = [estimate("transformer", 40 * MiB, 5 * MiB),
                  estimate("text_encoder", 64 * MiB, 1 * MiB, unit=4 * MiB, fixed=8 * MiB, streamable=True)]
    plan = fit(components, 60 * MiB, phases=phases, keep=["text_encoder"])
    # Sampling holds the kept text encoder: 45 + 64 MiB resident, 45 + 8 MiB once it streams (an idle streamed
    # component that runs once per request keeps only its fixed weights: its slot and staging go after its pass).
    assert plan.component_options["text_encoder"] == {"residency": "layerwise"}
    assert plan.phase("sampling").total_bytes == 53 * MiB and plan.peak_bytes <= 60 * MiB
    assert {i.label for i in plan.phase("sampling").items if i.kept} == {"text_encoder weights (kept)"}


def test_host_store_and_staging_rings_are_items_of_every_phase_they_live_in():
    phases = [PhaseSpec("sampling", "transformer"), PhaseSpec("audio decode", "audio_vae")]

    def components():
        dit = estimate("transformer", 100 * MiB, 2 * MiB, unit=10 * MiB, fixed=20 * MiB, streamable=True)
        dit.residency = "layerwise"
        dit.prefetch = 1
        return [dit, estimate("audio_vae", 4 * MiB, 1 * MiB)]

    # CUDA: two fixed device slots, ONE page-locked ring of max(1, read_ahead) + 1 buffers, the leading units packed
    # into pinned slabs with what the pin budget leaves after the ring (75 - 30 MiB: 4 of the 8 units, whole);
    # all of it outlives a pass, so a kept transformer holds it in the decode phase too.
    sampling, decode = phase_estimates(components(), phases, keep=["transformer"], platform=Platform("cuda"),
                                       staging_read_ahead=2, pin_budget_bytes=75 * MiB)
    items = {i.label: i.nbytes for i in sampling.items}
    assert items == {"transformer weights": 20 * MiB, "transformer slots": 20 * MiB,
                     "transformer activations": 2 * MiB, "transformer pinned blocks": 40 * MiB,
                     "transformer pinned staging": 30 * MiB}
    assert sampling.device_bytes == 42 * MiB and sampling.host_bytes == 70 * MiB
    assert {i.label for i in decode.items if i.kept} == {"transformer weights (kept)", "transformer slots (kept)",
                                                          "transformer pinned blocks (kept)",
                                                          "transformer pinned staging (kept)"}
    # A budget for all of it packs every unit; none (or one the ring alone fills) packs nothing.
    for budget, packed in ((200 * MiB, 80 * MiB), (30 * MiB, 0), (0, 0)):
        sampling = phase_estimates(components(), phases[:1], platform=Platform("cuda"), staging_read_ahead=2,
                                   pin_budget_bytes=budget)[0]
        assert {i.label: i.nbytes for i in sampling.items}.get("transformer pinned blocks", 0) == packed
    # read_ahead 0 still reads one unit ahead on CUDA (the backend's max(1, read_ahead)).
    cuda0 = phase_estimates(components(), phases[:1], platform=Platform("cuda"), staging_read_ahead=0)[0]
    assert {i.label: i.nbytes for i in cuda0.items}["transformer pinned staging"] == 20 * MiB
    # The CPU: the store holds memory maps (no copy) and the ring's buffers ARE the device slots: read_ahead
    # buffers beyond the slots, not a second ring (prefetch 0: one slot).
    cpu = fit([estimate("transformer", 100 * MiB, 2 * MiB, unit=10 * MiB, fixed=20 * MiB, streamable=True)],
              60 * MiB, staging_read_ahead=1)
    assert {i.label: i.nbytes for i in cpu.phases[0].items} == {
        "transformer weights": 20 * MiB, "transformer slots": 10 * MiB, "transformer activations": 2 * MiB,
        "transformer staging": 10 * MiB}
    assert cpu.shared_memory and cpu.peak_bytes == 42 * MiB
    # Apple MPS: device slots, and read_ahead + 1 host buffers besides them (one shared memory).
    mps = fit([estimate("transformer", 100 * MiB, 2 * MiB, unit=10 * MiB, fixed=20 * MiB, streamable=True)],
              60 * MiB, device="mps", staging_read_ahead=1)
    assert {i.label: i.nbytes for i in mps.phases[0].items}["transformer staging"] == 20 * MiB
    assert mps.peak_bytes == 52 * MiB
    # No ring (read_ahead None): only the slots.
    plain = fit([estimate("transformer", 100 * MiB, 2 * MiB, unit=10 * MiB, fixed=20 * MiB, streamable=True)],
                60 * MiB)
    assert plain.peak_bytes == 32 * MiB


def test_a_streamed_phase_peaks_at_its_largest_part():
    """Phase-scoped weights live in their own part, the AdaLN stack in its pass, the blocks with the activations
    and the precomputed AdaLN tables; a kept transformer's ring outlives its passes on the CPU."""
    dit = ComponentEstimate("transformer", 200 * MiB, 10 * MiB, 60 * MiB, 8 * MiB, True, residency="layerwise",
                            scoped_bytes={"text": 50 * MiB}, companion_unit_bytes=6 * MiB, host_table_bytes=3 * MiB)
    spec = PhaseSpec("sampling", "transformer", parts=("text", "AdaLN plan", "blocks"),
                     part_activations=(("text", 1 * MiB),))
    phase, = phase_estimates([dit], [spec], staging_read_ahead=1)
    assert phase.parts == ["text", "AdaLN plan", "blocks"]
    # Always: 10 MiB of resident fixed weights.
    assert {p: phase.part_bytes(p) for p in phase.parts} == {
        "text": (10 + 50 + 1) * MiB, "AdaLN plan": (10 + 6 + 6 + 3) * MiB, "blocks": (10 + 10 + 10 + 8 + 3) * MiB}
    assert phase.total_bytes == 61 * MiB and phase.peak_part == "text"
    assert phase.biggest(1)[0].label == "transformer phase weights [text]"
    # Kept: the ring (slot + staging) stays allocated between passes, so it counts in every part.
    kept, = phase_estimates([dit], [spec], keep=["transformer"], staging_read_ahead=1)
    assert kept.part_bytes("AdaLN plan") == (10 + 6 + 6 + 3 + 20) * MiB


def test_pageable_ring_buffers_hold_the_largest_unit_that_went_through_each():
    """Units of unequal size take the ring's buffers in turn; a pageable buffer (CPU, MPS) holds only the pages
    written into it, a page-locked one (CUDA) all of them."""
    assert touched_ring_bytes((144, 36, 9, 2, 1), 2) == 144 + 36
    assert touched_ring_bytes((144, 36, 9, 2, 1), 3) == 144 + 36 + 9
    assert touched_ring_bytes((10, 10, 10), 2) == 20
    audio = ComponentEstimate("audio_vae", 300 * MiB, 144 * MiB, 60 * MiB, 20 * MiB, True, residency="layerwise",
                              unit_sizes=(144 * MiB, 36 * MiB, 9 * MiB, 2 * MiB))
    spec = PhaseSpec("audio decode", "audio_vae")
    cpu, = phase_estimates([audio], [spec], staging_read_ahead=1)
    items = {i.what: i.nbytes for i in cpu.items}
    assert items["slots"] + items["staging"] == (144 + 36) * MiB  # the ring's two buffers are the device tensors
    mps, = phase_estimates([audio], [spec], platform=Platform("mps"), staging_read_ahead=1)
    assert {i.what: i.nbytes for i in mps.items}["staging"] == (144 + 36) * MiB
    cuda, = phase_estimates([audio], [spec], platform=Platform("cuda"), staging_read_ahead=1)
    assert {i.what: i.nbytes for i in cuda.items}["pinned staging"] == 2 * 144 * MiB


def test_on_a_discrete_device_host_items_count_against_the_host_budget():
    def components():
        return [estimate("transformer", 100 * MiB, 2 * MiB, unit=10 * MiB, fixed=20 * MiB, streamable=True)]

    plan = fit(components(), 60 * MiB, device="cuda")  # resident 102 MiB does not fit: it streams, 2 slots
    assert plan.peak_bytes == 42 * MiB and plan.host_peak_bytes == 80 * MiB and not plan.shared_memory
    assert "host budget not checked" in plan.describe()
    # With a ring (read ahead 0: still 2 buffers on CUDA), the leading units the pin budget leaves room for.
    with pytest.raises(MemoryBudgetError, match=r"fit a 64.0 MiB host budget: the transformer phase needs about "
                                                r"80.0 MiB of host memory.*transformer pinned blocks 60.0 MiB"):
        fit(components(), 60 * MiB, device="cuda", host_budget_bytes=64 * MiB, staging_read_ahead=0,
            pin_budget_bytes=80 * MiB)


def test_plan_for_budget_prints_each_phase_and_refuses_a_kept_component_that_breaks_one(sources):
    request = dict(width=96, height=64, num_frames=39)
    plan = plan_for_budget(sources, budget_bytes=1 << 30, keyframes=True, **request)
    assert [p.name for p in plan.phases] == [name for name, _ in PHASES]
    assert [p.name for p in plan_for_budget(sources, budget_bytes=1 << 30, **request).phases] == [
        "text encode", "sampling", "video decode", "audio decode"]  # no keyframes: no keyframe phase
    text = plan.describe()
    assert "per phase" in text and all(f"    {name} " in text for name, _ in PHASES)
    for phase in plan.phases:
        assert phase.total_bytes == sum(i.nbytes for i in phase.items) and {i.component for i in phase.items} == {
            phase.component}
    alone = plan.peak_bytes  # the largest phase holding one component
    kept = plan_for_budget(sources, budget_bytes=1 << 30, keep=["text_encoder"], **request)
    assert all("text_encoder" in p.components for p in kept.phases) and kept.peak_bytes > alone + (1 << 20)
    # Streamed, a kept text encoder holds only its fixed weights between its passes (the embedding and vision
    # tower are phase-scoped, its layers' slot and ring are freed), so the planner streams it and it fits ...
    streamed = plan_for_budget(sources, budget_bytes=alone + (1 << 20), keep=["text_encoder"], **request)
    assert streamed.component_options["text_encoder"] == {"residency": "layerwise"}
    # ... resident, it does not.
    with pytest.raises(MemoryBudgetError) as info:
        plan_for_budget(sources, budget_bytes=alone + (1 << 20), keep=["text_encoder"], residency="resident",
                        **request)
    first = str(info.value).splitlines()[0]
    assert f"the {kept.peak_phase.name} phase needs about" in first and "text_encoder weights (kept)" in first
    assert "do not keep text_encoder" in str(info.value)
    with pytest.raises(Exception, match=r"unknown component\(s\) \['vae'\] to keep"):
        plan_for_budget(sources, budget_bytes=1 << 30, keep=["vae"], **request)


def test_cli_keep_reaches_the_plan_and_the_pipeline(tiny, monkeypatch, capsys, tmp_path):
    from h3_core.app import cli

    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))
    seen = []
    real = H3Pipeline.generate
    monkeypatch.setattr(H3Pipeline, "generate", lambda self, *a, **kw: seen.append(self.kept) or real(self, *a, **kw))
    assert cli.main(["generate", "x", "--frames", "5", "--size", "64x64", "--steps", "2", "--keep", "video_vae",
                     "--memory-budget", "1", "--out", str(tmp_path / "o.mp4")]) == 0
    out = capsys.readouterr().out
    assert seen == [{"video_vae"}]
    assert "per phase" in out and "video_vae weights (kept)" in out
    assert "video decode: releasing transformer (not kept)" in out
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--keep", "vae"])
    assert "invalid choice: 'vae'" in capsys.readouterr().err
