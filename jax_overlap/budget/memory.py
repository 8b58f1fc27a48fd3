"""Per-device memory breakdown of a step, and a planner that fits a memory budget."""

from jax_overlap._src.budget.memory import CATEGORIES as CATEGORIES
from jax_overlap._src.budget.memory import Breakdown as Breakdown
from jax_overlap._src.budget.memory import Candidate as Candidate
from jax_overlap._src.budget.memory import MemoryPlan as MemoryPlan
from jax_overlap._src.budget.memory import PlanRow as PlanRow
from jax_overlap._src.budget.memory import breakdown as breakdown
from jax_overlap._src.budget.memory import plan as plan
from jax_overlap._src.budget.memory import remat_policy as remat_policy

__all__ = [
  "CATEGORIES",
  "Breakdown",
  "Candidate",
  "MemoryPlan",
  "PlanRow",
  "breakdown",
  "plan",
  "remat_policy",
]


def __getattr__(name: str):
  # ``Plan`` was this module's name for ``MemoryPlan`` (``runtime.Plan`` is another thing).
  if name == "Plan":
    from jax_overlap._src import deprecations

    deprecations.warn("budget.memory.Plan", "is now budget.memory.MemoryPlan")
    return MemoryPlan
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
