"""Library GEMMs' launch configurations.

GEMMs are modelled by shape, not by the launch configuration a deviceless compile reports
(those are untuned defaults): :func:`gemm_config` picks a tile configuration of the kind
cuBLAS/CUTLASS pick on each architecture:
  Hopper (sm_90): warp-specialised 128x256x64 or 128x128x64 tiles, 384 threads (one producer
    and two consumer warpgroups), ~168 registers per thread on average (setmaxnreg 240/40),
    the shared memory filled with 4-6 pipeline stages (~200 KB): one block per SM.
    (CUTLASS 3 ``KernelTmaWarpSpecializedCooperative``; cuBLAS ``sm90_xmma_gemm_*_128x256``.)
  Ampere (sm_80/86): 256x128x64 with 3 stages (~147 KB, 1 block/SM on A100) or
    128x128x32 with 5 stages on A100 / 3 on A40 (2 blocks/SM), 256 threads.
    (cuBLAS ``ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5``; CUTLASS sm80 defaults.)
  CDNA2 (MI250X): Tensile macro tiles 256x128x32 (48 KB LDS, double-buffered) or
    128x128x32 (32 KB LDS), 256 threads (4 wavefronts).
The large tile is used when it still gives at least one tile per SM (a full wave), as the
cuBLAS heuristics prefer filling the machine.

Launch kind. On Hopper cuBLAS's GEMMs are persistent and cluster-launched. Measured on an
H200 (``benchmarks/results/runtime_nvidia_h200_2026-12-04.md``, item 4): the 8192^3 bf16
GEMM ran as ``nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT``, grid [2, 66, 1] = 132
blocks in clusters of 2, one per SM, 384 threads x 168 registers (the whole register
file), 188,636 B of shared memory; a copy launched after it waited for the whole GEMM even
at the highest stream priority (1.74 ms beside a 1.42 ms GEMM), and launched before it ran
beside it while the GEMM still finished in 1.52 ms, 0.15 ms over its time alone, though 16
SMs were the copy's for 0.48 ms: the GEMM's blocks take its tiles as they go, so the blocks
placed late did less. The simulator therefore runs a persistent GEMM as its tiles, each SM
it holds taking the next tile as one finishes and freed only when none is left
(:class:`~jax_overlap.sim.Kernel` ``persistent``). Ampere's and CDNA2's library GEMMs are
launched one block per tile, many waves. Per block: ``flops = 2 * tm * tn * k`` (edge tiles
do full work); DRAM traffic of the whole GEMM is taken as ``2 * (m*k + k*n) * elt +
m*n*elt`` (inputs read about twice thanks to L2 reuse, output written once), shared evenly
by the blocks.
"""

from __future__ import annotations

import dataclasses
import math

from jax_overlap._src import deprecations, targets
from jax_overlap._src.sim.model import dtype_bytes

__all__ = [
  "SM_COUNT_TARGET_FOLLOWED",
  "sm_count_targets",
  "GemmConfig",
  "gemm_config",
  "launch_kind",
]


@dataclasses.dataclass(frozen=True)
class GemmConfig(deprecations.ReadAsDict):
  """One GEMM's launch configuration.

  Attributes:
    tile: the output tile ``(tm, tn)`` and the ``k`` step ``tk`` of one block.
    grid: blocks (one per output tile).
    threads: threads per block.
    regs: registers per thread.
    smem: shared memory per block (bytes).
    persistent: resident blocks take the next tile as they finish one (Hopper).
    cluster: blocks per thread-block cluster (2 on Hopper, 1 elsewhere).
  """

  tile: tuple[int, int, int]
  grid: int
  threads: int
  regs: int
  smem: int
  persistent: bool = False
  cluster: int = 1

  _was_dict = "sim.gemm_config()"


