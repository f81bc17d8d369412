"""Checkpoint files truncated or rewritten while a model is loaded: never a SIGBUS, never a silently changed result.

Resident weights are read into the process's own memory at load (explicit reads, no view of the memory map), so a
loaded resident model keeps working whatever happens to its files; anything that reads a file again later (a LoRA
change re-making resident weights, phase-scoped and streamed weights, the staged store's reads) checks the file and
raises one `CheckpointError` naming it.

The cases that could crash run in one child process (`child_cases`), each on its own copy of its files and each
reported on its own line: a SIGBUS (exit -7) fails the case it happened in, and the cases after it run in a fresh
child. Running them one after another in one process is sound because no case shares a file, a pipeline or a store
with another, and each case's objects are dropped before the next starts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from child_cases import ROOT, run_cases
from h3_core.errors import CheckpointError
from h3_core.runtime.host_store import HeldTensors
from test_staged_reads import stack_recipes, write_stack

CHILD = f"""
import gc, json, os, sys
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
from pathlib import Path
import torch
import h3_core
from child_cases import report_cases


def change(paths, how, rewrite_from):
    for path in paths:
        size = os.path.getsize(path)
        if how == "truncate":
            os.truncate(path, size // 2)
        else:  # rewritten in place: same size, other bytes from `rewrite_from(size)` on
            before = os.stat(path)
            start = rewrite_from(size)
            with open(path, "r+b") as f:
                f.seek(start)
                f.write(os.urandom(size - start))
            st = os.stat(path)
            # "rewrite" moves the modification time on (a coarse-clock file system may not have); "rewrite-keeping-
            # mtime" restores it, as `rsync --inplace -t` does: only the status-change time shows the change then.
            mtime = before.st_mtime_ns if how == "rewrite-keeping-mtime" else st.st_mtime_ns + 10**9
            os.utime(path, ns=(st.st_atime_ns, mtime))
            assert how != "rewrite-keeping-mtime" or os.stat(path).st_mtime_ns == before.st_mtime_ns


def pipeline_case(folder, how, residency):
    # All four components kept (resident or streamed); one generation, the files changed, a second generation.
    from h3_core.pipeline import H3Pipeline
    from h3_core.sources import resolve_model

    options = {{name: ({{"residency": "layerwise"}} if residency == "layerwise" else {{}})
               for name in H3Pipeline.COMPONENTS}}
    pipeline = H3Pipeline(resolve_model(folder), component_options=options, keep_text_encoder=True,
                          keep_transformer=True, keep_video_vae=True, keep_audio_vae=True)
    request = dict(width=64, height=64, num_frames=5, steps=2, seed=3)
    first = pipeline.generate("a lighthouse in the fog", **request)
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names if f.endswith(".safetensors"))
    change(files, how, lambda size: size // 2)  # past the header
    out = {{"files": len(files)}}
    try:
        again = pipeline.generate("a lighthouse in the fog", **request)
    except h3_core.CheckpointError as exc:
        out["error"] = str(exc)
    else:
        out["error"] = None
        out["same"] = torch.equal(first.frames, again.frames) and torch.equal(first.waveform, again.waveform)
    return out


def store_case(path, how, read_ahead):
    # A stack of 6 units streamed through the staged store; one pass, the file changed, a second pass.
    from h3_core.runtime.layerwise import LayerwiseOffloadManager
    from h3_core.runtime.offload_backends import SynchronousBackend
    from test_staged_reads import alternating_stack, linear_stack, run_passes

    recipes, state = alternating_stack(Path(path), 6)
    blocks = linear_stack(6).to(torch.bfloat16)
    manager = LayerwiseOffloadManager(SynchronousBackend("cpu", read_ahead=read_ahead)).attach(blocks, recipes)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    run_passes(manager, blocks, x, 1)
    change([path], how, lambda size: size - 4096)
    try:
        run_passes(manager, blocks, x, 1)
    except h3_core.CheckpointError as exc:
        return {{"error": str(exc), "path": str(exc.path)}}
    return {{"error": None}}


def run_case(parameters):
    kind = parameters.pop("kind")
    out = (pipeline_case if kind == "pipeline" else store_case)(**parameters)
    gc.collect()  # this case's maps and buffers go before the next case starts
    return out


report_cases(run_case)
"""

HOWS = ("truncate", "rewrite", "rewrite-keeping-mtime")
READ_AHEADS = (0, 1)


@pytest.fixture(scope="module")
def outcomes(tiny, tmp_path_factory):
    """Every case run once, in one child; each test below asserts its own case."""
    root = tmp_path_factory.mktemp("changed")
    cases = {}
    for read_ahead in READ_AHEADS:
        for how in HOWS:
            path = root / f"stack-{read_ahead}-{how}.safetensors"
            cases[f"store-{read_ahead}-{how}"] = dict(kind="store", path=str(path), how=how, read_ahead=read_ahead)
    for residency in ("resident", "layerwise"):
        for how in HOWS:
            folder = shutil.copytree(tiny, root / f"model-{residency}-{how}")
            cases[f"pipeline-{residency}-{how}"] = dict(kind="pipeline", folder=str(folder), how=how,
                                                        residency=residency)
    outcomes = run_cases(CHILD, cases, timeout_s=120)
    return {case: (cases[case], outcome) for case, outcome in outcomes.items()}


@pytest.mark.parametrize("how", HOWS)
def test_a_loaded_resident_model_is_untouched_by_changes_to_its_files(outcomes, how):
    """All four components resident and kept: their files truncated (or rewritten in place) after a generation,
    the next generation gives the same result (no SIGBUS, no changed numbers)."""
    _, outcome = outcomes[f"pipeline-resident-{how}"]
    result = outcome.value()
    assert result["files"] >= 4
    assert result["error"] is None and result["same"] is True


@pytest.mark.parametrize("how", HOWS)
def test_a_streamed_model_whose_files_change_raises_one_error(outcomes, how):
    """Layerwise: every streamed block and phase-scoped weight is read again each run, with its file checked."""
    _, outcome = outcomes[f"pipeline-layerwise-{how}"]
    result = outcome.value()
    assert result["error"] is not None, result
    assert "changed while it was loaded" in result["error"] and "load the model again" in result["error"]
    assert ("size changed" if how == "truncate" else "rewritten") in result["error"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("read_ahead", READ_AHEADS)
def test_a_checkpoint_changed_while_loaded_is_one_error_not_a_crash(outcomes, how, read_ahead):
    """The staged store (with and without read-ahead): a file truncated, or its last page rewritten in place."""
    parameters, outcome = outcomes[f"store-{read_ahead}-{how}"]
    result = outcome.value()
    assert result["error"] is not None and result["path"] == parameters["path"]
    assert "changed while it was loaded" in result["error"] and "load the model again" in result["error"]
    assert ("size changed" if how == "truncate" else "rewritten") in result["error"]


def test_re_reading_a_changed_file_for_a_lora_fold_is_one_error(tiny, tmp_path):
    import h3_core
    from h3_core.sources import resolve_model
    from h3_core.sources.tiny_default import ensure_tiny_lora

    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    lora = ensure_tiny_lora(tmp_path / "lora-cache")
    sources = resolve_model(folder)
    model = h3_core.load_dit(sources.transformer)
    for path in model.checkpoint_files:
        Path(path).write_bytes(Path(path).read_bytes()[: Path(path).stat().st_size // 2])  # rewritten, shorter
    with pytest.raises(h3_core.CheckpointError, match="changed while it was loaded") as info:
        h3_core.set_loras(model, [(lora, 1.0)])
    assert str(info.value.path) in {str(p) for p in model.checkpoint_files}
    assert "load the model again" in str(info.value)


def test_memory_mapped_units_check_their_file_before_touching_its_pages(tmp_path):
    path = tmp_path / "s.safetensors"
    write_stack(path, 2)
    store = HeldTensors(stack_recipes(path, 2))
    store.materialise(0, torch.device("cpu"))
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="changed while it was loaded") as error:
        store.materialise(1, torch.device("cpu"))
    assert error.value.path == str(path)
    # A file replaced by a rename is fine: the map still reads the loaded inode.
    other = tmp_path / "t.safetensors"
    write_stack(other, 2)
    store = HeldTensors(stack_recipes(other, 2))
    os.replace(path, other)
    assert torch.isfinite(store.materialise(1, torch.device("cpu"))["weight"]).all()
