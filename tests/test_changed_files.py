"""Checkpoint files truncated or rewritten while a model is loaded: never a SIGBUS, never a silently changed result.

Resident weights are read into the process's own memory at load (explicit reads, no view of the memory map), so a
loaded resident model keeps working whatever happens to its files; anything that reads a file again later (a LoRA
change re-making resident weights, phase-scoped and streamed weights) checks the file and raises one
`CheckpointError` naming it. Each case runs in a child process, where a SIGBUS would show as exit code -7.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    import torch
    import h3_core
    from h3_core.pipeline import H3Pipeline
    from h3_core.sources import resolve_model

    folder, how, residency = {folder!r}, {how!r}, {residency!r}
    sources = resolve_model(folder)
    options = {{name: ({{"residency": "layerwise"}} if residency == "layerwise" else {{}})
               for name in H3Pipeline.COMPONENTS}}
    pipeline = H3Pipeline(sources, component_options=options, keep_text_encoder=True, keep_transformer=True,
                          keep_video_vae=True, keep_audio_vae=True)
    request = dict(width=64, height=64, num_frames=5, steps=2, seed=3)
    first = pipeline.generate("a lighthouse in the fog", **request)
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names
                   if f.endswith(".safetensors"))
    for path in files:
        size = os.path.getsize(path)
        if how == "truncate":
            os.truncate(path, size // 2)
        else:  # rewritten in place: same size, other bytes past the header
            with open(path, "r+b") as f:
                f.seek(size // 2)
                f.write(os.urandom(size - size // 2))
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    out = {{"files": len(files)}}
    try:
        again = pipeline.generate("a lighthouse in the fog", **request)
    except h3_core.CheckpointError as exc:
        out["error"] = str(exc)
    else:
        out["error"] = None
        out["same"] = torch.equal(first.frames, again.frames) and torch.equal(first.waveform, again.waveform)
    print("RESULT " + json.dumps(out))
""")


def run_child(folder: Path, how: str, residency: str) -> dict:
    code = CHILD.format(root=str(ROOT), folder=str(folder), how=how, residency=residency)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])  # a SIGBUS would be -7
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture
def model_copy(tiny, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    return folder


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_a_loaded_resident_model_is_untouched_by_changes_to_its_files(model_copy, how):
    """All four components resident and kept: their files truncated (or rewritten in place) after a generation,
    the next generation gives the same result (no SIGBUS, no changed numbers)."""
    result = run_child(model_copy, how, "resident")
    assert result["files"] >= 4
    assert result["error"] is None and result["same"] is True


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


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_a_streamed_model_whose_files_change_raises_one_error(model_copy, how):
    """Layerwise: every streamed block and phase-scoped weight is read again each run, with its file checked."""
    result = run_child(model_copy, how, "layerwise")
    assert result["error"] is not None, result
    assert "changed while it was loaded" in result["error"] and "load the model again" in result["error"]
    assert ("size changed" if how == "truncate" else "rewritten") in result["error"]