# (tm, tn, tk, stages, threads, regs) per architecture family, large tile first.
_GEMM_TILES = {
  "hopper": [(128, 256, 64, 4, 384, 168), (128, 128, 64, 6, 384, 168)],
  "ampere": [(256, 128, 64, 3, 256, 232), (128, 128, 32, 5, 256, 128)],
  "ampere86": [(256, 128, 32, 3, 256, 232), (128, 128, 32, 3, 256, 128)],
  "cdna2": [(256, 128, 32, 2, 256, 256), (128, 128, 32, 2, 256, 128)],
}


def _family(gpu: targets.Gpu) -> str:
  if gpu.vendor == "amd":
    return "cdna2"
  if gpu.compute_capability >= (9, 0):
    return "hopper"
  if gpu.compute_capability >= (8, 6):
    return "ampere86"
  return "ampere"


def gemm_config(gpu: targets.Gpu | str, m: int, n: int, k: int, dtype: str = "bf16") -> GemmConfig:
  """The launch configuration a library GEMM of ``m x n x k`` gets on ``gpu`` (see the
  module docstring); ``gpu`` a catalogue GPU or its name."""
  gpu = targets.get_gpu(gpu)
  elt = dtype_bytes(dtype)
  family = _family(gpu)
  tiles = _GEMM_TILES[family]
  chosen = tiles[-1]
  for t in tiles:
    if math.ceil(m / t[0]) * math.ceil(n / t[1]) >= gpu.sm_count:
      chosen = t
      break
  tm, tn, tk, stages, threads, regs = chosen
  smem = stages * (tm + tn) * tk * max(elt, 2)
  if family == "hopper":
    smem += 8 * 1024  # epilogue staging and pipeline barriers
  smem = min(smem, gpu.smem_per_block_optin)
  grid = math.ceil(m / tm) * math.ceil(n / tn)
  persistent = gpu.persistent_library_gemms and targets.persistent_gemm_dtype(dtype)
  return GemmConfig(
    tile=(tm, tn, tk),
    grid=grid,
    threads=threads,
    regs=regs,
    smem=int(smem),
    persistent=persistent,
    cluster=2 if persistent else 1,
  )


def launch_kind(kernel, gpu: targets.Gpu | str) -> tuple[bool, int]:
  """(persistent, blocks per cluster) of a :class:`~jax_overlap.sim.Kernel` on ``gpu``: its
  own ``persistent`` and ``cluster`` where set, else as the target's library launches a
  GEMM built by ``Kernel.gemm``, else (a kernel with its own launch) neither."""
  persistent, cluster = False, 1
  if kernel.grid is None or kernel.threads is None:
    cfg = gemm_config(gpu, *kernel.gemm_mnk, kernel.dtype)
    persistent, cluster = cfg.persistent, cfg.cluster
  if kernel.persistent is not None:
    persistent = kernel.persistent
  if kernel.cluster is not None:
    cluster = kernel.cluster
  return persistent, cluster


# Whether cuBLAS's persistent GEMM grid follows an SM-count target (``cublasSetSmCountTarget``,
# ``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``), per catalogue GPU, as
# ``benchmarks/gpu/gemm_dispatch.cu`` measures it (SMs a probe finds free behind a targeted
# GEMM). No GPU of the catalogue has been measured: PyTorch's SM carve-out (meant to set the
# cuBLASLt target) left the 8192^3 bf16 GEMM's grid at 132 blocks on an H200, which does not
# settle it for the targets set directly.
SM_COUNT_TARGET_FOLLOWED: dict[str, bool] = {}


def sm_count_targets(gpu: targets.Gpu | str) -> tuple[int, ...]:
  """The SM-count targets :func:`~jax_overlap.sim.tune` tries for library GEMMs by default:
  8, 16, 24 and 32 SMs left free where cuBLAS was measured to follow a target on ``gpu``
  (:data:`SM_COUNT_TARGET_FOLLOWED`), none elsewhere (today, every GPU)."""
  gpu = targets.get_gpu(gpu)
  if not (gpu.persistent_library_gemms and SM_COUNT_TARGET_FOLLOWED.get(gpu.name)):
    return ()
  return tuple(gpu.sm_count - free for free in (8, 16, 24, 32))
