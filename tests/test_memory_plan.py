"""Memory-budget preflight: estimates from checkpoint headers, residency and chunk choice, refusal with numbers."""

from __future__ import annotations

import pytest

from h3_core.pipeline.planning import plan_for_budget
from h3_core.runtime.memory_plan import MemoryBudgetError
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_core.pipeline import H3Pipeline, plan_components, resolve_model
from h3_core.pipeline.tiny_default import ensure_tiny_model

REQUEST = dict(width=96, height=64, num_frames=39)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return resolve_model(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


def test_weights_are_read_from_headers(sources):
    plan = plan_for_budget(sources, budget_bytes=1 << 30, **REQUEST)
    by_name = {c.name: c for c in plan.components}
    assert set(by_name) == {"text_encoder", "transformer", "video_vae", "audio_vae"}
    # The data section of the file, less rope.inv_freq (recomputed, so not counted as a weight).
    data = sources.transformer.stat().st_size - _header(sources.transformer)
    inv_freq = SafetensorsFile(sources.transformer).nbytes("rope.inv_freq")
    assert by_name["transformer"].total_bytes == data - inv_freq
    # Plenty of room: everything resident, the DiT fused.
    assert all(c.residency == "resident" for c in plan.components)
    assert plan.component_options["transformer"] == {}
    assert "memory preflight" in plan.describe() and "estimated peak" in plan.describe()


def _header(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


@pytest.fixture
def transformer_dominated(monkeypatch):
    """Shrink the other phases' estimates so that the transformer decides the budget (at real sizes it does; the tiny
    model's VAEs and text-encoder embedding are large next to its 0.9 MB DiT)."""
    import h3_core.pipeline.planning as mp

    real_text, real_vaes = mp._text_encoder_estimate, mp._vae_estimates

    def small(estimate):
        estimate.total_bytes = estimate.fixed_bytes = estimate.unit_bytes = estimate.activation_bytes = 1024
        estimate.scoped_bytes, estimate.unit_sizes = {}, ()
        return estimate

    monkeypatch.setattr(mp, "_text_encoder_estimate", lambda *a: small(real_text(*a)))
    monkeypatch.setattr(mp, "_vae_estimates", lambda *a: [small(e) for e in real_vaes(*a)])


def test_small_budget_streams_and_chunks(sources, transformer_dominated):
    roomy = plan_for_budget(sources, budget_bytes=1 << 30, **REQUEST)
    dit = next(c for c in roomy.components if c.name == "transformer")
    assert roomy.component_options["transformer"] == {}
    # Lower and lower budgets: first the blocks stream, then the per-chunk temporaries get what is left, until
    # nothing fits. Every accepted plan stays within its budget.
    seen = set()
    budget = roomy.phase("sampling").total_bytes  # its weights, activations and step-cache tables
    assert budget == dit.device_bytes() + dit.host_table_bytes
    while True:
        budget -= 50_000
        try:
            plan = plan_for_budget(sources, budget_bytes=budget, **REQUEST)
        except MemoryBudgetError:
            break
        options = plan.component_options["transformer"]
        assert plan.peak_bytes <= budget
        seen.add(tuple(sorted(options)))
        if "memory_budget" in options:
            assert options["residency"] == "layerwise" and 0 < options["memory_budget"] < budget
            chunked_budget = budget
    assert ("residency",) in seen and ("memory_budget", "residency") in seen, seen
    # An explicit chunk size is kept as given.
    assert plan_for_budget(sources, budget_bytes=chunked_budget, chunk_size=64,
                           **REQUEST).component_options["transformer"]["chunk_size"] == 64


def test_refuses_what_cannot_fit_before_loading(sources):
    with pytest.raises(MemoryBudgetError) as info:
        plan_for_budget(sources, budget_bytes=64 << 10, **REQUEST)
    message = str(info.value)
    assert "does not fit" in message and "memory preflight" in message and "raise the budget" in message


def test_mps_streams_every_component(sources):
    plan = plan_for_budget(sources, device="mps", budget_bytes=1 << 30, **REQUEST)
    assert all(opts.get("residency") == "layerwise" for opts in plan.component_options.values())
    auto = plan_components(sources, device="mps", **REQUEST)
    assert all(opts.get("residency") == "layerwise" for opts in auto.values())
    assert plan_components(sources, device="cpu", **REQUEST)["transformer"] == {}


def test_planned_run_matches_the_plain_run(sources, transformer_dominated):
    request = dict(width=64, height=64, num_frames=5)
    plain = H3Pipeline(sources)
    a = plain.generate("x", steps=2, seed=0, **request)
    plain.release_all()
    roomy = plan_for_budget(sources, budget_bytes=1 << 30, **request)
    options = plan_components(sources, memory_budget_gb=(roomy.phase("sampling").total_bytes - 100_000) / 2**30,
                              **request)
    assert options["transformer"].get("residency") == "layerwise"
    planned = H3Pipeline(sources, component_options=options)
    b = planned.generate("x", steps=2, seed=0, **request)
    planned.release_all()
    assert float((b.frames - a.frames).norm() / a.frames.norm()) <= 1e-6
