"""SM-level simulation of compute/communication overlap, and a tuner for the runtime controls.

See ``jax_overlap/_src/sim/`` for the model: :mod:`~jax_overlap._src.sim.model` (residency,
kernels, GEMM tiles), :mod:`~jax_overlap._src.sim.engine` (dispatcher and rates),
:mod:`~jax_overlap._src.sim.collectives` (NCCL-like channels).
"""

from jax_overlap._src.sim.engine import KernelTiming as KernelTiming
from jax_overlap._src.sim.engine import SimResult as SimResult
from jax_overlap._src.sim.model import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from jax_overlap._src.sim.model import COMPUTE_KINDS as COMPUTE_KINDS
from jax_overlap._src.sim.model import Collective as Collective
from jax_overlap._src.sim.model import Constants as Constants
from jax_overlap._src.sim.model import Kernel as Kernel
from jax_overlap._src.sim.model import Workload as Workload
from jax_overlap._src.sim.model import constants_for as constants_for
from jax_overlap._src.sim.model import gemm_config as gemm_config
from jax_overlap._src.sim.model import residency as residency
from jax_overlap._src.sim.model import shaped_smem as shaped_smem
from jax_overlap._src.sim.policies import POLICIES as POLICIES
from jax_overlap._src.sim.policies import Policy as Policy
from jax_overlap._src.sim.policies import compare as compare
from jax_overlap._src.sim.policies import default_shaping as default_shaping
from jax_overlap._src.sim.policies import simulate as simulate
from jax_overlap._src.sim.workloads import large_step as large_step
from jax_overlap._src.sim.workloads import random_workload as random_workload
from jax_overlap._src.sim.workloads import synthetic as synthetic
from jax_overlap._src.sim.workloads import tail_effect as tail_effect
from jax_overlap._src.sim.workloads import transformer_step as transformer_step

__all__ = [
    "COLLECTIVE_KINDS",
    "COMPUTE_KINDS",
    "POLICIES",
    "Collective",
    "Constants",
    "Kernel",
    "KernelTiming",
    "Policy",
    "SimResult",
    "Workload",
    "compare",
    "constants_for",
    "default_shaping",
    "gemm_config",
    "large_step",
    "random_workload",
    "residency",
    "shaped_smem",
    "simulate",
    "synthetic",
    "tail_effect",
    "transformer_step",
]
