"""Quantised transformer checkpoints streamed layerwise: bytes moved per pass against the file size, and peak
RssAnon against the block count (issue 17).

    python benchmarks/quantized_streaming.py                       # 24 released blocks (~30.5 GiB bf16 + quantised)
    python benchmarks/quantized_streaming.py --blocks 12 --keep    # smaller; keep the files for another run
    python benchmarks/quantized_streaming.py --smoke               # reduced widths, 2 blocks: checks the script only

A synthetic bf16 DiT at the released widths (`benchmarks/synthetic_h3.py`, native layout) is written under `--out`
(default /tmp/h3-quantised, deleted afterwards unless `--keep`), then `python -m h3_core quantize` makes each
`--formats` file from it (q8_0 -> .gguf, fp8 / int8 -> ComfyUI .safetensors), from the whole model and from a
`--mid-blocks` view (a filtered index, no copy), so each format exists at two block counts. Disk: the bf16 files
plus about 0.53x (q8_0) / 0.50x (fp8, int8) of them per format and block count.

Every measurement runs in a fresh process:

1. quantise: peak RssAnon while writing each file (the tool holds one parameter at a time);
2. one cold layerwise forward (`load_dit(..., residency="layerwise")`, page cache dropped first) per file: the bytes
   the block and AdaLN stores moved host-to-device in the pass (`bytes_h2d`), the bytes they read from disk, and
   peak RssAnon (sampled every 10 ms).

Goals: bytes streamed per pass ~ the streamed units' quantised size in the file (streamed / stored ~ 1; the norms and
biases are cast to the compute dtype, a few KiB a block; q8_0 ~ 0.53x what bf16 streams), and peak RssAnon flat in
the block count (mid vs all blocks within 5 %). Linux only (RssAnon from /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from real_scale import AnonSampler, block_view, evict, managers_of, model_inputs, proc_status  # noqa: E402

GiB = 1024 ** 3
SUFFIX = {"q8_0": ".gguf", "fp8": ".safetensors", "int8": ".safetensors"}
GOAL_FLAT = 0.05
# Reduced widths for --smoke (every tensor still quantisable: columns multiples of 32).
SMOKE_WIDTHS = dict(hidden_size=256, num_attention_heads=2, attention_head_dim=128, ffn_dim=512, text_dim=256,
                    time_embed_dim=256)


def size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


def files_of(path: Path) -> list[Path]:
    return sorted(p.resolve() for p in path.glob("*.safetensors")) if path.is_dir() else [path]


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in files_of(path))


# ---- children -------------------------------------------------------------------------------------------------------


def child_quantise(args) -> dict:
    from h3_core.checkpoints.quantiser import quantise_checkpoint

    sampler = AnonSampler()
    base = proc_status("RssAnon")
    quantise_checkpoint(args.model, args.target, args.format)
    return {"peak_anon": sampler.stop(), "base_anon": base}


def child_forward(args) -> dict:
    import torch

    import h3_core
    from h3_core.runtime.file_reads import disk_read_bytes

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    evict(files_of(path))
    sampler = AnonSampler()
    base = proc_status("RssAnon")
    model = h3_core.load_dit(path, dtype=getattr(torch, args.dtype), residency="layerwise")
    _, inputs = model_inputs(model.config, args)
    disk = disk_read_bytes()
    with torch.no_grad():
        video, _ = model(**inputs)
    peak = sampler.stop()
    assert torch.isfinite(video).all()
    passes = [m.stats().last_pass for m in managers_of(model)]
    return {"peak_anon": peak, "base_anon": base, "bytes_h2d": sum(p.bytes_h2d for p in passes),
            "bytes_read": sum(p.bytes_read for p in passes), "disk_read": disk_read_bytes() - disk,
            "host_store": sum(m.store.host_bytes for m in managers_of(model)), "file_bytes": size_of(path)}


CHILDREN = {"quantise": child_quantise, "forward": child_forward}


def run_child(kind: str, args, **extra) -> dict:
    argv = [sys.executable, __file__, "--child", kind, "--threads", str(args.threads), "--dtype", args.dtype,
            "--text-rows", str(args.text_rows), "--frames", str(args.frames), "--latent-hw", str(args.latent_hw),
            "--audio-latents", str(args.audio_latents)]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{kind} child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- parent ---------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=24, help="DiT blocks of the synthetic model (released: 50)")
    parser.add_argument("--mid-blocks", type=int, default=None, help="the smaller block count (default: half)")
    parser.add_argument("--formats", default="q8_0,fp8,int8")
    parser.add_argument("--out", type=Path, default=Path("/tmp/h3-quantised"))
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    parser.add_argument("--smoke", action="store_true", help="reduced widths and 2 blocks: checks the script only")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--dtype", default="float32", help="compute dtype (float32 on the CPU)")
    parser.add_argument("--text-rows", type=int, default=64)
    parser.add_argument("--frames", type=int, default=2)
    parser.add_argument("--latent-hw", type=int, default=8)
    parser.add_argument("--audio-latents", type=int, default=8)
    parser.add_argument("--child", choices=sorted(CHILDREN))
    parser.add_argument("--model")
    parser.add_argument("--target")
    parser.add_argument("--format")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return
    from synthetic_h3 import write_dit

    if args.smoke:
        args.blocks, args.threads = 2, 1
    mid = args.mid_blocks or max(1, args.blocks // 2)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        # Small shards for --smoke too: the block view needs the index of a sharded folder.
        full, _ = write_dit(args.out / "bf16", args.blocks, config_overrides=SMOKE_WIDTHS if args.smoke else None,
                            **({"shard_bytes": 4 << 20} if args.smoke else {}))
        sources = {args.blocks: full, mid: block_view(full, mid, args.out / f"bf16-{mid}")}
        rows = []
        for blocks, source in sorted(sources.items()):
            bf16 = run_child("forward", args, model=source)
            rows.append(("bf16", blocks, bf16, None))
            for fmt in formats:
                target = args.out / f"h3-{blocks}-{fmt}{SUFFIX[fmt]}"
                quantised = run_child("quantise", args, model=source, target=target, format=fmt)
                rows.append((fmt, blocks, run_child("forward", args, model=target), quantised))
        print("| format | blocks | file | streamed units as stored | streamed / pass | streamed / stored | "
              "vs bf16 stored | vs bf16 streamed | peak RssAnon | quantise peak RssAnon |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        bf16_streamed = {blocks: r["bytes_h2d"] for fmt, blocks, r, _ in rows if fmt == "bf16"}
        bf16_stored = {blocks: r["host_store"] for fmt, blocks, r, _ in rows if fmt == "bf16"}
        for fmt, blocks, r, q in rows:
            quantise_peak = "-" if q is None else size(q["peak_anon"])
            # A block view shares the full model's shards: its file size is theirs.
            file = size(r["file_bytes"]) + (" (shared shards)" if fmt == "bf16" and blocks != args.blocks else "")
            print(f"| {fmt} | {blocks} | {file} | {size(r['host_store'])} | {size(r['bytes_h2d'])} | "
                  f"{r['bytes_h2d'] / r['host_store']:.3f} | {r['host_store'] / bf16_stored[blocks]:.3f} | "
                  f"{r['bytes_h2d'] / bf16_streamed[blocks]:.3f} | "
                  f"{size(r['peak_anon'])} | {quantise_peak} |")
        for fmt in ["bf16"] + formats:
            peaks = {blocks: r["peak_anon"] for f, blocks, r, _ in rows if f == fmt}
            if len(peaks) == 2:
                low, high = peaks[min(peaks)], peaks[max(peaks)]
                flat = abs(high - low) / low
                print(f"{fmt}: peak RssAnon {min(peaks)} vs {max(peaks)} blocks differs by {flat:.1%} "
                      f"({'ok' if flat <= GOAL_FLAT else 'over'} the {GOAL_FLAT:.0%} goal)")
    finally:
        if not args.keep:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
