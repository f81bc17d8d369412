"""Two threads generating on one pipeline: the calls are serialised, so both get the single-threaded result.

Without the pipeline's lock two `generate` calls on one layerwise pipeline drive the same residency managers and
fail with `ResidencyError: ... not attached`, a `KeyError`, an `IndexError` from the slot ledger, a shape error or
wrong numbers. With the lock removed, one repetition of this 3-step request caught it in 17 of 22 runs of this test
(in-process, default GIL switch interval) and 11 of 12 with the 0.1 ms switch interval used here; two repetitions
caught it in 20 of 20 runs. It runs in this process on daemon threads joined with a timeout: a lock that deadlocks
fails the test, and the stuck threads do not keep the suite from exiting.
"""

from __future__ import annotations

import sys
import threading

import torch

from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model

REPETITIONS = 2
# A shorter switch interval interleaves the two threads' Python code more finely, so a missing lock shows sooner.
SWITCH_INTERVAL_S = 1e-4
DEADLOCK_TIMEOUT_S = 120  # one locked repetition takes ~2.5 s on a busy 2-core machine


def test_two_threads_generating_on_one_layerwise_pipeline_get_the_single_threaded_result(tiny):
    options = {name: {"residency": "layerwise"} for name in ("transformer", "text_encoder", "video_vae", "audio_vae")}
    pipe = H3Pipeline(resolve_model(tiny), component_options=options)
    request = dict(width=64, height=64, num_frames=5, steps=3, seed=1)
    [alone] = generate_on_threads(pipe, request, 1)  # a thread too: a lock that deadlocks on re-entry fails here
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        for _ in range(REPETITIONS):
            results = generate_on_threads(pipe, request, 2)
            assert [torch.equal(r.frames, alone.frames) and torch.equal(r.waveform, alone.waveform)
                    for r in results] == [True, True]
    finally:
        sys.setswitchinterval(switch)


def generate_on_threads(pipe, request, count):
    """`count` threads call `pipe.generate` at once; their results, once every call has returned without error."""
    start = threading.Barrier(count, timeout=DEADLOCK_TIMEOUT_S)
    results, errors = [None] * count, []

    def work(i):
        start.wait()
        try:
            results[i] = pipe.generate("a fox in the snow", **request)
        except Exception as error:  # reported below, with the other threads' outcomes
            errors.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLOCK_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "generate deadlocked"
    assert errors == []
    return results
