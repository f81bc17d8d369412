"""Memory-budget preflight: estimates from checkpoint headers, residency and chunk choice, refusal with numbers."""

from __future__ import annotations

import pytest

from h3_core.memory_plan import MemoryBudgetError, plan_for_budget
from h3_core.pipeline import H3Pipeline, plan_components, resolve_model
from h3_core.tiny_default import ensure_tiny_model

REQUEST = dict(width=96, height=64, num_frames=39)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return resolve_model(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


def test_weights_are_read_from_headers(sources):
    plan = plan_for_budget(sources, budget_bytes=1 << 30, **REQUEST)
    by_name = {c.name: c for c in plan.components}
    assert set(by_name) == {"text_encoder", "transformer", "video_vae", "audio_vae"}
    assert by_name["transformer"].total_bytes == sources.transformer.stat().st_size - _header(sources.transformer) \
        - 16 * 4  # the file also holds rope.inv_freq (16 fp32 floats), which the plan does not count as weight
    # Plenty of room: everything resident, the DiT fused.
    assert all(c.residency == "resident" for c in plan.components)
    assert plan.component_options["transformer"] == {}
    assert "memory preflight" in plan.describe() and "estimated peak" in plan.describe()


def _header(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_small_budget_streams_and_chunks(sources):
    big = plan_for_budget(sources, budget_bytes=1 << 30, **REQUEST)
    dit = next(c for c in big.components if c.name == "transformer")
    # Room for the streamed weights and full-length buffers but not the fused temporaries.
    budget = dit.device_bytes() - 1
    plan = plan_for_budget(sources, budget_bytes=budget, **REQUEST)
    assert plan.peak_bytes <= budget
    options = plan.component_options["transformer"]
    assert options.get("residency") == "layerwise" or "memory_budget" in options


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


def test_planned_run_matches_the_plain_run(sources):
    plain = H3Pipeline(sources)
    a = plain.generate("x", width=64, height=64, num_frames=5, steps=2, seed=0)
    plain.release_all()
    options = plan_components(sources, memory_budget_gb=0.004, width=64, height=64, num_frames=5)
    planned = H3Pipeline(sources, component_options=options)
    b = planned.generate("x", width=64, height=64, num_frames=5, steps=2, seed=0)
    planned.release_all()
    assert (b.frames - a.frames).abs().max() <= 1e-5
