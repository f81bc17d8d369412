"""The step cache: DBCache ("dual block cache", cache-dit's algorithm) over the H3 transformer's joint sequence.

Every model call runs the first `first_blocks` (Fn) blocks. Their residual (output minus input) is compared with the one
of the last call that ran every block: when the relative L1 change `mean|r - r_prev| / mean|r_prev|` is under
`threshold`, the middle blocks are skipped and their residual from that call is added instead; the last `last_blocks`
(Bn) blocks always run. No call hits during the first `warmup_steps` calls, and after `max_consecutive` hits in a row
the next call runs every block (-1: no cap). The decisions and the arithmetic are cache-dit 1.5.3's
(`CachedContextManager.can_cache` / `similarity`, `CachedBlocks_Pattern_3_4_5.forward`), which the tests use as the
oracle; a threshold <= 0 never hits, one >= 1 always hits once a residual is cached.

A streamed transformer neither materialises nor reads the blocks a hit skips: `planned_order` tells the residency which
blocks the call will run (from the rules and the last measured change, before the call starts) so its read-ahead
follows the likely path, and `order_after_decision` the ones it really runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import H3Error
from ..step_cache_settings import StepCacheSettings, check_settings


@dataclass
class StepCacheStats:
    """What the cache did in one sampling run: one entry per model call."""

    settings: StepCacheSettings
    num_blocks: int
    decisions: list[bool] = field(default_factory=list)  # True: the middle blocks were skipped
    changes: list[float | None] = field(default_factory=list)  # the measured relative change (None: not measured)
    blocks_run: list[int] = field(default_factory=list)
    bytes_read: list[int] = field(default_factory=list)  # transformer bytes read from files in each call (streamed)

    @property
    def hits(self) -> int:
        return sum(self.decisions)

    @property
    def misses(self) -> int:
        return len(self.decisions) - self.hits

    def summary(self) -> str:
        run = sum(self.blocks_run)
        full = self.num_blocks * len(self.decisions)
        text = (f"step cache {self.settings.name}: {self.hits} of {len(self.decisions)} steps cached, "
                f"{run} of {full} blocks run")
        read = sum(self.bytes_read)
        if read:  # only a streamed transformer reads weights during the calls
            text += f", {read / 2**30:.2f} GiB of weights read" if read >= 2**30 else f", {read / 2**20:.1f} MiB of " \
                    "weights read"
        return text


class StepCacheRun:
    """The cache's state over one sampling run (one `denoise`): pass it to every model call of that run."""

    def __init__(self, settings: StepCacheSettings, num_blocks: int, name: str = "step_cache"):
        settings = check_settings(settings, name)
        if settings.first_blocks + settings.last_blocks >= num_blocks:
            raise H3Error(f"{name} {settings.name}: {settings.first_blocks} first + {settings.last_blocks} last blocks "
                          f"always run, which leaves none of this transformer's {num_blocks} blocks to skip; let fewer "
                          "blocks always run.")
        self.settings = settings
        self.num_blocks = num_blocks
        self.stats = StepCacheStats(settings, num_blocks)
        self._first_residual: torch.Tensor | None = None  # Fn residual of the last call that ran every block
        self._middle_residual: torch.Tensor | None = None  # what the middle blocks added in that call
        self._consecutive = 0
        self._last_change: float | None = None
        self._step = -1

    # ---- the call's plan -------------------------------------------------------------------------------------

    @property
    def middle(self) -> range:
        s = self.settings
        return range(s.first_blocks, self.num_blocks - s.last_blocks)

    @property
    def first_blocks(self) -> range:
        """The blocks every call runs first (the next call's head, whatever this one decides)."""
        return range(self.settings.first_blocks)

    @property
    def decision_block(self) -> int:
        """The block after which the call decides (the last of the first blocks)."""
        return self.settings.first_blocks - 1

    def begin_call(self) -> None:
        self._step += 1
        if not self.stats.decisions or not self.stats.decisions[-1]:
            self._consecutive = 0  # a call that ran every block breaks the run of hits

    def _may_hit(self) -> bool:
        """cache-dit's checks before it measures the change (warm-up, the cap, a threshold <= 0, nothing cached)."""
        s = self.settings
        if self._step < s.warmup_steps:
            return False
        if s.max_consecutive >= 0 and self._consecutive >= s.max_consecutive:
            return False
        return s.threshold > 0.0 and self._first_residual is not None

    def planned_order(self) -> list[int]:
        """The blocks this call will most likely run: all of them unless a hit is allowed and the last measured change
        was under the threshold (a threshold >= 1 always hits)."""
        likely = self._may_hit() and (self.settings.threshold >= 1.0 or (
            self._last_change is not None and self._last_change < self.settings.threshold))
        return self._order(likely)

    def _order(self, hit: bool) -> list[int]:
        if not hit:
            return list(range(self.num_blocks))
        return [i for i in range(self.num_blocks) if i not in self.middle]

    # ---- the decision ----------------------------------------------------------------------------------------

    def decide(self, block_input: torch.Tensor, first_output: torch.Tensor) -> bool:
        """After the first blocks: True when the middle blocks are skipped (then `apply` gives their output)."""
        first_residual = first_output - block_input.to(first_output.device)
        hit, change = False, None
        previous = self._first_residual
        comparable = previous is not None and previous.shape == first_residual.shape
        if self._may_hit():
            threshold = self.settings.threshold
            if threshold >= 1.0:
                hit = True
            elif comparable:
                change = relative_change(previous, first_residual)
                hit = change < threshold
        if change is not None:
            self._last_change = change
        elif comparable and self._step < self.settings.warmup_steps and 0.0 < self.settings.threshold < 1.0:
            # Measured in the warm-up only to guess the first call after it (cache-dit decides nothing there).
            self._last_change = relative_change(previous, first_residual)
        if hit:
            self._consecutive += 1
        else:
            self._first_residual = first_residual
        self.stats.decisions.append(hit)
        self.stats.changes.append(change)
        self.stats.blocks_run.append(len(self._order(hit)))
        return hit

    def order_after_decision(self, hit: bool) -> list[int]:
        return self._order(hit)

    def apply(self, first_output: torch.Tensor) -> torch.Tensor:
        """The middle blocks' output on a hit: the first blocks' output plus the cached middle residual."""
        return (self._middle_residual + first_output).contiguous()

    def record_middle(self, first_output: torch.Tensor, middle_output: torch.Tensor) -> None:
        """After the middle blocks of a call that ran them: keep what they added."""
        self._middle_residual = middle_output.contiguous() - first_output

    @property
    def held_bytes(self) -> int:
        """Device bytes the cached residuals take now."""
        return sum(t.numel() * t.element_size() for t in (self._first_residual, self._middle_residual)
                   if t is not None)


def relative_change(previous: torch.Tensor, current: torch.Tensor) -> float:
    """cache-dit's measure: `mean|previous - current| / mean|previous|`."""
    return ((previous - current).abs().mean() / previous.abs().mean()).item()


def step_cache_activation_bytes(rows: int, hidden_size: int, batch: int, dtype: torch.dtype) -> int:
    """Device bytes the step cache adds to a call of `rows` packed rows: the two cached residuals, plus the first
    blocks' output held while the middle blocks run and the new first residual while the change is measured."""
    one = batch * rows * hidden_size * torch.empty((), dtype=dtype).element_size()
    return 4 * one
