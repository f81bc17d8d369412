"""The first thing a GPU runs (issue 27): the CUDA path's checks and its first figures, in at most 8 minutes, into
one JSON file. Needs only CUDA torch and safetensors (offline: the models are synthetic, written under the work
directory and deleted afterwards).

Sections, each in a fresh process with its own time limit (one that fails, raises or runs out of time is recorded
with its error and the script goes on; the exit code is 1 when any check failed or a section did not finish):

* environment: torch, CUDA, the GPU, the host's RAM.
* ordering: layerwise against resident for three pin budgets (ring only, half the blocks packed, all packed), plain
  and with every released slot poisoned (NaN bytes on the copy stream behind its free event, the compute slowed by
  sleep kernels): each difference must be 0 and finite. A control backend whose free events wait for nothing must
  let the poison through (otherwise the poisoning could not fail).
* recovery: a read error in the staging reader, and an out-of-memory error raised by a copy, mid-pass: that pass
  fails, no slot stays loaded, no staging buffer stays lent, and the next passes equal resident.
* sync_debug: host synchronisations (`torch.cuda.set_sync_debug_mode("warn")`) in a steady-state sampling step and
  block loop: 0 expected.
* cuda_tests: `pytest tests/test_residency_cuda.py` (pass / fail / skip counts).
* released: `offload_cuda.py` at the released widths (6 synthetic blocks, bf16, 2 packed beyond the ring, about
  8,300 rows), resident against the constrained ring, each in a fresh process: load and step time, overlap waits,
  bytes read and copied per step, pinned GiB, peak RssAnon, the offloaded/resident step ratio, the H2D GB/s, and
  the largest output difference (0 expected).

    python benchmarks/gpu_first_run.py --out gpu-first-run.json         # a CUDA machine
    python benchmarks/gpu_first_run.py --dry-run --out /tmp/r.json      # anywhere (CI: tests/test_gpu_first_run.py)

`--dry-run` runs every section through the same code on the CPU at tiny sizes: the ordering, recovery and sync
sections on the simulated CUDA device of tests/fake_cuda.py (deferred copies, a race detector: a race fails the
check too), the released section with the asynchronous backend on the CPU; the sync-debug mode itself is CUDA-only
(recorded as not applicable; the simulated device's host waits are counted instead).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Bitwise layerwise == resident on the CPU needs MKL's reproducible mode (as tests/conftest.py sets), before torch.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path[:0] = [p for p in (str(ROOT), str(BENCHMARKS)) if p not in sys.path]

SECTIONS = ("environment", "ordering", "recovery", "sync_debug", "cuda_tests", "released")
# Seconds each section may take on the GPU (the last gets whatever the total budget leaves); the expected times are
# far lower: the checks' model is 6 blocks of hidden 256.
SECTION_BUDGET_S = {"environment": 30, "ordering": 75, "recovery": 45, "sync_debug": 45, "cuda_tests": 120,
                    "released": None}
# A dry run's processes: the sections on the simulated device share one.
DRY_RUN_GROUPS = (("environment",), ("ordering", "recovery", "sync_debug"), ("cuda_tests",), ("released",))
NOT_APPLICABLE = "not applicable: torch.cuda.set_sync_debug_mode needs a CUDA device (dry run)"
# The released-width comparison (offload_cuda.py's options): on the GPU, and in a dry run.
RELEASED = ["--widths", "released", "--blocks", "6", "--pin-units", "2", "--frames", "8", "--latent-hw", "64",
            "--steps", "5", "--warmup", "2", "--device", "cuda", "--dtype", "bfloat16"]
RELEASED_DRY = ["--widths", "tiny", "--blocks", "3", "--pin-units", "1", "--steps", "3", "--warmup", "1",
                "--device", "cpu", "--dtype", "float32", "--threads", "1"]


class Report:
    """One section's checks (each passed or not, with the value seen and what was expected) and figures."""

    def __init__(self):
        self.checks: dict[str, dict] = {}
        self.figures: dict = {}

    def check(self, name: str, passed: bool, value=None, expected: str | None = None) -> None:
        self.checks[name] = {"passed": bool(passed), "value": value, "expected": expected}


# ---- sections (each runs in a child process) -----------------------------------------------------------------------


