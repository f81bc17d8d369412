"""Page locking of host stores through the CUDA runtime (a fake `torch.cuda.cudart()`, on any machine): a refused
cudaHostRegister falls back to pageable memory, resetting the runtime's last error or warning once where it cannot;
a failed or raising cudaHostUnregister is reported, never swallowed, and its bytes stay counted as locked."""

from __future__ import annotations

import gc

import pytest
import torch

from h3_core.runtime import host_store
from h3_core.runtime.host_store import CudaHostPinner, HostTensor, PinBudget, PinnedSlab, PinWarning

CUDA_ERRORS = {1: "invalid argument", 2: "out of memory"}


class FakeCudart:
    """The two calls of `torch.cuda.cudart()` the pinner makes, answering with fixed statuses (0 = success)."""

    def __init__(self, register_status=0, unregister_status=0):
        self.register_status, self.unregister_status = register_status, unregister_status
        self.registered = []

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.registered.append(nbytes)
        return self.register_status

    def cudaHostUnregister(self, pointer):
        return self.unregister_status

    def cudaGetErrorString(self, status):
        return CUDA_ERRORS[status]


def slab_recipes(units=3):
    return [{"w": HostTensor.held(torch.full((1024,), float(i)))} for i in range(units)]


@pytest.fixture
def fake_cudart(monkeypatch):
    def install(**statuses):
        fake = FakeCudart(**statuses)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        return fake

    return install


def test_a_refused_page_lock_whose_error_cannot_be_reset_warns_once_and_stops_pinning(fake_cudart, monkeypatch):
    cudart = fake_cudart(register_status=2)
    monkeypatch.setattr(host_store, "_loaded_cudart_libraries", lambda: [])  # e.g. a platform without /proc
    budget = PinBudget(1 << 30)
    with pytest.warns(PinWarning) as caught:
        store = PinnedSlab(slab_recipes(), budget=budget, pinner=CudaHostPinner())
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        "cudaHostRegister refused to page-lock a 4,096-byte host buffer (status 2: out of memory) and the CUDA "
        "runtime's last error could not be reset here")
    assert len(cudart.registered) == 1 and store.pinned_bytes == 0 and budget.used_bytes == 0


def test_a_refused_page_lock_resets_the_last_error_in_the_loaded_runtime(fake_cudart, monkeypatch, recwarn):
    fake_cudart(register_status=2)
    resets = []

    class Library:
        def __init__(self, path):
            self.path = path

        def cudaGetLastError(self):
            resets.append(self.path)

    monkeypatch.setattr(host_store, "_loaded_cudart_libraries", lambda: ["/loaded/libcudart.so.12"])
    monkeypatch.setattr("ctypes.CDLL", Library)
    store = PinnedSlab(slab_recipes(), budget=PinBudget(1 << 30), pinner=CudaHostPinner())
    assert resets == ["/loaded/libcudart.so.12"] * 3 and store.pinned_bytes == 0  # each refusal reset, none pinned
    assert not [w for w in recwarn if issubclass(w.category, PinWarning)]


def test_a_failed_unpin_is_reported_and_stays_counted_as_locked(fake_cudart, monkeypatch):
    fake_cudart(unregister_status=1)
    monkeypatch.setattr(host_store, "_loaded_cudart_libraries", lambda: [])
    budget = PinBudget(1 << 30)
    store = PinnedSlab(slab_recipes(2), budget=budget, pinner=CudaHostPinner())
    assert store.pinned_bytes == budget.used_bytes == 2 * 4096
    with pytest.warns(PinWarning, match=r"cudaHostUnregister failed for a 4,096-byte host buffer \(status 1: "
                                        r"invalid argument\); its pages stay page-locked until the process exits"):
        store.close()
    assert budget.used_bytes == 2 * 4096 and store.pinned_bytes == 0


def test_a_dropped_store_whose_unpin_raises_warns_instead_of_swallowing_it():
    class BrokenPinner:
        def register(self, buffer):
            return True

        def unregister(self, buffer):
            raise RuntimeError("CUDA driver shutting down")

    store = PinnedSlab(slab_recipes(1), budget=PinBudget(1 << 30), pinner=BrokenPinner())
    with pytest.warns(PinWarning, match="could not unpin its slabs: RuntimeError\\('CUDA driver shutting down'\\)"):
        del store
        gc.collect()


class HostLedger:
    """A host application's pinned-memory ledger (ComfyUI's `MAX_PINNED_MEMORY` / `TOTAL_PINNED_MEMORY`)."""

    def __init__(self, limit, pinned):
        self.limit, self.pinned = limit, pinned

    def limit_bytes(self):
        return self.limit

    def pinned_bytes(self):
        return self.pinned

    def add(self, nbytes):
        self.pinned += nbytes


def test_a_budget_shared_with_a_host_ledger_pins_within_its_room_and_reports_every_pin(fake_cudart):
    """The host's own pins (1 MiB) and ours stay within its limit, however large our own budget; the host sees every
    pin of ours, and a closed store gives them all back."""
    fake_cudart()
    ledger = HostLedger(limit=(1 << 20) + int(2.5 * 4096), pinned=1 << 20)
    budget = PinBudget(1 << 30)
    budget.share_with(ledger)
    assert budget.limit_bytes == int(2.5 * 4096)  # the host's room, not our own limit
    store = PinnedSlab(slab_recipes(3), budget=budget, pinner=CudaHostPinner())
    assert store.pinned_bytes == budget.used_bytes == 2 * 4096  # the third unit stays pageable
    assert ledger.pinned == (1 << 20) + 2 * 4096
    store.close()
    assert budget.used_bytes == 0 and ledger.pinned == 1 << 20
    budget.share_with(None)  # on its own again: its own limit
    assert budget.limit_bytes == 1 << 30


def test_sharing_moves_what_is_reserved_onto_the_ledger():
    budget = PinBudget(1 << 20)
    assert budget.try_reserve(4096)
    ledger = HostLedger(limit=1 << 30, pinned=0)
    budget.share_with(ledger)
    assert ledger.pinned == 4096
    budget.share_with(None)
    assert ledger.pinned == 0 and budget.used_bytes == 4096
    ledger.limit = 0  # a host that pins nothing (ComfyUI's --disable-pinned-memory): no pin of ours either
    budget.give_back(4096)
    budget.share_with(ledger)
    assert budget.limit_bytes == 0 and not budget.try_reserve(1)
