"""Non-block weights (the DiT's text refiner, the text encoder's embedding and vision tower, the VAE encoders)
materialised on the device for one named phase of a forward, then released."""

from __future__ import annotations

import contextlib
from typing import Mapping

from .host_store import UnitRecipes
from .layerwise import LayerwiseOffloadManager, Unit
from .offload_backends import SynchronousBackend
from .residency import ResidencyError
from .telemetry import ResidencyStats


class PhaseScopedWeights:
    """Non-block weights materialised on the device for one named phase, then released.

    `phases` maps a phase name to its parameters (a module or name -> Parameter). Phases not declared here are
    resident weights, for which `phase(name)` does nothing. Without a backend nothing is phase-scoped.
    """

    def __init__(self, backend: SynchronousBackend | None = None, phases: Mapping[str, Unit] | None = None,
                 recipes: Mapping[str, UnitRecipes] | None = None):
        phases = dict(phases or {})
        self.names = tuple(phases)
        self._manager = None
        if phases:
            if backend is None:
                raise ResidencyError("phase-scoped weights need a backend to materialise them on.")
            units = [phases[n] for n in self.names]
            unit_recipes = None if recipes is None else [recipes[n] for n in self.names]
            self._manager = LayerwiseOffloadManager(backend, prefetch=0).attach(units, unit_recipes)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Materialise `name`'s weights for the body, release them however it exits."""
        if self._manager is None or name not in self.names:
            yield
            return
        index = self.names.index(name)
        self._manager.acquire(index)
        try:
            yield
        finally:
            self._manager.release(index)

    def set_transform(self, transform) -> None:
        """See `LayerwiseOffloadManager.set_transform`; nothing to do without phase-scoped weights."""
        if self._manager is not None:
            self._manager.set_transform(transform)

    def managed_parameters(self) -> frozenset[str]:
        return frozenset() if self._manager is None else self._manager.managed_parameters()

    def materialised(self) -> tuple[str, ...]:
        if self._manager is None:
            return ()
        return tuple(self.names[i] for i in self._manager.materialised_streamed())

    def stats(self) -> ResidencyStats | None:
        return None if self._manager is None else self._manager.stats()

    def close(self, restore: bool = True) -> None:
        if self._manager is not None:
            self._manager.close(restore)
            self._manager = None
            self.names = ()