def _device(args):
    import offload_checks

    return offload_checks.Device("fake" if args.dry_run else "cuda")


def _checks_model(args, device):
    """The checks' model (written once per run), its inputs and the resident reference."""
    import offload_checks

    folder = offload_checks.write_check_model(Path(args.work_dir) / f"checks-model-{args.section}")
    model = device.resident(folder)
    inputs = offload_checks.check_inputs(model, device)
    del model
    return folder, inputs, offload_checks.reference_outputs(folder, device, inputs)


def section_environment(args, report: Report) -> None:
    import platform as host

    import safetensors
    import torch

    from h3_core.runtime.file_reads import total_memory_bytes
    from h3_core.runtime.platform import device_problem

    problem = device_problem("cuda")
    report.figures.update(python=host.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
                          safetensors=safetensors.__version__, cpus=os.cpu_count(),
                          host_ram_gib=(total_memory_bytes() or 0) / 2**30, cuda_problem=problem)
    if problem is None:
        properties = torch.cuda.get_device_properties(0)
        report.figures.update(device=properties.name, capability=f"{properties.major}.{properties.minor}",
                              device_memory_gib=properties.total_memory / 2**30,
                              devices=torch.cuda.device_count())
    if args.dry_run:
        report.figures["device"] = "simulated CUDA on the CPU (tests/fake_cuda.py)"
        report.check("simulated_device", True, "dry run", "the checks run on the simulated device")
    else:
        report.check("cuda_device", problem is None, problem, "a usable CUDA device")


def section_ordering(args, report: Report) -> None:
    import offload_checks as oc

    device = _device(args)
    folder, inputs, reference = _checks_model(args, device)
    cases = []
    for pin_units in (0, oc.CHECK_BLOCKS // 2, oc.CHECK_BLOCKS):
        for poisoned in (False, True):
            case = oc.ordering_case(device, folder, inputs, reference, pin_units=pin_units, poisoned=poisoned)
            cases.append(case)
            name = f"packed{pin_units}_{'poisoned' if poisoned else 'plain'}"
            report.check(name, case["max_abs_difference"] == 0 and case["finite"] and case["race_count"] == 0,
                         {k: case[k] for k in ("max_abs_difference", "finite", "race_count")},
                         "difference from resident 0, finite, no race")
    control = oc.control_case(device, folder, inputs, reference)
    report.check("control_poison_detected", control["detected"], control,
                 "a backend whose free events wait for nothing lets the poison through (wrong outputs or races)")
    report.figures.update(device=device.name(), cases=cases, control=control, rows=int(inputs["position_ids"].shape[0]),
                          dtype=str(device.dtype))


def section_recovery(args, report: Report) -> None:
    import offload_checks as oc

    device = _device(args)
    folder, inputs, reference = _checks_model(args, device)
    for kind in oc.FAILURES:
        case = oc.recovery_case(device, folder, inputs, reference, kind=kind)
        report.check(kind, case["failure_reached"] and case["raised"] is not None
                     and case["slots_loaded_after_failure"] == [] and case["staging_buffers_lent_after_failure"] == 0
                     and case["max_abs_difference_after"] == 0 and case["finite_after"] and case["race_count"] == 0,
                     case, "the pass raises, nothing stays loaded or lent, the next passes equal resident, no race")


def section_sync_debug(args, report: Report) -> None:
    import offload_checks as oc

    device = _device(args)
    folder, inputs, _ = _checks_model(args, device)
    found = oc.steady_state_syncs(device, folder, inputs)
    report.figures.update(found)
    if args.dry_run:
        report.figures["sync_debug"] = NOT_APPLICABLE
        prefix, expected = "simulated_host_syncs", "no host wait on a stream, event or copy (simulated device)"
    else:
        prefix, expected = "sync_debug", "no synchronizing CUDA operation (set_sync_debug_mode warnings)"
    report.check(f"{prefix}_step", found["step_syncs"] == 0, found["step_syncs"], expected)
    report.check(f"{prefix}_block_loop", found["loop_syncs"] == 0, found["loop_syncs"], expected)
    report.check("same_outputs", found["same_outputs"] and found["race_count"] == 0,
                 {"same_outputs": found["same_outputs"], "race_count": found["race_count"]},
                 "the counted passes equal the warm-up's, no race")


def section_cuda_tests(args, report: Report) -> None:
    import xml.etree.ElementTree as ElementTree

    junit = Path(args.work_dir) / "cuda-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_residency_cuda.py",
               f"--junitxml={junit}"]
    timeout = max(1.0, args.deadline - time.time() - 2)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    suites = ElementTree.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    report.figures.update(counts, passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                          failed_tests=failed, returncode=done.returncode, output_tail=done.stdout[-2000:])
    report.check("no_failures", counts["failures"] + counts["errors"] == 0 and done.returncode == 0,
                 {"failures": counts["failures"], "errors": counts["errors"], "returncode": done.returncode},
                 "every test passes")
    report.check("tests_ran", report.figures["passed"] > 0, report.figures["passed"], "some tests ran")
    if not args.dry_run:
        report.check("none_skipped", counts["skipped"] == 0, counts["skipped"], "the CUDA tests run on the GPU")


