"""A LoRA on streamed blocks at the released widths: host memory and time of one layerwise forward, with and
without a rank-64 LoRA on every block (attention and MLP; rank 16 on the AdaLN tables), each in a fresh process.

    python benchmarks/lora_streamed.py                      # 3 blocks, bf16, 1024 packed rows (~4.5 GB file in /tmp)
    python benchmarks/lora_streamed.py --blocks 6 --rows 4096

A synthetic DiT at the released widths (hidden 5376, 56 heads x 128, SwiGLU 14336, AdaLN 96768 x 2688, one refiner
block) is written in the native layout (per-head interleaved QKV) with small random bf16 weights, and a LoRA in the
original key format. The CPU is the device: a streamed block's device copy is host memory, so "RssAnon in use" (after
malloc_trim) is what the forward holds. Reported: the forward's peak RssAnon growth and wall time, with / without the
LoRA, and their ratio; the LoRA factors stay memory-mapped, and each fold's temporary is bounded (FOLD_ELEMENTS). The
files are deleted at the end. Linux only (reads /proc, calls glibc's malloc_trim).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import ctypes, json, sys, threading, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import torch
import h3_core
from h3_core.models.dit_config import H3DiTConfig
from h3_fixtures import packed_inputs

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

folder, lora, rows = sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(2)
config = H3DiTConfig.from_dict(json.load(open(folder + "/config.json")))
frames = max(1, rows // (32 * 32))
inputs = packed_inputs(config, text_len=64, latent_frames=frames, latent_hw=(64, 64), audio_latents=8)
ctypes.CDLL("libc.so.6").malloc_trim(0)
model = h3_core.load_dit(folder, residency="layerwise", loras=[(lora, 1.0)] if lora != "-" else [])
before = rss_anon()
peak = [before]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
with torch.no_grad():
    video, audio = model(**inputs)
elapsed = time.perf_counter() - start
stop.set()
assert torch.isfinite(video).all()
print(json.dumps({"peak_growth": peak[0] - before, "seconds": elapsed, "rows": int(inputs["position_ids"].shape[0]),
                  "folds": model.lora_fold.folds if model.lora_fold else 0}))
"""


def write_files(folder: Path, blocks: int) -> tuple[Path, Path, object]:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    from safetensors.torch import save_file

    from h3_core.models.dit_config import H3DiTConfig
    from offload_fixtures import save_native

    config = H3DiTConfig(num_layers=blocks, num_refiner_layers=1)  # released widths
    from h3_core.models.dit import H3DiT

    with torch.device("meta"):
        meta = H3DiT(config)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in meta.named_parameters():
        if p.ndim == 1:
            state[name] = (torch.ones if "norm" in name else torch.zeros)(p.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5)).to(torch.bfloat16)
    state["rope.inv_freq"] = meta.rope.frequencies(config.rope_freq_dim, config.rope_theta)
    for name in [n for n in state if n.startswith(("video_patch_proj", "audio_patch_proj", "time_embedder",
                                                   "final_layer.video_out", "final_layer.audio_out"))]:
        state[name] = state[name].float()  # the release's fp32 islands
    checkpoint = save_native(state, config, folder / "transformer")
    del state
    lora = {}
    shapes = {"attn.qkv_proj": 64, "attn.out_proj": 64, "mlp.fc1": 64, "mlp.fc2": 64, "adaln_proj.linear": 16}
    params = dict(meta.named_parameters())
    for i in range(blocks):
        for module, rank in shapes.items():
            rows, cols = params[f"blocks.{i}.{module}.weight"].shape
            lora[f"blocks.{i}.{module}.lora_A.weight"] = (torch.randn(rank, cols, generator=g) * 0.01).to(torch.bfloat16)
            lora[f"blocks.{i}.{module}.lora_B.weight"] = (torch.randn(rows, rank, generator=g) * 0.01).to(torch.bfloat16)
    lora_path = folder / "lora.safetensors"
    save_file(lora, str(lora_path))
    return checkpoint, lora_path, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1024, help="about this many packed rows (video 64x64 latents)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="h3_lora_streamed_", dir="/tmp"))
    try:
        checkpoint, lora, config = write_files(folder, args.blocks)
        size = (checkpoint / "model.safetensors").stat().st_size
        runs = {"plain": [], "lora": []}
        for _ in range(args.rounds):
            for mode in runs:
                out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(checkpoint),
                                      str(lora) if mode == "lora" else "-", str(args.rows)],
                                     capture_output=True, text=True, timeout=1800)
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        best = {mode: min(r["peak_growth"] for r in rs) for mode, rs in runs.items()}
        times = {mode: sorted(r["seconds"] for r in rs)[len(rs) // 2] for mode, rs in runs.items()}
        block = size / (args.blocks + 1.5)  # rough: the refiner and embedders are about 1.5 blocks
        print(f"layerwise forward, released widths, {args.blocks} blocks ({size / 2**30:.2f} GiB bf16 file, "
              f"~{block / 2**30:.2f} GiB/block), LoRA {lora.stat().st_size / 2**20:.0f} MiB, "
              f"{runs['plain'][0]['rows']} packed rows, CPU as the device, 2 threads, {args.rounds} rounds")
        for mode in runs:
            print(f"  {mode:<5} peak RssAnon growth {best[mode] / 2**30:6.2f} GiB   forward {times[mode]:7.2f} s   "
                  f"(runs {[round(r['seconds'], 2) for r in runs[mode]]}; folds {runs[mode][0]['folds']})")
        print(f"  lora / plain: peak memory {best['lora'] / best['plain']:.3f}, extra "
              f"{(best['lora'] - best['plain']) / 2**20:.0f} MiB; time {times['lora'] / times['plain']:.3f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
