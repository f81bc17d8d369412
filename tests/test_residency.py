"""Layerwise offload on the CPU used as the device: exactness, the residency bound, protocol, restore (a manager's
close() and `H3DiT.close()`, which keeps the streamed weights' LoRAs), host stores.

The oracle is the resident path of the same loader on the same file: the synchronous backend and the slot backend
(whose streams and events are inline on the CPU) run the same kernels, so outputs must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from h3_fixtures import packed_inputs
from offload_fixtures import SMALL, random_dit, random_state, same_outputs, save_comfy, save_diffusers, save_native
from residency_probe import MaterialisationCensus
from safetensors.torch import save_file

import h3_core
from h3_core.runtime import (AllResident, AsyncBackend, LayerwiseOffloadManager, Platform, Residency, ResidencyError,
                             SlotState, SlotStateError, SlotTable, SynchronousBackend)
from h3_core.runtime.host_store import PAGE_SIZE, HostTensor, PinBudget, PinnedSlab, page_aligned_bytes, plan_slab

N = SMALL.num_layers


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matrices: a second intra-op thread only adds barrier waits (costly when the CPUs are shared).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    state = random_state(SMALL, seed=11)
    return {
        "native": save_native(state, SMALL, root / "native"),
        "diffusers": save_diffusers(state, SMALL, root / "diffusers"),
        "comfy": save_comfy(state, root / "h3_small.safetensors"),
    }


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(SMALL, seed=5)


@pytest.fixture(scope="module")
def reference(checkpoints, inputs):
    with torch.no_grad():
        return h3_core.load_dit(checkpoints["native"])(**inputs)


def is_materialised(module: nn.Module) -> bool:
    """Judged from the parameters themselves (independent of the manager's ledger): placeholders hold 1 element."""
    return all(p.numel() > 1 for p in module.parameters())


def body_materialised(block: nn.Module) -> bool:
    """A block's weights but its AdaLN projection (which the loader streams as a unit of its own)."""
    return all(p.numel() > 1 for name, p in block.named_parameters() if not name.startswith("adaln_proj."))


def adaln_bytes(model, index):
    return sum(p.numel() * p.element_size() for p in model.blocks[index].adaln_proj.parameters())


def block_bytes(model, index):
    return sum(p.numel() * p.element_size() for p in model.blocks[index].parameters())


class ResidencyProbe:
    """A forward pre-hook on every block recording, while block i runs, which blocks hold device weights."""

    def __init__(self, model, kind):
        self.model = model
        self.kind = kind
        manager = model.block_residency
        self.census = MaterialisationCensus(manager.store) if kind == "sync" else None
        self.slot_pointers = [b.data_ptr() for b in manager.backend.buffers] if kind == "slots" else None
        self.observations = []
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: self.observe(i))

    def observe(self, running):
        manager = self.model.block_residency
        bound = {j for j, b in enumerate(self.model.blocks) if body_materialised(b)}
        if self.model.adaln_streamed_apart:  # projected before the block is fetched, released at once
            assert not any(is_materialised(b.adaln_proj) for b in self.model.blocks)
        if self.kind == "sync":
            loaded = self.census.live()
        else:  # fixed slots: bound weights must lie inside the slots allocated at attach, which never move
            buffers = manager.backend.buffers
            assert [b.data_ptr() for b in buffers] == self.slot_pointers
            for p in self.model.blocks[running].parameters():
                if running not in manager.resident:
                    assert any(b.data_ptr() <= p.data_ptr() < b.data_ptr() + b.numel() for b in buffers)
            loaded = set(manager.materialised_streamed())
        assert loaded == set(manager.materialised_streamed())
        text_live = is_materialised(self.model.token_refiner) or is_materialised(self.model.condition_proj)
        self.observations.append((running, bound, loaded, text_live))


def resident_request(kind):
    return {"none": None, "some": 2, "all": N}[kind]


def offloaded_model(kind, checkpoints, prefetch, resident):
    if kind == "sync":  # the loader's path: memory-mapped sources, QKV de-interleaved when a block is materialised
        return h3_core.load_dit(checkpoints["native"], residency="layerwise", prefetch=prefetch,
                                resident_blocks=resident)
    model = h3_core.load_dit(checkpoints["native"])  # the slot backend (CUDA's code, inline streams on the CPU)
    model.block_residency = LayerwiseOffloadManager(AsyncBackend("cpu"), prefetch=prefetch,
                                                    resident_blocks=resident).attach(model.blocks)
    return model


