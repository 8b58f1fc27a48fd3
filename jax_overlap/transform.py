"""The overlap transform: ``@jax_overlap.overlap`` and manual annotations."""

from jax_overlap._src.transform import Action as Action
from jax_overlap._src.transform import Explanation as Explanation
from jax_overlap._src.transform import Overlapped as Overlapped
from jax_overlap._src.transform import overlap as overlap
from jax_overlap._src.transform import priority as priority

__all__ = ["Action", "Explanation", "Overlapped", "overlap", "priority"]
