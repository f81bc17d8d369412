"""Peak memory of a video VAE decode versus video length: h3_core (clip-streamed) and the diffusers reference.

Each mode runs in a fresh process: a tiny random video VAE (same clip / tile geometry as the release, 2 decoder blocks
of width 128) is loaded, the output buffer is preallocated, then one decode is measured three ways:

* `tracked`: peak bytes of tensors the decode itself allocates on the device (a dispatch-mode ledger; the weights and
  the preallocated output are not counted). Works on any device.
* `device`: the device allocator's peak growth over the decode, read through `h3_core.Platform` (CUDA; none on the CPU).
* `rss`: growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over the decode
  (CPU on Linux only; includes allocator slack).

Usage: python benchmarks/video_decode_memory.py [--device cpu|cuda] [--size 384] [--frames 39 124] [--threads 1]
Prints one row per mode and the long/short ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _latent_frames(frames: int) -> int:
    if (frames - 5) % 17:
        raise SystemExit(f"--frames {frames}: use 17k + 5 frames (5, 22, 39, 56, ..., 124, ...).")
    return (frames - 5) // 17 * 5 + 2


def _status_kb(field: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def child(args) -> None:
    import torch
    from vae_fixtures import LiveTensorBytes, reference_video, reference_video_decode

    from h3_core import Platform, load_video_vae

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    latent_frames = _latent_frames(args.frames)
    side = args.size // 16
    latent = torch.randn(1, 24, latent_frames, side, side, generator=torch.Generator().manual_seed(0))

    if args.mode == "h3_core":
        model = load_video_vae(args.checkpoint, device=device)
        out = torch.zeros(1, model.output_frames(latent_frames), args.size, args.size, 3)

        def run():
            model.decode(latent, out=out)
    else:  # the diffusers reference, the same weights (seed 0)
        model = reference_video(seed=0).to(device)
        latent = latent.to(device)

        def run():
            reference_video_decode(model, latent)

    platform = Platform.for_device(device)
    platform.synchronize()
    platform.reset_peak()
    device_base = platform.allocated_bytes()
    rss_ok = platform.host_is_device and _reset_peak_rss()
    rss_base = _status_kb("VmRSS")
    with LiveTensorBytes(device.type) as tracker:
        run()
    result = {"mode": args.mode, "frames": args.frames, "tracked_mib": tracker.peak / 2**20}
    platform.synchronize()
    peak = platform.peak_allocated_bytes()
    if peak is not None and device_base is not None:
        result["device_mib"] = (peak - device_base) / 2**20
    if rss_ok and rss_base is not None:
        result["rss_mib"] = (_status_kb("VmHWM") - rss_base) / 1024
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=384, help="square canvas in pixels (384 = 2 x 2 tiles of 256)")
    parser.add_argument("--frames", type=int, nargs=2, default=(39, 124), metavar=("SHORT", "LONG"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--frames-one", type=int, dest="frames_one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.frames = args.frames_one
        child(args)
        return

    from vae_fixtures import reference_video, save_video_diffusers

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_video_diffusers(reference_video(seed=0), Path(tmp) / "vae")
        for mode in ("h3_core", "diffusers"):
            for frames in args.frames:
                command = [sys.executable, __file__, "--child", "--mode", mode, "--checkpoint", str(checkpoint),
                           "--frames-one", str(frames), "--device", args.device, "--size", str(args.size),
                           "--threads", str(args.threads)]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))

    metrics = [m for m in ("tracked_mib", "device_mib", "rss_mib") if m in rows[0]]
    print(f"video decode peak memory, {args.size}x{args.size} px, device {args.device}, fresh process per mode")
    print(f"{'mode':<10} {'frames':>6} " + " ".join(f"{m:>12}" for m in metrics))
    for row in rows:
        print(f"{row['mode']:<10} {row['frames']:>6} " + " ".join(f"{row[m]:>12.1f}" for m in metrics))
    short, long = args.frames
    for mode in ("h3_core", "diffusers"):
        by_frames = {r["frames"]: r for r in rows if r["mode"] == mode}
        ratios = ", ".join(f"{m} {by_frames[long][m] / by_frames[short][m]:.3f}x" for m in metrics)
        print(f"{mode}: {long} vs {short} frames ({long / short:.2f}x) -> peak {ratios}")


if __name__ == "__main__":
    main()
