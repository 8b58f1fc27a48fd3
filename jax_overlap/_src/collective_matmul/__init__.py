"""Collective matmuls: a tensor-parallel all-gather or reduce-scatter as a ring of partial dots.

A tensor-parallel layer either all-gathers its input before a matmul
(``all_gather(x) @ w``) or reduce-scatters the matmul's partial sums after it
(``psum_scatter(x @ w)``). Issued as one collective, the communication cannot
overlap the matmul that depends on it. Split into ``N - 1`` neighbour
exchanges (``ppermute``) around the ring of the ``N`` devices on the axis,
each exchange is independent of the partial dot computed next to it, and the
latency-hiding scheduler can run them concurrently:

* :func:`all_gather_matmul`: every step multiplies the row block of ``x`` that
  the device holds by ``w`` and passes the block on to its neighbour; after
  ``N`` steps every row block has visited every device.
* :func:`matmul_reduce_scatter`: every step computes the partial product of
  one output row block, adds it to the partial sum received from the
  neighbour and passes the sum on; after ``N`` steps each device holds the
  full sum of its own block.

* :func:`all_gather_dot_generals`: the general form of the first, for what
  tensor- and sequence-parallel code writes: an N-D activation gathered along
  any free dimension (the sequence), ``dot_general``s with batch dimensions,
  one gather feeding several matmuls, the gathered value also returned (the
  backward pass needs it for the weight gradient). JAX differentiates it; the
  transpose of the ring is the reverse ring. ``@overlap`` uses it for every
  such gather the cost model (or ``collective_matmul="on"``) lets through.

A gather ring's results arrive in ring order (the block held at each step, which
depends on the device); they are kept as they come and put in the gathered order
once, by one gather per output that XLA fuses into the neighbouring loop (its
transpose is the inverse gather), rather than copied slice by slice into a buffer.

The bidirectional variants split each block into halves that travel in
opposite directions, using both directions of every link; ``chunks`` splits a
block into more pieces for finer-grained overlap. Both functions have
custom VJPs whose backward passes are again collective matmuls: the transpose
of an all-gather-matmul is a matmul-reduce-scatter and vice versa.

The cost model that decides where they pay is :mod:`.cost`; the rings are in :mod:`.rings`,
the pieces in :mod:`.pieces`, the N-D forms in :mod:`.nd`, the 2-D ones in :mod:`.matmul`.
"""

from jax_overlap._src.collective_matmul.cost import GainEstimate as GainEstimate
from jax_overlap._src.collective_matmul.cost import estimate_gain as estimate_gain
from jax_overlap._src.collective_matmul.matmul import all_gather_matmul as all_gather_matmul
from jax_overlap._src.collective_matmul.matmul import matmul_reduce_scatter as matmul_reduce_scatter
from jax_overlap._src.collective_matmul.nd import all_gather_dot_generals as all_gather_dot_generals
from jax_overlap._src.collective_matmul.nd import (
  dot_general_reduce_scatter as dot_general_reduce_scatter,
)
