"""Per-example learning-dynamics scores and selection of the most valuable examples."""

from jax_overlap._src.budget.data import Selection as Selection
from jax_overlap._src.budget.data import combine as combine
from jax_overlap._src.budget.data import per_example_scores as per_example_scores
from jax_overlap._src.budget.data import select as select
from jax_overlap._src.budget.data import selected_count as selected_count

__all__ = ["Selection", "combine", "per_example_scores", "select", "selected_count"]