# ---- exactness and the residency bound ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "slots"])
@pytest.mark.parametrize("resident", ["none", "some", "all"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_offloaded_equals_resident_bitwise_with_bounded_residency(checkpoints, inputs, reference, kind, prefetch,
                                                                  resident):
    model = offloaded_model(kind, checkpoints, prefetch, resident_request(resident))
    manager = model.block_residency
    pinned = set(range(resident_request(resident) or 0))
    streamed = [i for i in range(N) if i not in pinned]
    # The slot backend loads the next pass's head at the end of each pass (counted in the pass that loads it).
    head = streamed[:prefetch] if kind == "slots" else []
    unit_bytes = manager.store.unit_bytes
    probe = ResidencyProbe(model, kind)
    with torch.no_grad():
        for n in range(3):
            assert same_outputs(model(**inputs), reference)
            stats = manager.stats().last_pass
            loaded = streamed + head if n == 0 else streamed
            assert stats.loads == len(loaded)
            assert stats.bytes_h2d == sum(unit_bytes(i) for i in loaded)
            assert stats.peak_streamed_blocks == min(prefetch + 1, len(streamed))
            assert stats.host_store_bytes == sum(unit_bytes(i) for i in range(N))
    if kind == "sync":  # one block's file bytes per streamed block: the QKV permutation is applied on the device
        plain = random_dit(SMALL)  # (the AdaLN projection is a unit of its own)
        assert [unit_bytes(i) for i in range(N)] == [block_bytes(plain, i) - adaln_bytes(plain, i) for i in range(N)]
        assert [model.adaln_residency.store.unit_bytes(i) for i in range(N)] == [adaln_bytes(plain, i)
                                                                                  for i in range(N)]
    assert manager.stats().passes == 3
    assert len(probe.observations) == 3 * N
    for running, bound, loaded, text_live in probe.observations:
        assert bound == pinned | {running}  # only the running streamed block is bound to its parameters
        assert running in loaded or running in pinned
        assert len(loaded) <= prefetch + 1
        if kind == "sync":
            assert not text_live  # phase-scoped: the text weights were released after the refiner ran
    assert max(len(loaded) for _, _, loaded, _ in probe.observations) == min(prefetch + 1, len(streamed))
    # After a pass the resident blocks stay bound; only the slot backend keeps the next pass's head loaded.
    assert {j for j, b in enumerate(model.blocks) if body_materialised(b)} == pinned
    assert set(manager.resident_set()) == pinned | set(head)
    if kind == "sync":
        assert probe.census.live() == set()


def test_prefetch_loads_ahead_of_the_running_block(checkpoints, inputs):
    model = h3_core.load_dit(checkpoints["native"], residency="layerwise", prefetch=1, resident_blocks=[4])
    census = MaterialisationCensus(model.block_residency._store)
    seen = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(
            lambda m, a, i=i: seen.append((census.live() | {4}, set(model.block_residency.resident_set()))))
    with torch.no_grad():
        model(**inputs)
    assert [sorted(live) for live, _ in seen] == [[0, 1, 4], [1, 2, 4], [2, 3, 4], [3, 4, 5], [4, 5], [4, 5]]
    assert [live for live, _ in seen] == [ledger for _, ledger in seen]


@pytest.mark.parametrize("layout", ["diffusers", "comfy"])
def test_other_layouts_stream_exactly(checkpoints, inputs, reference, layout):
    resident = h3_core.load_dit(checkpoints[layout])
    model = h3_core.load_dit(checkpoints[layout], residency="layerwise", prefetch=1, resident_blocks=1)
    with torch.no_grad():
        expected = resident(**inputs)
        for _ in range(3):
            assert same_outputs(model(**inputs), expected)
    assert same_outputs(expected, reference)


def test_attach_binds_one_shared_placeholder_per_dtype(checkpoints):
    model = h3_core.load_dit(checkpoints["native"], residency="layerwise", resident_blocks=2)
    assert model.block_residency.residency is Residency.LAYERWISE_OFFLOAD
    assert model.block_residency.resident_set() == frozenset({0, 1})
    plain = random_dit(SMALL)
    for i in (0, 1):
        body = [n for n, _ in plain.blocks[i].named_parameters() if not n.startswith("adaln_proj.")]
        assert [model.blocks[i].get_parameter(n).shape for n in body] == [plain.blocks[i].get_parameter(n).shape
                                                                          for n in body]
        assert body_materialised(model.blocks[i]) and not is_materialised(model.blocks[i].adaln_proj)
    # All float32: one one-element placeholder for the streamed blocks, one for every AdaLN projection (streamed
    # apart, also those of the resident blocks), one for the phase-scoped text weights.
    assert len({p.data_ptr() for i in range(2, N) for n, p in model.blocks[i].named_parameters()
                if not n.startswith("adaln_proj.")}) == 1
    assert len({p.data_ptr() for b in model.blocks for p in b.adaln_proj.parameters()}) == 1
    assert len({p.data_ptr() for p in [*model.token_refiner.parameters(), *model.condition_proj.parameters()]}) == 1
    for i in range(2, N):
        assert all(p.numel() == 1 and p.dtype == torch.float32 for p in model.blocks[i].parameters())
    assert not is_materialised(model.condition_proj)
    assert is_materialised(model.final_layer) and is_materialised(model.video_patch_proj)
    # The host store reads the files themselves: its bytes are the streamed blocks' file bytes, nothing copied at load
    # (the staging ring comes with the first pass; reading the resident blocks needed only a one-tensor scratch).
    stats = model.block_residency.stats()
    assert stats.store == "staged_reads" and stats.pinned_bytes == 0
    assert stats.extra["staging_bytes"] < model.block_residency.store.unit_bytes(0)
    assert stats.host_store_bytes == sum(block_bytes(plain, i) - adaln_bytes(plain, i) for i in range(N))
    assert model.adaln_residency.stats().host_store_bytes == sum(adaln_bytes(plain, i) for i in range(N))


def test_text_phase_is_materialised_only_while_the_refiner_runs(checkpoints, inputs):
    model = h3_core.load_dit(checkpoints["native"], residency="layerwise")
    seen = []
    model.token_refiner.register_forward_pre_hook(lambda m, a: seen.append(is_materialised(model.token_refiner)))
    with torch.no_grad():
        model(**inputs)
    assert seen == [True]
    assert model.weight_phases.materialised() == ()
    assert not is_materialised(model.token_refiner)


# ---- exception safety, close() -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "slots"])
def test_exception_inside_a_block_leaves_the_manager_usable(checkpoints, inputs, reference, kind):
    model = offloaded_model(kind, checkpoints, prefetch=1, resident=1)
    manager = model.block_residency
    failures = []

    def fail_once(module, args):
        if not failures:
            failures.append(1)
            raise RuntimeError("boom in block 3")

    handle = model.blocks[3].register_forward_pre_hook(fail_once)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="boom in block 3"):
            model(**inputs)
        assert manager.stats().last_pass.aborted
        assert manager.materialised_streamed() == []
        assert SlotState.IN_USE not in manager._slots.states
        assert {j for j, b in enumerate(model.blocks) if body_materialised(b)} == {0}
        for _ in range(2):
            assert same_outputs(model(**inputs), reference)
        assert not manager.stats().last_pass.aborted
    handle.remove()


@pytest.mark.parametrize("backend", [SynchronousBackend, AsyncBackend])
def test_close_restores_the_same_parameter_objects_and_values(inputs, backend):
    model = random_dit(SMALL, seed=4)
    with torch.no_grad():
        expected = model(**inputs)
    before = {n: (p, p.data_ptr(), p.detach().clone(), p.stride()) for n, p in model.blocks.named_parameters()}
    manager = LayerwiseOffloadManager(backend("cpu"), prefetch=1, resident_blocks=[1, 3]).attach(model.blocks)
    model.block_residency = manager
    with torch.no_grad():
        assert same_outputs(model(**inputs), expected)
    manager.close()
    model.block_residency = AllResident(N)
    after = dict(model.blocks.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, ptr, value, stride) in before.items():
        assert after[name] is param
        assert torch.equal(param, value) and param.dtype == value.dtype and param.stride() == stride
        if backend is SynchronousBackend:
            assert param.data_ptr() == ptr  # held tensors: the very storage the module had
    with torch.no_grad():
        assert same_outputs(model(**inputs), expected)
    with pytest.raises(ResidencyError, match="not attached"):
        manager.acquire(0)
    manager.close()  # idempotent


def test_close_gives_a_loaded_model_its_host_tensors(checkpoints, inputs, reference):
    model = h3_core.load_dit(checkpoints["native"], residency="layerwise", prefetch=1)
    with torch.no_grad():
        model(**inputs)
    model.block_residency.close()
    model.block_residency = AllResident(N)
    model.adaln_residency.close()
    model.adaln_residency = AllResident(N)
    model.weight_phases.close()
    assert all(is_materialised(b) for b in model.blocks) and is_materialised(model.token_refiner)
    with torch.no_grad():
        assert same_outputs(model(**inputs), reference)


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def test_h3dit_close_leaves_a_layerwise_transformer_usable_and_resident(checkpoints, inputs, reference):
    model = h3_core.load_dit(checkpoints["native"], residency="layerwise")
    forward(model, inputs)
    model.close()
    assert isinstance(model.block_residency, AllResident) and isinstance(model.adaln_residency, AllResident)
    assert all(p.numel() > 1 for p in model.parameters())  # no placeholder is left bound
    assert same_outputs(forward(model, inputs), reference)
    model.close()  # idempotent
    assert same_outputs(forward(model, inputs), reference)


def test_h3dit_close_keeps_the_loras_of_the_streamed_weights(checkpoints, inputs, reference, tmp_path):
    g = torch.Generator().manual_seed(3)
    inner, hidden, ffn = SMALL.inner_dim, SMALL.hidden_size, SMALL.ffn_dim
    lora = {"blocks.1.attn.qkv_proj.lora_A.weight": torch.randn(2, hidden, generator=g),
            "blocks.1.attn.qkv_proj.lora_B.weight": torch.randn(3 * inner, 2, generator=g) * 0.3,
            "blocks.2.mlp.fc1.lora_A.weight": torch.randn(2, hidden, generator=g),
            "blocks.2.mlp.fc1.lora_B.weight": torch.randn(2 * ffn, 2, generator=g) * 0.3}
    path = tmp_path / "lora.safetensors"
    save_file(lora, str(path))
    with_lora = forward(h3_core.load_dit(checkpoints["native"], loras=[(path, 0.7)]), inputs)
    assert not torch.equal(with_lora[0], reference[0])
    model = h3_core.load_dit(checkpoints["native"], residency="layerwise", loras=[(path, 0.7)])
    model.close()
    assert same_outputs(forward(model, inputs), with_lora)


# ---- protocol -----------------------------------------------------------------------------------------------------


def run_blocks(model, order, x, ctx):
    outs = {}
    for i in order:
        model.block_residency.acquire(i)
        outs[i] = model.blocks[i](x, *ctx)
        model.block_residency.release(i)
    return outs


@pytest.fixture()
def block_inputs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 9, SMALL.hidden_size, generator=g)
    time_act = torch.randn(2, SMALL.time_embed_dim, generator=g)
    adaln_index = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    rope = (torch.randn(9, 3 * SMALL.rope_freq_dim, generator=g), torch.randn(9, 3 * SMALL.rope_freq_dim, generator=g))
    return x, (time_act, adaln_index, rope)