def section_released(args, report: Report) -> None:
    import offload_cuda

    parser = argparse.ArgumentParser()
    offload_cuda.add_arguments(parser, str(Path(args.work_dir) / "released"))
    bench = parser.parse_args(RELEASED_DRY if args.dry_run else RELEASED)
    started = time.perf_counter()
    model = offload_cuda.write_model(bench, Path(bench.out) / f"transformer-{bench.widths}-{bench.blocks}")
    write_s = time.perf_counter() - started
    try:
        result = offload_cuda.compare(bench, model, timeout=max(1.0, args.deadline - time.time() - 2))
    finally:
        shutil.rmtree(bench.out, ignore_errors=True)
    resident, ring = result["resident"], result["ring"]
    GiB = 2**30
    report.figures.update(
        options=" ".join(RELEASED_DRY if args.dry_run else RELEASED), write_s=write_s, device=ring["device_name"],
        rows=ring["rows"], hidden=ring["hidden"], blocks=ring["blocks"], pin_units=result["pin_units"],
        resident_load_s=resident["load_s"], ring_load_s=ring["load_s"],
        resident_step_s=resident["step_s"], ring_step_s=ring["step_s"], step_ratio=result["step_ratio"],
        acquire_wait_s=ring["acquire_wait_s"], read_wait_s=ring["read_wait_s"],
        read_gib_per_step=ring["bytes_read_per_step"] / GiB, copied_gib_per_step=ring["bytes_h2d_per_step"] / GiB,
        effective_h2d_gbps=ring["effective_h2d_gbps"], raw_h2d_gbps=ring["raw_h2d_gbps"],
        pinned_gib=result["pinned_gib"], pin_budget_gib=ring["pin_budget_bytes"] / GiB,
        packed_units=ring["packed_units"], streamed_units=ring["streamed_units"],
        unprefetched_loads=ring["unprefetched_loads"],
        resident_peak_anon_gib=resident["peak_anon"] / GiB, ring_peak_anon_gib=ring["peak_anon"] / GiB,
        resident_peak_allocated_gib=(resident["peak_allocated"] or 0) / GiB,
        ring_peak_allocated_gib=(ring["peak_allocated"] or 0) / GiB,
        max_abs_difference=result["max_abs_difference"])
    report.check("outputs_finite", resident["finite"] and ring["finite"],
                 {"resident": resident["finite"], "ring": ring["finite"]}, "both modes' outputs finite")
    report.check("ring_equals_resident", result["max_abs_difference"] == 0, result["max_abs_difference"],
                 "the same weights and inputs: difference 0")
    report.check("packed_as_budgeted", ring["packed_units"] == list(range(result["pin_units"])),
                 ring["packed_units"], f"the first {result['pin_units']} blocks packed into pinned slabs")
    report.check("ring_streamed", ring["bytes_read_per_step"] > 0, ring["bytes_read_per_step"],
                 "the other blocks read from the files every step")
    report.check("step_ratio_finite", math.isfinite(result["step_ratio"]) and result["step_ratio"] > 0,
                 result["step_ratio"], "a finite offloaded/resident ratio")


SECTION_FUNCTIONS = {"environment": section_environment, "ordering": section_ordering, "recovery": section_recovery,
                     "sync_debug": section_sync_debug, "cuda_tests": section_cuda_tests, "released": section_released}


