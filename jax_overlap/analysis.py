"""Deviceless schedule analysis: how a step's collectives overlap on a GPU target."""

from jax_overlap._src.analysis.analyze import analyze as analyze
from jax_overlap._src.analysis.analyze import analyze_compiled as analyze_compiled
from jax_overlap._src.analysis.analyze import analyze_hlo as analyze_hlo
from jax_overlap._src.analysis.calibration import Calibration as Calibration
from jax_overlap._src.analysis.calibration import calibrate as calibrate
from jax_overlap._src.analysis.calibration import fit as fit_calibration
from jax_overlap._src.analysis.calibration import load as load_calibration
from jax_overlap._src.analysis.calibration import save as save_calibration
from jax_overlap._src.analysis.cost_model import CostModel as CostModel
from jax_overlap._src.analysis.cost_model import collective_time as collective_time
from jax_overlap._src.analysis.cost_model import kernel_time as kernel_time
from jax_overlap._src.analysis.report import Comparison as Comparison
from jax_overlap._src.analysis.report import Report as Report
from jax_overlap._src.analysis.report import compare as compare
from jax_overlap._src.analysis.schedule import CollectiveInfo as CollectiveInfo
from jax_overlap._src.analysis.schedule import KernelInfo as KernelInfo
from jax_overlap._src.analysis.schedule import LoopInfo as LoopInfo
from jax_overlap._src.compile.memory_stats import MemoryStats as MemoryStats

__all__ = [
  "Calibration",
  "CollectiveInfo",
  "Comparison",
  "CostModel",
  "KernelInfo",
  "LoopInfo",
  "MemoryStats",
  "Report",
  "analyze",
  "analyze_compiled",
  "analyze_hlo",
  "calibrate",
  "collective_time",
  "compare",
  "fit_calibration",
  "kernel_time",
  "load_calibration",
  "save_calibration",
]
