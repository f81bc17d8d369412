"""Test double of `comfy.utils`: a ProgressBar that records every update."""

from __future__ import annotations

UPDATES: list[tuple] = []  # (node_id, value, total) of every update, in order
PREVIEWS: list[tuple] = []  # (node_id, value, preview) of every update that carried a preview, in order


class ProgressBar:
    def __init__(self, total, node_id=None):
        self.total = total
        self.current = 0
        self.node_id = node_id

    def update_absolute(self, value, total=None, preview=None):
        if total is not None:
            self.total = total
        self.current = min(value, self.total)
        UPDATES.append((self.node_id, self.current, self.total))
        if preview is not None:  # the real one hands it to the server's hook: ("JPEG", PIL image, max size)
            PREVIEWS.append((self.node_id, self.current, preview))

    def update(self, value):
        self.update_absolute(self.current + value)
