"""Test double of `comfy.model_management`: a configurable device, recorders for the memory calls, and an
interruption flag the tests raise (directly, or after a number of interruption checks)."""

from __future__ import annotations

import threading

import torch


class InterruptProcessingException(BaseException):
    pass


class _State:
    def __init__(self):
        self.reset()

    def reset(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.interrupt = False
        self.interrupt_at_check: int | None = None  # raise the flag at this (1-based) interruption check
        self.checks = 0
        self.soft_empty_cache_calls = 0
        self.free_memory_calls: list[tuple[float, torch.device]] = []
        self.unload_all_calls = 0
        self.free_bytes = 16 << 30  # what get_free_memory reports


state = _State()
_lock = threading.RLock()


def get_torch_device():
    return state.device


def get_free_memory(dev=None, torch_free_too=False):
    return (state.free_bytes, state.free_bytes) if torch_free_too else state.free_bytes


def free_memory(memory_required, device, keep_loaded=[], for_dynamic=False, pins_required=0, ram_required=0):
    state.free_memory_calls.append((memory_required, device))


def soft_empty_cache(force=False):
    state.soft_empty_cache_calls += 1


def unload_all_models():
    state.unload_all_calls += 1


def interrupt_current_processing(value=True):
    with _lock:
        state.interrupt = value


def processing_interrupted():
    with _lock:
        return state.interrupt


def throw_exception_if_processing_interrupted():
    with _lock:
        state.checks += 1
        if state.interrupt_at_check is not None and state.checks >= state.interrupt_at_check:
            state.interrupt = True
        if state.interrupt:
            state.interrupt = False
            state.interrupt_at_check = None
            raise InterruptProcessingException()
