"""The slot ledger of the layerwise offload manager: which device slot holds which block, and in what state; every
illegal transition raises, so a broken acquire / release protocol fails loudly instead of corrupting weights."""

from __future__ import annotations

import enum

from .residency import ResidencyError


class SlotStateError(ResidencyError):
    """An illegal transition of a device slot (a bug in the caller's acquire/release protocol)."""


class SlotState(enum.Enum):
    EMPTY = "empty"  # no unit; may be loaded
    LOADING = "loading"  # a copy into it is being issued
    READY = "ready"  # copy issued and its ready event recorded; not yet used by compute
    IN_USE = "in_use"  # bound to the unit's parameters
    FREEING = "freeing"  # unbound; its free event is being recorded


_LEGAL = {
    SlotState.EMPTY: {SlotState.LOADING},
    SlotState.LOADING: {SlotState.READY, SlotState.EMPTY},  # -> EMPTY: the load failed
    SlotState.READY: {SlotState.IN_USE, SlotState.EMPTY},  # -> EMPTY: a prefetched unit discarded unused
    SlotState.IN_USE: {SlotState.FREEING},
    SlotState.FREEING: {SlotState.EMPTY},
}


class SlotTable:
    """The state of each device slot and the unit it holds; any illegal transition raises `SlotStateError`."""

    def __init__(self, count: int):
        self.states = [SlotState.EMPTY] * count
        self.units: list[int | None] = [None] * count

    def __len__(self) -> int:
        return len(self.states)

    def _move(self, slot: int, new: SlotState, unit: int | None = None) -> None:
        old = self.states[slot]
        if new not in _LEGAL[old]:
            held = self.units[slot]
            raise SlotStateError(
                f"slot {slot} (holding block {held}) cannot go from {old.value} to {new.value}; legal next states: "
                f"{sorted(s.value for s in _LEGAL[old])}. Acquire a block once, release it before acquiring it "
                "again, and never acquire more than prefetch + 1 streamed blocks at once."
            )
        self.states[slot] = new
        if new is SlotState.LOADING:
            self.units[slot] = unit
        elif new is SlotState.EMPTY:
            self.units[slot] = None

    def start_loading(self, slot: int, unit: int) -> None:
        self._move(slot, SlotState.LOADING, unit)

    def abandon(self, slot: int) -> None:
        """The load into `slot` failed: it holds nothing."""
        self._move(slot, SlotState.EMPTY)

    def mark_ready(self, slot: int) -> None:
        self._move(slot, SlotState.READY)

    def take(self, slot: int) -> None:
        self._move(slot, SlotState.IN_USE)

    def give_back(self, slot: int) -> None:
        self._move(slot, SlotState.FREEING)

    def mark_free(self, slot: int) -> None:
        self._move(slot, SlotState.EMPTY)

    def discard(self, slot: int) -> None:
        self._move(slot, SlotState.EMPTY)

    def slot_of(self, unit: int) -> int | None:
        for slot, held in enumerate(self.units):
            if held == unit:
                return slot
        return None

    def first(self, state: SlotState) -> int | None:
        for slot, s in enumerate(self.states):
            if s is state:
                return slot
        return None

    def holding(self, *states: SlotState) -> list[int]:
        return [u for u, s in zip(self.units, self.states) if s in states and u is not None]
