"""The audio health check's cost against the audio decode it follows (issue 29: under 2 %).

    python benchmarks/audio_health.py                          # tiny decoder 5 s and 15 s, released width 5 s
    python benchmarks/audio_health.py --modes released:15      # one mode; MODE is tiny|released:SECONDS

Modes, each in a fresh process: `tiny` is the embedded tiny model's audio VAE (tiny-v2); `released` is the audio VAE at
the released widths (decoder 1024 channels, latent 2048) with synthetic weights written by
`benchmarks/synthetic_h3.py` (`write_audio_vae`, fp32). Each decodes normal latents [1, 32, 2, 40 x seconds] to a
32 kHz stereo waveform (the decode the pipeline runs, float32 on the CPU; `--decode-runs` runs, the median), then
times `check_audio` on that waveform (the median of `--check-runs`) and prints the ratio, and the decoded waveform's
statistics (RMS, DC / RMS, peak, share of samples on the clamp): the figures the check's thresholds are set against.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

GOAL = 0.02


def child(mode: str, seconds: float, decode_runs: int, check_runs: int, threads: int | None) -> dict:
    import math

    import torch

    from h3_core.checkpoints.audio_vae_loader import load_audio_vae
    from h3_core.request.audio_health import check_audio

    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="h3-audio-health-") as folder:
        if mode == "tiny":
            from h3_core.sources.tiny_default import ensure_tiny_model

            file = next((ensure_tiny_model(folder) / "vae").glob("minimax_h3_audio_vae*.safetensors"))
        else:
            from synthetic_h3 import write_audio_vae

            file = write_audio_vae(folder, seed=0)[0]
        vae = load_audio_vae(file)
        latents = torch.randn(1, 32, 2, round(40 * seconds), generator=torch.Generator().manual_seed(0))
        decode_times = []
        for _ in range(decode_runs):
            started = time.perf_counter()
            waveform = vae.decode(latents)[0].float().cpu()
            decode_times.append(time.perf_counter() - started)
    findings = check_audio(waveform)  # once untimed (first-call costs)
    check_times = []
    for _ in range(check_runs):
        started = time.perf_counter()
        check_audio(waveform)
        check_times.append(time.perf_counter() - started)
    w = waveform.double()
    rms = w.pow(2).mean(1).sqrt()
    return dict(mode=mode, seconds=seconds, samples=waveform.shape[1], threads=torch.get_num_threads(),
                decode_s=statistics.median(decode_times), check_s=statistics.median(check_times),
                rms_dbfs=[round(20 * math.log10(max(v, 1e-12)), 1) for v in rms.tolist()],
                dc_over_rms=[round(abs(m) / max(r, 1e-12), 4) for m, r in zip(w.mean(1).tolist(), rms.tolist())],
                peak=round(w.abs().max().item(), 3), clamped_share=round((w.abs() >= 0.999).double().mean().item(), 4),
                findings=[f.message for f in findings])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["tiny:5", "tiny:15", "released:5"],
                        help="MODE:SECONDS, MODE tiny or released")
    parser.add_argument("--decode-runs", type=int, default=3)
    parser.add_argument("--check-runs", type=int, default=51)
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, seconds = args.child.split(":")
        print(json.dumps(child(mode, float(seconds), args.decode_runs, args.check_runs, args.threads)))
        return 0
    worst = 0.0
    for spec in args.modes:
        command = [sys.executable, __file__, "--child", spec, "--decode-runs", str(args.decode_runs),
                   "--check-runs", str(args.check_runs)] + (["--threads", str(args.threads)] if args.threads else [])
        answer = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(answer.stdout.strip().splitlines()[-1])
        ratio = result["check_s"] / result["decode_s"]
        worst = max(worst, ratio)
        print(f"{result['mode']:8s} {result['seconds']:4g} s ({result['samples']} samples x 2, {result['threads']} "
              f"threads): decode {result['decode_s'] * 1e3:9.1f} ms, check {result['check_s'] * 1e3:6.2f} ms, "
              f"ratio {ratio:.3%}")
        print(f"         waveform: RMS {result['rms_dbfs']} dBFS, DC/RMS {result['dc_over_rms']}, peak "
              f"{result['peak']}, on the clamp {result['clamped_share']:.2%}, findings {result['findings'] or 'none'}")
    print(f"worst ratio {worst:.3%} (goal < {GOAL:.0%}): {'met' if worst < GOAL else 'NOT met'}")
    return 0 if worst < GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
