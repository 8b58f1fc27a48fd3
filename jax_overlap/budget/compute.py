"""FLOPs per step, cumulative FLOP accounting and a compute-budget stopping rule."""

from jax_overlap._src.budget.compute import ComputeGovernor as ComputeGovernor
from jax_overlap._src.budget.compute import Decision as Decision
from jax_overlap._src.budget.compute import FlopCounter as FlopCounter
from jax_overlap._src.budget.compute import keep_fraction_for_budget as keep_fraction_for_budget
from jax_overlap._src.budget.compute import step_flops as step_flops

__all__ = [
  "ComputeGovernor",
  "Decision",
  "FlopCounter",
  "keep_fraction_for_budget",
  "step_flops",
]
