"""The asynchronous offload path (AsyncBackend, LayerwiseOffloadManager, the StagedReads staging reader) run on a
simulated CUDA device (tests/fake_cuda.py): deferred copies, a caching allocator and a race detector. Every
configuration gives the resident numbers bit for bit with no unordered access; removing one event wait is caught."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fake_cuda import FakeCuda
from h3_core.runtime.host_store import PinBudget
from h3_core.runtime.layerwise import LayerwiseOffloadManager
from h3_core.runtime.offload_backends import AsyncBackend
from h3_core.runtime.platform import Platform
from test_failed_block_loads import one_pass
from test_staged_reads import stack_recipes, write_stack

BLOCKS, WIDTH = 5, 32
UNIT_BYTES = 4096 + 256  # a block's slot layout: 32x32 fp32 weight + bias on 256-byte boundaries


def resident(path, x):
    state = {k: v.float() for k, v in write_stack(path, BLOCKS, rows=WIDTH, cols=WIDTH).items()}
    out = x
    for i in range(BLOCKS):
        out = torch.nn.functional.linear(out, state[f"{i}.weight"], state[f"{i}.bias"])
    return out


def run(tmp_path, *, prefetch=1, pin_units=0, read_ahead=1, resident_blocks=None, passes=2, fake=None, before=None,
        transform=None):
    fake = fake or FakeCuda()
    path = tmp_path / "stack.safetensors"
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    expected = resident(path, x)
    stack = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
    # The ring (read_ahead + 1 buffers) is pinned first, then `pin_units` leading units are packed.
    budget = PinBudget(((read_ahead or -1) + 1 + pin_units) * UNIT_BYTES + 100)
    backend = AsyncBackend("cpu", platform=fake.platform(), pin_budget=budget, read_ahead=read_ahead)
    if before is not None:
        before(fake, backend)
    manager = LayerwiseOffloadManager(backend, prefetch=prefetch, resident_blocks=resident_blocks)
    manager.attach(stack, stack_recipes(path, BLOCKS))
    if read_ahead is not None and hasattr(manager.store, "_fill"):
        fake.watch_store(manager.store)
    outputs = []
    with torch.no_grad(), fake.watch():
        if transform is not None:
            manager.set_transform(transform)
        for _ in range(passes):
            outputs.append(one_pass(manager, stack, x))
    return fake, manager, stack, x, expected, outputs


CONFIGS = [dict(prefetch=p, pin_units=u, read_ahead=r) for p in (0, 1, 2) for u in (0, 2, BLOCKS) for r in (1, 2)
           if not (p == 0 and r == 2)] + [dict(prefetch=1, pin_units=0, read_ahead=1, resident_blocks=2),
                                          # no staging reader: every unit packed into a PinnedSlab
                                          dict(prefetch=1, pin_units=BLOCKS, read_ahead=None, resident_blocks=1)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_no_races_and_resident_numbers(tmp_path, config):
    fake, manager, stack, x, expected, outputs = run(tmp_path, **config)
    assert len(manager.store.slabs) == min(config["pin_units"], BLOCKS)
    manager.close()
    fake.assert_no_races()
    assert fake.copies > 0 and all(torch.equal(o, expected) for o in outputs)


def test_exception_in_a_block_interrupt_and_a_failed_load_leave_no_race(tmp_path, monkeypatch):
    fake, manager, stack, x, expected, _ = run(tmp_path, passes=1)
    with torch.no_grad(), fake.watch():
        with pytest.raises(ZeroDivisionError):  # an exception inside block 2
            with manager.pass_scope():
                for i, block in enumerate(stack):
                    manager.acquire(i)
                    try:
                        x2 = block(x)
                        if i == 2:
                            raise ZeroDivisionError
                    finally:
                        manager.release(i)
        with pytest.raises(KeyboardInterrupt):  # an interrupt between blocks
            with manager.pass_scope():
                for i, block in enumerate(stack):
                    if i == 3:
                        raise KeyboardInterrupt
                    manager.acquire(i)
                    try:
                        x2 = block(x2)
                    finally:
                        manager.release(i)
        original, calls = manager.store._reader.read_into, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(5, "Input/output error")
            return original(*args, **kwargs)

        monkeypatch.setattr(manager.store._reader, "read_into", failing)
        with pytest.raises(OSError):  # a read error mid-pass
            one_pass(manager, stack, x)
        monkeypatch.undo()
        assert torch.equal(one_pass(manager, stack, x), expected)
        copy, copies = fake.copy_to_device, []

        def refused(*args):
            copies.append(1)
            if len(copies) == 2:
                raise RuntimeError("CUDA error: out of memory")
            return copy(*args)

        monkeypatch.setattr(fake, "copy_to_device", refused)
        with pytest.raises(RuntimeError):  # the copy itself refused mid-pass
            one_pass(manager, stack, x)
        monkeypatch.undo()
        assert torch.equal(one_pass(manager, stack, x), expected)
    manager.close()
    fake.assert_no_races()


@pytest.mark.parametrize("resident_blocks", [None, 2])
def test_a_lora_fold_in_the_slots_has_no_race_and_the_folded_numbers(tmp_path, resident_blocks):
    delta = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(2)) * 0.01

    def fold(tensors):  # in place, on the compute stream, as the LoRA loader's fold does
        tensors["weight"].add_(delta)

    fake, manager, stack, x, _, outputs = run(tmp_path, transform=fold, resident_blocks=resident_blocks)
    state = {k: v.float() for k, v in write_stack(tmp_path / "again.safetensors", BLOCKS, rows=WIDTH,
                                                  cols=WIDTH).items()}
    expected = x
    for i in range(BLOCKS):
        expected = torch.nn.functional.linear(expected, state[f"{i}.weight"] + delta, state[f"{i}.bias"])
    manager.close()
    fake.assert_no_races()
    assert all(torch.equal(o, expected) for o in outputs)


def test_a_simulated_platform_keeps_the_facts_of_its_kind():
    fake = FakeCuda()
    platform = fake.platform()
    assert platform == Platform("cuda") and platform.asynchronous_copies and platform.default_prefetch == 1
    assert platform.device == torch.device("cpu") and not platform.host_is_device
    assert platform.new_stream() is not platform.current_stream()
    dst, src = torch.zeros(4), torch.arange(4.0)
    Platform("cpu").copy_to_device(dst, src)  # the real ops: dst.copy_(src)
    assert torch.equal(dst, src)


# ---- the detector catches a removed wait ------------------------------------------------------------------------


def skip_waits(monkeypatch, fake, which):
    """Make stream.wait_event ignore the events of `which` ("free": the copy stream's wait for the compute stream;
    "ready": the compute stream's wait for a copy)."""
    from fake_cuda import FakeStream

    original = FakeStream.wait_event

    def wait_event(self, event):
        waiter_is_copy = self is not fake.compute
        if (which == "free" and waiter_is_copy) or (which == "ready" and not waiter_is_copy):
            return
        original(self, event)

    monkeypatch.setattr(FakeStream, "wait_event", wait_event)


@pytest.mark.parametrize("which", ["free", "ready"])
@pytest.mark.parametrize("pin_units,read_ahead", [(0, 1), (BLOCKS, 1), (BLOCKS, None)])
def test_a_removed_event_wait_is_a_race(tmp_path, monkeypatch, which, pin_units, read_ahead):
    fake = FakeCuda()
    skip_waits(monkeypatch, fake, which)
    fake, manager, stack, x, expected, outputs = run(tmp_path, fake=fake, pin_units=pin_units, read_ahead=read_ahead)
    manager.close()
    assert fake.races, f"removing the {which} waits went unnoticed"
    if which == "ready":  # the compute stream read the slots before their copies landed: stale bytes
        assert not any(torch.equal(o, expected) for o in outputs)


def test_the_reader_refilling_a_buffer_under_a_pending_copy_is_a_race(tmp_path, monkeypatch):
    from fake_cuda import FakeEvent

    fake = FakeCuda()
    original = FakeEvent.synchronize
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: None if self.fake is fake else original(self))
    fake, manager, *_ = run(tmp_path, fake=fake, pin_units=0, passes=2)
    assert any("pinned host buffer" in r for r in fake.races)
    monkeypatch.setattr(FakeEvent, "synchronize", original)
    manager.close()