@pytest.mark.parametrize("backend", [SynchronousBackend, AsyncBackend])
def test_any_traversal_order_works_through_the_synchronous_fallback(block_inputs, backend):
    x, ctx = block_inputs
    plain = random_dit(SMALL, seed=7)
    model = random_dit(SMALL, seed=7)
    model.block_residency = LayerwiseOffloadManager(backend("cpu"), prefetch=1).attach(model.blocks)
    with torch.no_grad():
        expected = {i: plain.blocks[i](x, *ctx) for i in range(N)}
        for order in ([5, 4, 3, 2, 1, 0], [0, 2, 4], [3, 3, 1]):
            with model.block_residency.pass_scope():
                outs = run_blocks(model, order, x, ctx)
            assert all(torch.equal(outs[i], expected[i]) for i in order)
            assert model.block_residency.stats().last_pass.peak_streamed_blocks <= 2


def test_prefetch_is_idempotent_and_release_of_an_unacquired_block_is_a_no_op():
    model = random_dit(SMALL)
    manager = LayerwiseOffloadManager(SynchronousBackend("cpu"), prefetch=1).attach(model.blocks)
    manager.begin_pass()
    manager.prefetch(2)
    manager.prefetch(2)
    assert manager.stats().current.loads == 1 and manager.materialised_streamed() == [2]
    manager.release(2)  # prefetched, not acquired
    manager.release(4)  # not loaded at all
    assert manager.materialised_streamed() == [2]
    manager.prefetch(4)
    manager.prefetch(5)  # both slots taken: a hint never evicts
    assert manager.materialised_streamed() == [2, 4]
    manager.acquire(2)
    assert manager.stats().current.unprefetched_loads == 0
    manager.end_pass()
    assert manager.materialised_streamed() == []


