"""ComfyUI entry point of the h3-stream node pack.

ComfyUI imports this file from `custom_nodes/` and calls `comfy_entrypoint()`. `NODE_CLASS_MAPPINGS` is deliberately
never defined here: ComfyUI would then ignore `comfy_entrypoint`.
"""

import os
import sys

WEB_DIRECTORY = "./web"


def _make_h3_core_importable() -> None:
    # h3_core is imported by its absolute name (the pipeline itself does `import h3_core`), while ComfyUI imports this
    # pack under a module name made from its path. Appended, never prepended: the pack's `nodes/` must not shadow
    # ComfyUI's own `nodes` module.
    pack = os.path.dirname(os.path.abspath(__file__))
    if pack not in sys.path:
        sys.path.append(pack)


def comfy_entrypoint():
    _make_h3_core_importable()
    from .nodes import H3StreamExtension

    return H3StreamExtension()
