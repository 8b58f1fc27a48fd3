"""Version-safe XLA compiler options and NCCL/CUDA variables for overlap.

Recipes for overlapping collectives circulate as ``XLA_FLAGS`` strings. A flag
that the installed jaxlib does not take aborts the process when the backend
starts, with a C++ fatal error and no Python traceback. This package is the
safe way to choose, check and set those options, one stage a module:

* :mod:`.registry` (data): the overlap-relevant options with meaning, type,
  default, the jaxlib versions that accept them, removed and renamed flags.
* :mod:`.syntax`: how XLA reads ``XLA_FLAGS`` (tokens, quotes, bare flags,
  flag files, value syntax per type), and formatting that XLA reads back.
* :mod:`.probe`: asking the installed jaxlib's own flag parser, in a child
  process, what it does with a flag (cached per jaxlib version).
* :mod:`.validation`: :func:`validate`, every problem with the fix; errors
  are exactly what makes XLA abort.
* :mod:`.per_compile`: options spelled as the installed jaxlib takes them per
  compile (``compiler_options=``), which since jaxlib 0.11 is not always the
  ``XLA_FLAGS`` spelling.
* :mod:`.aborts`: options with which the installed XLA aborts compiling some programs
  (an XLA bug the registry records; asked of XLA in a helper process).
* :mod:`.environment`: :func:`judge_environment`, ``CUDA_DEVICE_MAX_CONNECTIONS`` and
  NCCL's channel cap judged by the simulator on a step (the user's, or a representative
  one, from which :func:`recommended` takes the settings that pay).
* :mod:`.configuration`: :func:`recommended`, :func:`configure`,
  :func:`as_compiler_options`.
"""

from jax_overlap._src.flags import per_compile as per_compile
from jax_overlap._src.flags.configuration import as_compiler_options as as_compiler_options
from jax_overlap._src.flags.configuration import backend_started as backend_started
from jax_overlap._src.flags.configuration import check_workload as check_workload
from jax_overlap._src.flags.configuration import configure as configure
from jax_overlap._src.flags.configuration import recommended as recommended
from jax_overlap._src.flags.environment import Verdict as Verdict
from jax_overlap._src.flags.environment import judge as judge_environment
from jax_overlap._src.flags.registry import REGISTRY as REGISTRY
from jax_overlap._src.flags.registry import WORKLOADS as WORKLOADS
from jax_overlap._src.flags.registry import Flag as Flag
from jax_overlap._src.flags.syntax import format_value as format_value
from jax_overlap._src.flags.syntax import format_xla_flags as format_xla_flags
from jax_overlap._src.flags.syntax import parse_xla_flags as parse_xla_flags
from jax_overlap._src.flags.syntax import read_xla_flags as read_xla_flags
from jax_overlap._src.flags.validation import Problem as Problem
from jax_overlap._src.flags.validation import accepted_by_jaxlib as accepted_by_jaxlib
from jax_overlap._src.flags.validation import validate as validate

__all__ = [
  "Flag",
  "Problem",
  "REGISTRY",
  "WORKLOADS",
  "recommended",
  "validate",
  "configure",
  "as_compiler_options",
  "parse_xla_flags",
  "read_xla_flags",
  "format_xla_flags",
  "accepted_by_jaxlib",
  "judge_environment",
  "Verdict",
]
