"""Test double of ComfyUI's `comfy_api` package (only `comfy_api.latest` is provided)."""
