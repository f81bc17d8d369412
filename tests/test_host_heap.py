"""The CPU's host-heap trim: the audio decoder returns the C heap's freed pages between its blocks, so its resident
memory follows what is alive instead of the allocator's retained free lists."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from h3_core.runtime.platform import Platform

ROOT = Path(__file__).resolve().parents[1]


def glibc() -> bool:
    try:
        ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return False
    return True


FRAGMENTED_HEAP = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import torch
    from h3_core.runtime.platform import Platform

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    big = torch.ones(4 << 20)
    del big  # freeing a 16 MiB map raises glibc's mmap threshold to it: mid-size buffers now come from the heap
    kept, freed = [], []
    for i in range(120):  # 1 MiB buffers, each followed by a kept 256 KiB one: freed, they are holes in the heap
        freed.append(torch.ones(1 << 18))
        kept.append(torch.ones(1 << 16))
    del freed
    # The device first: its trim must leave the holes, so the CPU's trim then finds the same heap a fresh process
    # would (each reading taken just before its own trim).
    readings = {{}}
    for device in ("cuda", "cpu"):
        before = anon()
        Platform(device).trim_host_heap()
        readings[device] = {{"before": before, "after": anon()}}
    print(json.dumps(readings))
""")


@pytest.mark.skipif(not glibc() or not Path("/proc/self/status").exists(), reason="glibc's malloc_trim, Linux RSS")
def test_the_cpu_platform_returns_freed_heap_pages_and_devices_leave_the_heap_alone():
    code = FRAGMENTED_HEAP.format(root=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    readings = json.loads(done.stdout.strip().splitlines()[-1])
    cuda, cpu = readings["cuda"], readings["cpu"]
    # A device computes in its own allocator: nothing to trim (and no CUDA needed to say so).
    assert abs(cuda["before"] - cuda["after"]) < 8 << 20, cuda
    assert cpu["before"] - cpu["after"] > 100 << 20, cpu  # most of the 120 MiB freed in the middle of the heap


def test_the_audio_decoder_trims_after_every_amp_block_with_the_same_numbers(tmp_path):
    from h3_core import load_audio_vae
    from h3_core.runtime.chunking import no_reclaim
    from vae_fixtures import reference_audio, save_audio_native

    folder = save_audio_native(reference_audio(seed=2), tmp_path / "audio_vae")
    vae = load_audio_vae(folder)
    decoder = vae.decoder
    hook = decoder.between_blocks  # the loader installs the platform's trim
    assert hook.__func__ is Platform.trim_host_heap and hook.__self__ == Platform("cpu")
    latent = torch.randn(1, vae.config.latent_channels, 2, 3, generator=torch.Generator().manual_seed(0))
    calls = []
    decoder.between_blocks = lambda: (calls.append(1), Platform("cpu").trim_host_heap())
    trimmed = vae.decode(latent)
    assert len(calls) == len(decoder.ups) * decoder.num_kernels
    decoder.between_blocks = no_reclaim
    assert torch.equal(trimmed, vae.decode(latent))