# ---- reviewed risks -----------------------------------------------------------------------------------------------


def test_the_first_copy_into_a_fresh_slot_waits_for_earlier_compute_work(tmp_path):
    def earlier_compute_work(fake, backend):
        # Memory the compute stream wrote and freed; the caching allocator hands it to the slots.
        block = fake.platform().empty(UNIT_BYTES)
        with fake.watch():
            block.fill_(7)
        del block

    fake, manager, *_ = run(tmp_path, before=earlier_compute_work, passes=1)
    manager.close()
    fake.assert_no_races()


def test_closing_the_store_without_the_backend_synchronises_before_unpinning(tmp_path):
    fake, manager, *_ = run(tmp_path, pin_units=BLOCKS, passes=1)
    # A pending copy on the copy stream still reads a slab (the next pass's head, prefetched); the store is
    # closed (as a dropped store's __del__ does) before the backend.
    manager.store.close()
    fake.assert_no_races()
    manager.close()


# ---- pinning once per load ------------------------------------------------------------------------------------------


def test_the_pipeline_packs_a_kept_transformer_once_and_never_the_text_encoder(monkeypatch, tiny):
    """On the simulated CUDA, the tiny pipeline with its transformer and text encoder streamed: the transformer (a
    pass per step) packs its leading blocks into pinned slabs once per load, and a kept one is not packed again by
    the next request; the text encoder (one pass per request) streams through its ring without packing."""
    from h3_core.checkpoints import placement
    from h3_core.pipeline.pipeline import H3Pipeline
    from h3_core.runtime.staged_store import StagedReads
    from h3_core.sources.model_sources import resolve_model

    fake = FakeCuda()
    real = placement.layerwise_manager
    monkeypatch.setattr(placement, "layerwise_manager", lambda device, **kw: real(device, platform=fake.platform(),
                                                                                  **kw))
    packs = []
    pack = StagedReads.pack_pinned

    def counted(self, pack_units=True):
        pack(self, pack_units)
        packs.append((pack_units, len(self.slabs)))

    monkeypatch.setattr(StagedReads, "pack_pinned", counted)
    layerwise = {"residency": "layerwise"}
    pipe = H3Pipeline(resolve_model(tiny), keep_transformer=True,
                      component_options={"transformer": layerwise, "text_encoder": layerwise})
    try:
        first = pipe.generate("a fox", width=96, height=64, num_frames=5, steps=3, seed=1)
        after_first = list(packs)
        second = pipe.generate("a fox", width=96, height=64, num_frames=5, steps=3, seed=1)
    finally:
        pipe.release_all()
    # per request: the text encoder's and the AdaLN units' stores (no slabs); once: the transformer's blocks
    repeated = [p for p in after_first if p[0]]
    assert repeated and all(slabs > 0 for _, slabs in repeated), after_first
    assert [p for p in after_first if not p[0]] and all(slabs == 0 for unit, slabs in after_first if not unit)
    assert [p for p in packs[len(after_first):] if p[0]] == [], packs  # the kept transformer: not packed again
    assert torch.equal(first.frames, second.frames)
