"""Reclaiming device memory synchronises the device before it empties the cache (MPS frees wait for the queued command
buffers, so emptying first returns little): `Platform.reclaim`, `reclaim_action`, the synchronous backend's reclaim
and the sampler node's `mps_reclaim_every` hook."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from h3_core.runtime import Platform
from h3_core.runtime import platform as platform_module


@pytest.fixture
def recorded_device_ops(monkeypatch):
    """What the CPU's and MPS's device operations are asked to do, in order (the ops classes, recording)."""
    calls = []

    def recording(base):
        class Recording(base):
            def synchronize(self):
                calls.append("synchronize")

            def empty_cache(self):
                calls.append("empty_cache")

        return Recording

    for kind in ("cpu", "mps"):
        facts = platform_module._FACTS[kind]
        monkeypatch.setitem(platform_module._FACTS, kind, dataclasses.replace(facts, ops=recording(facts.ops)))
    return calls


def test_reclaim_synchronises_before_it_empties_the_cache(recorded_device_ops):
    from h3_core.runtime.chunking import EveryNChunks
    from h3_core.runtime.offload_backends import SynchronousBackend

    Platform("mps").reclaim()
    assert recorded_device_ops == ["synchronize", "empty_cache"]
    recorded_device_ops.clear()
    hook = EveryNChunks(2, Platform("mps").reclaim_action(lambda: recorded_device_ops.append("host empty")))
    for _ in range(4):
        hook()
    assert recorded_device_ops == ["synchronize", "host empty"] * 2
    recorded_device_ops.clear()
    SynchronousBackend("mps", reclaim_every=1).reclaim()
    assert recorded_device_ops == ["synchronize", "empty_cache"]


def test_the_sampler_nodes_reclaim_hook_synchronises_first(recorded_device_ops, tmp_path, monkeypatch):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    pack = comfy_double.load_pack()
    from comfy_double.executor import run_node

    runtime = sys.modules[comfy_double.PACK_MODULE + ".nodes.comfy_runtime"]
    soft_empty = runtime.soft_empty_cache
    monkeypatch.setattr(runtime, "soft_empty_cache", lambda: (recorded_device_ops.append("soft_empty_cache"),
                                                              soft_empty()))
    loader = dict(source="tiny test model (embedded)", partition="FL2VA", transformer_residency="RESIDENT",
                  text_encoder_residency="RESIDENT", video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT",
                  prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu",
                  mps_reclaim_every=1)
    handle, = run_node(pack["H3StreamLoader"], "1", **loader)
    cond, = run_node(pack["H3StreamTextEncode"], "2", h3_model=handle, prompt="a fox", width=96, height=64)
    recorded_device_ops.clear()
    run_node(pack["H3StreamSampler"], "3", h3_model=handle, h3_cond=cond, width=96, height=64, seconds=1.0, frames=5,
             steps=2, seed=7, video_shift=12.0, audio_shift=3.0, chunk_size=16)
    reclaims = recorded_device_ops[:-1]  # the last one: the node's own call after the phase
    assert len(reclaims) >= 4 and reclaims == ["synchronize", "soft_empty_cache"] * (len(reclaims) // 2)
