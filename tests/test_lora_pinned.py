"""A LoRA folded into streamed blocks on the asynchronous (CUDA) path: the factors are read once per LoRA set into
page-locked host memory counted in the component's pin budget, and each fold copies them non-blocking on the compute
stream, so a steady-state sampling step reads no LoRA file and makes no host synchronisation (issue 27: the folds
read the factors from the file into pageable memory and copied them with a blocking copy at every block).

Runs through benchmarks/offload_checks.py on a real CUDA device ("cuda", skipped without one: the sync-debug mode
counts the host's synchronisations) and on the simulated CUDA of tests/fake_cuda.py ("fake", in every run: deferred
copies, streams and events, a race detector; it counts the host's waits and the bytes copied from pinned memory).
The reference is the resident model with the same LoRAs (whose folds are checked against diffusers in
tests/test_lora.py), compared bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import offload_checks as oc  # noqa: E402
from h3_core.checkpoints import lora_loader  # noqa: E402
from h3_core.checkpoints.lora_loader import LoraFold, block_factor_bytes, read_lora  # noqa: E402
from h3_core.runtime.host_store import PinBudget  # noqa: E402
from offload_cuda import constrained_budget  # noqa: E402
from test_residency_cuda import KINDS  # noqa: E402  (the real device where there is one, and the simulated one)



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return oc.write_check_model(tmp_path_factory.mktemp("lora_pinned_dit"))


@pytest.fixture(scope="module")
def loras(folder, tmp_path_factory):
    config = oc.h3_core.resolve_dit_checkpoint(folder).config
    diffsynth, diffusers = oc.write_check_loras(tmp_path_factory.mktemp("lora_pinned_loras"), config)
    return [(diffsynth, 0.8), (diffusers, -0.6)]


@pytest.fixture(params=KINDS)
def device(request):
    return oc.Device(request.param)


def cache_bytes(folder, loras, dtype) -> int:
    config = oc.h3_core.resolve_dit_checkpoint(folder).config
    return block_factor_bytes(LoraFold([(read_lora(path, config), strength) for path, strength in loras]), dtype)


@pytest.mark.parametrize("pins", ["every block packed", "the staging ring"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_steady_state_fold_reads_no_file_and_makes_no_host_wait(device, folder, loras, monkeypatch, pins, dtype):
    dtype = dtype or device.dtype
    if dtype != torch.float32:  # several fold steps per weight (float32 folds in one)
        monkeypatch.setattr(lora_loader, "FOLD_ELEMENTS", 7 * 256)
    planned = cache_bytes(folder, loras, dtype)
    config = oc.h3_core.resolve_dit_checkpoint(folder).config
    limit = 1 << 30 if pins == "every block packed" else constrained_budget(config, dtype, 1).limit_bytes + planned
    budget = PinBudget(limit)
    inputs = oc.check_inputs(device.resident(folder, dtype=dtype), device)
    found = oc.lora_steady_state(device, folder, inputs, loras, pin_budget=budget, dtype=dtype)
    assert found["same_as_resident"] and found["steady_same"] and found["again_same"], found
    assert found["lora_reads"] == 0, found  # the factors were read once, when the LoRA set was applied
    assert found["host_syncs"] == 0, found["where"]
    if device.simulated:  # every factor byte a fold moved came from pinned memory, copied without a host wait
        assert found["factor_bytes_moved"] == found["factor_bytes_from_pinned"] > 0, found
    assert found["cache_bytes"] == found["cache_pinned_bytes"] == planned > 0, found
    # In the backend's budget; given back when the set is removed, taken again when it returns, all back at close.
    assert found["pins_with"] - found["pins_without"] == planned == found["pins_again"] - found["pins_without"]
    assert found["pins_after_close"] == 0 and found["pin_warnings"] == [] and found["race_count"] == 0, found


def test_no_pin_budget_left_keeps_the_factors_pageable_and_says_so_once(device, folder, loras):
    inputs = oc.check_inputs(device.resident(folder), device)
    found = oc.lora_steady_state(device, folder, inputs, loras, pin_budget=PinBudget(0))
    assert found["same_as_resident"] and found["steady_same"] and found["again_same"], found
    assert found["lora_reads"] == 0 and found["race_count"] == 0, found
    assert found["cache_bytes"] == cache_bytes(folder, loras, device.dtype) > 0 == found["cache_pinned_bytes"]
    assert len(found["pin_warnings"]) == 1 and "pageable" in found["pin_warnings"][0], found["pin_warnings"]
    assert found["pins_with"] == found["pins_after_close"] == 0


def test_the_memory_plan_counts_the_factors_on_cuda_only(tiny):
    """The plan's streamed transformer holds its blocks' factors in host memory on CUDA, nowhere else."""
    from h3_core.sources import resolve_model
    from h3_core.sources.tiny_default import TINY_LORA

    lora = tiny / "loras" / TINY_LORA
    sources = resolve_model(tiny)
    config = oc.h3_core.resolve_dit_checkpoint(sources.transformer).config
    expected = block_factor_bytes(LoraFold([(read_lora(lora, config), 1.0)]), torch.bfloat16)
    for device, held in (("cuda", expected), ("cpu", 0), ("mps", 0)):
        plan = oc.h3_core.plan_for_budget(sources, device=device, budget_bytes=8 << 30, width=96, height=64,
                                          num_frames=39, residency="layerwise", loras=[(lora, 1.0)])
        sampling = next(p for p in plan.phases if p.component == "transformer")
        assert sum(i.nbytes for i in sampling.items if i.what == "LoRA factors" and i.on_host) == held
        assert ("page-locked" in " ".join(plan.notes)) == (device == "cuda")
    assert expected > 0


def test_unpinning_the_factors_without_a_device_synchronisation_is_a_race(folder, loras, monkeypatch):
    """The control of the synchronisation before the factors are unpinned: a LoRA set change right behind queued
    folds, with the device synchronisation skipped, is reported by the simulated device's race detector."""
    from fake_cuda import FakeCuda

    device = oc.Device("fake")
    inputs = oc.check_inputs(device.resident(folder), device)
    model = device.layerwise(folder, pin_budget=PinBudget(1 << 30), loras=loras)
    try:
        with device.watching():
            precomputed = oc.precompute(model, inputs)
            oc.forward(model, inputs, precomputed)
            assert device.races() == []
            monkeypatch.setattr(FakeCuda, "synchronize", lambda self: None)
            oc.h3_core.set_loras(model, [])
            monkeypatch.undo()
    finally:
        model.close(restore=False)
    assert any("unpin" in race and "copy source" in race for race in device.races()), device.races()