def test_protocol_misuse_raises_one_clear_error():
    model = random_dit(SMALL)
    manager = LayerwiseOffloadManager(SynchronousBackend("cpu"), prefetch=0).attach(model.blocks)
    manager.acquire(1)
    with pytest.raises(SlotStateError, match="in_use"):
        manager.acquire(1)
    with pytest.raises(ResidencyError, match="all 1 device slots hold acquired blocks"):
        manager.acquire(2)
    with pytest.raises(ResidencyError, match="out of range"):
        manager.acquire(N)
    manager.release(1)
    manager.acquire(2)
    manager.release(2)
    with pytest.raises(ResidencyError, match="already attached"):
        manager.attach(model.blocks)


def test_slot_table_raises_on_every_illegal_transition():
    table = SlotTable(2)
    table.start_loading(0, 7)
    table.mark_ready(0)
    table.take(0)
    table.give_back(0)
    table.mark_free(0)
    assert table.states[0] is SlotState.EMPTY and table.units[0] is None
    table.start_loading(1, 3)
    table.mark_ready(1)
    table.discard(1)  # a prefetched block dropped unused
    illegal = [
        ("take", SlotState.EMPTY), ("give_back", SlotState.EMPTY), ("mark_ready", SlotState.EMPTY),
        ("give_back", SlotState.READY), ("start_loading", SlotState.READY), ("mark_free", SlotState.IN_USE),
        ("discard", SlotState.IN_USE), ("take", SlotState.IN_USE), ("take", SlotState.FREEING),
        ("start_loading", SlotState.LOADING), ("take", SlotState.LOADING),
    ]
    path = {SlotState.EMPTY: [], SlotState.LOADING: ["start_loading"], SlotState.READY: ["start_loading", "mark_ready"],
            SlotState.IN_USE: ["start_loading", "mark_ready", "take"],
            SlotState.FREEING: ["start_loading", "mark_ready", "take", "give_back"]}
    for method, state in illegal:
        table = SlotTable(1)
        for step in path[state]:
            getattr(table, step)(*((0, 5) if step == "start_loading" else (0,)))
        assert table.states[0] is state
        with pytest.raises(SlotStateError, match=f"cannot go from {state.value}"):
            getattr(table, method)(*((0, 5) if method == "start_loading" else (0,)))
        assert table.states[0] is state  # a refused transition changes nothing


