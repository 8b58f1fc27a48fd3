"""SM-level simulation of compute/communication overlap, and a tuner for the runtime controls.

See ``jax_overlap/_src/sim/`` for the model: :mod:`~jax_overlap._src.sim.model` (residency,
kernels, GEMM tiles), :mod:`~jax_overlap._src.sim.engine` (dispatcher and rates),
:mod:`~jax_overlap._src.sim.collectives` (NCCL-like channels).
"""

from jax_overlap._src.sim.calibrate import CalibrationResult as CalibrationResult
from jax_overlap._src.sim.calibrate import CalibrationRow as CalibrationRow
from jax_overlap._src.sim.calibrate import calibrate as calibrate
from jax_overlap._src.sim.engine import KernelTiming as KernelTiming
from jax_overlap._src.sim.engine import SimResult as SimResult
from jax_overlap._src.sim.gemm import GemmConfig as GemmConfig
from jax_overlap._src.sim.gemm import gemm_config as gemm_config
from jax_overlap._src.sim.gemm import sm_count_targets as sm_count_targets
from jax_overlap._src.sim.measurements import load_measurements as load_measurements
from jax_overlap._src.sim.measurements import published_measurements as published_measurements
from jax_overlap._src.sim.model import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from jax_overlap._src.sim.model import COMPUTE_KINDS as COMPUTE_KINDS
from jax_overlap._src.sim.model import Collective as Collective
from jax_overlap._src.sim.model import Constants as Constants
from jax_overlap._src.sim.model import Kernel as Kernel
from jax_overlap._src.sim.model import Workload as Workload
from jax_overlap._src.sim.model import constants_for as constants_for
from jax_overlap._src.sim.model import residency as residency
from jax_overlap._src.sim.model import shaped_smem as shaped_smem
from jax_overlap._src.sim.paper import PaperRow as PaperRow
from jax_overlap._src.sim.paper import PaperTable as PaperTable
from jax_overlap._src.sim.paper import paper_mixes as paper_mixes
from jax_overlap._src.sim.paper import paper_table as paper_table
from jax_overlap._src.sim.plans import plan_dict as plan_dict
from jax_overlap._src.sim.plot import plot as plot
from jax_overlap._src.sim.policies import POLICIES as POLICIES
from jax_overlap._src.sim.policies import Policy as Policy
from jax_overlap._src.sim.policies import compare as compare
from jax_overlap._src.sim.policies import default_shaping as default_shaping
from jax_overlap._src.sim.policies import no_room as no_room
from jax_overlap._src.sim.policies import policy_from_plan as policy_from_plan
from jax_overlap._src.sim.policies import simulate as simulate
from jax_overlap._src.sim.realize import ContentionLosses as ContentionLosses
from jax_overlap._src.sim.realize import RealizeResult as RealizeResult
from jax_overlap._src.sim.realize import analysis_step_time as analysis_step_time
from jax_overlap._src.sim.realize import realize as realize
from jax_overlap._src.sim.realize import workload_from_report as workload_from_report
from jax_overlap._src.sim.tune import Evaluation as Evaluation
from jax_overlap._src.sim.tune import TuneResult as TuneResult
from jax_overlap._src.sim.tune import tune as tune
from jax_overlap._src.sim.workloads import attention as attention
from jax_overlap._src.sim.workloads import large_step as large_step
from jax_overlap._src.sim.workloads import random_workload as random_workload
from jax_overlap._src.sim.workloads import synthetic as synthetic
from jax_overlap._src.sim.workloads import tail_effect as tail_effect
from jax_overlap._src.sim.workloads import tp_chain as tp_chain
from jax_overlap._src.sim.workloads import transformer_step as transformer_step

__all__ = [
  "COLLECTIVE_KINDS",
  "COMPUTE_KINDS",
  "CalibrationResult",
  "CalibrationRow",
  "Collective",
  "Constants",
  "Evaluation",
  "Kernel",
  "KernelTiming",
  "POLICIES",
  "PaperRow",
  "PaperTable",
  "Policy",
  "RealizeResult",
  "ContentionLosses",
  "SimResult",
  "TuneResult",
  "Workload",
  "analysis_step_time",
  "attention",
  "calibrate",
  "compare",
  "constants_for",
  "default_shaping",
  "no_room",
  "GemmConfig",
  "gemm_config",
  "sm_count_targets",
  "large_step",
  "load_measurements",
  "paper_mixes",
  "paper_table",
  "plan_dict",
  "plot",
  "policy_from_plan",
  "published_measurements",
  "random_workload",
  "realize",
  "residency",
  "shaped_smem",
  "simulate",
  "synthetic",
  "tail_effect",
  "tp_chain",
  "transformer_step",
  "tune",
  "workload_from_report",
]
