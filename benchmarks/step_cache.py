"""The step cache on a streamed transformer: a cached call reads and runs only the blocks that always run.

    python benchmarks/step_cache.py                  # 24 released blocks (~30.5 GiB of files), float32 on the CPU
    python benchmarks/step_cache.py --blocks 3 --frames 1 --latent-hw 8    # a quick end-to-end check (5.2 GiB)
    python benchmarks/step_cache.py --tiny-only      # only the presets' hit counts on the tiny model (seconds)
    python benchmarks/step_cache.py --keep --out /tmp/h3-real-scale       # reuse real_scale.py's kept files
    python benchmarks/step_cache.py --blocks 3 --page-cache-gib 0          # small, but every read from the disk

Part 1, released widths. A synthetic DiT at the released widths is written with `benchmarks/synthetic_h3.py` under
`--out` (default /tmp/h3-step-cache; what this run writes is deleted afterwards unless `--keep`; a model already
there is reused, one with more blocks through a block-count view, as in `benchmarks/real_scale.py`, whose helpers
this script imports). 24 blocks are 30.5 GiB of files, more than the memory free for the page cache (MemAvailable,
printed). Each measurement runs in a fresh process, from a cold page cache (`posix_fadvise` DONTNEED):

1. the disk's cold sequential read speed (real_scale's child);
2. `h3_core.denoise` over `load_dit(..., residency="layerwise")` (float32 on the CPU, `--threads` compute threads;
   `--page-cache-gib` caps the page cache the stores keep) on a small canvas (real_scale's: 48 text, 128 video, 48
   audio rows), `--calls` model calls (default 5), with a fixed hit pattern: `StepCacheSettings(first_blocks=Fn,
   last_blocks=Bn, threshold=1.0, warmup_steps=1, max_consecutive=1)` (default Fn 1, Bn 0): call 1 runs every block
   (warm-up), then every other call is a hit (a threshold >= 1 always hits once allowed; the cap makes the next call
   run every block). With 5 calls: miss, hit, miss, hit, miss.

A call is timed from one `step_report` callback to the next (the first from the loop's start, less the step-invariant
work done before it: the text refiner and the AdaLN plan); it is left out of the ratios, having read the model from a
cold cache. Per call: hit or miss, blocks run; the bytes of the streamed files it read (each read counted for the
call that asked for it: a read ahead of the next call's first blocks, asked for while this call's last block
computes, is this call's even when it ends after it; page cache or disk alike); the bytes the process read from
storage in the call's time (/proc/self/io read_bytes: a read ahead that straddles two calls is split between them);
the bytes of the units it ran (their file segments); `StepCacheStats.bytes_read` (the residency's cumulative read counter, differenced per call);
the seconds; the seconds in blocks (each from the start of its `acquire` to the end of its `release`: waiting for its
read, binding, its compute; host time: on an accelerator, whose compute runs asynchronously, the split between
blocks and the rest means little); of those, the seconds waited for reads; the reader thread's busy seconds.

The fixed cost is measured on the uncached calls after the first: a call's seconds minus its seconds in blocks (the
median over those calls) = everything a call does beyond running blocks: input projections, final layer, the Euler
update, the step cache's residual arithmetic, the per-call bookkeeping. It is measured where no hit happens, so it
does not come from the calls it is used to judge; the cached calls' own non-block seconds are printed beside it.

Goals (issue 31), with U = the median uncached call after the first, C = the median cached call, N blocks:
  * C reads at most (Fn + Bn) / N of U's bytes + 0.05 (file bytes; the disk's too, when U read >= 1 % from it);
  * C's seconds within 10 % of (Fn + Bn) / N x U's seconds + the fixed cost.

Part 2, the tiny model (`h3_core.ensure_tiny_model()`, the CLI's default, random weights): a 50-step T2VA sampling
(49 model calls) per preset (off, quality, fast), each in a fresh process; prints hits, misses, blocks run and the
hit pattern. Random weights say nothing about image quality, only how often each preset's threshold is met.
Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import real_scale  # noqa: E402
from real_scale import GiB, AnonSampler, block_view, evict, load, managers_of, model_inputs, shard_files  # noqa: E402

from h3_core.runtime.file_reads import available_memory_bytes, disk_read_bytes, total_memory_bytes  # noqa: E402

BYTES_SLACK = 0.05
TIME_TOLERANCE = 0.10
TINY_STEPS = 50
PRESETS = ("off", "quality", "fast")
PROMPT = "a red fox runs across a snowy field at dawn"


# ---- children -------------------------------------------------------------------------------------------------------


class ReadLog:
    """The bytes each window (a call, or the step-invariant work before the first) reads from the streamed stores'
    files, counted for the window that asked for the read: a read ahead that ends after its call (the next call's
    first blocks, asked for while the last one computes) is the asking call's, wherever it completes."""

    def __init__(self, stores, window):
        self.window = window  # () -> the key of the window now
        self.bytes: dict = {}
        self.units: dict = {}
        for store in stores:
            if getattr(store, "counters", None) is not None:
                self._wrap(store)

    def _wrap(self, store) -> None:
        owner = {}  # unit -> the window that asked for its read (set before the job can start)
        request, read_job = store._request, store._read_job

        def asked(unit):
            if unit in store._staged:
                return request(unit)
            owner[unit] = self.window()  # no read of it is pending (a cancelled one never runs: overwritten)
            done = request(unit)
            if unit not in store._staged:
                owner.pop(unit, None)  # no buffer free: nothing asked yet
            return done

        def job(unit, buffer, after):  # on the reader thread, the only one that moves its counters
            before = store.counters.bytes_read
            try:
                read_job(unit, buffer, after)
            finally:
                key = owner.pop(unit, None)
                self.bytes[key] = self.bytes.get(key, 0) + store.counters.bytes_read - before
                self.units.setdefault(key, []).append(unit)

        store._request, store._read_job = asked, job


