"""Layerwise offload streamed from checkpoint files through the pinned staging ring, against fully resident weights.

This is the path `load_dit(residency="layerwise")` takes on CUDA: each block is read from its safetensors file by
`StagedReads` into a page-locked staging ring, leading blocks are packed into pinned slabs while the pin budget
lasts, and a copy stream moves them into fixed device slots. Here the pin budget is constrained on purpose
(`--pin-units` blocks packed beyond the ring), so both the packed slabs and the ring are measured.

A synthetic DiT at the released widths (`synthetic_h3.write_dit`, native layout, bf16 with the fp32 islands) is
written under `--out`; each mode runs in a fresh process (no allocator or pinned-memory state carried over). Per
mode: load time, median step time (a sampling step: the text refinement and the AdaLN tables computed once
beforehand, as `h3_core.denoise` does), peak RssAnon; for the ring also the overlap waits (host time in acquire,
time waiting for reads), bytes read from the files and copied to the device per step, pinned GiB, and the raw
host-to-device GB/s of one pinned slab. The parent prints the offloaded/resident step ratio.

    python benchmarks/offload_cuda.py --device cuda                      # 8 released blocks, 4 packed, bf16
    python benchmarks/offload_cuda.py --device cuda --blocks 12 --pin-units 2 --latent-hw 64 --frames 8
    python benchmarks/offload_cuda.py --device cpu --widths tiny --blocks 3 --pin-units 1   # smoke test, seconds

Helpers used by `offload_checks.py` (`gpu_first_run.py`, tests/test_residency_cuda.py): `streamed_dit` (load_dit's
layerwise path with an explicit backend class, pin budget and page-locker, on any device: the CPU runs the
asynchronous backend with inline streams, `platform=` a simulated device), `constrained_budget` and `unit_bytes`.
On the CPU the page-locker is a `CountingPinner` (it locks nothing), so the pin budget, the packing of slabs and the
unpinning run as on CUDA. `gpu_first_run.py` runs this benchmark as its `released` section. Linux (RssAnon from
/proc).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import torch  # noqa: E402

import h3_core  # noqa: E402
from h3_core.checkpoints import placement  # noqa: E402
from h3_core.runtime import layerwise  # noqa: E402
from h3_core.runtime.host_store import PinBudget  # noqa: E402
from h3_core.runtime.offload_backends import AsyncBackend  # noqa: E402
from real_scale import AnonSampler, add_model_arguments, model_inputs, parse_or_run_child, proc_status  # noqa: E402

GiB = 1024 ** 3
ALIGN = 256  # every tensor of a staging buffer or slot starts on a 256-byte boundary
# Reduced widths for a smoke test or a dry run (same layout, same code; two 128-wide heads).
TINY_WIDTHS = dict(hidden_size=256, num_attention_heads=2, attention_head_dim=128, ffn_dim=512, text_dim=256,
                   time_embed_hidden_dim=256, time_embed_dim=128)


# ---- helpers shared with gpu_first_run.py and tests/test_residency_cuda.py ------------------------------------------


class CountingPinner:
    """A page-locker that locks nothing and remembers what it was asked to lock: on the CPU (which has no page-locker)
    the pin budget, the packing of slabs and the unpinning at close run as they do on CUDA."""

    def __init__(self):
        self.registered: dict[int, int] = {}  # data_ptr -> bytes

    def register(self, buffer: torch.Tensor) -> bool:
        self.registered[buffer.data_ptr()] = buffer.numel()
        return True

    def unregister(self, buffer: torch.Tensor) -> bool:
        return self.registered.pop(buffer.data_ptr(), None) is not None

    def holds(self, buffer: torch.Tensor) -> bool:
        return buffer.data_ptr() in self.registered


def pinner_for(device):
    """The device's own page-locker (CUDA), else a `CountingPinner`."""
    return h3_core.Platform.for_device(device).host_pinner() or CountingPinner()


def page_locked(buffer: torch.Tensor, pinner) -> bool:
    """Whether `buffer` is page-locked as `pinner` sees it (the driver's view for a real page-locker)."""
    return pinner.holds(buffer) if isinstance(pinner, CountingPinner) else buffer.is_pinned()


