"""Repeated generations leak neither memory nor file handles: a soak of fresh pipelines (the transformer streamed
layerwise, so its store opens and closes the checkpoint's files every generation) in one child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The soak runs in a fresh child process: in the test process, a leak could fill heap pages other tests freed without
# raising RssAnon, and earlier tests' threads, caches and imports would move the baseline.
SOAK = r"""
import gc, json, os, sys
from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model

sources = resolve_model(sys.argv[1])
# As conftest.py does for the test process: the pipeline's gc.collect() on each release then walks only what the
# generations made, not torch's objects (0.45 s a generation here). RssAnon counts leaked memory whether or not the
# collector looks at it, and every object a generation makes is still collected.
gc.collect()
gc.freeze()

def rss_anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024

def fds():
    return len(os.listdir('/proc/self/fd'))

samples = []
for i in range(int(sys.argv[2])):
    pipe = H3Pipeline(sources, component_options={"transformer": {"residency": "layerwise"}})
    pipe.generate("a red fox runs through snow", width=64, height=64, num_frames=5, steps=3, seed=i)
    pipe.release_all()
    del pipe
    gc.collect()
    samples.append((rss_anon(), fds()))
print(json.dumps(samples))
"""

# How many generations, and how much growth is allowed. The first two generations grow RssAnon (allocator pools, lazy
# imports); from then on it moved by at most 0.97 MiB, mostly under 0.4 MiB (108 samples, 13 runs, 2-core
# machine). A leak of L bytes a generation shows as 4 L after the four measured generations, so 3 MiB (three times that
# noise) catches a leak from 0.75 MiB a generation, as the former 20-generation soak did with its 5 % allowance (12.5
# MiB of ~250 MiB over 17 generations); both caught 768 KiB a generation, just, and missed 512 KiB. A leaked
# descriptor shows after one generation. Checked with the guards broken by hand: `FileReader.close` made a no-op fails
# with "descriptors per generation: [11, 18, 25, 32, 39, 46]"; a 1 MiB tensor kept each generation with "RssAnon grew
# by 3.9 MiB over 4 generations"; every loaded component kept with "grew by 28.0 MiB". (`release_all` made a no-op
# alone leaks nothing here: the dropped pipeline takes its components with it.)
WARM_UP = 2
MEASURED = 4
ALLOWED_GROWTH = 3 << 20


def test_soak_leaks_no_memory_and_no_file_handles(tiny, tmp_path):
    script = tmp_path / "soak.py"
    script.write_text(SOAK)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script), str(tiny), str(WARM_UP + MEASURED)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    samples = json.loads(done.stdout.strip().splitlines()[-1])
    rss = [value for value, _ in samples]
    descriptors = [count for _, count in samples]
    assert len(set(descriptors[1:])) == 1, f"descriptors per generation: {descriptors}"
    baseline = rss[WARM_UP - 1]
    growth = max(rss[WARM_UP:]) - baseline
    assert growth <= ALLOWED_GROWTH, (f"RssAnon grew by {growth / (1 << 20):.1f} MiB over {MEASURED} generations "
                                      f"after the warm-up: {[(value - baseline) >> 10 for value in rss]} KiB")
