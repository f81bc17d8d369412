"""The staged host store: explicit reads ahead of use, the page-cache policy, and the CUDA store (pinned ring + the
process-wide pin budget) exercised on the CPU with the same classes. Its files changed under it (errors, never a
SIGBUS) are in test_checkpoints_changed.py."""

from __future__ import annotations

import ctypes
import mmap
import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from child_cases import forked_result, run_cases
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_core.runtime import host_store
from h3_core.runtime.host_store import HostTensor, PinBudget, PAGE_SIZE
from h3_core.runtime.layerwise import LayerwiseOffloadManager
from h3_core.runtime.offload_backends import AsyncBackend, SynchronousBackend
from h3_core.runtime.staged_store import StagedReads

ROOT = Path(__file__).resolve().parents[1]


def write_stack(path: Path, blocks: int, rows: int = 64, cols: int = 48, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(blocks):
        state[f"{i}.weight"] = (torch.randn(rows, cols, generator=g) * 0.1).to(dtype)
        state[f"{i}.bias"] = torch.randn(rows, generator=g).to(dtype)
    save_file(state, str(path))
    return state


def stack_recipes(path: Path, blocks: int, dtype=torch.float32, combine=None):
    file = SafetensorsFile(path)
    units = []
    for i in range(blocks):
        w, b = file.tensor(f"{i}.weight"), file.tensor(f"{i}.bias")
        weight_shape = tuple(w.shape) if combine is None else tuple(combine(w).shape)
        units.append({"weight": HostTensor((w,), dtype, weight_shape, combine), "bias": HostTensor((b,), dtype,
                                                                                                    tuple(b.shape))})
    return units


def flip_rows(w):  # a row permutation, like the QKV de-interleave
    return w.flip(0)


# ---- exactness ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("combine", [None, flip_rows])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_staged_units_are_bitwise_what_the_recipes_make(tmp_path, combine, dtype):
    write_stack(tmp_path / "s.safetensors", 4)
    recipes = stack_recipes(tmp_path / "s.safetensors", 4, dtype, combine)
    store = StagedReads(recipes, range(4), read_ahead=1, hand_over=True)
    store.reserve_consumer_buffers(1)
    for unit in (0, 1, 2, 3, 0):
        staged = store.take(unit)
        got = store.views(unit, staged.buffer)
        for name, recipe in recipes[unit].items():
            expected = recipe.materialise(torch.device("cpu"))
            assert got[name].dtype == expected.dtype and torch.equal(got[name], expected)
            assert got[name].data_ptr() % 256 == 0
        store.give_back(staged)
    fresh = store.materialise(2, torch.device("cpu"))
    assert torch.equal(fresh["weight"], recipes[2]["weight"].materialise(torch.device("cpu")))
    store.close()


# ---- read-ahead -----------------------------------------------------------------------------------------------------


def run_passes(manager, blocks, x, passes):
    for _ in range(passes):
        manager.begin_pass()
        y = x
        for i, block in enumerate(blocks):
            manager.acquire(i)
            y = block(y)
            manager.release(i)
        manager.end_pass()
    return y


def linear_stack(blocks):
    return nn.ModuleList(nn.Linear(48, 64) if i % 2 == 0 else nn.Linear(64, 48) for i in range(blocks))


def alternating_stack(path: Path, blocks: int):
    g = torch.Generator().manual_seed(1)
    state = {}
    for i in range(blocks):
        shape = (64, 48) if i % 2 == 0 else (48, 64)
        state[f"{i}.weight"] = (torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16)
        state[f"{i}.bias"] = torch.randn(shape[0], generator=g).to(torch.bfloat16)
    save_file(state, str(path))
    file = SafetensorsFile(path)
    return [{"weight": HostTensor.held(file.tensor(f"{i}.weight")), "bias": HostTensor.held(file.tensor(f"{i}.bias"))}
            for i in range(blocks)], state


@pytest.mark.parametrize("read_ahead", [0, 1, 2])
def test_reads_run_ahead_of_the_pass_and_wrap_into_the_next(tmp_path, read_ahead):
    recipes, state = alternating_stack(tmp_path / "s.safetensors", 6)
    blocks = linear_stack(6).to(torch.bfloat16)
    manager = LayerwiseOffloadManager(SynchronousBackend("cpu", read_ahead=read_ahead)).attach(blocks, recipes)
    store = manager.store
    assert isinstance(store, StagedReads)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    expected = x
    for i in range(6):
        expected = nn.functional.linear(expected, state[f"{i}.weight"], state[f"{i}.bias"])
    for n in range(3):
        assert torch.equal(run_passes(manager, blocks, x, 1), expected)
        # Without read-ahead every unit is read when it is asked for; with it none is: a pass's head is read from
        # begin_pass on (or already during the previous pass's tail), the rest while the unit before runs.
        assert store.counters.misses == (6 * (n + 1) if read_ahead == 0 else 0)
        assert manager.stats().last_pass.read_wait_s >= 0
    for _, read in list(store._staged.values()):
        read.result()  # the next pass's head, read ahead
    unit_bytes = [state[f"{i}.weight"].nbytes + state[f"{i}.bias"].nbytes for i in range(6)]
    assert store.counters.bytes_read == 3 * sum(unit_bytes) + sum(unit_bytes[:read_ahead])
    # The ring: the slot's buffer plus read_ahead more, whatever the stack's length; without read-ahead nothing is
    # read for the next pass and the ring is freed between passes.
    assert len(store._ring) == (1 + read_ahead if read_ahead else 0)
    manager.close()
    assert all(torch.equal(p, state[n]) for n, p in blocks.named_parameters())


# ---- the page cache ---------------------------------------------------------------------------------------------------


def resident_pages(path: Path, offset: int, nbytes: int) -> int:
    """Pages of `path`'s byte range that are in the page cache (mincore over a fresh read-only map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    start = offset // PAGE_SIZE * PAGE_SIZE
    length = offset + nbytes - start
    pages = -(-length // PAGE_SIZE)
    with open(path, "rb") as f:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), start)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(length))
    return sum(v & 1 for v in vec)


def on_tmpfs(path: Path) -> bool:
    best = ("", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, kind = line.split()[:3]
        if str(path).startswith(point) and len(point) > len(best[0]):
            best = (point, kind)
    return best[1] in ("tmpfs", "ramfs")


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not Path("/proc/mounts").exists(), reason="Linux page cache")
def test_units_past_the_cache_budget_leave_the_page_cache_after_they_are_read(tmp_path):
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs pages cannot be dropped")
    path = tmp_path / "s.safetensors"
    write_stack(path, 6, rows=1024, cols=1024)  # 2 MiB per weight
    with open(path, "rb") as f:  # start cold: written pages are clean once synced, and can then be dropped
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    recipes = stack_recipes(path, 6)
    unit_file_bytes = 1024 * 1024 * 2 + 1024 * 2
    store = StagedReads(recipes, range(6), read_ahead=1, hand_over=True, cache_budget_bytes=2 * unit_file_bytes)
    store.reserve_consumer_buffers(1)
    assert store.cached_units == frozenset({0, 1})
    for unit in range(6):
        store.give_back(store.take(unit))
    store.close()
    file = SafetensorsFile(path)
    weights = [(file._data_start + file._entries[f"{i}.weight"][2], file.nbytes(f"{i}.weight")) for i in range(6)]
    cached = [resident_pages(path, off, n) for off, n in weights]
    full = weights[0][1] // PAGE_SIZE
    assert all(c >= full for c in cached[:2]), cached  # read and kept
    # Read and dropped; the kernel keeps the odd page (partial pages at the ends, pages still in a CPU's LRU batch).
    assert all(c <= full // 10 for c in cached[2:]), cached
    # Without a budget problem nothing is dropped.
    assert StagedReads(stack_recipes(path, 6), range(6), cache_budget_bytes=-1).cached_units == frozenset(range(6))


# ---- the CUDA store on the CPU ----------------------------------------------------------------------------------------


class RecordingPinner:
    def __init__(self):
        self.registered = {}

    def register(self, buffer):
        assert buffer.data_ptr() % PAGE_SIZE == 0
        self.registered[buffer.data_ptr()] = buffer.numel()
        return True

    def unregister(self, buffer):
        self.registered.pop(buffer.data_ptr())


def test_the_pin_budget_is_one_for_the_whole_process(tmp_path, monkeypatch):
    monkeypatch.setattr(host_store, "_SHARED_BUDGET", None)
    path = tmp_path / "s.safetensors"
    write_stack(path, 6, rows=256, cols=256)
    unit = StagedReads(stack_recipes(path, 6), range(6)).buffer_bytes(0)
    shared = PinBudget.shared()
    assert PinBudget.shared() is shared
    shared.limit_bytes = 5 * unit  # one component's ring (2 buffers) and 3 packed units
    pinner = RecordingPinner()

    def component():
        stack = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        manager = LayerwiseOffloadManager(AsyncBackend("cpu", pinner=pinner)).attach(stack, stack_recipes(path, 6))
        return manager, stack

    (first, first_stack), (second, second_stack) = component(), component()  # e.g. text encoder, then transformer
    assert first.backend.pin_budget is second.backend.pin_budget is shared
    assert first.store.pinned_bytes == 5 * unit and len(first.store.slabs) == 3
    assert second.store.pinned_bytes == 0 and not second.store.slabs  # nothing left for it
    assert shared.used_bytes == sum(pinner.registered.values()) == 5 * unit
    x = torch.randn(2, 256)
    file = SafetensorsFile(path)
    expected = x
    for i in range(6):  # packed, staged and pinned or not: the same numbers
        expected = nn.functional.linear(expected, file.tensor(f"{i}.weight").float(), file.tensor(f"{i}.bias").float())
    with torch.no_grad():
        for manager, stack in ((first, first_stack), (second, second_stack)):
            assert torch.equal(run_passes(manager, stack, x, 2), expected)
    first.close()
    assert shared.used_bytes == 0
    second.close()
    assert not pinner.registered


def test_a_single_pass_component_streams_through_its_pinned_ring_without_packing(tmp_path, monkeypatch):
    # The text encoder runs one pass per prompt: packing its leading layers would read them ahead once, at the cost of
    # pinned slabs (up to the whole budget) re-read and re-pinned at every load. The transformer's are read again
    # at every step, so it packs.
    monkeypatch.setattr(host_store, "_SHARED_BUDGET", None)
    path = tmp_path / "s.safetensors"
    write_stack(path, 6, rows=256, cols=256)
    unit = StagedReads(stack_recipes(path, 6), range(6)).buffer_bytes(0)
    x = torch.randn(2, 256)
    results = {}
    for next_pass in (False, None):
        pinner = RecordingPinner()
        stack = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        manager = LayerwiseOffloadManager(AsyncBackend("cpu", pinner=pinner, pin_budget=PinBudget(5 * unit)),
                                          prefetch_next_pass=next_pass).attach(stack, stack_recipes(path, 6))
        store = manager.store
        results[next_pass] = (len(store.slabs), store.pinned_bytes, sum(store._ring_pinned))
        with torch.no_grad():
            out = run_passes(manager, stack, x, 2)
        assert torch.equal(out, results.setdefault("out", out))
        manager.close()
        assert not pinner.registered
    assert results[False] == (0, 2 * unit, 2)  # the ring only
    assert results[None] == (3, 5 * unit, 2)  # the ring, then leading units while the budget lasts


ANON_CHILD = textwrap.dedent(f"""
    import json, sys, torch
    sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
    from pathlib import Path
    from h3_core.checkpoints.safetensors_io import SafetensorsFile
    from h3_core.runtime.host_store import HostTensor, PinBudget
    from h3_core.runtime.layerwise import LayerwiseOffloadManager
    from h3_core.runtime.offload_backends import AsyncBackend
    from test_staged_reads import RecordingPinner, run_passes
    from child_cases import report_forked_cases

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    def measure(case):
        blocks, dim = case["blocks"], 2048
        file = SafetensorsFile(Path(case["path"]))
        recipes = [{{"weight": HostTensor.held(file.tensor(f"{{i}}.weight"))}} for i in range(blocks)]
        # Untouched (never initialised) weights take no resident memory: the store is what is measured.
        stack = torch.nn.ModuleList(torch.nn.utils.skip_init(torch.nn.Linear, dim, dim, bias=False)
                                    for _ in range(blocks))
        unit = dim * dim * 4
        before = anon()
        manager = LayerwiseOffloadManager(AsyncBackend("cpu", pin_budget=PinBudget(4 * unit),
                                                       pinner=RecordingPinner()), prefetch=1).attach(stack, recipes)
        x = torch.randn(4, dim)
        with torch.no_grad():
            run_passes(manager, stack, x, 2)
        return {{"growth": anon() - before, "slots": manager.backend.slot_bytes(),
                "ring": sum(b.numel() for b in manager.store._ring), "unit": unit,
                "packed": len(manager.store.slabs), "pinned": manager.store.pinned_bytes}}

    torch.set_num_threads(1)
    report_forked_cases(measure)
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon")
def test_cuda_store_anonymous_memory_is_ring_plus_budget_whatever_the_model_size(tmp_path):
    dim = 2048
    cases = {}
    for blocks in (12, 24):  # 192 and 384 MiB of float32 weights; the pin budget is 4 units (64 MiB)
        path = tmp_path / f"stack{blocks}.safetensors"
        g = torch.Generator().manual_seed(blocks)
        save_file({f"{i}.weight": torch.randn(dim, dim, generator=g) * 0.03 for i in range(blocks)}, str(path))
        cases[str(blocks)] = {"blocks": blocks, "path": str(path)}
    # Each model size in its own process, forked from one child after its imports, the two side by side: measured
    # one after the other in one process, the first one's frees would change the heap the second is measured in
    # (glibc's adaptive mmap threshold: test_host_memory's forward read +80 MB instead of +46 MB that way).
    outcomes = run_cases(ANON_CHILD, cases, timeout_s=300)
    results = {blocks: forked_result(outcomes[str(blocks)]) for blocks in (12, 24)}
    for blocks, r in results.items():
        # The ring (read_ahead + 1 = 2 buffers) and the packed units (the budget less the ring's pins: 2 units) are
        # the host side; the 2 fixed slots stand for device memory (the CPU is the device here).
        assert r["ring"] == 2 * r["unit"] and r["packed"] == 2 and r["pinned"] == 4 * r["unit"]
        budget = 4 * r["unit"]  # the ring's pins are drawn from it too
        assert r["growth"] <= 1.10 * (r["ring"] + budget + r["slots"]), (blocks, r)
    assert abs(results[24]["growth"] - results[12]["growth"]) <= 0.05 * results[12]["growth"] + 4 * 2 ** 20, results


# ---- telemetry ----------------------------------------------------------------------------------------------------


def test_passes_report_their_reads_and_never_reset_a_process_wide_peak(tmp_path, monkeypatch):
    from h3_core.runtime.platform import Platform

    def no_reset(self):
        raise AssertionError("a pass reset the process-wide peak counter")

    monkeypatch.setattr(Platform, "reset_peak", no_reset)
    recipes, state = alternating_stack(tmp_path / "s.safetensors", 6)
    blocks = linear_stack(6).to(torch.bfloat16)
    manager = LayerwiseOffloadManager(SynchronousBackend("cpu", read_ahead=0)).attach(blocks, recipes)
    run_passes(manager, blocks, torch.randn(3, 48, dtype=torch.bfloat16), 2)
    last = manager.stats().last_pass
    assert last.bytes_read == sum(t.numel() * t.element_size() for t in state.values())  # no read-ahead: exact
    assert last.read_s > 0 and last.read_wait_s > 0 and last.seconds >= last.read_wait_s
    assert last.read_gb_per_s is not None and last.read_gb_per_s > 0
    if Path("/proc/self/io").exists():
        assert last.disk_read_bytes is not None and last.disk_read_bytes >= 0


def test_a_dropped_component_gives_nothing_back_to_host_memory(tmp_path):
    """`close(restore=False)` (what `H3Pipeline.release` calls) leaves the parameters on their placeholders: restoring
    cast or combined weights would copy the whole component into host memory just before it is dropped."""
    path = tmp_path / "s.safetensors"
    write_stack(path, 4, rows=256, cols=256)
    stack = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
    manager = LayerwiseOffloadManager(SynchronousBackend("cpu")).attach(stack, stack_recipes(path, 4))  # bf16 -> fp32
    run_passes(manager, stack, torch.randn(2, 256), 1)
    manager.close(restore=False)
    assert all(p.numel() == 1 for p in stack.parameters())
    stack = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
    manager = LayerwiseOffloadManager(SynchronousBackend("cpu")).attach(stack, stack_recipes(path, 4))
    manager.close()  # the default gives every parameter its (cast) host value back
    assert all(p.dtype == torch.float32 and p.numel() > 1 for p in stack.parameters())
