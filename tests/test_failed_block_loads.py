"""A block load that fails — out of memory in the copy, a read error in the staging reader, Ctrl-C while a read is
awaited — fails that pass only: the slot it was loading into is freed, and the next pass of the same component
loads every block again and gives the same numbers. On both offload backends (the asynchronous one runs on the CPU
with the same classes as on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from h3_core.runtime.layerwise import LayerwiseOffloadManager
from h3_core.runtime.offload_backends import AsyncBackend, SynchronousBackend
from test_staged_reads import stack_recipes, write_stack

BLOCKS = 4


class Refused(RuntimeError):
    """The failure a test injects (its text is what MPS says when it runs out of memory)."""


def one_pass(manager, stack, x):
    with manager.pass_scope():  # as the models run their blocks: the pass ends however it exits
        for i, block in enumerate(stack):
            manager.acquire(i)
            try:
                x = block(x)
            finally:
                manager.release(i)
    return x


def fail_once(monkeypatch, target, name, error, at_call=2):
    """Make `target.name` raise `error` on its `at_call`-th call (1-based), and behave as before otherwise."""
    original, calls = getattr(target, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)
    return calls


def out_of_memory_in_the_copy(manager, monkeypatch):
    return fail_once(monkeypatch, manager.backend, "load", Refused("MPS backend out of memory (MPS allocated: 7.9 GB)"))


def read_error(manager, monkeypatch):
    return fail_once(monkeypatch, manager.store._reader, "read_into", OSError(5, "Input/output error"))


def ctrl_c_while_waiting_on_a_read(manager, monkeypatch):
    # Raised by the read, it reaches the consumer from the future it waits on, as Ctrl-C during that wait does.
    return fail_once(monkeypatch, manager.store._reader, "read_into", KeyboardInterrupt())


def copy_refused_after_the_staging_buffer_was_taken(manager, monkeypatch):
    # The asynchronous backend's copy is issued on its copy stream once the unit's staging buffer is taken; the
    # buffer must go back to the ring, or every later pass waits for a buffer nobody returns.
    # (Platforms are frozen records: the method is replaced on the class, for this test only.)
    return fail_once(monkeypatch, type(manager.backend.platform), "on_stream", Refused("CUDA error: out of memory"))


def staging_buffers_lent_out(store) -> int:
    """Buffers of the staging ring that are neither free nor being read into: held by a consumer."""
    return len(store._ring) - len(store._free) - len(store._staged)


BACKENDS = {"synchronous": lambda: SynchronousBackend("cpu"), "asynchronous": lambda: AsyncBackend("cpu")}


CASES = [(backend, failure) for backend in BACKENDS
         for failure in (out_of_memory_in_the_copy, read_error, ctrl_c_while_waiting_on_a_read)]
CASES.append(("asynchronous", copy_refused_after_the_staging_buffer_was_taken))


@pytest.mark.parametrize("backend,failure", CASES, ids=[f"{b}-{f.__name__}" for b, f in CASES])
def test_a_failed_block_load_fails_one_pass_and_the_next_pass_works(tmp_path, monkeypatch, backend, failure):
    path = tmp_path / "stack.safetensors"
    write_stack(path, BLOCKS, rows=48, cols=48)
    stack = nn.ModuleList(nn.Linear(48, 48) for _ in range(BLOCKS))
    manager = LayerwiseOffloadManager(BACKENDS[backend]()).attach(stack, stack_recipes(path, BLOCKS))
    x = torch.randn(3, 48)
    with torch.no_grad():
        expected = one_pass(manager, stack, x)
        calls = failure(manager, monkeypatch)
        with pytest.raises((Refused, OSError, KeyboardInterrupt)):
            one_pass(manager, stack, x)
        assert calls, "the injected failure was never reached"
        assert manager.materialised_streamed() == []  # the failed slot was freed with the others
        assert staging_buffers_lent_out(manager.store) == 0  # none kept by the failed load
        for _ in range(2):
            assert torch.equal(one_pass(manager, stack, x), expected)
    manager.close()
