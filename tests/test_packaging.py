"""Packaging rules: h3_core stays a plain PyTorch library; the pack never pulls torch; ComfyUI entry point hygiene."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("comfy", "comfy_api", "folder_paths", "server", "node_helpers", "diffusers", "transformers",
             "accelerate")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_h3_core_never_imports_comfyui_or_reference_libraries():
    for path in sorted((ROOT / "h3_core").rglob("*.py")):
        bad = imported_modules(path) & set(FORBIDDEN)
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
    code = ("import sys, h3_core; bad = [m for m in sys.modules if m.split('.')[0] in %r]; print(bad)" % (FORBIDDEN,))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_nodes_never_import_reference_libraries():
    for path in sorted((ROOT / "nodes").rglob("*.py")):
        bad = imported_modules(path) & {"diffusers", "transformers", "accelerate"}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_requirements_never_list_torch():
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        name = re.split(r"[<>=!~\[; ]", line.split("#")[0].strip())[0].lower()
        assert name not in {"torch", "torchvision", "torchaudio"}, line


def test_pyproject_declares_runtime_and_test_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["name"] == "h3-stream"
    runtime = {re.split(r"[<>=!~\[; ]", d)[0].lower() for d in project["dependencies"]}
    assert {"torch", "safetensors", "huggingface_hub", "numpy", "pillow", "soundfile", "tokenizers"} <= runtime
    # torch is never pinned to a version pip would have to fetch.
    assert all(not d.startswith("torch==") for d in project["dependencies"])
    test = project["optional-dependencies"]["test"]
    assert "diffusers==0.42.1" in test and "transformers==5.23.0" in test
    comfy = meta["tool"]["comfy"]
    for key in ("PublisherId", "DisplayName", "Icon", "includes", "requires-comfyui"):
        assert key in comfy, key


def test_entry_point_never_defines_node_class_mappings():
    tree = ast.parse((ROOT / "__init__.py").read_text())
    assigned = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    assert "NODE_CLASS_MAPPINGS" not in assigned


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python -m pytest -q tests"
    assert command in readme and command in ci
    assert "pip install torch==2.13.0" in readme and "torch==2.13.0" in ci
    assert "pip install -e '.[test,video]'" in readme and "-e '.[test,video]'" in ci
    # The README's first command is the CLI on the embedded tiny model.
    first = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert "python -m h3_core generate" in first.splitlines()[2]


def test_a_built_wheel_holds_every_h3_core_module(tmp_path):
    """`pip install .` (not only the editable install) gets the whole library: every module under h3_core/."""
    import subprocess
    import sys
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wheel, = tmp_path.glob("h3_stream-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("h3_core/")}
    expected = {str(path.relative_to(ROOT)) for path in (ROOT / "h3_core").rglob("*.py")
                if "__pycache__" not in path.parts}
    assert expected <= shipped, sorted(expected - shipped)