def sabotage(which: str):
    """For tests/test_gpu_first_run.py only: remove one of the backend's waits, so the checks must fail.
    "ready": the compute stream no longer waits for a slot's copy; "free": a copy into a slot no longer waits for
    the compute that read it."""
    from unittest import mock

    from h3_core.runtime.offload_backends import AsyncBackend

    if which == "ready":
        return mock.patch.object(AsyncBackend, "wait_ready", lambda self, slot, unit: self.store.views(
            unit, self.buffers[slot]))
    return mock.patch.object(AsyncBackend, "unload", lambda self, slot: None)


def run_sections(args) -> None:
    """Child: the sections named by `--section` in turn, each report written to `--section-dir` as soon as it is
    done (an exception is recorded there too, and the next section runs)."""
    for name in args.section.split(","):
        report = Report()
        error = reason = None
        started = time.perf_counter()
        try:
            with sabotage(args.sabotage) if args.sabotage else contextlib.nullcontext():
                SECTION_FUNCTIONS[name](args, report)
        except BaseException as exc:  # noqa: BLE001 - recorded; the parent goes on with the next section
            error = traceback.format_exc()[-4000:]
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        (Path(args.section_dir) / f"section-{name}.json").write_text(json.dumps(
            {"checks": report.checks, "figures": report.figures, "error": error,
             "reason": reason if error else None, "wall_s": time.perf_counter() - started}, default=str))


# ---- parent --------------------------------------------------------------------------------------------------------


def finite_json(value):
    """Non-finite floats as strings ("nan", "inf"): the file stays strict JSON and they stand out."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def spawn_sections(args, names: list[str], work_dir: Path, timeout: float) -> dict[str, dict]:
    """Run `names` in one fresh process within `timeout` seconds; each section's result (a section without a
    report: its error, or the timeout)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--section", ",".join(names), "--section-dir",
               str(work_dir), "--work-dir", str(work_dir), "--deadline", str(time.time() + timeout)]
    if args.dry_run:
        command.append("--dry-run")
    if args.sabotage:
        command += ["--sabotage", args.sabotage]
    started = time.perf_counter()
    # A session of its own: on a timeout its children (the benchmark's modes, pytest) are killed with it.
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = child.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        timed_out = True
    wall = time.perf_counter() - started
    results = {}
    for name in names:
        out = work_dir / f"section-{name}.json"
        if out.exists():
            result = json.loads(out.read_text())
        elif timed_out:
            reason = f"ran past its {timeout:.0f} s limit and was killed"
            result = {"checks": {}, "figures": {}, "wall_s": wall, "status": "timeout", "reason": reason,
                      "error": f"{reason}\n{(output or '')[-2000:]}"}
        else:
            reason = f"its process exited {child.returncode} without a report"
            result = {"checks": {}, "figures": {}, "wall_s": wall, "status": "error", "reason": reason,
                      "error": f"{reason}\n{(output or '')[-3000:]}"}
        failed = [c for c, v in result["checks"].items() if not v["passed"]]
        result.setdefault("status", "error" if result["error"] else "failed" if failed else "passed")
        result["limit_s"] = timeout
        results[name] = result
    return results


