"""Test double of ComfyUI's `comfy` package (`model_management` and `utils` only)."""