def unit_file_bytes(store, unit: int) -> int:
    return sum(seg.nbytes for seg in store.unit_segments(unit))


def child_loop(args) -> dict:
    """The sampling loop with the fixed hit pattern, from a cold page cache."""
    import torch

    import h3_core
    from h3_core import Platform
    from h3_core.pipeline.sampler import Schedule
    from h3_core.step_cache_settings import StepCacheSettings

    torch.set_num_threads(args.threads)
    evict(shard_files(Path(args.model)))
    model = load(args)
    if args.page_cache_gib is not None:  # else the stores choose from the memory available, pass by pass
        for manager in managers_of(model):
            manager.store.set_cache_budget(int(args.page_cache_gib * GiB))
    layout, inputs = model_inputs(model.config, args)
    settings = StepCacheSettings(args.first_blocks, args.last_blocks, threshold=1.0, warmup_steps=1,
                                 max_consecutive=1, name="every other call")
    stores = [m.store for m in managers_of(model)]
    residency = model.block_residency
    block_store = residency.store

    # Each block's span: from the start of acquire (its read awaited, copied) to the end of release (computed).
    spans, started_at = [], {}
    acquire, release = residency.acquire, residency.release

    def timed_acquire(index):
        started_at[index] = time.perf_counter()
        acquire(index)

    def timed_release(index):
        release(index)
        if index in started_at:
            spans.append((index, time.perf_counter() - started_at.pop(index)))

    residency.acquire, residency.release = timed_acquire, timed_release
    # The step-invariant work `denoise` does before the first call (the text refiner, the AdaLN plan): timed apart.
    plan = {"t": 0.0, "disk": 0, "wait": 0.0, "read": 0.0}
    in_plan = []
    mark = {}
    calls = []
    reads = ReadLog(stores, lambda: "plan" if in_plan else len(calls))

    def timed(method):
        def run(*a, **k):
            before = now()
            in_plan.append(True)
            try:
                return method(*a, **k)
            finally:
                in_plan.pop()
                after = now()
                for key in plan:
                    plan[key] += after[key] - before[key]
                spans.clear()  # the plan's own block passes are not a call's
        return run

    model.refine_text, model.adaln_plan = timed(model.refine_text), timed(model.adaln_plan)

    def now() -> dict:
        return {"t": time.perf_counter(), "disk": disk_read_bytes() or 0, "wait": block_store.counters.wait_s,
                "read": block_store.counters.read_s}

    def progress(done, total):
        if done == 0:
            mark.update(now())

    platform = Platform.for_device(args.device)

    def step_report(stats):
        platform.synchronize()  # the call's device work has ended (a no-op on the CPU)
        here = now()
        blocks = [b for b, _ in spans]
        calls.append({
            "hit": bool(stats.decisions[-1]), "blocks_run": stats.blocks_run[-1], "blocks": blocks,
            "seconds": here["t"] - mark["t"], "block_seconds": sum(s for _, s in spans),
            "disk_bytes": here["disk"] - mark["disk"],
            "stats_bytes": stats.bytes_read[-1], "read_wait_s": here["wait"] - mark["wait"],
            "read_s": here["read"] - mark["read"],
            "unit_bytes": sum(unit_file_bytes(block_store, b) for b in blocks if b in block_store.streamed)})
        spans.clear()
        mark.update(here)

    generator = torch.Generator().manual_seed(0)
    video_rows = torch.randn(layout.video_indices.numel(), model.config.video_patch_dim, generator=generator)
    audio_rows = torch.randn(layout.audio_indices.numel(), model.config.audio_in_channels, generator=generator)
    sampler = AnonSampler()
    with torch.no_grad():
        result = h3_core.denoise(model, inputs["encoder_hidden_states"][0], layout, Schedule.build(args.calls + 1),
                                 video_rows, audio_rows, progress=progress, step_cache=settings,
                                 step_report=step_report)
    assert torch.isfinite(result.video_rows).all() and torch.isfinite(result.audio_rows).all()
    for key, field in (("t", "seconds"), ("disk", "disk_bytes"), ("wait", "read_wait_s"), ("read", "read_s")):
        calls[0][field] -= plan[key]  # the step-invariant work, done before the first call
    for store in stores:
        store._executor.submit(lambda: None).result()  # the last call's reads ahead have ended
    for i, call in enumerate(calls):
        call["file_bytes"], call["units_read"] = reads.bytes.get(i, 0), reads.units.get(i, [])
    plan["file"] = reads.bytes.get("plan", 0)
    return {"calls": calls, "plan": plan, "peak_anon": sampler.stop(),
            "blocks": len(model.blocks), "rows": layout.num_rows,
            "cached_units": [len(getattr(s, "cached_units", ())) for s in stores],
            "block_unit_bytes": [unit_file_bytes(block_store, u) for u in block_store.streamed]}


