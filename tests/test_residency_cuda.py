"""The asynchronous backend on a real CUDA device: slots, events, overlap, races, pinned slabs. Skipped without CUDA.

Race detection follows the design's invariant: after `release(i)` the slot is poisoned (NaN bytes) on the copy
stream behind the slot's `free` event, while compute is slowed down with sleep kernels; outputs must not change.
A deliberately broken backend (its `free` event recorded on the copy stream, so nothing waits for compute) is the
control that shows the poison reaches the output when the ordering is wrong.
"""

from __future__ import annotations

import pytest
import torch

import h3_core
from h3_core.runtime.host_store import PinBudget
from h3_core.runtime import AsyncBackend
from h3_core.runtime import LayerwiseOffloadManager, SlotState
from h3_fixtures import packed_inputs
from offload_fixtures import SMALL, random_state, save_native

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

N = SMALL.num_layers
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU clock: widens every race window by far more than a tiny block's copy


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return save_native(random_state(SMALL, seed=11), SMALL, tmp_path_factory.mktemp("cuda") / "native")


@pytest.fixture(scope="module")
def inputs():
    return {k: v.cuda() for k, v in packed_inputs(SMALL, seed=5).items()}


@pytest.fixture(scope="module")
def reference(native, inputs):
    with torch.no_grad():
        return h3_core.load_dit(native, device="cuda")(**inputs)


def assert_same(outputs, expected):
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def slow_blocks(model):
    """Sleep on the compute stream before every block: queued work lags far behind the host."""
    return [b.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(SLEEP_CYCLES)) for b in model.blocks]


@pytest.mark.parametrize("resident", [None, 2])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_layerwise_matches_resident_with_fixed_slots(native, inputs, reference, prefetch, resident):
    model = h3_core.load_dit(native, device="cuda", residency="layerwise", prefetch=prefetch,
                             resident_blocks=resident)
    manager = model.block_residency
    backend = manager.backend
    assert isinstance(backend, AsyncBackend)
    streamed = manager.streamed
    assert len(backend.buffers) == prefetch + 1
    pointers = [b.data_ptr() for b in backend.buffers]
    for i in range(N):  # streamed slabs are page-locked in place; resident ones were copied once and need no pin
        assert backend.store.slab(i).data.is_pinned() == (i in streamed)
    assert manager.stats().pinned_bytes == sum(backend.store.unit_bytes(i) for i in streamed)
    peaks = []
    with torch.no_grad():
        for _ in range(3):
            assert_same(model(**inputs), reference)
            stats = manager.stats().last_pass
            peaks.append(stats.peak_device_bytes)
            assert SlotState.IN_USE not in manager._slots.states
            assert stats.peak_streamed_blocks <= prefetch + 1
    assert [b.data_ptr() for b in backend.buffers] == pointers  # allocated once, never moved
    assert peaks[1] == peaks[2]  # no growth across passes


@pytest.mark.parametrize("prefetch", [1, 2])
def test_poisoning_a_released_slot_does_not_change_outputs(native, inputs, reference, prefetch):
    class PoisoningBackend(AsyncBackend):
        def unload(self, slot):
            super().unload(slot)
            with self.platform.on_stream(self.copy_stream):
                self.copy_stream.wait_event(self.free_events[slot])
                self.buffers[slot].fill_(255)  # every float or bf16 read from it is NaN

    model = h3_core.load_dit(native, device="cuda")
    model.block_residency = LayerwiseOffloadManager(PoisoningBackend("cuda"), prefetch=prefetch).attach(model.blocks)
    hooks = slow_blocks(model)
    with torch.no_grad():
        for _ in range(3):
            assert_same(model(**inputs), reference)
    for h in hooks:
        h.remove()