@contextlib.contextmanager
def asynchronous_backends(pin_budget: PinBudget, pinner=None, backend_class=AsyncBackend, **options):
    """While active, the layerwise loaders' managers (load_dit's blocks and their AdaLN projections) get a
    `backend_class` backend with this pin budget and page-locker (None: the device's), whatever the device.

    load_dit has no option for a backend (users get the platform's); a benchmark needs a constrained budget and a
    test a poisoning backend, so the loaders' factory is replaced here, for both places that call it."""
    def make(device, **loader_options):
        return backend_class(device, **{**loader_options, **options, "pin_budget": pin_budget, "pinner": pinner})

    with mock.patch.object(layerwise, "offload_backend", make), mock.patch.object(placement, "offload_backend", make):
        yield


def streamed_dit(source, device, *, pin_budget: PinBudget, pinner=None, backend_class=AsyncBackend,
                 read_ahead: int = 1, platform=None, **load_options) -> h3_core.H3DiT:
    """`load_dit(source, residency="layerwise")` through `backend_class` (default the CUDA backend) with `pin_budget`:
    blocks read from the files into the staging ring, leading ones packed while the budget lasts. `platform`: a
    simulated device's (tests/fake_cuda.py; `device` is then where its tensors live, the CPU)."""
    options = {"read_ahead": read_ahead} if platform is None else {"read_ahead": read_ahead, "platform": platform}
    with asynchronous_backends(pin_budget, pinner, backend_class, **options):
        return h3_core.load_dit(source, device=device, residency="layerwise", **load_options)


