"""Tensor-parallel matmuls fused with their all-gather or reduce-scatter as a ppermute ring."""

from jax_overlap._src.collective_matmul import GainEstimate as GainEstimate
from jax_overlap._src.collective_matmul import all_gather_dot_generals as all_gather_dot_generals
from jax_overlap._src.collective_matmul import all_gather_matmul as all_gather_matmul
from jax_overlap._src.collective_matmul import (
  dot_general_reduce_scatter as dot_general_reduce_scatter,
)
from jax_overlap._src.collective_matmul import estimate_gain as estimate_gain
from jax_overlap._src.collective_matmul import matmul_reduce_scatter as matmul_reduce_scatter

__all__ = [
  "GainEstimate",
  "all_gather_dot_generals",
  "all_gather_matmul",
  "dot_general_reduce_scatter",
  "estimate_gain",
  "matmul_reduce_scatter",
]
