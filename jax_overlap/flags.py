"""Version-safe XLA compiler options and NCCL/CUDA variables for overlap."""

from jax_overlap._src.flags import REGISTRY as REGISTRY
from jax_overlap._src.flags import WORKLOADS as WORKLOADS
from jax_overlap._src.flags import Flag as Flag
from jax_overlap._src.flags import Problem as Problem
from jax_overlap._src.flags import Verdict as Verdict
from jax_overlap._src.flags import accepted_by_jaxlib as accepted_by_jaxlib
from jax_overlap._src.flags import as_compiler_options as as_compiler_options
from jax_overlap._src.flags import configure as configure
from jax_overlap._src.flags import format_xla_flags as format_xla_flags
from jax_overlap._src.flags import judge_environment as judge_environment
from jax_overlap._src.flags import parse_xla_flags as parse_xla_flags
from jax_overlap._src.flags import read_xla_flags as read_xla_flags
from jax_overlap._src.flags import recommended as recommended
from jax_overlap._src.flags import validate as validate

__all__ = [
  "REGISTRY",
  "WORKLOADS",
  "Flag",
  "Problem",
  "Verdict",
  "accepted_by_jaxlib",
  "as_compiler_options",
  "configure",
  "format_xla_flags",
  "judge_environment",
  "parse_xla_flags",
  "read_xla_flags",
  "recommended",
  "validate",
]
