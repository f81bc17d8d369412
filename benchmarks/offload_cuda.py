"""Step time of layerwise offload against fully resident weights, and the host-to-device bandwidth it achieves.

Each mode runs in a fresh process (no allocator or pinned-memory state carried over) on an H3-shaped DiT with
random bf16 weights whose blocks have the requested size; the parent prints the offloaded/resident step-time ratio
and the H2D GB/s (raw pinned slab -> slot copies timed with events, and effective bytes moved per offloaded step).

    python benchmarks/offload_cuda.py                                   # 512 MiB blocks x 8, 8192 tokens
    python benchmarks/offload_cuda.py --block-mib 1230 --blocks 6 --tokens 16384   # H3-sized blocks (1.2 GiB)
    python benchmarks/offload_cuda.py --device cpu --dtype float32 --block-mib 8 --blocks 4 --tokens 256  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import h3_core  # noqa: E402
from h3_core.models.dit_config import H3DiTConfig  # noqa: E402
from h3_core.runtime import LayerwiseOffloadManager, Platform, offload_backend  # noqa: E402


def config_for(block_mib: float, blocks: int) -> H3DiTConfig:
    """An H3-proportioned config (heads of 128, SwiGLU 8/3 wide, AdaLN from half width) with ~block_mib per block.

    Block parameters ~ 3h^2 (QKV) + h^2 (out) + 3*f*h (SwiGLU) + 18h*h/2 (AdaLN) = 21 h^2 at f = 8h/3; bf16 doubles it.
    """
    hidden = max(128, round(math.sqrt(block_mib * 2**20 / 42) / 128) * 128)
    return H3DiTConfig(
        num_layers=blocks, num_refiner_layers=1, hidden_size=hidden, num_attention_heads=hidden // 128,
        attention_head_dim=128, ffn_dim=round(8 * hidden / 3 / 128) * 128, in_channels=24, audio_in_channels=32,
        text_dim=hidden, freq_dim=256, time_embed_hidden_dim=hidden, time_embed_dim=hidden // 2, rope_freq_dim=16,
    )


def packed_inputs(config: H3DiTConfig, tokens: int, device) -> dict:
    frames = 8
    side = max(2, round(math.sqrt(tokens / frames)) * 2)  # video rows = frames * (side/2)^2
    layout = h3_core.build_packed_layout(torch.ones(64, dtype=torch.long), frames, side, side, audio_latents=32)
    timestep, timestep_indices = h3_core.row_timesteps(layout, 0.4, 0.6)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g),
        audio_hidden_states=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, 64, config.text_dim, generator=g),
        timestep=timestep, timestep_indices=timestep_indices, **layout.model_kwargs())
    return {k: v.to(device) for k, v in inputs.items()}


def build_model(config: H3DiTConfig, device, dtype: torch.dtype) -> h3_core.H3DiT:
    """Random weights drawn on the device (fast), the same for every mode."""
    with torch.device("meta"):
        model = h3_core.H3DiT(config)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        value = torch.empty(p.shape, dtype=dtype, device=device)
        if p.ndim > 1:
            value.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
        else:  # norm weights 1, biases 0: activations stay finite however deep the stack
            value.fill_(1.0 if "norm" in name else 0.0)
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    c = config
    inv_freq = h3_core.models.dit.RotaryEmbedding3D.frequencies(c.rope_freq_dim, c.rope_theta)
    model.rope._buffers["inv_freq"] = inv_freq.to(device)
    return model.eval()


class Clock:
    """Wall time of queued device work: the device is drained before and after (steps take far longer than that)."""

    def __init__(self, device):
        self.platform = Platform.for_device(device)

    def measure(self, fn) -> float:
        self.platform.synchronize()
        begin = time.perf_counter()
        fn()
        self.platform.synchronize()
        return time.perf_counter() - begin


def run_mode(args) -> dict:
    device = torch.device(args.device)
    config = config_for(args.block_mib, args.blocks)
    inputs = packed_inputs(config, args.tokens, device)
    model = build_model(config, device, getattr(torch, args.dtype))
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    if args.mode == "layerwise":  # built on the device like the resident model, then handed to the host store
        manager = LayerwiseOffloadManager(offload_backend(device), prefetch=args.prefetch,
                                          resident_blocks=args.resident_blocks or None)
        model.block_residency = manager.attach(model.blocks)
    clock = Clock(device)
    steps = []
    with torch.no_grad():
        for step in range(args.warmup + args.steps):
            elapsed = clock.measure(lambda: model(**inputs))
            if step >= args.warmup:
                steps.append(elapsed)
    result = {"mode": args.mode, "step_s": statistics.median(steps), "steps": steps, "hidden": config.hidden_size,
              "rows": int(inputs["position_ids"].shape[0]), "device_name": Platform.for_device(device).name()}
    peak = Platform.for_device(device).peak_allocated_bytes()
    if peak is not None:
        result["peak_allocated"] = peak
    if args.mode == "layerwise":
        manager = model.block_residency
        stats = manager.stats()
        result.update(bytes_h2d_per_step=stats.last_pass.bytes_h2d, pinned_bytes=stats.pinned_bytes,
                      host_store_bytes=stats.host_store_bytes, peak_held=stats.last_pass.peak_held_bytes,
                      peak_device=stats.last_pass.peak_device_bytes, wait_s=stats.last_pass.wait_s,
                      store=stats.store)
        result["raw_h2d_gbps"] = raw_copy_gbps(manager, clock) if manager.streamed else None
    result["block_bytes"] = block_bytes
    return result


def raw_copy_gbps(manager, clock, repeats: int = 10) -> float:
    """One streamed block moved host -> device the way the backend moves it, timed on the device."""
    unit = manager.streamed[0]
    store, device = manager.store, manager.backend.device
    nbytes = store.unit_bytes(unit)
    if manager.backend.asynchronous:  # one DMA of the block's slab into a slot-sized buffer
        source = store.slab(unit).data
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def copy():
            target.copy_(source, non_blocking=True)
    else:  # the synchronous backend materialises tensor by tensor
        def copy():
            store.materialise(unit, device)
    copy()
    seconds = clock.measure(lambda: [copy() for _ in range(repeats)])
    return repeats * nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-mib", type=float, default=512, help="MiB per block in bf16 (default 512)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="approximate packed rows per forward")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--resident-blocks", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--mode", choices=["resident", "layerwise"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    results = {}
    for mode in ("resident", "layerwise"):
        command = [sys.executable, __file__, "--mode", mode] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "mode"]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{mode} run failed:\n{out.stderr[-4000:]}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    resident, layerwise = results["resident"], results["layerwise"]
    gib = 2**30
    print(f"device {resident['device_name']}: {args.blocks} {args.dtype} blocks of "
          f"{layerwise['block_bytes'] / gib:.3f} GiB (hidden {resident['hidden']}), {resident['rows']} rows, "
          f"prefetch {args.prefetch}, resident blocks {args.resident_blocks}; median of {args.steps} steps after "
          f"{args.warmup} warm-up")
    print(f"resident : {resident['step_s'] * 1e3:9.1f} ms/step"
          + (f", peak allocated {resident['peak_allocated'] / gib:.2f} GiB" if "peak_allocated" in resident else ""))
    print(f"layerwise: {layerwise['step_s'] * 1e3:9.1f} ms/step"
          + (f", peak allocated {layerwise['peak_allocated'] / gib:.2f} GiB" if "peak_allocated" in layerwise else "")
          + f", store {layerwise['store']} ({layerwise['pinned_bytes'] / gib:.2f} GiB pinned), "
            f"host wait {layerwise['wait_s'] * 1e3:.1f} ms/step")
    print(f"ratio offloaded/resident step time: {layerwise['step_s'] / resident['step_s']:.3f}")
    moved = layerwise["bytes_h2d_per_step"]
    print(f"H2D per offloaded step: {moved / gib:.2f} GiB = {moved / layerwise['step_s'] / 1e9:.1f} GB/s effective; "
          + (f"raw block copy {layerwise['raw_h2d_gbps']:.1f} GB/s" if layerwise["raw_h2d_gbps"] else ""))


if __name__ == "__main__":
    main()
