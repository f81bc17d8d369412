"""Peak host memory of a long video versus its length: 15 s, 30 s and 60 s, each made in a fresh process by
`h3_core.pipeline.long_video.generate_long_video` (windows of at most 15 s, each decoded and streamed into the mp4).

The transformer and the text encoder are the embedded tiny model's (the claim is about decoding and writing); each
VAE is either the released widths with synthetic weights (`released`: benchmarks/synthetic_h3.py writes it) or the
tiny model's (`tiny`). The default is the released audio VAE (0.6 GB fp32; its decoder runs at up to 32 kHz, the
per-length activations that matter) with the tiny video VAE: the released video VAE is 5.2 GB in fp16 and ran at
10.4 GiB resident and about 1.5 s per 64x64 frame on the 2-core, 24 GB machine this was written on, so a 60 s clip
would take over half an hour for its video alone and its weights would dwarf the frames the claim is about
(`--video-vae released` runs it where there is the room). Each child samples its RssAnon
(anonymous resident memory: tensors, the heap; not the memory-mapped weight files) every 20 ms from /proc/self/status
and reports the largest, plus VmHWM (peak RSS). The parent prints one row per duration, the whole clip's decoded
frames in float32 (what a stitch-everything-then-write approach would hold at least once), and the ratios of the
peaks to the 15 s run's (within 5 % of each other is the bar).

    nice python benchmarks/long_video.py --size 128x64                          # released audio VAE, tiny video VAE
    nice python benchmarks/long_video.py --video-vae released --size 64x32      # both released: hours on a CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def model_folder(video_vae: str, audio_vae: str, cache: Path) -> Path:
    """The tiny model, with a released-width synthetic VAE for each one named "released" (written once into
    `cache`)."""
    from h3_core.sources.tiny_default import ensure_tiny_model

    tiny = ensure_tiny_model(cache / "h3cache")
    if video_vae == audio_vae == "tiny":
        return tiny
    folder = cache / f"video-{video_vae}-audio-{audio_vae}"
    if not (folder / "model_index.json").exists():
        import synthetic_h3

        staging = cache / f"{folder.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(tiny, staging)
        (staging / "tiny_manifest.json").unlink(missing_ok=True)
        if video_vae == "released":
            next((staging / "vae").glob("*video_vae*")).unlink()
            synthetic_h3.write_video_vae(staging / "vae")
        if audio_vae == "released":
            next((staging / "vae").glob("*audio_vae*")).unlink()
            synthetic_h3.write_audio_vae(staging / "vae")
        staging.rename(folder)
    return folder


def child(args) -> None:
    import torch

    from h3_core.pipeline import H3Pipeline
    from h3_core.pipeline.long_video import generate_long_video
    from h3_core.request.generation_request import GenerationRequest
    from h3_core.request.windows import long_frame_count
    from h3_core.sources.model_sources import resolve_model

    torch.set_num_threads(args.threads)
    peak = {"anon": _status_kib("RssAnon")}
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["anon"] = max(peak["anon"], _status_kib("RssAnon"))
            time.sleep(0.02)

    width, height = (int(v) for v in args.size.split("x"))
    pipeline = H3Pipeline(resolve_model(Path(args.model)))
    request = GenerationRequest("a long take of a beach", width=width, height=height, steps=2, seed=1)
    total = long_frame_count(args.seconds)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        result = generate_long_video(pipeline, request, Path(folder) / "long.mp4", total_frames=total)
        size = (Path(folder) / "long.mp4").stat().st_size
    elapsed = time.perf_counter() - started
    done.set()
    watcher.join()
    peak["anon"] = max(peak["anon"], _status_kib("RssAnon"))
    print(json.dumps({"seconds": args.seconds, "frames": result.num_frames, "windows": len(result.windows),
                      "peak_rss_anon_kib": peak["anon"], "vm_hwm_kib": _status_kib("VmHWM"),
                      "elapsed_s": elapsed, "mp4_bytes": size,
                      "clip_frames_float32_bytes": result.num_frames * width * height * 3 * 4}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--video-vae", choices=("released", "tiny"), default="tiny")
    parser.add_argument("--audio-vae", choices=("released", "tiny"), default="released")
    parser.add_argument("--size", default="128x64", help="WIDTHxHEIGHT canvas (default 128x64)")
    parser.add_argument("--seconds", type=float, nargs="+", default=[15, 30, 60])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "h3-long-video-bench")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.seconds = args.seconds[0]
        return child(args)
    args.cache.mkdir(parents=True, exist_ok=True)
    model = model_folder(args.video_vae, args.audio_vae, args.cache)
    rows = []
    for seconds in args.seconds:
        out = subprocess.run([sys.executable, __file__, "--child", "--model", str(model), "--size", args.size,
                              "--threads", str(args.threads), "--seconds", str(seconds)],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{seconds:>5g} s: {row['frames']} frames, {row['windows']} window(s), peak RssAnon "
              f"{row['peak_rss_anon_kib'] / 2**20:.3f} GiB, VmHWM {row['vm_hwm_kib'] / 2**20:.3f} GiB, "
              f"{row['elapsed_s']:.0f} s; the whole clip's frames in float32 would be "
              f"{row['clip_frames_float32_bytes'] / 2**30:.3f} GiB", flush=True)
    base = rows[0]["peak_rss_anon_kib"]
    print(f"video VAE {args.video_vae}, audio VAE {args.audio_vae}, canvas {args.size}, {args.threads} threads; peak RssAnon ratios to the "
          f"{rows[0]['seconds']:g} s run: " + ", ".join(f"{r['seconds']:g} s {r['peak_rss_anon_kib'] / base:.3f}"
                                                          for r in rows))
    spread = max(r["peak_rss_anon_kib"] for r in rows) / min(r["peak_rss_anon_kib"] for r in rows) - 1
    print(f"largest / smallest peak - 1 = {100 * spread:.1f} % ({'within' if spread <= 0.05 else 'outside'} the "
          "5 % bar)")


if __name__ == "__main__":
    main()
