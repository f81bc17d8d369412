"""Memory planning before anything loads: the fit of per-phase estimates to a budget (`memory_plan.py`), the
estimates of each component read from its checkpoint headers and the plan for a request (`phase_plans.py`), the
memory profiles of the machines users own (`memory_profiles.py`), and the large-request preflight
(`request_estimate.py`). Admission (which residencies a platform allows) is the runtime's: the loaders enforce it."""

from .memory_plan import ComponentEstimate, MemoryBudgetError, MemoryPlan, fit_budget
from .phase_plans import plan_components, plan_for_budget

__all__ = ["ComponentEstimate", "MemoryBudgetError", "MemoryPlan", "fit_budget", "plan_components", "plan_for_budget"]
