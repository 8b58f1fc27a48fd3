"""Per-target cost model: roofline for kernels, alpha-beta for collectives.

Compute kernels (roofline)::

    t_kernel = max(F / (eta_c * P(dtype)), B / (eta_m * BW)) + t_launch

where F is the kernel's FLOPs and B its bytes at the kernel boundary (counted
from the HLO, see ``hlo.py``), P the target's dense peak for the kernel's math
(bf16/f16 tensor cores for low-precision dots; TF32 tensor cores, half the
bf16 rate, for f32 dots as XLA emits them by default; the FP32 vector rate for
everything else), BW the HBM bandwidth, and eta_c, eta_m the achievable
fractions of peak.

Collectives over a group of p devices moving a buffer of n bytes (the gathered
result of an all-gather, the input of a reduce-scatter, the buffer of an
all-reduce), ring algorithm with per-hop latency alpha and per-direction link
bandwidth beta (the target's intra-node link, or the network when the group
spans hosts)::

    all-gather, reduce-scatter, all-to-all:  t = (p - 1) * alpha + (p - 1) / p * n / (eta_l * beta)
    all-reduce (ring):                      t = 2 (p - 1) * alpha + 2 (p - 1) / p * n / (eta_l * beta)
    all-reduce (tree):                      t = 2 log2(p) * alpha + 2 n / (eta_l * beta)
    all-reduce:                             t = min(ring, tree)
    collective-permute:                     t = alpha + n / (eta_l * beta * c_p2p / c)

On NVIDIA GPUs a collective-permute and an all-to-all are NCCL send/recv operations, and
NCCL runs each send/recv on fewer channels (CTAs) than its collectives use: ``c_p2p`` of
the ``c`` collective channels (4 of 24 for a 16 MiB message among 8 H100s; the rule is in
``nccl.py``). Each channel moves at most the rate the collective channels reach together,
``eta_l * beta / c``, so a permute that uses few channels does not reach the link
(``c_p2p / c`` is capped at 1; an all-to-all's channels are those of all its peers). This
is an assumption: a send/recv CTA might copy faster than a collective's channel, which
would make permutes faster than stated here.

A group of one device costs nothing. These are the standard alpha-beta costs of
ring collectives (Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005) as NCCL implements them.

Default efficiencies are assumptions stated here, not measurements:
eta_c = 0.75 (large cuBLAS/CUTLASS GEMMs reach about 70-80% of dense peak on
A100/H100), eta_m = 0.85 (STREAM-like kernels reach 80-90% of HBM peak),
eta_l = 0.8 (NCCL bus bandwidth on NVLink reaches about 80% of the link),
t_launch = 1 us per kernel.
"""

from __future__ import annotations

import dataclasses
import math

from jax_overlap._src import deprecations
from jax_overlap._src import targets as targets_lib
from jax_overlap._src.analysis import nccl

__all__ = ["CostModel", "HOST_CPU", "collective_time", "kernel_time"]


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Efficiency factors applied to a target's peaks. See the module docstring."""

  compute_efficiency: float = 0.75
  memory_efficiency: float = 0.85
  link_efficiency: float = 0.8
  kernel_overhead_s: float = 1e-6
  # Per-kind factors measured on one GPU (analysis.calibration.Calibration), or None.
  calibration: object | None = None

  def kernel_factor(self, kind: str) -> float:
    """The calibration's factor on a kernel of ``kind``'s roofline body (1 without one)."""
    return 1.0 if self.calibration is None else self.calibration.factor(kind)

  def __post_init__(self):
    for f in ("compute_efficiency", "memory_efficiency", "link_efficiency"):
      v = getattr(self, f)
      if not 0 < v <= 1:
        raise ValueError(f"CostModel: {f} must be in (0, 1], got {v}")
    if self.kernel_overhead_s < 0:
      raise ValueError(f"CostModel: kernel_overhead_s must be >= 0, got {self.kernel_overhead_s}")


@dataclasses.dataclass(frozen=True)
class _Host:
  """A rough model of the local CPU, for analyses with target=None."""

  name: str = "cpu"
  vendor: str = "host"  # not NVIDIA's: no NCCL channel rules
  peak_bf16_flops: float = 2e11
  peak_fp32_flops: float = 2e11
  memory_bandwidth: float = 2e10
  link_bandwidth: float = 1e10
  link_latency_s: float = 1e-5

  def peak_flops(self, dtype: str = "bf16") -> float:
    return self.peak_fp32_flops


HOST_CPU = _Host()
_DEFAULT = CostModel()

_LOW_PRECISION = ("bf16", "f16", "f8", "s8", "u8", "s4", "u4")


@deprecations.renamed({"model": "cost_model"}, api="jax_overlap.analysis.kernel_time")
def kernel_time(
  flops: float,
  bytes_accessed: float,
  gpu,
  *,
  dtype: str = "f32",
  is_dot: bool = False,
  cost_model: CostModel | None = None,
) -> float:
  """Roofline time of one kernel on ``gpu`` (a targets.Gpu or HOST_CPU)."""
  model = cost_model or _DEFAULT
  if is_dot:
    peak = gpu.peak_bf16_flops
    if not str(dtype).startswith(_LOW_PRECISION):
      peak = gpu.peak_bf16_flops / 2  # TF32 tensor cores
  else:
    peak = gpu.peak_fp32_flops
  t_compute = flops / (model.compute_efficiency * peak) if flops else 0.0
  t_memory = bytes_accessed / (model.memory_efficiency * gpu.memory_bandwidth)
  return max(t_compute, t_memory) + model.kernel_overhead_s


@deprecations.renamed({"model": "cost_model"}, api="jax_overlap.analysis.collective_time")
def collective_time(
  kind: str,
  nbytes: float,
  group_size: int,
  topology,
  *,
  cost_model: CostModel | None = None,
) -> float:
  """Alpha-beta time of one collective; see the module docstring for the formulas."""
  model = cost_model or _DEFAULT
  p = int(group_size)
  if p <= 1 or nbytes <= 0:
    return 0.0
  if isinstance(topology, targets_lib.Topology):
    beta, alpha = topology.link_for(p)
  else:
    beta, alpha = topology.link_bandwidth, topology.link_latency_s
  beta = beta * model.link_efficiency
  gpu = topology.gpu if isinstance(topology, targets_lib.Topology) else topology
  if kind in nccl.P2P_KINDS and getattr(gpu, "vendor", "nvidia") == "nvidia":
    c = nccl.collective_channels(gpu)
    beta = beta * min(1.0, nccl.p2p_ctas(kind, nbytes, p, topology, c) / c)
  if kind in ("all-gather", "reduce-scatter", "all-to-all"):
    return (p - 1) * alpha + (p - 1) / p * nbytes / beta
  if kind == "all-reduce":
    ring = 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta
    tree = 2 * math.log2(p) * alpha + 2 * nbytes / beta
    return min(ring, tree)
  if kind == "collective-permute":
    return alpha + nbytes / beta
  raise ValueError(
    f"collective_time: unknown collective kind {kind!r}; expected all-gather, reduce-scatter, "
    "all-reduce, all-to-all or collective-permute"
  )
