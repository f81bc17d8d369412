"""Where a component's weights live while it runs: all on the device, or streamed block by block.

One interface (`BlockResidency`) for every component built from a stack of repeated blocks (the DiT's blocks, the
text encoder's layers, the video and audio VAE decoders' blocks):

    residency.begin_pass()
    for i, block in enumerate(blocks):
        residency.acquire(i)      # block i's weights are valid for the compute stream (and i+1..i+p are on the way)
        x = block(x, ...)
        residency.release(i)      # block i's device copy may be reclaimed after the work already queued
    residency.end_pass()          # in a `finally`: an exception inside a block leaves the manager usable

* `AllResident` (`Residency.RESIDENT`): every weight stays on the device; the calls cost nothing.
* `LayerwiseOffloadManager` (`Residency.LAYERWISE_OFFLOAD`): blocks live in a host store and at most
  `prefetch + 1` of them are materialised on the device at any moment (slot ledger `SlotTable`); the first
  `resident_blocks` (or the listed indices) stay on the device (`layerwise.py`; its slot ledger is `slots.py`, its
  telemetry `telemetry.py`). The device work is a backend's (`offload_backends.py`): synchronous (MPS, CPU as the
  device) or asynchronous (CUDA).
* `PhaseScopedWeights` (`phase_scoped.py`): non-block weights (e.g. the text refiner) materialised for one named
  phase, then released.

Inference only: nothing is ever written back to the host store. Buffers are never offloaded.
"""

from __future__ import annotations

import contextlib
import enum

from .. import settings
from ..errors import H3Error, ResidencyError  # noqa: F401 - ResidencyError is re-exported here
from .telemetry import PassStats, ResidencyStats


class Residency(str, enum.Enum):
    """Where a component's weights live while it runs."""

    RESIDENT = settings.RESIDENT  # all weights on the device
    LAYERWISE_OFFLOAD = settings.LAYERWISE  # blocks in a host store, at most prefetch + 1 materialised on the device

    @classmethod
    def parse(cls, value: "Residency | str") -> "Residency":
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower()
        for member in cls:
            if text in (member.value, member.name.lower()):
                return member
        raise ResidencyError(
            f"residency {value!r} is not one of {[m.value for m in cls]}; use 'resident' (all weights on the device) "
            "or 'layerwise' (blocks streamed from a host store)."
        )


# ---- the interface -----------------------------------------------------------------------------------------------


class BlockResidency:
    """The calls a block loop makes. Subclasses: `AllResident`, `LayerwiseOffloadManager`."""

    residency: Residency

    def begin_pass(self) -> None: ...

    def end_pass(self) -> None: ...

    def acquire(self, index: int) -> None: ...

    def release(self, index: int) -> None: ...

    def prefetch(self, index: int) -> None: ...

    def set_order(self, blocks, next_head=()) -> None:
        """The blocks this pass will acquire (ascending; None: all), so that loads and reads ahead skip the others
        (a step cache's hit skips the middle blocks), and `next_head`, those the next pass surely starts with (read
        ahead after this pass's last). Called before `begin_pass` for the pass's likely path and during it once the
        path is known; `end_pass` resets it. Nothing to do when every weight stays on the device."""

    def resident_set(self) -> frozenset[int]:
        raise NotImplementedError

    @property
    def bytes_read(self) -> int:
        """Bytes read from checkpoint files so far, all passes together (0 for weights that are not streamed)."""
        return 0

    def set_transform(self, transform) -> None:
        """Edit weights when they are materialised (see `LayerwiseOffloadManager.set_transform`); resident weights are
        never materialised, so there is nothing to do: their owner changes them itself."""

    def managed_parameters(self) -> frozenset[str]:
        """Names of the parameters this residency materialises (none when every weight stays resident)."""
        return frozenset()

    def stats(self) -> ResidencyStats:
        raise NotImplementedError

    def close(self, restore: bool = True) -> None:
        """Stop managing the weights; `restore=False` when the model is being dropped (nothing is given back)."""

    @contextlib.contextmanager
    def pass_scope(self):
        """`begin_pass()`, then `end_pass()` however the body exits."""
        self.begin_pass()
        try:
            yield self
        finally:
            self.end_pass()


class AllResident(BlockResidency):
    """Every block's weights stay on the device: the default of a plain module."""

    residency = Residency.RESIDENT

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._passes = 0

    def end_pass(self) -> None:
        self._passes += 1

    def resident_set(self) -> frozenset[int]:
        return frozenset(range(self.num_blocks))

    def stats(self) -> ResidencyStats:
        return ResidencyStats(Residency.RESIDENT, self._passes, None, PassStats(), 0, 0, 0, self.resident_set(), (),
                              0, "none")
