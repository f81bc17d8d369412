"""Test double of `comfy_api.latest.ui`: the UI outputs the pack returns."""


class _UIOutput:
    def as_dict(self) -> dict:
        raise NotImplementedError


class PreviewText(_UIOutput):
    def __init__(self, value: str, **kwargs):
        self.value = value

    def as_dict(self):
        return {"text": (self.value,)}
