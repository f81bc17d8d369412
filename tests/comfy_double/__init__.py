"""A small test double of the ComfyUI modules the pack uses (ComfyUI is not installable from PyPI).

`modules/` holds `comfy_api.latest`, `comfy.cli_args` (the preview settings), `comfy.model_management`, `comfy.nested_tensor`, `comfy.utils`, `folder_paths` and
`server`, with ComfyUI 0.33.0's signatures (contract/signatures.json, recorded from a real ComfyUI by
record_contract.py; the model registry's calls and values were added from kat3ri/ComfyUI 0f1fa67, the other
entries unchanged there).
`load_pack()` imports the pack the way ComfyUI's custom-node loader does; `executor.PromptExecutor` validates and runs
API-format prompts; `core_nodes` stands in for the core nodes the example workflows end in and the core H3
latent nodes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

MODULES = Path(__file__).resolve().parent / "modules"
CONTRACT = Path(__file__).resolve().parent / "contract"
PACK_ROOT = Path(__file__).resolve().parents[2]
# ComfyUI names a custom-node package after its path (dots replaced).
PACK_MODULE = str(PACK_ROOT).replace(".", "_x_")


def install(base_dir) -> None:
    """Put the double on sys.path (first) and give every recorder a fresh state, with ComfyUI's folders under
    `base_dir`."""
    if str(MODULES) not in sys.path:
        sys.path.insert(0, str(MODULES))
    import comfy.cli_args
    import comfy.model_management
    import comfy.utils
    import comfy_api.latest  # noqa: F401  (imported so the check below sees it)
    import folder_paths
    import server

    for name in ("comfy_api", "comfy", "folder_paths", "server"):
        module = sys.modules[name]
        assert str(MODULES) in str(getattr(module, "__file__", "") or module.__path__[0]), \
            f"{name} is not the test double: {module}"
    folder_paths.configure(str(base_dir))
    comfy.model_management.state.reset()
    comfy.utils.UPDATES.clear()
    comfy.utils.PREVIEWS.clear()
    comfy.cli_args.reset()
    server.PromptServer()


def load_pack(root: Path = PACK_ROOT):
    """Import the pack as ComfyUI does (module name from its path, `__init__.py` executed as a package), call
    `comfy_entrypoint()`, `on_load()` and `get_node_list()`, and return {node_id: class}."""
    from comfy_api.latest import ComfyExtension

    module_name = PACK_MODULE if root == PACK_ROOT else str(root).replace(".", "_x_")
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, root / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    assert not hasattr(module, "NODE_CLASS_MAPPINGS"), "NODE_CLASS_MAPPINGS makes ComfyUI ignore comfy_entrypoint"
    extension = module.comfy_entrypoint()
    assert isinstance(extension, ComfyExtension)

    async def register():
        await extension.on_load()
        return await extension.get_node_list()

    classes = asyncio.run(register())
    return {cls.GET_SCHEMA().node_id: cls for cls in classes}


def pack_module(name: str):
    """A module of the loaded pack, e.g. `pack_module("nodes.memory_settings")` (call `load_pack()` first)."""
    return importlib.import_module(f"{PACK_MODULE}.{name}")
