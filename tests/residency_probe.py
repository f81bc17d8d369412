"""Observing a layerwise manager from outside its ledger: which units have device weights alive, which are bound.

Shared by the text-encoder and VAE residency tests. The census judges liveness from storages alone (weak references
to what the host store's `materialise` returned); `bound` judges from the parameters themselves (a streamed unit that
is not bound holds the manager's one-element placeholder, and the test models have no one-element parameters).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef


def is_materialised(parameters) -> bool:
    return all(p.numel() > 1 for p in parameters)


class MaterialisationCensus:
    """Which units of `store` have device tensors alive; wraps `store.materialise` (the synchronous backend's only
    way to make device tensors from held tensors) and, for a staged store whose staging buffers are the device
    memory (the CPU), `take` / `give_back` (a unit is alive from the take of its buffer to its return)."""

    def __init__(self, store):
        self.refs = []
        self.lent: dict[int, int] = {}  # staging buffer -> unit
        make = store.materialise
        if getattr(store, "hand_over", False):
            take, give_back = store.take, store.give_back

            def taken(unit):
                staged = take(unit)
                self.lent[staged.index] = unit
                return staged

            def given_back(staged, after=None):
                self.lent.pop(staged.index, None)
                return give_back(staged, after)

            store.take, store.give_back = taken, given_back

        def materialise(unit, device):
            tensors = make(unit, device)
            self.refs += [(unit, StorageWeakRef(t.untyped_storage())) for t in tensors.values()]
            return tensors

        store.materialise = materialise

    def live(self) -> set[int]:
        self.refs = [(u, r) for u, r in self.refs if not r.expired()]
        return {u for u, _ in self.refs} | set(self.lent.values())


class UnitProbe:
    """A forward pre-hook on the first module of every unit, recording while unit i runs: the units whose weights
    are alive on the device (census), the units bound to their parameters, the manager's own ledger, and whether
    any phase-scoped weights are materialised.

    `unit_parameters(i)` lists unit i's parameters; `entry_modules[i]` is the module unit i runs first (after its
    acquire); `phase_parameters` are the phase-scoped weights that must not be alive while units run.
    """

    def __init__(self, manager, entry_modules: Sequence[nn.Module], unit_parameters: Callable[[int], list],
                 phase_parameters: Sequence[torch.nn.Parameter] = ()):
        self.manager = manager
        self.census = MaterialisationCensus(manager.store)
        self.unit_parameters = unit_parameters
        self.phase_parameters = list(phase_parameters)
        self.observations = []
        self.handles = [module.register_forward_pre_hook(lambda m, a, i=i: self.observe(i))
                        for i, module in enumerate(entry_modules)]

    def observe(self, running: int) -> None:
        units = range(self.manager.num_blocks)
        bound = {j for j in units if is_materialised(self.unit_parameters(j))}
        phase_live = any(p.numel() > 1 for p in self.phase_parameters)
        self.observations.append((running, bound, self.census.live(), set(self.manager.materialised_streamed()),
                                  phase_live))

    def check(self, prefetch: int, resident: set[int], passes: int) -> None:
        """Every observation obeys the bound; the bound is reached; the census agrees with the ledger."""
        units = self.manager.num_blocks
        streamed = [i for i in range(units) if i not in resident]
        assert len(self.observations) == passes * units
        for running, bound, live, ledger, phase_live in self.observations:
            assert bound == resident | {running}  # only the running streamed unit is bound to its parameters
            assert live == ledger  # the manager's ledger tells the truth
            assert running in live or running in resident
            assert len(live) <= prefetch + 1
            assert not live & resident  # resident units were materialised once, at attach, outside the census
            assert not phase_live  # phase-scoped weights were released before the units ran
        assert max(len(live) for _, _, live, _, _ in self.observations) == min(prefetch + 1, len(streamed))
        assert self.census.live() == set()  # after the pass nothing streamed stays on the device

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