def summary(report: dict) -> str:
    lines = [f"gpu_first_run on {report['device']}{' (dry run)' if report['dry_run'] else ''}: "
             f"{report['wall_s']:.1f} s of a {report['budget_s']:.0f} s budget"]
    for name, section in report["sections"].items():
        checks = section.get("checks", {})
        passed = sum(c["passed"] for c in checks.values())
        lines.append(f"  {name:12s} {section['status']:8s} {section.get('wall_s', 0):6.1f} s  "
                     f"{passed}/{len(checks)} checks")
    released = report["sections"].get("released", {}).get("figures", {})
    if "step_ratio" in released:
        raw = released["raw_h2d_gbps"]
        lines.append(f"  released widths: {released['blocks']} blocks, {released['rows']} rows: offloaded/resident "
                     f"step {released['step_ratio']:.3f} ({released['ring_step_s'] * 1e3:.1f} / "
                     f"{released['resident_step_s'] * 1e3:.1f} ms), H2D {released['effective_h2d_gbps']:.1f} GB/s "
                     f"effective" + (f", {raw:.1f} GB/s raw" if isinstance(raw, float) else "")
                     + f", pinned {released['pinned_gib']:.2f} GiB")
    sync = report["sections"].get("sync_debug", {}).get("figures", {})
    if "step_syncs" in sync:
        lines.append(f"  host synchronisations in a steady-state step / block loop: {sync['step_syncs']} / "
                     f"{sync['loop_syncs']}" + (" (simulated device)" if report["dry_run"] else ""))
    for failure in report["failed"]:
        lines.append(f"  FAILED {failure}")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-first-run.json", help="the JSON report")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, tiny sizes, the simulated CUDA device")
    parser.add_argument("--budget-s", type=float, default=480.0, help="total seconds for every section")
    parser.add_argument("--work-dir", default=None, help="where the synthetic models are written (default: the "
                        "system's temporary folder); a folder of this run's is made there and deleted afterwards")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="a comma-separated subset")
    parser.add_argument("--jobs", type=int, default=None, help="processes run side by side (default 1; a dry "
                        "run: 2, its figures are not timings)")
    parser.add_argument("--sabotage", choices=("ready", "free"), help=argparse.SUPPRESS)  # tests only
    parser.add_argument("--section", help=argparse.SUPPRESS)  # a child's sections
    parser.add_argument("--section-dir", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        run_sections(args)
        return 0
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")

    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    work_dir = Path(tempfile.mkdtemp(prefix="h3-gpu-first-run-", dir=args.work_dir))
    sections: dict[str, dict] = {}
    names = [s for s in SECTIONS if s in wanted]
    if args.dry_run:  # the simulated device's sections share a process (each would import the same things)
        groups = [[n for n in group if n in names] for group in DRY_RUN_GROUPS]
        groups = [g for g in groups if g]
    else:  # the GPU: each section in a process of its own, one at a time, the environment's first
        groups = [[n] for n in names]
    jobs = args.jobs or (2 if args.dry_run else 1)

    def run(group: list[str]) -> None:
        left = args.budget_s - (time.perf_counter() - started)
        environment = sections.get("environment", {})
        if left < 5:
            error = ("not run", "the time budget was spent before this section")
        elif not args.dry_run and environment.get("figures", {}).get("cuda_problem"):
            error = ("not run", f"no CUDA device ({environment['figures']['cuda_problem']}); --dry-run runs the "
                     "sections on the simulated device")
        else:
            limits = [SECTION_BUDGET_S[n] for n in group]
            timeout = left - 2 if None in limits or jobs > 1 else min(sum(limits), left - 2)
            print(f"[gpu_first_run] {', '.join(group)} (limit {timeout:.0f} s) ...", flush=True)
            sections.update(spawn_sections(args, group, work_dir, timeout))
            return
        for name in group:
            sections[name] = {"status": error[0], "checks": {}, "figures": {}, "error": error[1], "reason": error[1]}

    try:
        if jobs == 1:
            for group in groups:
                run(group)
        else:  # a dry run's groups side by side (its figures are not timings)
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(run, groups))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    sections = {name: sections[name] for name in SECTIONS if name in sections}
    device = sections.get("environment", {}).get("figures", {}).get(
        "device", "simulated CUDA on the CPU" if args.dry_run else "unknown")
    failed = []
    for name, section in sections.items():
        if section["status"] != "passed":
            failed += [f"{name}.{check}: {value['value']}" for check, value in section["checks"].items()
                       if not value["passed"]]
            if section.get("error"):
                failed.append(f"{name}: {section['status']}: {section['reason']}")
            elif not section["checks"] or section["status"] != "failed":
                failed.append(f"{name}: {section['status']}")
    report = {"script": "benchmarks/gpu_first_run.py", "dry_run": args.dry_run, "device": device,
              "started_at": started_at,
              "budget_s": args.budget_s, "wall_s": time.perf_counter() - started,
              "command": " ".join([Path(sys.executable).name] + sys.argv), "sections": sections,
              "failed": failed, "passed": not failed}
    Path(args.out).write_text(json.dumps(finite_json(report), indent=1, default=str))
    print(summary(report))
    print(f"report: {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
