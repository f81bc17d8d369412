"""A fake MPS device for CPU tests: an MPS `Platform` (`Platform.simulated("mps", fake)`) whose tensors are on the
CPU, with the MPS behaviours the pack's MPS rules exist for:

* no float64 and no float8: an op that makes a tensor of such a dtype raises, as MPS does;
* a per-op buffer limit (MPSGraph: 4 GiB; tests may scale it down): an op whose output, or whose materialised
  attention score matrix (MPS's SDPA builds it whole), is larger raises;
* frees deferred until synchronise: a buffer from `empty()` that is dropped is counted as held by the driver
  (`driver_bytes`) until `synchronize()` (what `reclaim_every` exists for on MPS).

The dtype and buffer rules apply to the ops run inside `with fake.active():` (a torch function mode), so test code
outside it may still use float64 for its own comparisons. `active(device_only=True)` applies them only to ops that
read a buffer of this device (from `empty`: the offload backends' slots and copies), for code that also does host work
on the same thread (reading and dequantising weights on the host), which the CPU-backed fake cannot tell apart.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from h3_core.runtime.platform import GiB, Platform, _HostOps

MISSING_DTYPES = (torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


class FakeMpsError(RuntimeError):
    """What the real MPS raises, as one type the tests can expect."""


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


class _MpsRules(TorchFunctionMode):
    def __init__(self, fake: "FakeMps", device_only: bool):
        super().__init__()
        self.fake = fake
        self.device_only = device_only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.device_only and not any(t.untyped_storage().data_ptr() in self.fake.device_storages
                                        for t in _tensors((args, tuple(kwargs.values())))):
            return func(*args, **kwargs)  # host work
        if func is F.scaled_dot_product_attention:
            self.fake.check_scores(args[0], args[1])
        out = func(*args, **kwargs)
        for t in _tensors(out):
            self.fake.check_tensor(t, getattr(func, "__name__", str(func)))
        return out


class FakeMps(_HostOps):
    def __init__(self, max_buffer_bytes: int = 4 * GiB):
        super().__init__(torch.device("cpu"))
        self.max_buffer_bytes = max_buffer_bytes
        self.largest_op_bytes = 0
        self.live_bytes = 0
        self.pending_free_bytes = 0  # freed by Python, held by the driver until synchronize()
        self.synchronizations = 0
        self.copies: list[int] = []  # bytes of each host-to-device copy
        self.device_storages: set[int] = set()  # data pointers of the buffers `empty` made
        self._kept: list[torch.Tensor] = []  # an empty view of each: their addresses are never reused by host memory

    def platform(self) -> Platform:
        return Platform.simulated("mps", self)

    @contextlib.contextmanager
    def active(self, device_only: bool = False):
        with _MpsRules(self, device_only):
            yield self

    # ---- the rules ----------------------------------------------------------------------------------------------

    def check_tensor(self, t: torch.Tensor, op: str) -> None:
        if t.dtype in MISSING_DTYPES:
            raise FakeMpsError(f"{op}: MPS has no {t.dtype} (Trying to convert {t.dtype} to the MPS backend but it "
                               "does not have support for that dtype.)")
        self._check_bytes(t.numel() * t.element_size(), op)

    def check_scores(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """MPS's SDPA materialises the (batch, heads, query rows, key rows) scores in the query dtype."""
        scores = math.prod(q.shape[:-1]) * k.shape[-2] * q.element_size()
        self._check_bytes(scores, "scaled_dot_product_attention scores")

    def _check_bytes(self, nbytes: int, op: str) -> None:
        self.largest_op_bytes = max(self.largest_op_bytes, nbytes)
        if nbytes > self.max_buffer_bytes:
            raise FakeMpsError(f"{op}: a {nbytes}-byte buffer is over MPS's {self.max_buffer_bytes}-byte limit "
                               "(MPSGraph does not support tensor dims larger than INT_MAX)")

    # ---- the allocator ------------------------------------------------------------------------------------------

    def empty(self, nbytes: int) -> torch.Tensor:
        self._check_bytes(nbytes, "empty")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.device_storages.add(buffer.untyped_storage().data_ptr())
        self._kept.append(torch.empty(0, dtype=torch.uint8).set_(buffer.untyped_storage(), 0, (0,)))  # no _base
        self.live_bytes += nbytes
        weakref.finalize(buffer, self._freed, nbytes)
        return buffer

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self.pending_free_bytes += nbytes

    def copy_to_device(self, dst, src, non_blocking=False) -> None:
        self.check_tensor(dst, "copy_to_device")
        self.copies.append(src.numel() * src.element_size())
        dst.copy_(src)

    def synchronize(self) -> None:
        self.synchronizations += 1
        self.pending_free_bytes = 0

    def allocated_bytes(self) -> int:
        return self.live_bytes

    def driver_bytes(self) -> int:
        return self.live_bytes + self.pending_free_bytes