@pytest.mark.parametrize("options, message", [
    (dict(residency="auto"), "residency 'auto' is not one of"),
    (dict(residency="layerwise", prefetch=-1), "prefetch=-1 must be an integer >= 0"),
    (dict(residency="layerwise", prefetch=1.5), "prefetch=1.5"),
    (dict(residency="layerwise", resident_blocks=N + 1), f"resident_blocks={N + 1} must be between 0 and"),
    (dict(residency="layerwise", resident_blocks=[0, 9]), "resident_blocks lists 9"),
])
def test_bad_residency_options_raise_one_error_naming_the_value(checkpoints, options, message):
    with pytest.raises(ResidencyError, match=message) as info:
        h3_core.load_dit(checkpoints["native"], **options)
    assert isinstance(info.value, h3_core.H3Error)


# ---- the synchronous backend's memory-reclaim policy ----------------------------------------------------------------


class RecordingPlatform(Platform):
    """The CPU platform, recording the reclaim calls the backend makes through it."""

    def __init__(self):
        super().__init__("cpu")
        object.__setattr__(self, "calls", [])

    def synchronize(self):
        self.calls.append("synchronize")

    def empty_cache(self):
        self.calls.append("empty_cache")


def test_reclaim_synchronizes_then_empties_the_cache_every_n_releases():
    assert SynchronousBackend("mps").reclaim_every == 1  # the MPS default (constructing it touches no device)
    assert SynchronousBackend("cpu").reclaim_every == 0
    model = random_dit(SMALL)
    backend = SynchronousBackend("cpu", reclaim_every=2)
    backend.platform = RecordingPlatform()
    manager = LayerwiseOffloadManager(backend, prefetch=0).attach(model.blocks)
    for i in range(5):
        manager.acquire(i)
        manager.release(i)
    assert backend.platform.calls == ["synchronize", "empty_cache"] * 2
    assert manager.stats().extra["reclaims"] == 2
    with pytest.raises(ResidencyError, match="reclaim_every"):
        SynchronousBackend("cpu", reclaim_every=-1)


