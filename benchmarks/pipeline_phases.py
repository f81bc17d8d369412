"""Per-phase memory of a whole generation at the released widths: the plan's predicted peak against the measured one,
and a census of the components each phase holds.

    python benchmarks/pipeline_phases.py --out /tmp/h3-phases                  # layerwise, then resident
    python benchmarks/pipeline_phases.py --out /tmp/h3-phases --modes layerwise --delete

Writes (with `synthetic_h3`, unless they are already there) a pipeline at real widths: the Qwen3-VL-32B text
encoder with `--layers` decoder layers and a `--vision-layers` vision tower (no lm_head: H3 never reads it), the DiT
with `--blocks` blocks (native layout), both VAEs at full width. Then, for each residency mode, in a fresh process:
an `H3Pipeline` over those files generates one request (`--size`, `--frames`, `--steps`, a first keyframe unless
`--no-keyframe`, a prompt of about the plan's `TEXT_ROWS_ESTIMATE` tokens) on the CPU, while a thread samples
`/proc/self/status` every `--interval-ms` (5 ms). Each phase (`H3Pipeline.enter_phase` to the next one) reports its
peak RssAnon over the level it started at (after its releases and a `malloc_trim`), next to the plan's prediction
for the same request and residency (`plan_for_budget(..., residency=mode).phase(name).total_bytes`). Every weight
the loaders place is read into the process's own memory, so RssAnon counts all of it; RssFile growth (the page
cache of the files this process maps) is reported beside it.
PASS when every phase is within `--tolerance` (15 %) of the prediction and no phase holds a component it does not
run (`pipeline.loaded` when each phase starts and when it ends).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

MiB = 1 << 20


# ---- the files -----------------------------------------------------------------------------------------------------


def write_files(out: Path, *, blocks: int, layers: int, vision_layers: int) -> dict:
    """The four components under `out` (kept when a previous run wrote them with the same shape)."""
    import synthetic_h3 as synth

    out.mkdir(parents=True, exist_ok=True)
    stamp = out / "shape.json"
    shape = {"blocks": blocks, "layers": layers, "vision_layers": vision_layers}
    if not (stamp.is_file() and json.loads(stamp.read_text()) == shape):
        for name in ("transformer", "text_encoder", "vae"):
            shutil.rmtree(out / name, ignore_errors=True)
        started = time.perf_counter()
        synth.write_dit(out / "transformer", blocks, sync=False)
        synth.write_text_encoder(out / "text_encoder", layers, vision_layers=vision_layers, lm_head=False,
                                 sync=False)
        synth.write_video_vae(out / "vae", sync=False)
        synth.write_audio_vae(out / "vae", sync=False)
        stamp.write_text(json.dumps(shape))
        print(f"wrote the synthetic pipeline to {out} in {time.perf_counter() - started:.0f} s", flush=True)
    return {"transformer": str(out / "transformer"), "text_encoder": str(out / "text_encoder"),
            "video_vae": str(out / "vae" / synth.VIDEO_VAE_FILE), "audio_vae": str(out / "vae" / synth.AUDIO_VAE_FILE),
            "text_encoder_layer": layers}


# ---- one mode, in its own process -----------------------------------------------------------------------------------


def _status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                key, value = line.split(":")
                values[key] = int(value.split()[0]) * 1024
    return values


class PhaseSampler:
    """Samples RssAnon / RssFile every `interval` seconds and keeps each phase's peak."""

    def __init__(self, interval: float):
        self.interval = interval
        self.phase: str | None = None
        self.peaks: dict[str, dict[str, int]] = {}
        self.order: list[str] = []
        self.trace: list[tuple] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.sample()
        self._stop.set()
        self._thread.join()

    def enter(self, phase: str) -> None:
        self.sample()  # the end of the previous phase
        with self._lock:
            self.phase = phase
            if phase not in self.peaks:
                self.peaks[phase] = {}
                self.order.append(phase)
        self.sample()

    def sample(self) -> None:
        with self._lock:  # read and attributed under the lock: a phase change cannot fall between the two
            now = _status()
            if self.phase is None:
                return
            self.trace.append((time.perf_counter(), self.phase, now["RssAnon"], now["RssFile"]))
            peak = self.peaks[self.phase]
            for key, value in now.items():
                peak[key] = max(peak.get(key, 0), value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - not glibc
        pass


def _prompt(tokenizer, rows: int) -> str:
    """A prompt of about `rows` tokens (the plan sizes the text activations for TEXT_ROWS_ESTIMATE rows)."""
    words = ("a slow camera pan over a quiet harbour at dawn, gulls, rippling water, fishing boats, soft light, "
             "distant bells and the hum of an engine. ").split()
    text, i = [], 0
    while len(tokenizer.tokenize(" ".join(text))) < rows - 48:  # the template adds its own tokens
        text.append(words[i % len(words)])
        i += 1
    return " ".join(text)


def run_mode(args) -> dict:
    import torch
    from PIL import Image

    from h3_core.pipeline import H3Pipeline
    from h3_core.planning.phase_plans import TEXT_ROWS_ESTIMATE, plan_for_budget
    from h3_core.sources.model_sources import ModelSources

    torch.set_num_threads(args.threads)
    files = json.loads(args.files)
    sources = ModelSources(Path(files["transformer"]), Path(files["text_encoder"]), Path(files["video_vae"]),
                           Path(files["audio_vae"]), text_encoder_layer=int(files["text_encoder_layer"]))
    width, height = (int(v) for v in args.size.split("x"))
    keyframes = not args.no_keyframe
    plan = plan_for_budget(sources, device="cpu", budget_bytes=1 << 50, width=width, height=height,
                           num_frames=args.frames, keyframes=keyframes, steps=args.steps, residency=args.child)
    options = {name: ({"residency": "layerwise"} if args.child == "layerwise" else {})
               for name in H3Pipeline.COMPONENTS}
    pipeline = H3Pipeline(sources, device="cpu", component_options=options)
    runs = dict(H3Pipeline.PHASES)
    sampler = PhaseSampler(args.interval_ms / 1000)
    census: list[dict] = []
    baseline: dict[str, int] = {}
    real_enter = pipeline.enter_phase

    def enter_phase(phase: str) -> None:
        if census:  # the phase that ends now held only its own component (and kept ones)
            census[-1]["at_end"] = list(pipeline.loaded)
        real_enter(phase)  # its releases are measured apart (`release` below), the previous phase's until then
        _trim()
        sampler.enter(phase)
        census.append({"phase": phase, "runs": runs[phase], "at_start": list(pipeline.loaded),
                       "floor": _status()["RssAnon"] - baseline["RssAnon"]})

    pipeline.enter_phase = enter_phase
    real_release = pipeline.release

    def release(name: str) -> None:
        # Releasing a component is measured apart ("release <name>"), then the phase goes on: the phase's own peak
        # is what it holds while it runs.
        phase = sampler.phase
        sampler.enter(f"release {name}")
        real_release(name)
        _trim()
        if phase is not None:
            sampler.enter(phase)

    pipeline.release = release
    # The prompt's token count comes from the tokenizer file alone (no model loaded before the baseline).
    from h3_core.models.tokenizer import H3Tokenizer

    prompt = _prompt(H3Tokenizer(Path(files["text_encoder"]) / "tokenizer.json"), TEXT_ROWS_ESTIMATE)
    first = Image.new("RGB", (width, height), (180, 90, 40)) if keyframes else None
    _trim()
    baseline.update(_status())
    sampler.start()
    started = time.perf_counter()
    result = pipeline.generate(prompt, width=width, height=height, num_frames=args.frames, steps=args.steps,
                               seed=0, first_frame=first)
    seconds = time.perf_counter() - started
    census[-1]["at_end"] = list(pipeline.loaded)
    sampler.stop()
    pipeline.release_all()
    _trim()
    after = _status()["RssAnon"] - baseline["RssAnon"]
    phases, releases = [], []
    floors = {e["phase"]: e["floor"] for e in census}
    for name in sampler.order:
        peak = sampler.peaks[name]
        # Growth over the phase: its peak over the level it started at (after its releases, what earlier phases
        # left: their outputs and the allocator's free lists); `over_baseline` counts from before the generation.
        measured = {"measured": peak["RssAnon"] - baseline["RssAnon"] - floors.get(name, 0),
                    "over_baseline": peak["RssAnon"] - baseline["RssAnon"],
                    "file_measured": peak["RssFile"] - baseline["RssFile"]}
        if name.startswith("release "):
            releases.append({"phase": name, **measured})
            continue
        planned = plan.phase(name)
        phases.append({"phase": name, "predicted": planned.total_bytes, "peak_part": planned.peak_part, **measured})
    return {"mode": args.child, "seconds": seconds, "phases": phases, "releases": releases, "census": census, "after_release_all": after,
            "trace": [(t - started, p, a - baseline["RssAnon"], f - baseline["RssFile"]) for t, p, a, f in
                      sampler.trace] if args.trace else [],
            "frames": list(result.frames.shape), "describe": plan.describe(),
            "prompt_tokens": len(H3Tokenizer(Path(files["text_encoder"]) / "tokenizer.json").tokenize(prompt))}


# ---- the report -----------------------------------------------------------------------------------------------------


def census_problems(census: list[dict]) -> list[str]:
    problems = []
    for entry in census:
        for when in ("at_start", "at_end"):
            extra = sorted(set(entry.get(when, ())) - {entry["runs"]})
            if extra:
                problems.append(f"{entry['phase']} holds {extra} {when.replace('_', ' ')}")
    return problems


def report(result: dict, tolerance: float) -> bool:
    print(f"\n{result['mode']}: {result['seconds']:.0f} s, {result['prompt_tokens']} prompt tokens, frames "
          f"{result['frames']}")
    print(f"  {'phase':<16} {'predicted':>10} {'measured':>10} {'ratio':>6}   {'peak part':<11} {'RssFile':>8}")
    ok = True
    for p in result["phases"]:
        ratio = p["measured"] / p["predicted"] if p["predicted"] else float("inf")
        good = abs(ratio - 1) <= tolerance
        ok &= good
        print(f"  {p['phase']:<16} {p['predicted'] / MiB:>8.0f} M {p['measured'] / MiB:>8.0f} M {ratio:>6.2f}   "
              f"{str(p['peak_part'] or '-'):<11} {p['file_measured'] / MiB:>6.0f} M"
              f"  {'PASS' if good else 'FAIL'}")
    for r in result.get("releases", ()):
        print(f"  {r['phase']:<27} {r['measured'] / MiB:>8.0f} M   (not a phase: the release itself, RssFile "
              f"{r['file_measured'] / MiB:.0f} M)")
    print("  anonymous level when each phase starts (after its releases): "
          + ", ".join(f"{e['phase']} {e['floor'] / MiB:.0f} M" for e in result["census"])
          + f"; after release_all {result['after_release_all'] / MiB:.0f} M")
    problems = census_problems(result["census"])
    for problem in problems:
        print(f"  census FAIL: {problem}")
    if not problems:
        print("  census PASS: every phase held only the component it runs "
              f"({', '.join(e['phase'] + ': ' + e['runs'] for e in result['census'])})")
    return ok and not problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/h3-phases"))
    parser.add_argument("--modes", nargs="+", default=["layerwise", "resident"], choices=("layerwise", "resident"))
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--size", default="256x256")
    parser.add_argument("--frames", type=int, default=22)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-keyframe", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--verbose", action="store_true", help="print each plan's per-phase breakdown")
    parser.add_argument("--delete", action="store_true", help="delete the synthetic files at the end")
    parser.add_argument("--child", choices=("layerwise", "resident"), help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help="keep every sample in the --json results")
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return 0
    try:
        files = write_files(args.out, blocks=args.blocks, layers=args.layers, vision_layers=args.vision_layers)
        results, ok = [], True
        for mode in args.modes:
            command = [sys.executable, __file__, "--child", mode, "--files", json.dumps(files), "--size", args.size,
                       "--frames", str(args.frames), "--steps", str(args.steps), "--threads", str(args.threads),
                       "--interval-ms", str(args.interval_ms)] + (["--no-keyframe"] if args.no_keyframe else []) \
                + (["--trace"] if args.trace else [])
            done = subprocess.run(command, capture_output=True, text=True)
            line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
            if done.returncode or line is None:
                print(done.stdout[-4000:], done.stderr[-4000:])
                return 1
            result = json.loads(line[len("RESULT "):])
            if args.verbose:
                print(result["describe"])
            ok &= report(result, args.tolerance)
            results.append(result)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        print(f"\n{'PASS' if ok else 'FAIL'}: per-phase peaks within ±{args.tolerance:.0%} of the plan, phases hold "
              "only what they run" if ok else "\nFAIL")
        return 0 if ok else 1
    finally:
        if args.delete:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
