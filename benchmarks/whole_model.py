"""The whole model at its released size, one generation, one memory budget: predicted against measured, per phase.

    python benchmarks/whole_model.py --out /tmp/h3-whole                       # T2VA and FL2VA, --memory-budget 16
    python benchmarks/whole_model.py --out /tmp/h3-whole --memory-budget 12 --delete

Writes (once, streaming to disk, with `synthetic_h3`) every component at its released widths and depths in the
quantised layouts users run on small machines, into a ComfyUI-style models folder under `--out`:

* `diffusion_models/`: the DiT, 50 blocks + 2 refiner blocks, one Q8_0 `.gguf` as `python -m h3_core quantize`
  writes it (the block matrices Q8_0, the rest as released: bf16 and the fp32 islands), about 35 GB;
* `text_encoders/`: Qwen3-VL-32B's language model cut at H3's layer 50 as a published-layout GGUF (architecture
  `qwen3vl`, llama.cpp names, `qwen3vl.*` metadata; the matrices and the token embedding Q4_K, norms F32), its
  27-block vision tower in a separate mmproj file (`clip`, `qwen3vl_merger`; Q8_0 where a row fits Q8_0's 32-value
  blocks, else F16) and H3's tokenizer.json beside them, about 15 GB;
* `vae/`: both VAEs as the ComfyUI files (video fp16, audio fp32), about 5.8 GB.

The quantised tensors are windows of a pool of valid blocks (`synthetic_h3.QuantisedBlocks`: Q8_0 by gguf's
quantiser, Q4_K a symmetric encoding checked against gguf's `dequantize`), scaled per tensor as the bf16 synthetic
weights are, so values stay in range through 50 blocks.

Then each task (`--tasks`: t2va, fl2va with one keyframe) runs in a fresh process from a cold page cache (every file
dropped with `posix_fadvise(DONTNEED)`), exactly as `python -m h3_core generate --memory-budget N` plans it:
`plan_components` picks each component's residency and chunking for the budget, `H3Pipeline` runs the request on the
CPU at the default dtype (bf16 for dequantised weights). A thread samples `/proc/self/status` every `--interval-ms`.
Per phase it prints: the plan's predicted peak (`plan_for_budget(...).phase(name).total_bytes`) against the measured
peak RssAnon growth over the level the phase started at, the process's peak RSS (RssAnon + RssFile + RssShmem) and
peak RssAnon, the bytes read from storage (`/proc/self/io` read_bytes), read time (the streamed stores' reader time
plus the time spent loading components, which reads their resident weights), compute time (wall time less the time
the compute waited for reads and the loads), and wall time.

PASS when, for every task: the process's peak RSS (VmHWM) is at most the budget, each phase's prediction is within
`--tolerance` (15 %) of its measured growth, and each phase's wall time is at most 1.25 x max(compute, reads).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

GiB = 1 << 30
MiB = 1 << 20
DIT_FILE = "minimax_h3_synthetic_fl2va_q8_0.gguf"
TEXT_ENCODER_FILE = "Qwen3-VL-32B-Instruct-H3-50L-Q4_K.gguf"  # published files are named by their publishers
MMPROJ_FILE = "mmproj-Qwen3-VL-32B-Instruct-Q8_0.gguf"
TEXT_ENCODER_LAYER = 50
OVERLAP_LIMIT = 1.25
PROMPT = ("A slow camera pan over a quiet harbour at dawn: fishing boats rock on rippling water, gulls circle the "
          "masts, soft golden light spreads over the stone quay, a distant bell rings twice and an engine hums as a "
          "small boat leaves for the open sea, its wake catching the light.")


# ---- the files -----------------------------------------------------------------------------------------------------


def model_files(out: Path) -> dict:
    import synthetic_h3 as synth

    return {"transformer": str(out / "diffusion_models" / DIT_FILE),
            "text_encoder": str(out / "text_encoders" / TEXT_ENCODER_FILE),
            "mmproj": str(out / "text_encoders" / MMPROJ_FILE),
            "video_vae": str(out / "vae" / synth.VIDEO_VAE_FILE), "audio_vae": str(out / "vae" / synth.AUDIO_VAE_FILE)}


def write_files(out: Path, *, blocks: int, layers: int, vision_layers: int) -> dict:
    """Every component under `out` (kept when a previous run wrote the same shapes)."""
    import synthetic_h3 as synth

    out.mkdir(parents=True, exist_ok=True)
    files = model_files(out)
    stamp = out / "shape.json"
    shape = {"blocks": blocks, "layers": layers, "vision_layers": vision_layers, "version": 1}
    if stamp.is_file() and json.loads(stamp.read_text()) == shape and all(Path(f).is_file() for f in files.values()):
        return files
    stamp.unlink(missing_ok=True)
    for name in ("diffusion_models", "text_encoders", "vae"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name, write in (
            ("transformer", lambda: synth.write_dit_gguf(files["transformer"], blocks)),
            ("text encoder", lambda: synth.write_text_encoder_gguf(files["text_encoder"], files["mmproj"], layers,
                                                                   vision_layers=vision_layers)),
            ("video VAE", lambda: synth.write_video_vae(out / "vae")),
            ("audio VAE", lambda: synth.write_audio_vae(out / "vae"))):
        started = time.perf_counter()
        write()
        print(f"wrote the {name} in {time.perf_counter() - started:.0f} s", flush=True)
    stamp.write_text(json.dumps(shape))
    sizes = {name: Path(path).stat().st_size for name, path in files.items()}
    print("files: " + ", ".join(f"{name} {size / 1e9:.2f} GB" for name, size in sizes.items())
          + f"; total {sum(sizes.values()) / 1e9:.1f} GB", flush=True)
    return files


def drop_from_page_cache(paths) -> None:
    """Every file's pages out of the page cache (a cold start), without root."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- one task, in its own process -----------------------------------------------------------------------------------


