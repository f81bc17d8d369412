"""The package's layers, read from the source: every import of h3_core (module level or inside a function) goes from
a layer to itself or to a layer below it, the import graph has no circle, every imported name exists, and no module
outside the platform object compares a device type."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "h3_core"
# The layers and what each may import besides itself: a partial order, lowest first. `request` is what every front
# end and both engines share (no loader); `pipeline` (this machine) and `remote` (a server) are the two engines, and
# neither imports the other; `app` (the CLI) drives both. The facade (h3_core/__init__.py and __main__.py) may import
# every layer.
LAYERS = {
    "base": (),
    "runtime": ("base",),
    "models": ("base", "runtime"),
    "checkpoints": ("base", "runtime", "models"),
    "request": ("base",),
    "sources": ("base", "runtime", "models", "checkpoints", "request"),
    "planning": ("base", "runtime", "models", "checkpoints", "request", "sources"),
    "pipeline": ("base", "runtime", "models", "checkpoints", "request", "sources", "planning"),
    "remote": ("base", "request"),
    "app": ("base", "runtime", "models", "checkpoints", "request", "sources", "planning", "pipeline", "remote"),
}
BASE_MODULES = {"h3_core.errors", "h3_core.components", "h3_core.json_values", "h3_core.settings",
                "h3_core.staged_files", "h3_core.step_cache_settings"}
FACADE = {"h3_core", "h3_core.__main__"}
PLATFORM_MODULE = "h3_core.runtime.platform"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> str:
    if name in BASE_MODULES:
        return "base"
    parts = name.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{name} belongs to no layer: put it in a layer folder or add it to the base modules")


def imports_of(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported h3_core module, names imported from it, line) for every import statement of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "h3_core":
                    found.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "h3_core":
                found.append((target, [a.name for a in node.names], node.lineno))
    return found


def import_graph() -> dict[str, set[str]]:
    """Edges module -> imported module; `from package import submodule` counts as an edge to the submodule."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target, names, _ in imports_of(name, path):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            graph[name].update(submodules or [target])
    return graph


def layer_problems(sources: dict[str, Path]) -> list[str]:
    """Every import (module level or in a function) from a module to a layer its own may not import, or to the
    facade."""
    known = modules()
    problems = []
    for name, path in sources.items():
        if name in FACADE:
            continue
        own = layer_of(name)
        for imported, names, line in imports_of(name, path):
            # `from h3_core import settings` imports the module h3_core.settings, not the facade
            for target in [f"{imported}.{n}" for n in names if f"{imported}.{n}" in known] or [imported]:
                if target in FACADE:
                    problems.append(f"{path.name}:{line} imports the facade {target}; import the module")
                elif layer_of(target) != own and layer_of(target) not in LAYERS[own]:
                    problems.append(f"{path.name}:{line} ({own}) imports {target} ({layer_of(target)}), which "
                                    f"{own} may not import")
    return problems


def test_every_module_is_in_a_layer_and_imports_only_the_layers_below_it():
    assert sorted({layer_of(name) for name in modules() if name not in FACADE}) == sorted(LAYERS)
    assert layer_problems(modules()) == []


def test_the_layer_check_finds_an_upward_import(tmp_path):
    """The check itself fails on an import that runs up: a function-level import of the pipeline from the remote
    engine, and one of the CLI from the pipeline."""
    remote = tmp_path / "remote_engine.py"
    remote.write_text("def generate():\n    from ..pipeline.pipeline import H3Pipeline\n")
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text("from ..app import cli\n")
    found = layer_problems({"h3_core.remote.remote_engine": remote, "h3_core.pipeline.pipeline": pipeline})
    assert len(found) == 2
    assert "(remote) imports h3_core.pipeline.pipeline (pipeline)" in found[0]
    assert "(pipeline) imports h3_core.app.cli (app)" in found[1]


def test_named_layer_rules():
    """The rules as the README states them, each checked on its own."""
    graph = import_graph()
    for name, targets in graph.items():
        if name in FACADE:
            continue
        layer = layer_of(name)
        if layer != "app":
            assert not any(t.startswith("h3_core.app") for t in targets), (name, targets)
        if layer == "remote":  # a server is the other engine: no loader, no local pipeline
            assert not any(t.startswith(("h3_core.pipeline", "h3_core.checkpoints", "h3_core.models"))
                           for t in targets), (name, targets)
        if layer == "pipeline":
            assert not any(t.startswith("h3_core.remote") for t in targets), (name, targets)
        if layer == "request":  # what both engines share loads nothing
            assert not any(t.startswith(("h3_core.checkpoints", "h3_core.models", "h3_core.sources"))
                           for t in targets), (name, targets)
        if layer == "runtime":
            assert not any(t.startswith(("h3_core.models", "h3_core.checkpoints", "h3_core.pipeline"))
                           for t in targets), (name, targets)


