"""LoRA on H3's streamed blocks: fold into W at materialisation, or a runtime low-rank branch in every forward?

    python benchmarks/lora_fold.py                     # fp32, 2 threads, rows 256..32768, 3 rounds (~2 min)
    python benchmarks/lora_fold.py --full              # 5 rounds, rows up to 49152, plain forward also at 4096 rows
    python benchmarks/lora_fold.py --dtype bfloat16    # where the CPU has fast bf16 (AMX / AVX512-BF16)

One released H3 block's linears with random weights: fused QKV [3*5376, 5376], out_proj [5376, 5376], SwiGLU fc1
[2*14336, 5376], fc2 [5376, 14336] (LoRA rank 64; they see every packed row) and the AdaLN table [96768, 2688]
(rank 16; it sees only the M timestep rows, `--adaln-rows`). Each mode runs in a fresh process, the modes alternate
over `--rounds` rounds, medians are reported:
  fold      W.addmm_(B, A, alpha=s)        in place, once per block load (= once per block per sampling step)
  fold-oop  W.add_(B @ A, alpha=s)         the same with one temporary [out, in] per layer
  fold-core h3_core's own fold (`lora_loader.Update.add_to`: addmm_ into float32, stepped products otherwise)
  runtime   y.addmm_(x @ A.T, B.T, alpha=s) the extra work of the unfolded path in each forward, at each row count
  plain     y = x @ W.T                    the block's linears without LoRA (for the fold-cost fraction)
The runtime path runs over chunks of at most `--chunk-rows` rows (as the core's chunked blocks do; the per-row cost
is the same once the buffers exceed the caches). Every mode is timed after one untimed pass at the same shapes.
Peak extra memory = VmHWM - VmRSS after `clear_refs` (Linux only). Attention scores/softmax are not timed: fold/plain
is relative to the linears alone, so it overstates the fold's share of a whole block forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from h3_core.checkpoints.lora_loader import Update  # noqa: E402

H, FFN, T_DIM = 5376, 14336, 2688
PACKED = {"qkv": (3 * H, H, 64), "out_proj": (H, H, 64), "fc1": (2 * FFN, H, 64), "fc2": (H, FFN, 64)}
ADALN = {"adaln": (6 * 3 * H, T_DIM, 16)}
SCALE = 0.8  # strength * alpha / rank; its value does not change the cost


def kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


class Peak:
    """Peak resident memory above the level at entry, in MiB."""

    def __enter__(self):
        self.base = kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        return self

    def __exit__(self, *exc):
        self.mib = (kib("VmHWM") - self.base) / 1024


def filled(rows: int, cols: int, dtype, seed: int) -> torch.Tensor:
    """[rows, cols] of small random values, tiled from a 64-row block (fast to build; values do not change timing)."""
    tile = torch.randn(64, cols, generator=torch.Generator().manual_seed(seed)).mul_(0.02).to(dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    full, rest = divmod(rows, 64)
    out[: full * 64].view(full, 64, cols).copy_(tile)
    out[full * 64:].copy_(tile[:rest])
    return out


def run_child(args) -> dict:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layers = {**PACKED, **ADALN}
    lora = {n: (filled(r, i, dtype, 1), filled(o, r, dtype, 2)) for n, (o, i, r) in layers.items()}  # A, B
    warm = torch.randn(256, 512).to(dtype)
    warm.addmm_(warm[:, :64], warm[:64], alpha=SCALE)  # thread pools and BLAS started before anything is timed
    times, peaks = {}, {}
    if args.mode != "runtime":
        weights = {n: filled(o, i, dtype, 3) for n, (o, i, r) in layers.items()}
    if args.mode.startswith("fold"):
        for _ in range(2):  # only the second pass counts (first calls at these shapes excluded)
            with Peak() as peak:
                for name, w in weights.items():
                    a, b = lora[name]
                    start = time.perf_counter()
                    if args.mode == "fold":
                        w.addmm_(b, a, alpha=SCALE)
                    elif args.mode == "fold-oop":
                        w.add_(b @ a, alpha=SCALE)
                    else:  # the core's own fold, as a streamed block gets it
                        Update(b, a, SCALE).add_to(w, 1.0)
                    times[name] = time.perf_counter() - start
        peaks["block"] = peak.mib
        return {"times": times, "peaks": peaks}
    chunk = args.chunk_rows if args.mode == "runtime" else max(args.plain_rows)
    x_flat = filled(chunk, max(i for o, i, r in PACKED.values()), dtype, 4).view(-1)
    y_flat = torch.zeros(chunk * max(o for o, i, r in PACKED.values()), dtype=dtype)
    (o_ad, i_ad, _), = ADALN.values()
    x_ad, y_ad = filled(args.adaln_rows, i_ad, dtype, 5), torch.zeros(args.adaln_rows, o_ad, dtype=dtype)
    row_counts = args.rows if args.mode == "runtime" else args.plain_rows
    for key, group, rows in [("adaln", ADALN, args.adaln_rows)] + [(str(n), PACKED, n) for n in row_counts]:
        def one_pass():
            for name, (o, i, r) in group.items():
                a, b = lora[name]
                for first in range(0, rows, chunk):
                    n = min(chunk, rows - first)
                    x, y = (x_ad, y_ad) if group is ADALN else (x_flat[: n * i].view(n, i), y_flat[: n * o].view(n, o))
                    if args.mode == "runtime":
                        y.addmm_(x @ a.T, b.T, alpha=SCALE)
                    else:
                        torch.mm(x, weights[name].T, out=y)

        one_pass()  # untimed, as for the fold
        with Peak() as peak:
            start = time.perf_counter()
            one_pass()
            times[key] = time.perf_counter() - start
        peaks[key] = peak.mib
    return {"times": times, "peaks": peaks}


def interpolate_crossover(rows: list[int], runtime: list[float], fold: float) -> str:
    """Smallest row count at which the fold (fixed cost) is no dearer than the runtime path (linear in rows)."""
    if runtime[0] >= fold:
        return f"rows >= {rows[0]} (fold already cheaper at the smallest measured count)"
    for (r0, t0), (r1, t1) in zip(zip(rows, runtime), zip(rows[1:], runtime[1:])):
        if t1 >= fold:
            return f"rows >= {round(r0 + (fold - t0) * (r1 - r0) / (t1 - t0))} (measured, interpolated {r0}..{r1})"
    per_row = runtime[-1] / rows[-1]
    return f"rows >= ~{round(fold / per_row)} (extrapolated: runtime cheaper at every measured count up to {rows[-1]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: sorted(int(v) for v in s.split(","))  # noqa: E731
    parser.add_argument("--rows", type=ints, default=[256, 1024, 4096, 12432, 32768], help="packed rows, comma list")
    parser.add_argument("--plain-rows", type=ints, default=[1024], help="rows at which the plain forward is timed; "
                        "other counts scale linearly from the largest of them")
    parser.add_argument("--adaln-rows", type=int, default=2, help="M: distinct timestep rows the AdaLN table sees")
    parser.add_argument("--chunk-rows", type=int, default=4096, help="runtime path: rows per chunk")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per mode, alternating (medians)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--full", action="store_true", help="5 rounds, rows up to 49152, plain also at 4096 rows")
    parser.add_argument("--mode", choices=("fold", "fold-oop", "fold-core", "runtime", "plain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_child(args)))
        return
    if args.full:
        args.rounds, args.rows, args.plain_rows = 5, [256, 1024, 4096, 12432, 32768, 49152], [1024, 4096]
    modes = ("fold", "fold-oop", "fold-core", "runtime", "plain")
    runs = {m: [] for m in modes}
    load_before, start = os.getloadavg(), time.perf_counter()
    for _ in range(args.rounds):
        for mode in modes:
            command = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--threads", str(args.threads),
                       "--dtype", args.dtype, "--rows", ",".join(map(str, args.rows)), "--plain-rows",
                       ",".join(map(str, args.plain_rows)), "--adaln-rows", str(args.adaln_rows), "--chunk-rows",
                       str(args.chunk_rows)]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load_after = os.getloadavg()
    med = {m: {k: statistics.median(r["times"][k] for r in rs) for k in rs[0]["times"]} for m, rs in runs.items()}
    peak = {m: {k: statistics.median(r["peaks"][k] for r in rs) for k in rs[0]["peaks"]} for m, rs in runs.items()}
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    print(f"LoRA fold vs runtime, one H3 block (hidden {H}, QKV {3 * H}, FFN {FFN}, AdaLN {6 * 3 * H}x{T_DIM}; rank "
          f"64 attention/FFN, 16 AdaLN), {args.dtype}; {cpu}, {os.cpu_count()} cores, {args.threads} threads, torch "
          f"{torch.__version__}; medians of {args.rounds} fresh processes per mode; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; {time.perf_counter() - start:.0f} s")
    fold = {m: (sum(med[m][n] for n in PACKED), med[m]["adaln"]) for m in modes if m.startswith("fold")}
    for m, (packed, adaln) in fold.items():
        print(f"  {m:<9} {packed + adaln:6.3f} s per block load ({packed:.3f} attention+FFN, {adaln:.3f} AdaLN)   "
              f"peak extra {peak[m]['block']:7.1f} MiB   (" +
              ", ".join(f"{n} {med[m][n]:.3f}" for n in PACKED) + ")")
    print(f"  runtime AdaLN branch ({args.adaln_rows} rows): {med['runtime']['adaln'] * 1e3:.2f} ms; plain AdaLN "
          f"{med['plain']['adaln'] * 1e3:.1f} ms")
    top = str(max(args.plain_rows))
    per_row = med["plain"][top] / int(top)
    fold_total = fold["fold"][0] + fold["fold"][1]
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    print(f"  {'rows':>6} {'runtime s':>10} {'fold s':>7} {'oop s':>7} {'core s':>7} {'runtime/fold':>12} "
          f"{'plain s':>9} {'fold/plain':>10} {'runtime peak MiB':>17} {'[rows,r] MiB':>12}")
    runtime = []
    for rows in args.rows:
        t = med["runtime"][str(rows)] + med["runtime"]["adaln"]
        runtime.append(t)
        measured = str(rows) in med["plain"]
        plain = (med["plain"][str(rows)] if measured else per_row * rows) + med["plain"]["adaln"]
        print(f"  {rows:>6} {t:>10.3f} {fold_total:>7.3f} {sum(fold['fold-oop']):>7.3f} {sum(fold['fold-core']):>7.3f} "
              f"{t / fold_total:>12.3f} "
              f"{'' if measured else '~'}{plain:>8.2f} {fold_total / plain:>10.4f} "
              f"{peak['runtime'][str(rows)]:>17.1f} {rows * 64 * itemsize / 2**20:>12.1f}")
    print(f"  plain forward measured at {args.plain_rows} rows ({per_row * 1e3:.2f} ms/row); '~' = scaled linearly. "
          f"runtime peak: measured with chunks of {args.chunk_rows} rows; [rows,r]: the unchunked intermediate")
    print(f"  runtime path is cheaper for AdaLN alone at any rows ({med['runtime']['adaln'] * 1e3:.2f} ms vs fold "
          f"{fold['fold'][1]:.3f} s); attention+FFN alone: fold when "
          f"{interpolate_crossover(args.rows, [med['runtime'][str(r)] for r in args.rows], fold['fold'][0])}")
    print(f"rule (per block per step, in-place fold): fold when {interpolate_crossover(args.rows, runtime, fold_total)}"
          f"; out-of-place fold: {interpolate_crossover(args.rows, runtime, sum(fold['fold-oop']))}; h3_core's "
          f"fold: {interpolate_crossover(args.rows, runtime, sum(fold['fold-core']))}")


if __name__ == "__main__":
    main()