def _disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class ReadLog:
    """The streamed stores' read counters (bytes read, reader time, the compute's waits for reads), summed per phase
    over every offload manager alive in it: the block stacks, the AdaLN stack and the phase-scoped weights."""

    def __init__(self):
        import weakref

        self.managers = weakref.WeakSet()
        self.seen: dict[int, tuple] = {}

    def install(self) -> None:
        from h3_core.runtime.layerwise import LayerwiseOffloadManager

        log, original = self, LayerwiseOffloadManager.__init__

        def init(manager, *args, **kwargs):
            original(manager, *args, **kwargs)
            log.managers.add(manager)

        LayerwiseOffloadManager.__init__ = init

    def take(self) -> dict:
        """What was read since the last call: bytes_read, read_s, read_wait_s."""
        total = [0, 0.0, 0.0]
        for manager in list(self.managers):
            now = manager._read_counters()
            if now is None:
                continue
            before = self.seen.get(id(manager), (0, 0.0, 0.0))
            for i in range(3):
                total[i] += now[i] - before[i]
            self.seen[id(manager)] = now
        return {"streamed_bytes": total[0], "reader_s": total[1], "read_wait_s": total[2]}


def run_task(args) -> dict:
    import torch
    from PIL import Image

    from h3_core.pipeline import H3Pipeline
    from h3_core.planning.phase_plans import plan_components, plan_for_budget
    from h3_core.sources.model_sources import ModelSources
    from pipeline_phases import PhaseSampler, _status, _trim

    files = json.loads(args.files)
    drop_from_page_cache(files.values())
    torch.set_num_threads(args.threads)
    sources = ModelSources(Path(files["transformer"]), Path(files["text_encoder"]), Path(files["video_vae"]),
                           Path(files["audio_vae"]), text_encoder_layer=TEXT_ENCODER_LAYER)
    width, height = (int(v) for v in args.size.split("x"))
    keyframes = args.child == "fl2va"
    request = dict(width=width, height=height, num_frames=args.frames, keyframes=keyframes, steps=args.steps)
    messages: list[str] = []
    options = plan_components(sources, device="cpu", memory_budget_gb=args.memory_budget, log=messages.append,
                              residency=args.residency, **request)
    plan = plan_for_budget(sources, device="cpu", budget_bytes=int(args.memory_budget * GiB),
                           residency=None if args.residency == "auto" else args.residency, **request)
    pipeline = H3Pipeline(sources, device="cpu", component_options=options, log=messages.append)
    runs = dict(H3Pipeline.PHASES)
    sampler = PhaseSampler(args.interval_ms / 1000)
    reads = ReadLog()
    reads.install()
    phases: list[dict] = []
    baseline: dict[str, int] = {}
    real_enter, real_component, real_release = pipeline.enter_phase, pipeline.component, pipeline.release

    def close_phase() -> None:
        if phases and "wall_s" not in phases[-1]:
            phase = phases[-1]
            phase["wall_s"] = time.perf_counter() - phase["started"]
            phase["disk_read_bytes"] = _disk_read_bytes() - phase["disk_read_at_start"]
            phase["at_end"] = list(pipeline.loaded)
            for key, value in reads.take().items():
                phase[key] = phase.get(key, 0) + value

    def enter_phase(phase: str) -> None:
        close_phase()
        print(f"{time.perf_counter() - started:7.1f} s  {phase}", file=sys.stderr, flush=True)
        real_enter(phase)
        _trim()
        sampler.enter(phase)
        reads.take()  # the releases at the phase's start belong to no phase
        phases.append({"phase": phase, "runs": runs[phase], "at_start": list(pipeline.loaded),
                       "floor": _status()["RssAnon"] - baseline["RssAnon"], "started": time.perf_counter(),
                       "disk_read_at_start": _disk_read_bytes(), "load_s": 0.0})

    def component(name: str):
        started = time.perf_counter()
        loaded = name in pipeline.loaded
        value = real_component(name)
        if not loaded and phases:
            phases[-1]["load_s"] += time.perf_counter() - started
        return value

    def release(name: str) -> None:
        if phases and "wall_s" not in phases[-1]:  # its stores' reads belong to the phase running now
            for key, value in reads.take().items():
                phases[-1][key] = phases[-1].get(key, 0) + value
        phase = sampler.phase
        sampler.enter(f"release {name}")
        real_release(name)
        _trim()
        if phase is not None:
            sampler.enter(phase)

    pipeline.enter_phase, pipeline.component, pipeline.release = enter_phase, component, release
    first = Image.new("RGB", (width, height), (180, 90, 40)) if keyframes else None
    _trim()
    baseline.update(_status())
    sampler.start()
    started = time.perf_counter()
    print(f"{args.child} at --memory-budget {args.memory_budget:g}:", file=sys.stderr, flush=True)
    result = pipeline.generate(PROMPT, width=width, height=height, num_frames=args.frames, steps=args.steps, seed=0,
                               first_frame=first)
    seconds = time.perf_counter() - started
    close_phase()
    sampler.stop()
    peak_rss = _peak_rss()
    pipeline.release_all()
    out = []
    for phase in phases:
        name = phase["phase"]
        peak = sampler.peaks[name]
        planned = plan.phase(name)
        out.append({
            "phase": name, "runs": phase["runs"], "at_start": phase["at_start"], "at_end": phase["at_end"],
            "predicted": planned.total_bytes, "peak_part": planned.peak_part,
            "measured": peak["RssAnon"] - baseline["RssAnon"] - phase["floor"],
            "peak_rss": peak["RssAnon"] + peak["RssFile"] + peak.get("RssShmem", 0), "peak_anon": peak["RssAnon"],
            "disk_read_bytes": phase["disk_read_bytes"], "streamed_bytes": phase["streamed_bytes"],
            "reader_s": phase["reader_s"], "read_wait_s": phase["read_wait_s"], "load_s": phase["load_s"],
            "wall_s": phase["wall_s"]})
    return {"task": args.child, "budget_gib": args.memory_budget, "residency": args.residency, "seconds": seconds,
            "peak_rss": peak_rss,
            "phases": out, "frames": list(result.frames.shape), "audio": list(result.waveform.shape),
            "finite": bool(torch.isfinite(result.frames).all()) and bool(torch.isfinite(result.waveform).all()),
            "options": {k: {o: str(v) for o, v in opts.items()} for k, opts in options.items()},
            "plan": messages[0] if messages else "", "log": messages[1:]}