def test_the_poison_reaches_the_output_when_release_does_not_wait_for_compute(native, inputs, reference):
    class BrokenBackend(AsyncBackend):
        def unload(self, slot):  # the bug the events exist to prevent: the free event ignores the compute stream
            self.free_events[slot].record(self.copy_stream)
            self._free_recorded[slot] = True
            with self.platform.on_stream(self.copy_stream):
                self.copy_stream.wait_event(self.free_events[slot])
                self.buffers[slot].fill_(255)

    model = h3_core.load_dit(native, device="cuda")
    model.block_residency = LayerwiseOffloadManager(BrokenBackend("cuda"), prefetch=1).attach(model.blocks)
    slow_blocks(model)
    with torch.no_grad():
        video, _ = model(**inputs)
    # Block 0 reads its slot after the poison (NaN) or after block 2's weights landed there: either way, wrong.
    assert not (torch.isfinite(video).all() and torch.allclose(video, reference[0], rtol=1e-5, atol=1e-6))


def block_context(model, inputs):
    c = model.config
    x = torch.randn(1, inputs["position_ids"].shape[0], c.hidden_size, device="cuda")
    time_act = model.embed_time(inputs["timestep"])
    adaln_index = inputs["timestep_indices"] * 3 + inputs["token_tags"].clamp(min=0)
    return x, (time_act, adaln_index, model.rope(inputs["position_ids"]))


def test_copies_overlap_compute_and_wait_only_for_their_slot(native, inputs):
    model = h3_core.load_dit(native, device="cuda", residency="layerwise", prefetch=1)
    manager = model.block_residency
    x, ctx = block_context(model, inputs)
    with torch.no_grad():
        with manager.pass_scope():  # a first pass: every slot has been used and freed once
            for i in range(N):
                manager.acquire(i)
                x = model.blocks[i](x, *ctx)
                manager.release(i)
        manager.begin_pass()
        manager.acquire(0)
        x = model.blocks[0](x, *ctx)
        manager.release(0)
        manager.acquire(1)  # prefetches block 2 into the slot block 0 just freed
        torch.cuda._sleep(50 * SLEEP_CYCLES)  # block 1's "compute": ~0.5 s
        computed = torch.cuda.Event()
        computed.record()
        ready = manager.backend.ready_events[manager._slots.slot_of(2)]
        ready.synchronize()  # the host waits for the copy only
        assert not computed.query()  # block 2 arrived while block 1 was still computing
        manager.release(1)
        manager.end_pass()
    torch.cuda.synchronize()


def test_no_host_synchronisation_in_steady_state(native, inputs):
    model = h3_core.load_dit(native, device="cuda", residency="layerwise", prefetch=1, resident_blocks=1)
    manager = model.block_residency
    x, ctx = block_context(model, inputs)

    def one_pass(x):
        with manager.pass_scope():
            for i in range(N):
                manager.acquire(i)
                x = model.blocks[i](x, *ctx)
                manager.release(i)
        return x

    with torch.no_grad():
        expected = one_pass(x)  # warm-up: cuBLAS handles, allocator blocks
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [one_pass(x) for _ in range(2)]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_pin_budget_falls_back_to_pageable_slabs(native, inputs, reference):
    model = h3_core.load_dit(native, device="cuda")
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    backend = AsyncBackend("cuda", pin_budget=PinBudget(int(2.5 * block)))
    model.block_residency = LayerwiseOffloadManager(backend, prefetch=1).attach(model.blocks)
    assert [backend.store.slab(i).pinned for i in range(N)] == [True, True] + [False] * (N - 2)
    assert [backend.store.slab(i).data.is_pinned() for i in range(N)] == [True, True] + [False] * (N - 2)
    with torch.no_grad():
        for _ in range(2):
            assert_same(model(**inputs), reference)
    slabs = [backend.store.slab(i).data for i in range(N)]
    model.block_residency.close()
    model.block_residency = h3_core.AllResident(N)
    assert backend.buffers == [] and not any(s.is_pinned() for s in slabs)  # slots freed, pins unregistered
    assert all(p.device.type == "cuda" for p in model.blocks.parameters())  # back where they were captured
    with torch.no_grad():
        assert_same(model(**inputs), reference)
