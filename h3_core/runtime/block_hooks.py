"""Drive a residency from forward hooks, for block stacks inside modules we do not own."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .residency import BlockResidency


class BlockHooks:
    """Drives `residency` from forward hooks on `blocks` (a stack inside a module we do not own).

    The pre-hook acquires block i (loading it synchronously when it was not prefetched: any traversal order works)
    and the post-hook releases it. Pass `root` to bracket each call of the owning module with begin/end_pass.
    The hooks are hidden from torch.compile so a compiled block body never traces offload logic.
    """

    def __init__(self, residency: BlockResidency, blocks: Sequence[nn.Module], root: nn.Module | None = None):
        disable = torch.compiler.disable
        self.residency = residency
        self._handles = []
        for index, block in enumerate(blocks):
            pre = disable(lambda module, args, i=index: residency.acquire(i))
            post = disable(lambda module, args, output, i=index: residency.release(i))
            self._handles.append(block.register_forward_pre_hook(pre))
            self._handles.append(block.register_forward_hook(post, always_call=True))
        if root is not None:
            self._handles.append(root.register_forward_pre_hook(disable(lambda module, args: residency.begin_pass())))
            self._handles.append(root.register_forward_hook(disable(lambda module, args, output: residency.end_pass()),
                                                            always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
