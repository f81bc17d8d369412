"""Cancel latency at a large request: the time from an interrupt to the exception, per phase, on the tiny model.

    python benchmarks/cancel_latency.py                          # 1920x1088, 15 s, every phase
    python benchmarks/cancel_latency.py --modes sampling --after 5
    python benchmarks/cancel_latency.py --size 4096x4096         # the largest canvas

Each mode runs in a fresh process on the CPU with torch's default threads (as a ComfyUI server does). It builds an
`H3Pipeline` over the tiny model (`ensure_tiny_model`, the CLI's default; `$H3_STREAM_CACHE` is honoured) that keeps
its components loaded, generates a small request (96x64, 5 frames), then starts one phase of the
large request with an interrupt check like ComfyUI's (a flag that another thread sets; the check raises when it is
set). A timer thread sets the flag `--after` seconds after the phase's first check (text encode: `--text-after`, with
a prompt of about 4,000 tokens). Reported per mode: the latency from setting the flag to the exception reaching the
caller, the checks seen and the longest gap between two of them before the flag (the worst latency the phase would
have had at that point), the machine's load average; then the small request runs again on the same pipeline and must
give the same frames and waveform, bitwise.

Modes: `text` (text encode), `keyframe` (the first-frame keyframe's VAE encode, `sample`'s first phase), `sampling`
(the transformer), `video` (VAE decode of random latents of the request's shape) and `audio` (the audio VAE's).
PASS when every latency is under `--limit` (2 s) and every second small run equals the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("text", "keyframe", "sampling", "video", "audio")
SMALL = dict(width=96, height=64, num_frames=5, steps=3, seed=1)  # the tiny default's canvas, 5 frames


class Cancelled(Exception):
    """What the benchmark's interrupt check raises (ComfyUI's is InterruptProcessingException)."""


class Interrupt:
    """ComfyUI's interrupt, in small: `fire()` sets a flag (another thread: the server's /interrupt), `check()` raises
    once it is set. `check()` also records when it ran, and starts the timer on its first call."""

    def __init__(self, after: float):
        self.after = after
        self.flag = threading.Event()
        self.started = threading.Event()
        self.fired_at: float | None = None
        self.checks: list[float] = []
        threading.Thread(target=self._timer, daemon=True).start()

    def _timer(self) -> None:
        self.started.wait()
        time.sleep(self.after)
        self.fired_at = time.perf_counter()
        self.flag.set()

    def check(self) -> None:
        self.checks.append(time.perf_counter())
        self.started.set()
        if self.flag.is_set():
            raise Cancelled()

    def longest_gap_before_the_interrupt(self) -> float:
        before = [t for t in self.checks if self.fired_at is None or t <= self.fired_at]
        return max((b - a for a, b in zip(before, before[1:])), default=0.0)


def run_mode(mode: str, width: int, height: int, num_frames: int, after: float) -> dict:
    import torch

    from h3_core.pipeline import H3Pipeline
    from h3_core.pipeline.pipeline import Latents
    from h3_core.request.generation_request import MAX_PROMPT_TOKENS, GenerationRequest
    from h3_core.sources import resolve_model
    from h3_core.sources.tiny_default import ensure_tiny_model

    pipe = H3Pipeline(resolve_model(ensure_tiny_model()), keep_text_encoder=True, keep_transformer=True,
                      keep_video_vae=True, keep_audio_vae=True)
    started = time.perf_counter()
    before = pipe.generate("a red fox in the snow", **SMALL)
    small_seconds = time.perf_counter() - started

    prompt = "a red fox runs across a snowy field at dawn"
    if mode == "text":  # about 4,000 tokens, the most a prompt may have
        prompt = " ".join([prompt] * (MAX_PROMPT_TOKENS // 10))
    first_frame = None
    if mode == "keyframe":
        from PIL import Image
        first_frame = Image.new("RGB", (width, height), (200, 80, 40))
    request = GenerationRequest(prompt, width=width, height=height, num_frames=num_frames, steps=3, seed=1,
                                first_frame=first_frame)
    shape = request.shape
    if mode in ("sampling", "keyframe"):
        cond = pipe.encode_prompt(request)
    generator = torch.Generator().manual_seed(3)
    latents = Latents(torch.randn(shape.video, generator=generator),
                      torch.randn((1, 32, 2, shape.audio_latents), generator=generator), shape)
    phase = {"text": lambda check: pipe.encode_prompt(request, check_interrupt=check),
             "keyframe": lambda check: pipe.encode_keyframes(cond, check_interrupt=check),
             "sampling": lambda check: pipe.sample(cond, check_interrupt=check),
             "video": lambda check: pipe.decode_video(latents, check_interrupt=check),
             "audio": lambda check: pipe.decode_audio(latents, check_interrupt=check)}[mode]

    interrupt = Interrupt(after)
    load_before = os.getloadavg()[0]
    phase_started = time.perf_counter()
    try:
        phase(interrupt.check)
        outcome, latency = "finished", None
    except Cancelled:
        outcome, latency = "cancelled", time.perf_counter() - interrupt.fired_at
    phase_seconds = time.perf_counter() - phase_started
    load_after = os.getloadavg()[0]

    started = time.perf_counter()
    again = pipe.generate("a red fox in the snow", **SMALL)
    same = torch.equal(again.frames, before.frames) and torch.equal(again.waveform, before.waveform)
    result = dict(mode=mode, outcome=outcome, latency_s=latency, checks=len(interrupt.checks),
                  longest_gap_s=interrupt.longest_gap_before_the_interrupt(), phase_s=phase_seconds,
                  small_s=small_seconds, small_again_s=time.perf_counter() - started, same=same,
                  load=(load_before, load_after), threads=torch.get_num_threads())
    pipe.release_all()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1920x1088", help="WIDTHxHEIGHT of the large request")
    parser.add_argument("--frames", type=int, default=362, help="frames of the large request (362: 15 s)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--after", type=float, default=3.0, help="seconds into the phase the interrupt fires")
    parser.add_argument("--text-after", type=float, default=0.0, help="the same for the text encode (short)")
    parser.add_argument("--keyframe-after", type=float, default=0.3, help="the same for the keyframe encode")
    parser.add_argument("--limit", type=float, default=2.0, help="PASS when every latency is below this")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.lower().split("x"))
    if args.child:
        after = {"text": args.text_after, "keyframe": args.keyframe_after}.get(args.child, args.after)
        print(json.dumps(run_mode(args.child, width, height, args.frames, after)), flush=True)
        return 0

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; use {', '.join(MODES)}")
    print(f"cancel latency, tiny model, {width}x{height}, {args.frames} frames, one fresh process per mode "
          f"({os.cpu_count()} CPUs)")
    print(f"{'mode':<9} {'outcome':<9} {'latency':>8} {'checks':>7} {'longest gap':>12} {'phase':>8} "
          f"{'load 1 min':>11}  next small prompt")
    passed = True
    for mode in modes:
        child = subprocess.run([sys.executable, __file__, "--child", mode, "--size", args.size, "--frames",
                                str(args.frames), "--after", str(args.after), "--text-after", str(args.text_after),
                                "--keyframe-after", str(args.keyframe_after)],
                               capture_output=True, text=True)
        if child.returncode != 0:
            print(f"{mode:<9} failed (exit {child.returncode}):\n{child.stderr[-2000:]}")
            passed = False
            continue
        r = json.loads(child.stdout.strip().splitlines()[-1])
        latency = "-" if r["latency_s"] is None else f"{r['latency_s']:.3f} s"
        print(f"{mode:<9} {r['outcome']:<9} {latency:>8} {r['checks']:>7} {r['longest_gap_s']:>10.3f} s "
              f"{r['phase_s']:>6.1f} s {r['load'][0]:>5.2f}-{r['load'][1]:<5.2f}  "
              f"{'same result' if r['same'] else 'DIFFERENT result'} ({r['small_again_s']:.1f} s, first "
              f"{r['small_s']:.1f} s)")
        # A phase that finished before the interrupt fired had no longer a latency than its whole run.
        ok = r["same"] and (r["latency_s"] if r["latency_s"] is not None else r["phase_s"]) < args.limit
        passed = passed and ok
    print("PASS" if passed else "FAIL", f"(every latency under {args.limit:g} s and the next prompt unchanged)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
