"""Two threads generating on one pipeline: the calls are serialised, so both get the single-threaded result.

Without the pipeline's lock two `generate` calls on one layerwise pipeline drive the same residency managers and
fail with `ResidencyError: ... not attached`, a `KeyError` or an `IndexError` from the slot ledger (most runs of
four). Run in a subprocess with a timeout: a lock that deadlocks must fail the test, not hang the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, threading
import torch
from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model

torch.set_num_threads(1)
options = {name: {"residency": "layerwise"} for name in ("transformer", "text_encoder", "video_vae", "audio_vae")}
pipe = H3Pipeline(resolve_model(sys.argv[1]), component_options=options)
request = dict(width=64, height=64, num_frames=5, steps=3, seed=1)
alone = pipe.generate("a fox in the snow", **request)
report = []
for repetition in range(int(sys.argv[2])):
    start = threading.Barrier(2)
    results, errors = [None, None], []

    def work(i):
        start.wait()
        try:
            results[i] = pipe.generate("a fox in the snow", **request)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    same = [r is not None and torch.equal(r.frames, alone.frames) and torch.equal(r.waveform, alone.waveform)
            for r in results]
    report.append({"errors": errors, "same": same})
print(json.dumps(report))
"""


def test_two_threads_generating_on_one_layerwise_pipeline_get_the_single_threaded_result(tiny):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny), "4"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == [{"errors": [], "same": [True, True]}] * 4