def test_nothing_in_h3_core_imports_comfyui_or_the_nodes():
    for name, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            roots = []
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = [node.module.split(".")[0]]
            for root in roots:
                assert root not in ("nodes", "comfy", "comfy_api", "folder_paths", "server"), (name, node.lineno)


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if target == node or target in FACADE or target not in graph:
                continue
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state and node not in FACADE:
            visit(node)


def test_every_imported_name_exists():
    """A function-level import of a moved name fails only when that function runs; catch it here."""
    missing = []
    for name, path in modules().items():
        for target, names, line in imports_of(name, path):
            module = importlib.import_module(target)
            for attribute in names:
                if attribute != "*" and not hasattr(module, attribute):
                    try:
                        importlib.import_module(f"{target}.{attribute}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}:{line}: {target} has no {attribute}")
    assert not missing, "\n".join(missing)


# A device type compared or tested: `.type == "cuda"`, `device_type != "mps"`, `"mps" in ...`, availability probes.
DEVICE_TEST = re.compile(
    r"""\.type\s*(==|!=|\bin\b|\bnot\s+in\b)"""
    r"""|\bdevice_type\s*(==|!=|\bin\b)"""
    r"""|(==|!=)\s*["'](cuda|mps|cpu|xpu)["']"""
    r"""|["'](cuda|mps|cpu|xpu)["']\s*(==|!=|\bin\b)"""
    r"""|\.is_available\(\)"""
    r"""|startswith\(\s*["'](cuda|mps)"""
)


def device_type_tests(paths) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if DEVICE_TEST.search(code):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_only_the_platform_object_compares_a_device_type():
    """The product (h3_core, the nodes) and the benchmarks that measure it; tests may assert where a result lives."""
    platform = modules()[PLATFORM_MODULE]
    paths = [p for folder in (PACKAGE, ROOT / "nodes", ROOT / "benchmarks") for p in folder.rglob("*.py")
             if p != platform]
    assert device_type_tests(paths) == []
    # The check itself finds what it is meant to find.
    assert device_type_tests([platform])


def test_each_platform_fact_has_one_source():
    """The objects that used to hold platform facts are gone; their facts come from the platform."""
    import h3_core
    from h3_core.models import video_vae
    from h3_core.runtime import chunking, offload_backends

    assert not hasattr(offload_backends, "DeviceOps")
    assert not hasattr(h3_core.ChunkingBackend, "for_device")
    assert not hasattr(video_vae.DecodeAutocast, "for_device")
    assert h3_core.Platform("mps").chunking.materializes_scores and not h3_core.Platform("cuda").chunking.materializes_scores
    # A chunking policy without an explicit backend takes the device's caps from the platform: MPS caps the query
    # rows of long sequences, the CPU does not.
    widths = _Widths()
    policy = chunking.ChunkingPolicy()
    assert policy.plan(20_000, widths, batch=1, dtype=torch.float32, device="mps").size == 2048
    assert policy.plan(20_000, widths, batch=1, dtype=torch.float32, device="cpu").size is None


class _Widths:
    hidden_size, inner_dim, ffn_dim, num_attention_heads = 64, 64, 128, 4


# The public names the README documents; outside checks import them from `h3_core` whatever moves inside.
PUBLIC_NAMES = (
    "AdmissionError AllResident BlockResidency CheckpointError ComponentPlan ChunkingBackend ChunkingError "
    "ChunkingPolicy EveryNChunks H3DiT H3DiTConfig H3Error H3Tokenizer LatentShape LayerwiseOffloadManager "
    "LoraError PackedLayout PhaseScopedWeights PickleCheckpointError Platform Residency ResidencyError STEP_CACHE_PRESETS Schedule StepCacheSettings TextEncoder "
    "build_packed_layout check_admission chunk_rows_for_budget denoise ensure_tiny_model euler_step "
    "frames_for_seconds initial_noise layerwise_manager load_audio_vae load_dit load_text_encoder load_video_vae patchify "
    "plan_for_budget read_lora resolve_dit_checkpoint row_timesteps set_loras sigma_schedule step_cache_settings unpatchify"
).split()


def test_the_facade_keeps_the_public_names():
    import h3_core
    import h3_core.pipeline as pipeline

    assert sorted(h3_core.__all__) == sorted(PUBLIC_NAMES)
    assert all(hasattr(h3_core, name) for name in PUBLIC_NAMES)
    import h3_core.planning as planning
    import h3_core.request as request
    import h3_core.sources as sources

    for package, names in ((pipeline, ("H3Pipeline", "Conditioning", "Latents")),
                           (sources, ("ModelSources", "resolve_model", "is_repo_id")),
                           (planning, ("plan_components", "plan_for_budget", "MemoryPlan")),
                           (request, ("GenerationResult",))):
        for name in names:
            assert hasattr(package, name), (package.__name__, name)
