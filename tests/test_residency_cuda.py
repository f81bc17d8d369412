"""The asynchronous backend as `load_dit(residency="layerwise")` uses it on CUDA: blocks read from their safetensors
files by the staging reader into a pinned ring, leading ones packed into pinned slabs while the pin budget lasts,
copied into fixed slots on a copy stream ordered by per-slot events.

Every test runs twice through the same code (benchmarks/offload_checks.py): on a real CUDA device ("cuda", skipped
without one) and on the simulated CUDA of tests/fake_cuda.py ("fake", on the CPU, in every run: deferred copies,
streams and events with vector clocks, a race detector). So the API calls and block calls a GPU run makes are
exercised in CI, and a GPU run reports only what the GPU does differently. What only the real device can show is
asserted there only: that a copy finishes while compute is still running (sleep kernels), and the sync-debug mode's
count (the simulated device counts the host's waits on its streams, events and copies instead).

Race detection follows the design's invariant: after `release(i)` the slot is poisoned (NaN bytes) on the copy
stream behind the slot's `free` event while compute is slowed down with sleep kernels (CUDA); outputs must not
change. A deliberately broken backend (its `free` event recorded on the copy stream, so nothing waits for compute)
is the control: the poison reaches the output (CUDA), or the detector reports the race (simulated).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import offload_checks as oc  # noqa: E402
from h3_core.runtime.host_store import PinBudget  # noqa: E402
from h3_core.runtime.offload_backends import AsyncBackend  # noqa: E402
from h3_core.runtime.platform import Platform  # noqa: E402
from h3_core.runtime.slots import SlotState  # noqa: E402
from offload_cuda import constrained_budget, unit_bytes  # noqa: E402

CUDA_PROBLEM = oc.Device.problem("cuda")
KINDS = [pytest.param("cuda", marks=[pytest.mark.cuda,
                                     pytest.mark.skipif(CUDA_PROBLEM is not None, reason=f"needs a CUDA device "
                                                                                        f"({CUDA_PROBLEM})")]),
         "fake"]
SAME = {"max_abs_difference": 0.0, "finite": True}


@pytest.fixture(params=KINDS)
def device(request):
    return oc.Device(request.param)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return oc.write_check_model(tmp_path_factory.mktemp("cuda-checks") / "transformer")


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.fixture
def inputs_and_reference(device, folder, references):
    """The checks' inputs on the device and the resident model's outputs (once per device kind)."""
    if device.kind not in references:
        model = device.resident(folder)
        inputs = oc.check_inputs(model, device)
        del model
        references[device.kind] = inputs, oc.reference_outputs(folder, device, inputs)
    return references[device.kind]


@pytest.mark.parametrize("resident", [None, 2])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_layerwise_matches_resident_with_fixed_slots(device, folder, inputs_and_reference, prefetch, resident):
    inputs, reference = inputs_and_reference
    # CUDA: exactly load_dit(residency="layerwise"), with the process's pin budget (it holds these small blocks).
    model = device.layerwise(folder, prefetch=prefetch, resident_blocks=resident)
    manager = model.block_residency
    backend, store, streamed = manager.backend, manager.store, manager.streamed
    assert isinstance(backend, AsyncBackend) and backend.platform == Platform("cuda")
    assert store.kind == "staged_reads" and manager.resident == frozenset(range(resident or 0))
    assert len(backend.buffers) == min(prefetch + 1, len(streamed))
    pointers = [b.data_ptr() for b in backend.buffers]
    # Every streamed block packed once into a page-locked slab: no file read per pass.
    assert sorted(store.slabs) == list(streamed)
    assert all(store.slabs[i].pinned and device.page_locked(store.slabs[i].data) for i in streamed)
    assert manager.stats().pinned_bytes == store.pinned_bytes >= sum(s.nbytes for s in store.slabs.values())
    peaks = []
    with device.watching():
        precomputed = oc.precompute(model, inputs)
        for _ in range(3):
            assert oc.difference(oc.forward(model, inputs, precomputed), reference) == SAME
            stats = manager.stats().last_pass
            peaks.append(stats.peak_device_bytes)
            assert SlotState.IN_USE not in manager._slots.states
            assert stats.peak_streamed_blocks <= prefetch + 1 and stats.bytes_read == 0
    device.synchronize()
    assert [b.data_ptr() for b in backend.buffers] == pointers  # allocated once, never moved
    assert peaks[1] == peaks[2]  # no growth across passes
    model.close(restore=False)
    assert device.races() == []


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("pin_units", [0, 3, oc.CHECK_BLOCKS])
def test_poisoning_released_slots_does_not_change_outputs(device, folder, inputs_and_reference, pin_units,
                                                          prefetch):
    inputs, reference = inputs_and_reference
    case = oc.ordering_case(device, folder, inputs, reference, pin_units=pin_units, poisoned=True, prefetch=prefetch)
    assert case["packed_units"] == list(range(pin_units))  # ring only, some packed, all packed
    assert case["poisoned_slots"] > 0
    assert (case["max_abs_difference"], case["finite"], case["races"]) == (0.0, True, [])


def test_the_poison_reaches_the_output_when_release_does_not_wait_for_compute(device, folder, inputs_and_reference):
    inputs, reference = inputs_and_reference
    control = oc.control_case(device, folder, inputs, reference)
    if device.simulated:  # eager compute has read the slot before the copy lands; the detector sees the order
        assert control["race_count"] > 0
    else:  # block 0 reads its slot after the poison (NaN) or after block 2's weights landed there
        assert control["outputs_wrong"]


@pytest.mark.parametrize("failure", oc.FAILURES)
def test_a_failed_load_fails_one_pass_and_the_next_passes_equal_resident(device, folder, inputs_and_reference,
                                                                        failure):
    inputs, reference = inputs_and_reference
    case = oc.recovery_case(device, folder, inputs, reference, kind=failure)
    assert case["failure_reached"] and case["raised"] is not None
    assert case["slots_loaded_after_failure"] == [] and case["staging_buffers_lent_after_failure"] == 0
    assert (case["first_step_difference"], case["max_abs_difference_after"], case["finite_after"]) == (0, 0, True)
    assert case["race_count"] == 0


def test_copies_overlap_compute_and_wait_only_for_their_slot(device, folder, inputs_and_reference):
    inputs, _ = inputs_and_reference
    model = device.layerwise(folder, prefetch=1)
    manager = model.block_residency
    x, context, tables = oc.block_context(model, inputs, device)
    with device.watching(), torch.no_grad():
        oc.block_loop(model, x, context, tables)  # a first pass: every slot has been used and freed once
        manager.begin_pass()
        manager.acquire(0)
        y = model.blocks[0](x, *context, table=tables.table(0, x.device))
        manager.release(0)
        manager.acquire(1)  # prefetches block 2 into the slot block 0 just freed
        device.sleep(50 * oc.SLEEP_CYCLES)  # block 1's "compute": ~0.5 s on CUDA
        computed = device.platform.new_event()
        computed.record()
        ready = manager.backend.ready_events[manager._slots.slot_of(2)]
        ready.synchronize()  # the host waits for the copy only
        if not device.simulated:
            assert not computed.query()  # block 2 arrived while block 1 was still computing
        y = model.blocks[1](y, *context, table=tables.table(1, x.device))
        manager.release(1)
        manager.end_pass()
    device.synchronize()
    assert torch.isfinite(y).all()
    model.close(restore=False)
    assert device.races() == []


def test_no_host_synchronisation_in_steady_state(device, folder, inputs_and_reference):
    inputs, _ = inputs_and_reference
    found = oc.steady_state_syncs(device, folder, inputs)
    assert found["where"] == [] and (found["step_syncs"], found["loop_syncs"]) == (0, 0)
    assert found["same_outputs"] and found["race_count"] == 0


def test_a_pin_budget_below_the_ring_streams_from_pageable_memory(device, folder, inputs_and_reference):
    inputs, reference = inputs_and_reference
    config = oc.h3_core.resolve_dit_checkpoint(folder).config
    budget = PinBudget(unit_bytes(config, device.dtype)[0] // 2)  # not even one staging buffer
    model = device.layerwise(folder, pin_budget=budget)
    store = model.block_residency.store
    assert store.slabs == {} and store.pinned_bytes == 0 and budget.used_bytes == 0
    with device.watching():
        precomputed = oc.precompute(model, inputs)
        for _ in range(2):
            assert oc.difference(oc.forward(model, inputs, precomputed), reference) == SAME
    model.close(restore=False)
    assert device.races() == []


def test_closing_gives_every_pin_back(device, folder, inputs_and_reference):
    inputs, reference = inputs_and_reference
    config = oc.h3_core.resolve_dit_checkpoint(folder).config
    budget = constrained_budget(config, device.dtype, pin_units=2)
    model = device.layerwise(folder, pin_budget=budget)
    manager = model.block_residency
    store, backend = manager.store, manager.backend
    assert sorted(store.slabs) == [0, 1]
    assert budget.used_bytes == store.pinned_bytes + model.adaln_residency.store.pinned_bytes > 0
    pinned = [s.data for s in store.slabs.values()] + [b for b, p in zip(store._ring, store._ring_pinned) if p]
    assert pinned and all(device.page_locked(b) for b in pinned)
    with device.watching():
        assert oc.difference(oc.forward(model, inputs, oc.precompute(model, inputs)), reference) == SAME
    model.close(restore=False)
    assert backend.buffers == [] and budget.used_bytes == 0  # slots freed, the budget whole again
    assert not any(device.page_locked(b) for b in pinned)  # pins unregistered
    assert device.races() == []
