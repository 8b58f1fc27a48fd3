"""Budget-aware training: memory, compute and data decided together.

* :mod:`jax_overlap.budget.memory`: per-device memory breakdown of a step and a
  planner over remat policy, optimizer-state sharding and prefetch depth;
* :mod:`jax_overlap.budget.compute`: FLOPs per step, cumulative accounting and
  a stopping rule on the loss gain per FLOP;
* :mod:`jax_overlap.budget.data`: per-example learning-dynamics scores and
  selection of the most valuable examples inside the sharded step.
"""

from jax_overlap.budget import compute as compute
from jax_overlap.budget import data as data
from jax_overlap.budget import memory as memory

__all__ = ["compute", "data", "memory"]
