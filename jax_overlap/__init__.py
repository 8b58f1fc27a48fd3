"""jax_overlap: overlap collectives with compute in sharded JAX training steps.

The data flow, stage by stage:

  program -> transform -> compile -> schedule analysis -> simulation / plan -> runtime

* ``jax_overlap.flags``: version-safe XLA options per GPU target and workload.
* ``jax_overlap.targets``: the GPU catalogue and compile-only meshes.
* ``jax_overlap.analyze`` / ``compare``: deviceless schedule analysis.
* ``jax_overlap.profile.measure``: the same metrics from a real profiler trace.
"""

from jax_overlap import analysis as analysis
from jax_overlap import flags as flags
from jax_overlap import profile as profile
from jax_overlap import targets as targets
from jax_overlap._src.analysis import analyze as analyze
from jax_overlap._src.errors import ConfigError as ConfigError
from jax_overlap._src.report import Report as Report
from jax_overlap._src.report import compare as compare

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Report",
    "analysis",
    "analyze",
    "compare",
    "flags",
    "profile",
    "targets",
    "__version__",
]
