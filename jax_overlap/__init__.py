"""jax_overlap: overlap collectives with compute in sharded JAX training steps.

The data flow, stage by stage:

  program -> transform -> compile -> schedule analysis -> simulation / plan -> runtime

* ``jax_overlap.overlap``, ``jax_overlap.fsdp``, ``jax_overlap.collective_matmul``:
  the transform (prefetch, per-layer reduce-scatter, annotations, pipelined
  scanned layers, collective matmuls).
* ``jax_overlap.flags``: version-safe XLA options per GPU target and workload.
* ``jax_overlap.targets``: the GPU catalogue and compile-only meshes.
* ``jax_overlap.analyze`` / ``compare``: deviceless schedule analysis.
* ``jax_overlap.profile.measure``: the same metrics from a real profiler trace.
* ``jax_overlap.sim``: SM-level simulation of the runtime controls, and the tuner.
* ``jax_overlap.runtime``, ``jax_overlap.occupancy``: runtime plans and regions.
* ``jax_overlap.budget``: memory, compute and data decided together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax_overlap._src import lazy_names

# Names are imported on first use (PEP 562), so that commands which need no JAX -- the
# ``jax-overlap launch`` wrapper, plan checks, the flag syntax -- start without importing it.
_SUBMODULES = (
  "analysis",
  "budget",
  "collective_matmul",
  "flags",
  "fsdp",
  "latency_profile",
  "profile",
  "runtime",
  "sim",
  "targets",
  "transform",
)
_NAMES = {
  "analyze": "jax_overlap._src.analysis.analyze",
  "ConfigError": "jax_overlap._src.errors",
  "NothingToOverlapWarning": "jax_overlap._src.errors",
  "occupancy": "jax_overlap._src.runtime.regions",
  "Report": "jax_overlap._src.analysis.report",
  "compare": "jax_overlap._src.analysis.report",
  "overlap": "jax_overlap._src.transform",
  "priority": "jax_overlap._src.transform",
}

if TYPE_CHECKING:
  from jax_overlap import analysis as analysis
  from jax_overlap import budget as budget
  from jax_overlap import collective_matmul as collective_matmul
  from jax_overlap import flags as flags
  from jax_overlap import fsdp as fsdp
  from jax_overlap import latency_profile as latency_profile
  from jax_overlap import profile as profile
  from jax_overlap import runtime as runtime
  from jax_overlap import sim as sim
  from jax_overlap import targets as targets
  from jax_overlap import transform as transform
  from jax_overlap._src.analysis.analyze import analyze as analyze
  from jax_overlap._src.analysis.report import Report as Report
  from jax_overlap._src.analysis.report import compare as compare
  from jax_overlap._src.errors import ConfigError as ConfigError
  from jax_overlap._src.errors import NothingToOverlapWarning as NothingToOverlapWarning
  from jax_overlap._src.runtime.regions import occupancy as occupancy
  from jax_overlap._src.transform import overlap as overlap
  from jax_overlap._src.transform import priority as priority


__getattr__, __dir__ = lazy_names.attach(__name__, globals(), _SUBMODULES, _NAMES)

__version__ = "0.1.0"

__all__ = sorted([*_SUBMODULES, *_NAMES], key=str.lower) + ["__version__"]
