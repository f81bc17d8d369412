"""Test double of `comfy.model_management`: a configurable device, recorders for the memory calls, an interruption
flag the tests raise (directly, or after a number of interruption checks), and the model registry as ComfyUI keeps
it: `current_loaded_models`, whose entries `free_memory` unloads the way the real one does (read from ComfyUI's
comfy/model_management.py, kat3ri/ComfyUI 0f1fa67), `unload_all_models` (what "Unload models", POST /free, runs
between prompts), `cleanup_models`, `loaded_models`, and the pinned-memory ledger (`TOTAL_PINNED_MEMORY` under
`MAX_PINNED_MEMORY`)."""

from __future__ import annotations

import sys
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
        self.unloaded: list = []  # entries free_memory unloaded, in order
        current_loaded_models.clear()
        global TOTAL_PINNED_MEMORY, MAX_PINNED_MEMORY
        TOTAL_PINNED_MEMORY, MAX_PINNED_MEMORY = 0, -1  # a CPU server pins nothing


current_loaded_models: list = []
TOTAL_PINNED_MEMORY = 0
MAX_PINNED_MEMORY = -1


state = _State()
_lock = threading.RLock()


def get_torch_device():
    return state.device


def get_free_memory(dev=None, torch_free_too=False):
    return (state.free_bytes, state.free_bytes) if torch_free_too else state.free_bytes


def free_memory(memory_required, device, keep_loaded=[], for_dynamic=False, pins_required=0, ram_required=0):
    """As ComfyUI does: every entry on `device` (all for None) that is not kept nor dead is a candidate, marked not
    currently used, ordered by (most offloaded memory first, fewest references, smallest); each is asked to unload
    while the device's free memory is short of `memory_required` (nothing for `device` None), and the entries
    whose `model_unload` returned True are popped from `current_loaded_models` (by index, after the loop)."""
    state.free_memory_calls.append((memory_required, device))
    candidates = []
    for i in range(len(current_loaded_models) - 1, -1, -1):
        entry = current_loaded_models[i]
        if (device is None or entry.device == device) and entry not in keep_loaded and not entry.is_dead():
            candidates.append((-entry.model_offloaded_memory(), sys.getrefcount(entry.model), entry.model_memory(),
                               i))
            entry.currently_used = False
    unloaded = []
    for *_, i in sorted(candidates):
        entry = current_loaded_models[i]
        to_free = 0 if device is None else memory_required - get_free_memory(device)
        if entry.model.is_dynamic() and for_dynamic:
            to_free = 0
        if to_free > 0 and entry.model_unload(to_free):
            f"Unloading {entry.model.model.__class__.__name__}"  # ComfyUI logs this (it must not raise)
            unloaded.append(i)
    popped = [current_loaded_models.pop(i) for i in sorted(unloaded, reverse=True)]
    state.unloaded.extend(popped)
    return popped


def get_all_torch_devices(exclude_current=False):
    return [] if exclude_current else [get_torch_device()]


def unload_all_models():
    state.unload_all_calls += 1
    for device in get_all_torch_devices():
        free_memory(1e30, device)


def loaded_models(only_currently_used=False):
    return [entry.model for entry in current_loaded_models if entry.currently_used or not only_currently_used]


def cleanup_models():
    """Drop the entries whose real model is gone (ComfyUI runs it from a finaliser on each loaded model)."""
    for i in range(len(current_loaded_models) - 1, -1, -1):
        if current_loaded_models[i].real_model() is None:
            current_loaded_models.pop(i)


def soft_empty_cache(force=False):
    state.soft_empty_cache_calls += 1


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
