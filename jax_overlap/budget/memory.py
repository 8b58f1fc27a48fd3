"""Per-device memory breakdown of a step, and a planner that fits a memory budget."""

from jax_overlap._src.budget.memory import CATEGORIES as CATEGORIES
from jax_overlap._src.budget.memory import Breakdown as Breakdown
from jax_overlap._src.budget.memory import Candidate as Candidate
from jax_overlap._src.budget.memory import Plan as Plan
from jax_overlap._src.budget.memory import PlanRow as PlanRow
from jax_overlap._src.budget.memory import breakdown as breakdown
from jax_overlap._src.budget.memory import plan as plan
from jax_overlap._src.budget.memory import remat_policy as remat_policy

__all__ = [
  "CATEGORIES",
  "Breakdown",
  "Candidate",
  "Plan",
  "PlanRow",
  "breakdown",
  "plan",
  "remat_policy",
]
