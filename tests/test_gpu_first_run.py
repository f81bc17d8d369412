"""benchmarks/gpu_first_run.py, the script a GPU runs first, dry-run on the CPU: every section runs through the same
code as on the GPU (the simulated CUDA device, tiny sizes) and writes its checks and figures into one JSON file. And
the dry run can fail: with one of the backend's waits removed, its ordering section does."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_first_run.py"
SECTIONS = ("environment", "ordering", "recovery", "sync_debug", "cuda_tests", "released")


def dry_run(tmp_path, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--work-dir", str(tmp_path),
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def numbers(value, path=""):
    """Every number in a JSON value, with where it is; non-finite ones are written as strings ("nan", "inf")."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from numbers(item, f"{path}[{i}]")
    elif isinstance(value, str) and value.lstrip("-") in ("nan", "inf"):
        yield path, float(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def test_the_dry_run_runs_every_section_and_passes_every_check(tmp_path):
    done, report = dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert report["dry_run"] and report["passed"] and report["failed"] == []
    assert tuple(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] == "passed" and section["error"] is None, (name, section.get("error"))
        assert section["checks"] and all(c["passed"] for c in section["checks"].values()), name
    assert [path for path, x in numbers(report) if not math.isfinite(x)] == []
    sections = report["sections"]
    assert len(sections["ordering"]["checks"]) == 7  # three pin budgets, plain and poisoned, and the control
    assert sections["sync_debug"]["figures"]["sync_debug"].startswith("not applicable")
    tests = sections["cuda_tests"]["figures"]
    assert tests["passed"] > 0 and tests["failures"] == tests["errors"] == 0
    released = sections["released"]["figures"]
    assert released["step_ratio"] > 0 and released["read_gib_per_step"] > 0 and released["max_abs_difference"] == 0
    assert "PASSED" in done.stdout and "released widths" in done.stdout  # the human summary
    assert list(tmp_path.iterdir()) == [tmp_path / "r.json"]  # the synthetic models were deleted


@pytest.mark.parametrize("wait", ["free"])
def test_the_ordering_section_fails_when_a_wait_is_removed(tmp_path, wait):
    # "free": a copy into a slot no longer waits for the compute that read it. On the simulated device the outputs
    # stay right (its compute runs eagerly), so only its race detector can see this one.
    done, report = dry_run(tmp_path, "--sections", "ordering", "--sabotage", wait)
    assert done.returncode == 1 and not report["passed"]
    ordering = report["sections"]["ordering"]
    assert ordering["status"] == "failed"
    failed = {name for name, check in ordering["checks"].items() if not check["passed"]}
    assert failed == {f"packed{n}_{kind}" for n in (0, 3, 6) for kind in ("plain", "poisoned")}
    assert all(ordering["checks"][name]["value"]["race_count"] > 0 for name in failed)
    assert "FAILED ordering.packed0_plain" in done.stdout