def unit_bytes(config, dtype: torch.dtype) -> tuple[int, int]:
    """(block unit, AdaLN unit) bytes as laid out in a staging buffer: a block without its AdaLN projection (streamed
    apart), and the projection; each tensor rounded up to the 256-byte alignment."""
    with torch.device("meta"):
        block = h3_core.H3DiT(dataclasses.replace(config, num_layers=1)).blocks[0]
    body = adaln = 0
    for name, p in block.named_parameters():
        nbytes = -(-p.numel() * dtype.itemsize // ALIGN) * ALIGN
        if name.startswith("adaln_proj."):
            adaln += nbytes
        else:
            body += nbytes
    return body, adaln


def constrained_budget(config, dtype: torch.dtype, pin_units: int, read_ahead: int = 1) -> PinBudget:
    """A pin budget for the blocks' staging ring (read_ahead + 1 buffers) and `pin_units` packed blocks, with slack
    under a block (so exactly that many pack). The AdaLN manager, attached second, gets what is left: nothing pinned
    (a sampling step never reads its units: the tables are computed once per run)."""
    body, _ = unit_bytes(config, dtype)
    return PinBudget((read_ahead + 1 + pin_units) * body + body // 4)


class Clock:
    """Wall time of queued device work: the device is drained before and after."""

    def __init__(self, device):
        self.platform = h3_core.Platform.for_device(device)

    def measure(self, fn) -> float:
        self.platform.synchronize()
        begin = time.perf_counter()
        fn()
        self.platform.synchronize()
        return time.perf_counter() - begin


def step_inputs(model, args, device) -> tuple[dict, dict]:
    """A forward's inputs on `device`, and the step-invariant work a sampling step gets precomputed (refined text,
    this call's AdaLN tables), as `h3_core.denoise` computes them once per run."""
    _, inputs = model_inputs(model.config, args)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        refined = model.refine_text(inputs["encoder_hidden_states"])
        plan = model.adaln_plan([inputs["timestep"]])
    return inputs, dict(refined_text=refined, modulation=plan.call(inputs["timestep"].cpu()))


def raw_copy_gbps(store, device, clock: Clock, repeats: int = 10) -> float | None:
    """One packed pinned slab copied to a device buffer as the backend copies it (non-blocking, one DMA)."""
    slabs = [s for s in store.slabs.values() if s.pinned]
    if not slabs or clock.platform.host_is_device:
        return None
    source = slabs[0].data
    target = torch.empty(source.numel(), dtype=torch.uint8, device=device)

    def copy():
        target.copy_(source, non_blocking=True)

    copy()
    return repeats * source.numel() / clock.measure(lambda: [copy() for _ in range(repeats)]) / 1e9


# ---- children -------------------------------------------------------------------------------------------------------


def child_mode(args) -> dict:
    """One mode in this fresh process: `resident` or `ring`."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    platform = h3_core.Platform.for_device(device)
    sampler = AnonSampler()
    base_anon = proc_status("RssAnon")
    started = time.perf_counter()
    if args.child == "resident":
        model = h3_core.load_dit(args.model, device=device, dtype=dtype)
        budget = pinner = None
    else:
        config = h3_core.resolve_dit_checkpoint(args.model).config
        budget = constrained_budget(config, dtype, args.pin_units, args.read_ahead)
        pinner = pinner_for(device)
        model = streamed_dit(args.model, device, pin_budget=budget, pinner=pinner, dtype=dtype,
                             read_ahead=args.read_ahead, prefetch=None if args.prefetch < 0 else args.prefetch)
    platform.synchronize()
    load_s = time.perf_counter() - started
    inputs, precomputed = step_inputs(model, args, device)
    clock = Clock(device)
    ring = args.child == "ring"
    steps, passes = [], []
    with torch.no_grad():
        for step in range(args.warmup + args.steps):
            if step == args.warmup and ring:
                # Reads run ahead on the reader thread (the next pass's head during this pass's tail), so one pass's
                # counters may or may not hold a read in flight: the timed steps are counted together.
                read_before = model.block_residency.store.counters.bytes_read
            elapsed = clock.measure(lambda: model(**inputs, **precomputed))
            if step >= args.warmup:
                steps.append(elapsed)
                if ring:
                    passes.append(model.block_residency.stats().last_pass)
        video, _ = model(**inputs, **precomputed)
    if args.save_output:
        torch.save(video.float().cpu(), args.save_output)
    result = {"mode": args.child, "load_s": load_s, "step_s": statistics.median(steps), "steps": steps,
              "finite": bool(torch.isfinite(video).all()), "rows": int(inputs["position_ids"].shape[0]),
              "hidden": model.config.hidden_size, "blocks": model.config.num_layers, "device_name": platform.name(),
              "peak_allocated": platform.peak_allocated_bytes()}
    if ring:
        manager = model.block_residency
        store = manager.store
        result.update(
            acquire_wait_s=statistics.mean(p.wait_s for p in passes),
            read_wait_s=statistics.mean(p.read_wait_s for p in passes),
            bytes_read_per_step=(store.counters.bytes_read - read_before) / len(passes),
            bytes_h2d_per_step=statistics.mean(p.bytes_h2d for p in passes),
            unprefetched_loads=max(p.unprefetched_loads for p in passes),
            pinned_bytes=store.pinned_bytes + model.adaln_residency.store.pinned_bytes,
            pin_budget_bytes=budget.limit_bytes, pin_budget_used=budget.used_bytes,
            packed_units=sorted(store.slabs), streamed_units=list(manager.streamed),
            ring_bytes=store.ring_bytes, staging_bytes=store.staging_bytes, store=store.kind,
            raw_h2d_gbps=raw_copy_gbps(store, device, clock))
        result["effective_h2d_gbps"] = result["bytes_h2d_per_step"] / result["step_s"] / 1e9
    result.update(peak_anon=sampler.stop(), base_anon=base_anon, anon_now=proc_status("RssAnon"))
    return result


CHILDREN = {"resident": child_mode, "ring": child_mode}
CHILD_FLAGS = ("dtype", "device", "threads", "frames", "latent_hw", "audio_latents", "text_rows", "prefetch",
               "pin_units", "read_ahead", "steps", "warmup")


def run_child(args, mode: str, model: Path, timeout: float | None = None, save_output: Path | None = None) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--model", str(model)]
    for name in CHILD_FLAGS:
        command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if save_output is not None:
        command += ["--save-output", str(save_output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"offload_cuda child {mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- parent ---------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """This benchmark's options (also gpu_first_run.py's): real_scale's model options, then the ring's."""
    add_model_arguments(parser, out)
    parser.set_defaults(blocks=8, device=h3_core.Platform.detect().device_type)
    parser.add_argument("--widths", choices=("released", "tiny"), default="released")
    parser.add_argument("--pin-units", type=int, default=None,
                        help="blocks packed into pinned slabs beyond the ring (default: half the blocks)")
    parser.add_argument("--read-ahead", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", choices=sorted(CHILDREN))
    parser.add_argument("--model")
    parser.add_argument("--save-output", help=argparse.SUPPRESS)  # a child's video output (the parent compares them)


def write_model(args, folder: Path) -> Path:
    import synthetic_h3

    if not (folder / "config.json").exists():
        overrides = TINY_WIDTHS if args.widths == "tiny" else None
        synthetic_h3.write_dit(folder, args.blocks, refiner_blocks=1, config_overrides=overrides, sync=False)
    return folder


def compare(args, model: Path, timeout: float | None = None) -> dict:
    """Both modes on the model at `model`, and the figures that compare them (the largest difference of the two
    modes' video outputs: the same weights and inputs, so 0 is expected)."""
    if args.pin_units is None:
        args.pin_units = args.blocks // 2
    outputs = {mode: model.parent / f"{model.name}-{mode}-output.pt" for mode in ("resident", "ring")}
    try:
        resident = run_child(args, "resident", model, timeout, outputs["resident"])
        ring = run_child(args, "ring", model, timeout, outputs["ring"])
        difference = (torch.load(outputs["ring"]) - torch.load(outputs["resident"])).abs().max().item()
    finally:
        for path in outputs.values():
            path.unlink(missing_ok=True)
    return {"resident": resident, "ring": ring, "step_ratio": ring["step_s"] / resident["step_s"],
            "pinned_gib": ring["pinned_bytes"] / GiB, "pin_units": args.pin_units, "max_abs_difference": difference}


def report(result: dict, args) -> None:
    resident, ring = result["resident"], result["ring"]
    print(f"device {resident['device_name']}: {resident['blocks']} {args.dtype} blocks (hidden {resident['hidden']}), "
          f"{resident['rows']} rows, pin budget {ring['pin_budget_bytes'] / GiB:.2f} GiB = ring + {args.pin_units} "
          f"packed blocks; median of {args.steps} steps after {args.warmup} warm-up")
    for mode in (resident, ring):
        peak = mode["peak_allocated"]
        print(f"{mode['mode']:8s}: load {mode['load_s']:6.1f} s, {mode['step_s'] * 1e3:9.1f} ms/step, peak RssAnon "
              f"{mode['peak_anon'] / GiB:.2f} GiB" + (f", peak allocated {peak / GiB:.2f} GiB" if peak else ""))
    print(f"ring    : packed {ring['packed_units']} of {ring['streamed_units']}, pinned {result['pinned_gib']:.2f} GiB; "
          f"per step read {ring['bytes_read_per_step'] / GiB:.3f} GiB, copied {ring['bytes_h2d_per_step'] / GiB:.3f} "
          f"GiB ({ring['effective_h2d_gbps']:.1f} GB/s effective"
          + (f", raw slab copy {ring['raw_h2d_gbps']:.1f} GB/s" if ring["raw_h2d_gbps"] else "") + "); "
          f"waits: acquire {ring['acquire_wait_s'] * 1e3:.1f} ms, reads {ring['read_wait_s'] * 1e3:.1f} ms")
    print(f"ratio offloaded/resident step time: {result['step_ratio']:.3f}; largest output difference "
          f"{result['max_abs_difference']:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, "/tmp/h3-offload-cuda")
    args = parse_or_run_child(parser, CHILDREN)
    if args is None:
        return
    out = Path(args.out)
    try:
        model = write_model(args, out / f"transformer-{args.widths}-{args.blocks}")
        result = compare(args, model)
        report(result, args)
        print(json.dumps(result))
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
