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


class VideoFromFile:
    """Core's file-backed VIDEO (`comfy_api.latest._input_impl.video_types.VideoFromFile`): a path (or a BytesIO),
    read through PyAV when asked."""

    def __init__(self, file, *, start_time: float = 0, duration: float = 0):
        self._file = file
        self._start_time = start_time
        self._duration = duration

    def get_stream_source(self):
        return self._file

    def get_dimensions(self) -> tuple[int, int]:
        import av

        with av.open(self._file) as container:
            stream = container.streams.video[0]
            return stream.width, stream.height

    def save_to(self, path, format=None, codec=None, metadata=None, bit_depth=None, crf=None):
        import shutil

        if isinstance(self._file, str):
            shutil.copyfile(self._file, path)
        else:
            self._file.seek(0)
            with open(path, "wb") as handle:
                handle.write(self._file.read())


class InputImpl:
    VideoFromFile = VideoFromFile


__all__ = ["ComfyExtension", "io", "IO", "ui", "UI", "InputImpl"]
