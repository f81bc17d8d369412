"""Test double of `comfy_api.latest`: the V3 node API the pack uses (`io`, `ui`, `ComfyExtension`).

Signatures follow ComfyUI 0.33.0 (checked against tests/comfy_double/contract/signatures.json, recorded from a real
ComfyUI); the bodies are this double's own, just enough to build schemas, serialise them like `/object_info` and run
nodes.
"""

from abc import ABC, abstractmethod

from . import _io as io
from . import _ui as ui

IO = io
UI = ui


class ComfyExtension(ABC):
    async def on_load(self) -> None:
        """Called once when ComfyUI loads the extension."""

    @abstractmethod
    async def get_node_list(self) -> list:
        """The extension's node classes."""


__all__ = ["ComfyExtension", "io", "IO", "ui", "UI"]