def child_tiny(args) -> dict:
    """A 50-step T2VA sampling on the tiny model with one preset."""
    import torch

    from h3_core.pipeline import H3Pipeline
    from h3_core.request.generation_request import GenerationRequest
    from h3_core.sources import resolve_model
    from h3_core.sources.tiny_default import ensure_tiny_model

    torch.set_num_threads(args.threads)
    pipe = H3Pipeline(resolve_model(ensure_tiny_model()))
    width, height = (int(v) for v in args.tiny_size.split("x"))
    request = GenerationRequest(PROMPT, width=width, height=height, num_frames=args.tiny_frames, steps=TINY_STEPS,
                                seed=1, step_cache=args.preset)
    cond = pipe.encode_prompt(request)
    started = time.perf_counter()
    latents = pipe.sample(cond)
    seconds = time.perf_counter() - started
    pipe.release_all()
    stats = latents.step_cache
    calls = TINY_STEPS - 1
    if stats is None:  # off: the uncached loop
        return {"preset": args.preset, "calls": calls, "hits": 0, "misses": calls, "blocks_run": None,
                "blocks": None, "pattern": "." * calls, "seconds": seconds}
    return {"preset": args.preset, "calls": len(stats.decisions), "hits": stats.hits, "misses": stats.misses,
            "blocks_run": sum(stats.blocks_run), "blocks": stats.num_blocks * len(stats.decisions),
            "pattern": "".join("H" if d else "." for d in stats.decisions), "settings": stats.settings.describe(),
            "seconds": seconds}


CHILDREN = {"loop": child_loop, "tiny": child_tiny}
PASSED = ("dtype", "device", "threads", "frames", "latent_hw", "audio_latents", "text_rows", "calls", "prefetch",
          "first_blocks", "last_blocks", "tiny_size", "tiny_frames", "page_cache_gib")


