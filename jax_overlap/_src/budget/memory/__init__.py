"""Memory budgets: what one training step holds per device, and a planner that fits a budget.

:func:`breakdown` compiles a step (deviceless for GPU targets) and splits XLA's
own per-device total,

    total = argument bytes + output bytes + temp bytes - alias bytes

(``Compiled.memory_analysis()``), into categories that sum to it exactly:

* arguments, from the argument pytrees and their shardings (bytes of each
  leaf's shard): ``weights``, ``optimizer_state``, ``inputs``;
  ``other_arguments`` holds any difference to XLA's argument bytes (arguments
  that ``jit`` pruned are negative there);
* ``outputs``: output bytes that do not reuse a donated argument;
* the temp buffer, from the compiler's buffer assignment and live ranges
  (``xla_dump_to``: ``*buffer-assignment.txt``, ``*live-range.txt`` and the
  optimized HLO): for each temp allocation, the values live at the moment the
  allocation is fullest are classified by their defining instruction:
  ``gathered_weights`` (all-gather results: the prefetch buffers overlap
  needs), ``gradients`` (backward values and reduce-scatter/all-reduce
  results shaped like a weight), ``collective_buffers`` (other collective
  results), ``activations`` (forward values still live: saved residuals and
  the forward's working set), ``temporaries`` (everything else), and
  ``fragmentation`` (allocation bytes no value occupies at that moment).

:func:`plan` searches remat policy x optimizer-state sharding x prefetch depth
(and, given ``prefetch_memory=``, the cap on gathered parameters held ahead of
their first use, ``overlap(prefetch_memory=...)``) through a user step builder,
compiles each candidate, keeps those within the budget and ranks them by
estimated step time, returning the whole table.

Layout: :mod:`.breakdown` (the categories), :mod:`.dump` (reading XLA's dumps),
:mod:`.planner` (the search).
"""

from jax_overlap._src.budget.memory.breakdown import Breakdown as Breakdown
from jax_overlap._src.budget.memory.breakdown import breakdown as breakdown
from jax_overlap._src.budget.memory.dump import CATEGORIES as CATEGORIES
from jax_overlap._src.budget.memory.planner import Candidate as Candidate
from jax_overlap._src.budget.memory.planner import MemoryPlan as MemoryPlan
from jax_overlap._src.budget.memory.planner import PlanRow as PlanRow
from jax_overlap._src.budget.memory.planner import plan as plan
from jax_overlap._src.budget.memory.planner import remat_policy as remat_policy
