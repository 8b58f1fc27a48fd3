"""Runtime controls: occupancy shaping and stream priority at kernel launch.

See ``docs/runtime.md``. Plans (:class:`Plan`) select kernels or occupancy
regions and say how many of their blocks may be resident per SM; the runtime
library applies them when the program runs under ``jax-overlap launch``;
:func:`status` tells whether it is loaded and what it has done.
"""

from typing import TYPE_CHECKING

from jax_overlap._src import lazy_names
from jax_overlap._src.runtime.library import Counters as Counters
from jax_overlap._src.runtime.library import Status as Status
from jax_overlap._src.runtime.library import library_path as library_path
from jax_overlap._src.runtime.library import status as status
from jax_overlap._src.runtime.plan import CommBlock as CommBlock
from jax_overlap._src.runtime.plan import KernelRule as KernelRule
from jax_overlap._src.runtime.plan import LibraryGemms as LibraryGemms
from jax_overlap._src.runtime.plan import Plan as Plan
from jax_overlap._src.runtime.plan import PlanCheck as PlanCheck
from jax_overlap._src.runtime.plan import RegionRule as RegionRule
from jax_overlap._src.runtime.plan import StreamPolicy as StreamPolicy
from jax_overlap._src.runtime.plan import check_plan as check_plan
from jax_overlap._src.runtime.plan import region_id as region_id
from jax_overlap._src.runtime.residency import blocks_per_sm as blocks_per_sm
from jax_overlap._src.runtime.residency import padded_dynamic_smem as padded_dynamic_smem
from jax_overlap._src.runtime.residency import residency_limits as residency_limits
from jax_overlap._src.runtime.residency import room_cap as room_cap
from jax_overlap._src.runtime.residency import shaped_dynamic_smem as shaped_dynamic_smem

if TYPE_CHECKING:
  from jax_overlap._src.runtime.regions import Occupancy as Occupancy
  from jax_overlap._src.runtime.regions import occupancy as occupancy
  from jax_overlap._src.runtime.regions import region_events as region_events

# The regions (custom calls in a jitted program) need JAX; plans and the library's status
# do not, so the launcher and plan checks start without importing it.
_REGIONS = {
  name: "jax_overlap._src.runtime.regions" for name in ("Occupancy", "occupancy", "region_events")
}
__getattr__, __dir__ = lazy_names.attach(__name__, globals(), (), _REGIONS)

__all__ = [
  "CommBlock",
  "Counters",
  "KernelRule",
  "Occupancy",
  "Plan",
  "PlanCheck",
  "RegionRule",
  "Status",
  "StreamPolicy",
  "LibraryGemms",
  "blocks_per_sm",
  "check_plan",
  "library_path",
  "occupancy",
  "padded_dynamic_smem",
  "region_events",
  "region_id",
  "residency_limits",
  "room_cap",
  "shaped_dynamic_smem",
  "status",
]