# ---- the report -----------------------------------------------------------------------------------------------------


def phase_times(p: dict) -> tuple[float, float]:
    """(reads, compute) seconds of a phase: reads are the streamed stores' reader time plus the component loads
    (which read the resident weights); compute is the wall time less the waits for reads and the loads."""
    reads = p["reader_s"] + p["load_s"]
    compute = max(0.0, p["wall_s"] - p["read_wait_s"] - p["load_s"])
    return reads, compute


def report(result: dict, tolerance: float) -> bool:
    budget = result["budget_gib"] * GiB
    print(f"\n{result['task']} at --memory-budget {result['budget_gib']:g} --residency {result['residency']}: "
          f"{result['seconds']:.0f} s, frames "
          f"{result['frames']}, audio {result['audio']}, finite {result['finite']}; peak RSS (VmHWM) "
          f"{result['peak_rss'] / GiB:.2f} GiB {'<=' if result['peak_rss'] <= budget else '>'} "
          f"{result['budget_gib']:g} GiB")
    print("  residency: " + ", ".join(f"{name} {opts.get('residency', 'resident')}"
                                      for name, opts in result["options"].items()))
    print(f"  {'phase':<16} {'predicted':>9} {'measured':>9} {'ratio':>5} {'peak RSS':>9} {'peak anon':>9} "
          f"{'read':>8} {'reads':>7} {'compute':>7} {'wall':>7} {'wall/max':>8}")
    ok = result["peak_rss"] <= budget and result["finite"]
    for p in result["phases"]:
        ratio = p["measured"] / p["predicted"] if p["predicted"] else float("inf")
        reads, compute = phase_times(p)
        overlap = p["wall_s"] / max(reads, compute, 1e-9)
        good = abs(ratio - 1) <= tolerance and overlap <= OVERLAP_LIMIT
        ok &= good
        print(f"  {p['phase']:<16} {p['predicted'] / GiB:>7.2f} G {p['measured'] / GiB:>7.2f} G {ratio:>5.2f} "
              f"{p['peak_rss'] / GiB:>7.2f} G {p['peak_anon'] / GiB:>7.2f} G {p['disk_read_bytes'] / GiB:>6.2f} G "
              f"{reads:>6.1f}s {compute:>6.1f}s {p['wall_s']:>6.1f}s {overlap:>8.2f}  {'PASS' if good else 'FAIL'}")
        extra = sorted(set(p["at_start"] + p["at_end"]) - {p["runs"]})
        if extra:
            ok = False
            print(f"    census FAIL: {p['phase']} holds {extra}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/h3-whole"))
    parser.add_argument("--memory-budget", type=float, default=16.0, help="GiB, as the CLI's --memory-budget")
    parser.add_argument("--tasks", nargs="+", default=["t2va", "fl2va"], choices=("t2va", "fl2va"))
    parser.add_argument("--blocks", type=int, default=50)
    parser.add_argument("--layers", type=int, default=TEXT_ENCODER_LAYER, help="text-encoder layers written")
    parser.add_argument("--vision-layers", type=int, default=27)
    parser.add_argument("--residency", default="auto", choices=("auto", "resident", "layerwise"),
                        help="as the CLI's --residency: auto lets the plan choose for the budget")
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--frames", type=int, default=22)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--json", type=Path, help="append the results here")
    parser.add_argument("--write-only", action="store_true", help="write the files and stop")
    parser.add_argument("--delete", action="store_true", help="delete the synthetic files at the end")
    parser.add_argument("--child", choices=("t2va", "fl2va"), help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_task(args)), flush=True)
        return 0
    try:
        files = write_files(args.out, blocks=args.blocks, layers=args.layers, vision_layers=args.vision_layers)
        if args.write_only:
            return 0
        ok = True
        for task in args.tasks:
            command = [sys.executable, __file__, "--child", task, "--files", json.dumps(files),
                       "--memory-budget", str(args.memory_budget), "--residency", args.residency,
                       "--size", args.size, "--frames", str(args.frames),
                       "--steps", str(args.steps), "--threads", str(args.threads),
                       "--interval-ms", str(args.interval_ms)]
            done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its log goes to our stderr
            line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
            if done.returncode or line is None:
                print(done.stdout[-4000:])
                return 1
            result = json.loads(line[len("RESULT "):])
            print(result["plan"])
            ok &= report(result, args.tolerance)
            if args.json:
                previous = json.loads(args.json.read_text()) if args.json.is_file() else []
                args.json.write_text(json.dumps(previous + [result], indent=2))
        print(f"\n{'PASS' if ok else 'FAIL'}: peak RSS within --memory-budget {args.memory_budget:g}, per-phase peaks "
              f"within ±{args.tolerance:.0%} of the plan, wall <= {OVERLAP_LIMIT} x max(compute, reads)")
        return 0 if ok else 1
    finally:
        if args.delete:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
