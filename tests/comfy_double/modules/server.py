"""Test double of ComfyUI's `server`: a PromptServer whose websocket messages are recorded."""

from __future__ import annotations


class PromptServer:
    instance: "PromptServer | None" = None

    def __init__(self):
        self.messages: list[tuple] = []  # (event, data, sid)
        # The client that queued the running prompt (ComfyUI sets it from the prompt's `client_id`, None for an API
        # prompt queued without one): a browser tab by default here.
        self.client_id: str | None = "browser-tab"
        PromptServer.instance = self

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data, sid))

    def send_progress_text(self, text, node_id, sid=None):
        self.messages.append(("progress_text", {"text": text, "node": node_id}, sid))
