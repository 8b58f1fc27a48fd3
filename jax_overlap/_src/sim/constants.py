"""The simulator's per-target model constants that are not in the GPU catalogue: their
defaults per GPU, where each value comes from (a source or an assumed range), and the
table ``docs/runtime.md`` prints."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from jax_overlap._src import targets
from jax_overlap._src.analysis import cost_model, nccl

__all__ = ["Constants", "PROVENANCE", "constants_for", "provenance_markdown"]


@dataclasses.dataclass(frozen=True)
class Constants:
  """Per-target model constants that are not in the GPU catalogue (calibratable).

  Attributes:
    gemm_efficiency: fraction of the dense tensor peak a saturating GEMM tile reaches.
      Defaults from published cuBLAS throughput for large bf16 GEMMs (H100 SXM ~700-750
      TFLOP/s of 989; A100 ~260-280 of 312; A40 ~110-120 of 150; MI250X ~110-130 of 191
      per GCD with rocBLAS/hipBLASLt).
    cta_copy_bandwidth: bytes/s one communication CTA can move (NCCL channel). From
      nccl-tests bus bandwidth divided by the channel count: ~20 GB/s per channel on H100
      NVLink (24-32 channels reach the ~360-450 GB/s links), ~15 GB/s on A100.
    launch_overhead_s: delay from a kernel's stream predecessor finishing to its first
      block being dispatchable; ~1-2 us back to back in a CUDA graph on NVIDIA, more on
      ROCm (HIP graph launches). On NVIDIA the analysis's per-kernel overhead
      (``CostModel.kernel_overhead_s``), so both models charge the same launch cost.
    event_latency_s: delay from an item finishing to a waiter on another stream becoming
      dispatchable (event record + stream wait). Measured on an H200: 1.5-1.8 us, as
      back to back on one stream within the timer's 0.26 us steps (``launch_gaps.cu``);
      the Hopper default is the larger figure. Other GPUs: assumed.
    block_overhead_s: fixed time per block (dispatch, prologue, epilogue).
    sm_bandwidth_factor: how many times its fair share of DRAM bandwidth one SM can draw
      (memory-level parallelism of one SM); bounds memory-bound kernels with few blocks.
    comm_hbm_factor: DRAM bytes a collective moves per link byte (read to send, write on
      receive).
    channels: communication CTAs (NCCL channels) per collective. NCCL uses about 2 on a
      PCIe box and 16-32 on NVLink systems (BACKGROUND section 2; NVIDIA/nccl#689); 24 on
      H100 as in the "tail effect" report.
    comm_threads, comm_regs, comm_smem: launch configuration of one communication CTA.
      NCCL's Simple-protocol channel on sm_80 and later (``plan.CommBlock.nccl``, from
      NCCL's src/include/device.h): 512 threads plus a synchronization warp, built for at
      most 96 registers (``__launch_bounds__(640, 1)``), 82,240 bytes of dynamic shared
      memory (``ncclShmemDynamicSize``). RCCL on CDNA2: 256 threads (assumed 8 KB LDS).
    saturating_threads: resident threads of one kernel an SM needs to reach full
      throughput (latency hiding); half the SM's thread limit by default. GEMM tiles are
      built to saturate an SM on their own.
    occupancy_exponent: how an SM's throughput grows with resident blocks below
      saturation: ``(resident / saturating) ** occupancy_exponent``.
    block_jitter: relative spread of the work of blocks placed together on one SM (block
      times vary by a few percent on hardware, so co-resident blocks finish apart).
    comm_sm_share: fraction of an SM's compute throughput (issue and load/store slots)
      one resident communication CTA takes from the compute blocks beside it, so a GEMM
      slows next to an all-gather even when neither waits for DRAM.
  """

  gemm_efficiency: float = 0.75
  cta_copy_bandwidth: float = 20e9
  launch_overhead_s: float = cost_model.CostModel.kernel_overhead_s
  event_latency_s: float = 5e-6
  block_overhead_s: float = 5e-7
  sm_bandwidth_factor: float = 3.0
  comm_hbm_factor: float = 2.0
  channels: int = 16
  comm_threads: int = 544
  comm_regs: int = 96
  comm_smem: int = 82240
  saturating_threads: int = 1024
  block_jitter: float = 0.04
  occupancy_exponent: float = 0.5
  comm_sm_share: float = 0.1

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TypeError(f"sim.Constants: {f.name} must be a finite number, got {v!r}")
      if v < 0 or (
        v == 0
        and f.name
        not in (
          "launch_overhead_s",
          "event_latency_s",
          "block_overhead_s",
          "comm_smem",
          "block_jitter",
          "occupancy_exponent",
          "comm_sm_share",
        )
      ):
        raise ValueError(f"sim.Constants: {f.name} must be positive, got {v!r}")

    for f in ("comm_sm_share", "block_jitter"):
      if getattr(self, f) > 1:
        raise ValueError(f"sim.Constants: {f} must be in [0, 1], got {getattr(self, f)!r}")

  def replace(self, **changes) -> Constants:
    return dataclasses.replace(self, **changes)


# Where each constant comes from, and for the assumed ones the plausible range that
# ``sim.sensitivity`` sweeps (per-GPU values sit inside these ranges).
PROVENANCE: dict[str, dict] = {
  "gemm_efficiency": {
    "source": "published cuBLAS throughput for large bf16 GEMMs (per GPU, see Constants)",
  },
  "cta_copy_bandwidth": {
    "source": "nccl-tests bus bandwidth divided by the channel count (published DGX results)",
  },
  "launch_overhead_s": {
    "source": "assumed (the analysis's kernel overhead, shared with it)",
    "range": (0.5e-6, 5e-6),
  },
  "event_latency_s": {
    "source": "measured on an H200 for Hopper (1.8 us, launch_gaps.cu); assumed elsewhere",
    "range": (1e-6, 10e-6),
  },
  "block_overhead_s": {"source": "assumed", "range": (1e-7, 2e-6)},
  "sm_bandwidth_factor": {"source": "assumed", "range": (1.5, 6.0)},
  "comm_hbm_factor": {"source": "derived: a copied byte is read once and written once"},
  "channels": {"source": "NCCL defaults on NVLink systems (NVIDIA/nccl#689), per GPU"},
  "comm_threads": {"source": "NCCL src/include/device.h (Simple protocol: 512 + one warp)"},
  "comm_regs": {"source": "NCCL __launch_bounds__(640, 1): at most 96 registers"},
  "comm_smem": {"source": "NCCL ncclShmemDynamicSize on sm_80+ (82,240 bytes)"},
  "saturating_threads": {"source": "assumed", "range": (512, 2048)},
  "block_jitter": {"source": "assumed", "range": (0.0, 0.1)},
  "occupancy_exponent": {
    "source": "fitted for Hopper to the H200 sweep's capped kernels (0.64); assumed elsewhere",
    "range": (0.0, 1.0),
  },
  "comm_sm_share": {"source": "assumed", "range": (0.0, 0.3)},
}


def provenance_markdown() -> str:
  """The constants table of ``docs/runtime.md``: default value, source or plausible range."""
  default = Constants()
  lines = ["| constant | default | source | swept range |", "|---|---|---|---|"]
  for f in dataclasses.fields(Constants):
    info = PROVENANCE[f.name]
    rng = info.get("range")
    lines.append(
      f"| `{f.name}` | {getattr(default, f.name):g} | {info['source']} | "
      f"{f'{rng[0]:g} - {rng[1]:g}' if rng else '-'} |"
    )
  return "\n".join(lines)


# Fitted to the H200 sweep (benchmarks/results/runtime_nvidia_h200_2026-12-04.json): the
# GEMM and loop-fusion rows, each kernel at its measured time alone, so that only the
# dispatcher, contention and occupancy rules are fitted (0.644); checked on the sweep's
# attention-like rows (which alone fit 0.72) and on the third run (every makespan within 20%).
HOPPER_OCCUPANCY_EXPONENT = 0.64

# benchmarks/results/runtime_nvidia_h200_2026-12-04.md: 1.79 and 1.54 us (two runs) from a
# kernel's end to a kernel on another stream behind an event, 1.54 us back to back on one
# stream, 0.77 us for both inside a CUDA graph (one-block kernels, medians of 300 pairs).
HOPPER_EVENT_LATENCY_S = 1.8e-6

_CONSTANTS = {
  "a40": Constants(
    gemm_efficiency=0.75,
    cta_copy_bandwidth=16e9,
    channels=nccl.CHANNELS["a40"],
    saturating_threads=768,
  ),
  "a100": Constants(gemm_efficiency=0.85, cta_copy_bandwidth=15e9, channels=nccl.CHANNELS["a100"]),
  "a100-40": Constants(
    gemm_efficiency=0.85, cta_copy_bandwidth=15e9, channels=nccl.CHANNELS["a100-40"]
  ),
  "h100": Constants(
    gemm_efficiency=0.72,
    cta_copy_bandwidth=20e9,
    channels=nccl.CHANNELS["h100"],
    event_latency_s=HOPPER_EVENT_LATENCY_S,
    occupancy_exponent=HOPPER_OCCUPANCY_EXPONENT,
  ),
  "h200": Constants(
    gemm_efficiency=0.74,
    cta_copy_bandwidth=20e9,
    channels=nccl.CHANNELS["h200"],
    event_latency_s=HOPPER_EVENT_LATENCY_S,
    occupancy_exponent=HOPPER_OCCUPANCY_EXPONENT,
  ),
  # RCCL on MI250X: 256-thread CTAs; register use is an assumption (128 VGPRs/lane).
  "mi250x": Constants(
    gemm_efficiency=0.62,
    cta_copy_bandwidth=12e9,
    channels=nccl.CHANNELS["mi250x"],
    launch_overhead_s=3e-6,
    event_latency_s=8e-6,
    comm_threads=256,
    comm_regs=128,
    comm_smem=8 * 1024,
  ),
}


def constants_for(
  gpu: str | targets.Gpu, overrides: Mapping[str, float] | None = None
) -> Constants:
  """Default :class:`Constants` for a catalogue GPU, with optional overrides."""
  g = targets.get_gpu(gpu)
  c = _CONSTANTS.get(g.name, Constants())
  if overrides:
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(Constants)})
    if unknown:
      raise ValueError(f"sim.constants_for: unknown constant(s) {unknown}")
    c = dataclasses.replace(c, **dict(overrides))
  return c
