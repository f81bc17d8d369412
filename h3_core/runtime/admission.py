"""Admission rules: which placements of the four H3 components a platform accepts.

A pure function of a plan and an injected platform description, so every rule is testable on any machine.

On Apple MPS the CPU and GPU share one memory: a resident component is a second copy of weights that are already
mapped from disk, and the full model does not fit. So on MPS:

* every component (transformer, text encoder, video VAE, audio VAE) must be `Residency.LAYERWISE_OFFLOAD`;
* residency values are limited to `Residency.RESIDENT` and `Residency.LAYERWISE_OFFLOAD` (and the former is
  refused by the rule above);
* torch.compile is refused (offload and chunking rely on eager execution there);
* only one device: every component on the same MPS device.

A plan that breaks rules raises one `AdmissionError` listing every violating component and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..components import COMPONENTS
from ..errors import H3Error
from .platform import Platform
from .residency import Residency


class AdmissionError(H3Error):
    """A plan breaks the platform's admission rules; `violations` holds (component, problem, fix) triples."""

    def __init__(self, message: str, violations: list[tuple[str, str, str]]):
        super().__init__(message)
        self.violations = violations


@dataclass(frozen=True)
class ComponentPlan:
    """How one component is to run: its residency, its device and whether it is compiled."""

    residency: Residency | str
    device: str = "mps"
    compile: bool = False


def admission_violations(plan: Mapping[str, ComponentPlan], platform: Platform) -> list[tuple[str, str, str]]:
    """Every (component, problem, fix) the plan breaks on `platform`; empty when it is admitted."""
    violations: list[tuple[str, str, str]] = []
    for name in plan:
        if name not in COMPONENTS:
            violations.append((name, "is not an H3 component", f"name components {', '.join(COMPONENTS)}"))
    if not platform.unified_memory:
        for name, component in plan.items():
            try:
                Residency.parse(component.residency)
            except H3Error:
                violations.append((name, f"residency {component.residency!r} is unknown",
                                   "use residency='resident' or 'layerwise'"))
        return violations

    for name, component in plan.items():
        try:
            residency = Residency.parse(component.residency)
        except H3Error:
            violations.append((name, f"residency {component.residency!r} is not available on MPS (only 'resident' "
                                     "and 'layerwise' exist)", "set residency='layerwise'"))
            residency = None
        if residency is Residency.RESIDENT:
            violations.append((name, "is resident; on unified memory that holds a second copy of weights already "
                                     "mapped from disk", "set residency='layerwise'"))
        if component.compile:
            violations.append((name, "asks for torch.compile, which is refused on MPS",
                               "set compile=False (eager execution)"))
    devices = {}
    for name, component in plan.items():
        try:
            devices[name] = platform.device_key(component.device)
        except (RuntimeError, TypeError):
            violations.append((name, f"device {component.device!r} is not a torch device", "use device='mps'"))
    distinct = sorted(set(devices.values()))
    ours = [key for key in distinct if platform.is_kind_of(key)]
    if len(distinct) > 1 or not ours:
        target = ours[0] if ours else platform.device_key(platform.device_type)
        for name, key in devices.items():
            if key != target:
                violations.append((name, f"runs on {plan[name].device!r}; {platform.device_type.upper()} runs use "
                                         "one device", f"put every component on '{platform.device_type}'"))
    return violations


def check_admission(plan: Mapping[str, ComponentPlan], platform: Platform) -> None:
    """Raise one `AdmissionError` listing every rule `plan` breaks on `platform`."""
    violations = admission_violations(plan, platform)
    if violations:
        lines = "\n".join(f"  - {name}: {problem}; fix: {fix}." for name, problem, fix in violations)
        names = sorted({name for name, _, _ in violations})
        raise AdmissionError(
            f"{platform.device_type.upper()} admission refused {len(violations)} setting(s) of "
            f"{', '.join(names)}:\n{lines}",
            violations,
        )