# ---- hooks for modules we do not own -----------------------------------------------------------------------------


# ---- host stores ---------------------------------------------------------------------------------------------------


def test_slab_layout_is_aligned_and_keeps_strides():
    base = torch.arange(35, dtype=torch.float32).reshape(5, 7)
    tensors = {"odd": torch.arange(3, dtype=torch.bfloat16), "transposed": base.t(), "half": torch.ones(3, 3).half(),
               "empty": torch.empty(0, 4)}
    entries, total = plan_slab([(n, t.dtype, tuple(t.shape), tuple(t.stride())) for n, t in tensors.items()])
    assert all(e.offset % 256 == 0 for e in entries)
    spans = sorted((e.offset, e.offset + e.storage_nbytes) for e in entries)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert total == max(end for _, end in spans)
    store = PinnedSlab([{n: HostTensor.held(t) for n, t in tensors.items()}])
    assert store.slab(0).data.data_ptr() % PAGE_SIZE == 0 and store.unit_bytes(0) == total
    views = store.views(0)
    for name, t in tensors.items():
        assert torch.equal(views[name], t) and views[name].stride() == t.stride() and views[name].dtype == t.dtype
    # A device slot is any buffer laid out like the slab (larger is fine): the slot backend's views.
    slot = torch.zeros(total + 512, dtype=torch.uint8)
    slot[:total].copy_(store.slab(0).data)
    assert all(torch.equal(store.views(0, slot)[n], t) for n, t in tensors.items())


class RecordingPinner:
    """Stands in for cudaHostRegister; `fail` lists the calls (0-based) that the driver refuses."""

    def __init__(self, fail=()):
        self.fail = set(fail)
        self.calls = 0
        self.registered = []
        self.unregistered = []

    def register(self, buffer):
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail:
            return False
        assert buffer.data_ptr() % PAGE_SIZE == 0  # registered in place, page-aligned, exact size
        self.registered.append((buffer.data_ptr(), buffer.numel()))
        return True

    def unregister(self, buffer):
        self.unregistered.append((buffer.data_ptr(), buffer.numel()))


def test_pin_budget_pins_whole_slabs_in_place_and_falls_back_to_pageable():
    units = [{"w": HostTensor.held(torch.randn(64, 64))} for _ in range(4)]  # 16 KiB each
    unit_bytes = 64 * 64 * 4
    pinner = RecordingPinner()
    budget = PinBudget(int(2.5 * unit_bytes))
    store = PinnedSlab(list(units), budget=budget, pinner=pinner, pin_units=[0, 1, 2, 3])
    assert [s.pinned for s in store.slabs] == [True, True, False, False]
    assert [n for _, n in pinner.registered] == [unit_bytes, unit_bytes]  # exact sizes, no power-of-two rounding
    assert store.pinned_bytes == 2 * unit_bytes == budget.used_bytes
    store.close()
    assert sorted(pinner.unregistered) == sorted(pinner.registered) and budget.used_bytes == 0
    # A refused registration leaves that slab pageable and its budget free for the next one.
    failing = RecordingPinner(fail={0})
    store = PinnedSlab(list(units), budget=PinBudget(10 * unit_bytes), pinner=failing, pin_units=[0, 1, 2])
    assert [s.pinned for s in store.slabs] == [False, True, True, False]
    assert store.budget.used_bytes == 2 * unit_bytes


def test_pinned_slab_consumes_recipes_as_it_packs():
    source = torch.randn(32, 32)
    recipes = [{"w": HostTensor.held(source)}, {"w": HostTensor.held(source * 2)}]
    store = PinnedSlab(recipes)
    assert recipes == [None, None]
    assert torch.equal(store.original(0, "w"), source) and store.original(0, "w").data_ptr() != source.data_ptr()
    assert page_aligned_bytes(10).data_ptr() % PAGE_SIZE == 0
