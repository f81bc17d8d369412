"""Fused vs chunked DiT forward: peak activation memory and wall time, each mode in a fresh process.

    python benchmarks/streamed_dit.py                  # fused vs chunk_size=256, the issue's model and sequence
    python benchmarks/streamed_dit.py --rounds 1 --frames 3   # quicker, smaller sequence
    python benchmarks/streamed_dit.py --threads 1      # one thread: no OpenMP joins (fairer on a shared machine)

A random 2-block model (hidden 1024, 8 heads x 128, FFN 2816, fp32) is written once as a ComfyUI-layout
.safetensors file and loaded with `h3_core.load_dit(..., chunk_size=...)` in a fresh Python process per measurement.
After loading, building the inputs and a small warm-up forward (which touches every weight page and starts the thread
pools), the child resets its peak RSS (`5 > /proc/self/clear_refs`) and runs only the timed forward. Peak activation
memory = VmHWM after the forward - VmRSS at the reset. The modes alternate over `--rounds` rounds (fused, chunked,
fused, ...) so that a change in machine load hits both; medians are reported. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from h3_core import H3DiT, H3DiTConfig, build_packed_layout, load_dit, row_timesteps  # noqa: E402

CONFIG = H3DiTConfig(
    num_layers=2, num_refiner_layers=1, hidden_size=1024, num_attention_heads=8, attention_head_dim=128,
    ffn_dim=2816, in_channels=24, audio_in_channels=32, text_dim=1024, freq_dim=256, time_embed_hidden_dim=1024,
    time_embed_dim=512, rope_freq_dim=16,
)
TARGET_MEMORY_RATIO = 0.30
TARGET_TIME_RATIO = 1.10


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def model_inputs(frames: int, latent_hw: int, audio_latents: int, text_rows: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    layout = build_packed_layout(torch.ones(text_rows, dtype=torch.long), frames, latent_hw, latent_hw, audio_latents,
                                 (), CONFIG.patch_size)
    timestep, timestep_indices = row_timesteps(layout, 0.4, 0.6)
    return dict(
        hidden_states=torch.randn(1, layout.video_indices.numel(), CONFIG.video_patch_dim, generator=generator),
        audio_hidden_states=torch.randn(1, layout.audio_indices.numel(), CONFIG.audio_in_channels,
                                        generator=generator),
        encoder_hidden_states=torch.randn(1, text_rows, CONFIG.text_dim, generator=generator),
        timestep=timestep, timestep_indices=timestep_indices, **layout.model_kwargs(),
    )


def run_child(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk_size = args.chunk_size if args.mode == "chunked" else None
    model = load_dit(args.checkpoint, chunk_size=chunk_size)
    inputs = model_inputs(args.frames, args.latent_hw, args.audio_latents, args.text_rows)
    with torch.no_grad():
        model(**model_inputs(1, 8, 4, 8))  # warm-up: every weight page read, thread pools started
    gc.collect()
    rss_at_reset = proc_status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    with torch.no_grad():
        start = time.perf_counter()
        model(**inputs)
        seconds = time.perf_counter() - start
    peak_kib = proc_status_kib("VmHWM") - rss_at_reset
    print(json.dumps({"mode": args.mode, "chunk_size": chunk_size, "rows": int(inputs["position_ids"].shape[0]),
                      "peak_activation_mib": peak_kib / 1024, "seconds": seconds,
                      "threads": torch.get_num_threads()}))


def write_checkpoint(path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = H3DiT(CONFIG)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--frames", type=int, default=12, help="latent frames (12 -> 12,288 video rows at 64x64)")
    parser.add_argument("--latent-hw", type=int, default=64, help="latent height = width")
    parser.add_argument("--audio-latents", type=int, default=40, help="audio latents per stereo channel")
    parser.add_argument("--text-rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per mode, alternating (medians)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    parser.add_argument("--mode", choices=("fused", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        run_child(args)
        return

    runs = {"fused": [], "chunked": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "streamed_dit_bench.safetensors"
        write_checkpoint(checkpoint)
        for _ in range(args.rounds):
            for mode in runs:
                command = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--checkpoint", str(checkpoint),
                           "--chunk-size", str(args.chunk_size), "--frames", str(args.frames), "--latent-hw",
                           str(args.latent_hw), "--audio-latents", str(args.audio_latents), "--text-rows",
                           str(args.text_rows), "--threads", str(args.threads)]
                done = subprocess.run(command, check=True, capture_output=True, text=True)
                runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load_after = os.getloadavg()
    summary = {mode: {"peak_activation_mib": statistics.median(r["peak_activation_mib"] for r in results),
                      "seconds": statistics.median(r["seconds"] for r in results),
                      "all_seconds": [round(r["seconds"], 2) for r in results]}
               for mode, results in runs.items()}
    first = runs["fused"][0]
    print(f"H3 DiT forward, hidden {CONFIG.hidden_size}, {CONFIG.num_attention_heads} heads x "
          f"{CONFIG.attention_head_dim}, FFN {CONFIG.ffn_dim}, {CONFIG.num_layers} blocks, fp32, {first['rows']} "
          f"packed rows, {first['threads']} CPU threads ({os.cpu_count()} cores), medians of {args.rounds} fresh "
          f"processes per mode; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    for mode, r in summary.items():
        label = "fused" if mode == "fused" else f"chunked ({args.chunk_size} rows)"
        print(f"  {label:<22} peak activation {r['peak_activation_mib']:8.1f} MiB   time {r['seconds']:7.2f} s   "
              f"(runs: {r['all_seconds']})")
    memory_ratio = summary["chunked"]["peak_activation_mib"] / summary["fused"]["peak_activation_mib"]
    time_ratio = summary["chunked"]["seconds"] / summary["fused"]["seconds"]
    print(f"  chunked / fused: activation peak {memory_ratio:.3f} (target <= {TARGET_MEMORY_RATIO}), "
          f"time {time_ratio:.3f} (target <= {TARGET_TIME_RATIO})")


if __name__ == "__main__":
    main()
