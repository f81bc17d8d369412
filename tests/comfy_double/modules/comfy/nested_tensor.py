"""Test double of `comfy.nested_tensor`: core's container of several latent streams (video and audio of an AV latent).

Only what the pack and the double's core nodes touch: the constructor (the recorded signature), `is_nested`,
`unbind()` and `shape` (the first stream's, as core's own nodes read it).
"""

from __future__ import annotations


class NestedTensor:
    def __init__(self, tensors):
        self.tensors = list(tensors)
        self.is_nested = True

    def unbind(self):
        return self.tensors

    @property
    def shape(self):
        return self.tensors[0].shape