def run_child(args, mode: str, **extra) -> dict:
    command = [sys.executable, __file__, "--child", mode]
    for key, value in [*((k, getattr(args, k)) for k in PASSED), *extra.items()]:
        if value is not None:
            command += ["--" + key.replace("_", "-"), str(value)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child {mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- parent ---------------------------------------------------------------------------------------------------------


def model_folder(args, out: Path, made: list[Path]) -> Path:
    """The synthetic DiT with `args.blocks` blocks: written, reused, or a block-count view of a larger one; what
    this run creates is added to `made`."""
    import synthetic_h3

    full = out / "transformer"
    if not (full / "config.json").exists():
        made.append(full)
        print(f"writing {args.blocks} released blocks under {full} ...", flush=True)
        started = time.perf_counter()
        synthetic_h3.write_dit(full, args.blocks)
        print(f"  written in {time.perf_counter() - started:.0f} s", flush=True)
    have = json.loads((full / "config.json").read_text())["num_layers"]
    if have < args.blocks:
        raise SystemExit(f"{full} has {have} blocks, fewer than --blocks {args.blocks}: delete it or use another "
                         "--out.")
    if have == args.blocks:
        return full
    view = out / f"view{args.blocks}"
    if not view.exists():
        made.append(view)
    return block_view(full, args.blocks, view)


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def released_part(args) -> dict:
    out = Path(args.out)
    made = [] if out.exists() else [out]
    try:
        folder = model_folder(args, out, made)
        files = shard_files(folder)
        file_bytes = sum(p.stat().st_size for p in files)
        ram, free = total_memory_bytes(), available_memory_bytes()
        print(f"machine: {os.cpu_count()} cores, RAM {ram / GiB:.1f} GiB, MemAvailable {free / GiB:.1f} GiB; "
              f"{args.device}, {args.dtype}, {args.threads} compute threads", flush=True)
        small = file_bytes <= free and args.page_cache_gib is None
        print(f"files {file_bytes / GiB:.2f} GiB = {file_bytes / free:.2f} x MemAvailable"
              + ("  (NOT larger than the free page cache: a check of the script only)" if small else "")
              + ("" if args.page_cache_gib is None else f"; page cache budget {args.page_cache_gib:g} GiB"),
              flush=True)
        evict(files)
        read = real_scale.run_child(args, "cold_read", folder)
        print(f"cold sequential read: {read['gbps']:.2f} GB/s ({read['bytes'] / GiB:.1f} GiB in "
              f"{read['seconds']:.1f} s)", flush=True)
        loop = run_child(args, "loop", model=folder)
        report = judge(args, loop)
        return {"file_bytes": file_bytes, "ram": ram, "mem_available": free, "cores": os.cpu_count(), "read": read,
                "loop": loop, **report}
    finally:
        if not args.keep:  # only what this run wrote: a folder kept by another run stays
            for path in reversed(made):
                shutil.rmtree(path, ignore_errors=True)


def judge(args, loop) -> dict:
    calls, n = loop["calls"], loop["blocks"]
    share = (args.first_blocks + args.last_blocks) / n
    plan = loop["plan"]
    print(f"\n{n} blocks, {loop['rows']} packed rows; text refiner + AdaLN plan before call 1 (left out of its "
          f"row): {plan['t']:.1f} s, {plan['disk'] / GiB:.2f} GiB of disk reads; "
          f"units kept in the page cache per store: {loop['cached_units']}; peak RssAnon "
          f"{loop['peak_anon'] / GiB:.2f} GiB")
    print("| call | hit | blocks run | file reads GiB | disk reads GiB | units run GiB | stats GiB | seconds "
          "| in blocks s | waited for reads s | reader busy s | outside blocks s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, c in enumerate(calls):
        print(f"| {i + 1} | {'hit' if c['hit'] else 'miss'} | {c['blocks_run']} | {c['file_bytes'] / GiB:.2f} "
              f"| {c['disk_bytes'] / GiB:.2f} | {c['unit_bytes'] / GiB:.2f} | {c['stats_bytes'] / GiB:.2f} "
              f"| {c['seconds']:.2f} | {c['block_seconds']:.2f} | {c['read_wait_s']:.2f} | {c['read_s']:.2f} "
              f"| {c['seconds'] - c['block_seconds']:.2f} |")
    if loop["plan"]["file"]:
        print(f"(the step-invariant work read {loop['plan']['file'] / GiB:.2f} GiB of the streamed files)")
    later = calls[1:]
    hits = [c for c in later if c["hit"]]
    misses = [c for c in later if not c["hit"]]
    if len(hits) < 1 or len(misses) < 1:
        raise SystemExit("need a cached and an uncached call after the first: raise --calls")
    u = {k: median([c[k] for c in misses]) for k in ("file_bytes", "disk_bytes", "seconds", "block_seconds")}
    c = {k: median([c[k] for c in hits]) for k in ("file_bytes", "disk_bytes", "seconds", "block_seconds")}
    fixed = median([m["seconds"] - m["block_seconds"] for m in misses])
    fixed_cached = c["seconds"] - c["block_seconds"]
    byte_ratio = c["file_bytes"] / u["file_bytes"]
    disk_ratio = c["disk_bytes"] / u["disk_bytes"] if u["disk_bytes"] else float("nan")
    predicted = share * u["seconds"] + fixed
    time_ratio = c["seconds"] / predicted
    print(f"\n(Fn + Bn) / N = ({args.first_blocks} + {args.last_blocks}) / {n} = {share:.3f}; medians of "
          f"{len(hits)} cached and {len(misses)} uncached calls after the first")
    print(f"bytes: cached / uncached = {c['file_bytes'] / GiB:.2f} / {u['file_bytes'] / GiB:.2f} GiB = "
          f"{byte_ratio:.3f} (file reads), {c['disk_bytes'] / GiB:.2f} / {u['disk_bytes'] / GiB:.2f} GiB = "
          f"{disk_ratio:.3f} (disk); goal <= {share + BYTES_SLACK:.3f}")
    print(f"fixed cost (uncached calls' seconds outside blocks): {fixed:.2f} s (the cached calls': "
          f"{fixed_cached:.2f} s)")
    print(f"time: cached {c['seconds']:.2f} s vs {share:.3f} x {u['seconds']:.2f} s + {fixed:.2f} s = "
          f"{predicted:.2f} s: ratio {time_ratio:.3f}; speed-up of a cached call {u['seconds'] / c['seconds']:.1f}x")
    goals = {f"a cached call reads <= (Fn + Bn) / N + {BYTES_SLACK} of an uncached call's file bytes":
             byte_ratio <= share + BYTES_SLACK}
    if u["disk_bytes"] >= 0.01 * u["file_bytes"]:
        goals["... and of its disk bytes"] = disk_ratio <= share + BYTES_SLACK
    else:
        print("  (the uncached calls read under 1 % of their bytes from the disk: the files stayed in the page "
              "cache, no disk goal)")
    goals[f"a cached call's time within {TIME_TOLERANCE:.0%} of (Fn + Bn) / N x uncached + the fixed cost"] = (
        abs(time_ratio - 1) <= TIME_TOLERANCE)
    for goal, ok in goals.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {goal}")
    return {"share": share, "byte_ratio": byte_ratio, "disk_ratio": disk_ratio, "fixed_s": fixed,
            "fixed_cached_s": fixed_cached, "predicted_s": predicted, "time_ratio": time_ratio,
            "goals": {k: bool(v) for k, v in goals.items()}}


def tiny_part(args) -> list[dict]:
    print(f"\ntiny model, {TINY_STEPS} steps ({TINY_STEPS - 1} model calls), T2VA {args.tiny_size}, "
          f"{args.tiny_frames} frames:")
    print("| preset | hits | misses | blocks run | seconds | pattern (H: hit) |")
    print("|---|---|---|---|---|---|")
    results = []
    for preset in PRESETS:
        r = run_child(args, "tiny", preset=preset)
        blocks = "all" if r["blocks"] is None else f"{r['blocks_run']} of {r['blocks']}"
        print(f"| {preset} | {r['hits']} | {r['misses']} | {blocks} | {r['seconds']:.1f} | {r['pattern']} |",
              flush=True)
        results.append(r)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    real_scale.add_model_arguments(parser, "/tmp/h3-step-cache")
    parser.add_argument("--tiny-only", action="store_true", help="only the tiny model's hit counts")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny model's hit counts")
    parser.add_argument("--calls", type=int, default=5, help="model calls (odd, >= 5: 2 cached, 2 uncached after "
                                                             "the first)")
    parser.add_argument("--first-blocks", type=int, default=1, help="Fn")
    parser.add_argument("--last-blocks", type=int, default=0, help="Bn")
    parser.add_argument("--page-cache-gib", type=float, default=None,
                        help="keep at most this much of the streamed files in the page cache (default: the stores' "
                             "own choice from MemAvailable); 0 drops every unit after its read, so a small --blocks "
                             "reads from the disk every call, as files larger than the RAM do")
    parser.add_argument("--tiny-size", default="96x64", help="the tiny model's canvas, WIDTHxHEIGHT")
    parser.add_argument("--tiny-frames", type=int, default=22, help="the tiny model's frames (17n + 5)")
    parser.add_argument("--child", choices=sorted(CHILDREN))
    parser.add_argument("--model")
    parser.add_argument("--preset")
    args = real_scale.parse_or_run_child(parser, CHILDREN)
    if args is None:
        return
    if args.calls < 5 and not args.tiny_only:
        parser.error("--calls must be at least 5 (after the first call, 2 cached and 2 uncached ones)")
    results = {}
    if not args.tiny_only:
        results["released"] = released_part(args)
    if not args.no_tiny:
        results["tiny"] = tiny_part(args)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
