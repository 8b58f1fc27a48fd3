"""What the simulator simulates: kernels, collectives, residency and per-target constants.

Residency (blocks of one kernel that fit on one SM/CU) is the runtime library's
arithmetic (``residency.residency_limits``, ``xla_patches/runtime/shaping.h``): the minimum over
threads, registers (allocated per warp, from one of four sub-partitions), shared memory
(with the per-block reservation, in allocation units) and the blocks-per-SM limit, as in the
CUDA occupancy calculator (CUDA C Programming Guide, "Occupancy Calculator" and "Technical
Specifications per Compute Capability").

Occupancy shaping pads each block's dynamic shared memory so that at most ``r`` blocks fit,
with the smallest padded size that does so (``residency.capping_smem``; never less than the block
already uses). Padding no more than that leaves the most room beside the kernel for
communication blocks; ``residency.room_cap`` says whether that room is enough for one.

GEMMs are launched as the libraries launch them (:mod:`.gemm`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

import numpy as np

from jax_overlap._src import targets
from jax_overlap._src.sim.constants import PROVENANCE as PROVENANCE
from jax_overlap._src.sim.constants import Constants as Constants
from jax_overlap._src.sim.constants import constants_for as constants_for
from jax_overlap._src.sim.constants import provenance_markdown as provenance_markdown

__all__ = [
  "COLLECTIVE_KINDS",
  "COMPUTE_KINDS",
  "Constants",
  "PROVENANCE",
  "Kernel",
  "Collective",
  "constants_for",
  "residency",
  "residency_limits",
  "shaped_smem",
  "dtype_bytes",
  "Workload",
  "regs_per_block",
]

ComputeKind = Literal["gemm", "fusion", "reduction", "copy", "custom", "other"]
CollectiveKind = Literal[
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "copy",  # a local device copy by communication-sized CTAs: a GPU benchmark's proxy
]
COMPUTE_KINDS: tuple[str, ...] = typing.get_args(ComputeKind)
COLLECTIVE_KINDS: tuple[str, ...] = typing.get_args(CollectiveKind)

_DTYPE_BYTES = {
  "f64": 8,
  "float64": 8,
  "f32": 4,
  "float32": 4,
  "tf32": 4,
  "bf16": 2,
  "bfloat16": 2,
  "f16": 2,
  "float16": 2,
  "f8": 1,
  "fp8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s8": 1,
  "int8": 1,
  "u8": 1,
  "s32": 4,
  "int32": 4,
  "u32": 4,
  "pred": 1,
  "s64": 8,
  "int64": 8,
  "u64": 8,
  "uint64": 8,
  "s16": 2,
  "int16": 2,
  "u16": 2,
  "uint16": 2,
  "uint8": 1,
  "uint32": 4,
  "bool": 1,
  "c64": 8,
  "complex64": 8,
  "c128": 16,
  "complex128": 16,
  "float8_e4m3fn": 1,
  "float8_e5m2": 1,
}


def dtype_name(dtype) -> str:
  """A dtype's name as the simulator spells it: a name as given (short, "bf16", or
  NumPy's, "bfloat16"), or a NumPy/JAX dtype's NumPy name."""
  if isinstance(dtype, str):
    return dtype.lower()
  try:
    return np.dtype(dtype).name
  except TypeError:
    raise TypeError(
      f"sim: dtype must be a name such as 'bf16' or 'bfloat16', or a NumPy/JAX dtype, got {dtype!r}"
    ) from None


def dtype_bytes(dtype) -> int:
  """Bytes per element of a dtype ("bf16", "float32", jnp.bfloat16, ...); 2 when unknown."""
  return _DTYPE_BYTES.get(dtype_name(dtype), 2)


def residency_limits(gpu: targets.Gpu, threads: int, regs_per_thread: int, smem_bytes: int) -> dict:
  """Blocks per SM allowed by each limit: the runtime library's arithmetic
  (``residency.residency_limits``), with at least one register per thread."""
  from jax_overlap._src.runtime import residency

  return residency.residency_limits(gpu, threads, max(int(regs_per_thread), 1), int(smem_bytes))


def residency(gpu: targets.Gpu, threads: int, regs_per_thread: int, smem_bytes: int) -> int:
  """Blocks of one kernel that fit on an empty SM: the minimum over the four limits.

  The runtime library's arithmetic (``residency.blocks_per_sm``); a kernel always holds
  at least one register per thread here.
  """
  from jax_overlap._src.runtime import residency

  return residency.blocks_per_sm(gpu, threads, max(int(regs_per_thread), 1), int(smem_bytes))


def regs_per_block(gpu: targets.Gpu, threads: int, regs_per_thread: int) -> int:
  """Registers allocated to one block (per-warp allocation in ``reg_alloc_unit`` units)."""
  warps = -(-threads // gpu.warp_size)
  per_warp = -(-max(regs_per_thread, 1) * gpu.warp_size // gpu.reg_alloc_unit) * gpu.reg_alloc_unit
  return warps * per_warp


def shaped_smem(gpu: targets.Gpu, smem_bytes: int, blocks_per_sm: int) -> int:
  """Per-block shared memory (without the reservation) that caps residency at ``blocks_per_sm``.

  Returns ``smem_bytes`` unchanged when the kernel already uses enough.
  """
  if blocks_per_sm < 1:
    raise ValueError(f"sim.shaped_smem: blocks_per_sm must be at least 1, got {blocks_per_sm}")
  from jax_overlap._src.runtime import residency

  need = residency.capping_smem(gpu, blocks_per_sm)
  return max(int(smem_bytes), min(need, gpu.smem_per_block_optin))


def _check_name_and_kind(cls: str, name, kind, kinds: tuple[str, ...]) -> str:
  """The API name for a record's errors, ``cls(name)``, once its name and kind are valid."""
  if not isinstance(name, str) or not name:
    raise TypeError(f"{cls}: name must be a non-empty string, got {name!r}")
  api = f"{cls}({name!r})"
  if kind not in kinds:
    raise ValueError(f"{api}: kind must be one of {kinds}, got {kind!r}")
  return api


def _check_int(api: str, field: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{api}: {field} must be an int, got {type(value).__name__} {value!r}")
  if value < minimum:
    raise ValueError(f"{api}: {field} must be at least {minimum}, got {value}")
  return value


def _check_num(api: str, field: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{api}: {field} must be a number, got {type(value).__name__} {value!r}")
  if not math.isfinite(value) or value < 0:
    raise ValueError(f"{api}: {field} must be a finite number >= 0, got {value}")
  return float(value)


def _check_time(api: str, value) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{api}: time_s must be a number of seconds or None, got {value!r}")
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"{api}: time_s must be a finite number of seconds > 0, got {value}")


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A compute kernel: a grid of identical blocks.

  Either give the launch configuration (``grid``, ``threads``, ...) and the total work
  (``flops``, ``bytes``), or build a GEMM with :meth:`Kernel.gemm`, whose launch
  configuration is chosen per target by :func:`gemm_config`.

  Attributes:
    name: unique name in its workload (plans and ``after`` refer to it).
    grid: number of blocks (None for a GEMM resolved per target).
    threads: threads per block.
    regs: registers per thread.
    smem: shared memory per block in bytes (static + dynamic).
    flops: total floating-point operations of the kernel.
    bytes: total DRAM bytes the kernel reads and writes.
    stream: stream index; kernels of one stream run in list order.
    after: names of earlier kernels/collectives (on other streams) this one waits for.
    kind: one of ``COMPUTE_KINDS``.
    dtype: element type of the math: a name ("bf16", "bfloat16", "f32", ...) or a NumPy/JAX
      dtype (stored by name).
    gemm_mnk: ``(m, n, k)`` for GEMMs.
    efficiency: fraction of peak a block reaches (None: per-target GEMM efficiency for
      GEMMs, 1.0 otherwise).
    launch_name: the kernel's name as the GPU driver reports it, which runtime plans
      match; None: the same as ``name`` (hand-built workloads); "": unknown (a library
      call such as a cuBLAS GEMM), so no plan rule can select it by name.
    time_s: the kernel's duration alone on the device (first block dispatched to last
      block done) as another model states it, typically the analysis's roofline
      (:func:`~jax_overlap.sim.workload_from_report`). The simulator then scales its
      per-block work so the kernel alone takes exactly this long, and only residency,
      sharing and contention change it. None: the block model's own time.
    persistent: whether the kernel is persistent: resident blocks take the grid's next
      block (tile) as they finish one, so an SM the kernel holds is given to no other
      kernel, of any priority, until the kernel's blocks run out (cuBLAS's GEMMs on
      Hopper; see :mod:`.gemm`). None: as the target's libraries launch a GEMM built by
      :meth:`Kernel.gemm` (persistent on Hopper), not persistent otherwise.
    cluster: blocks per thread-block cluster (1: no cluster). The runtime library leaves
      cluster launches unshaped, and so does the simulator. None: as the target's
      libraries launch a GEMM built by :meth:`Kernel.gemm`, 1 otherwise.
  """

  name: str
  grid: int | None = None
  threads: int | None = None
  regs: int = 32
  smem: int = 0
  flops: float = 0.0
  bytes: float = 0.0
  stream: int = 0
  after: tuple[str, ...] = ()
  kind: ComputeKind = "fusion"
  dtype: str = "bf16"
  gemm_mnk: tuple[int, int, int] | None = None
  efficiency: float | None = None
  launch_name: str | None = None
  time_s: float | None = None
  persistent: bool | None = None
  cluster: int | None = None

  def __post_init__(self):
    api = _check_name_and_kind("sim.Kernel", self.name, self.kind, COMPUTE_KINDS)
    if self.persistent is not None and not isinstance(self.persistent, bool):
      raise TypeError(f"{api}: persistent must be True, False or None, got {self.persistent!r}")
    if self.cluster is not None:
      _check_int(api, "cluster", self.cluster, 1)
    if self.gemm_mnk is not None:
      if len(self.gemm_mnk) != 3:
        raise ValueError(f"{api}: gemm_mnk must be (m, n, k), got {self.gemm_mnk!r}")
      for f, v in zip("mnk", self.gemm_mnk):
        _check_int(api, f"gemm_mnk.{f}", v, 1)
    if self.grid is None or self.threads is None:
      if self.gemm_mnk is None:
        raise ValueError(f"{api}: grid and threads are required unless gemm_mnk is given")
    else:
      _check_int(api, "grid", self.grid, 1)
      _check_int(api, "threads", self.threads, 1)
    _check_int(api, "regs", self.regs, 1)
    _check_int(api, "smem", self.smem, 0)
    _check_int(api, "stream", self.stream, 0)
    _check_num(api, "flops", self.flops)
    _check_num(api, "bytes", self.bytes)
    if self.efficiency is not None and not 0 < self.efficiency <= 1:
      raise ValueError(f"{api}: efficiency must be in (0, 1], got {self.efficiency}")
    _check_time(api, self.time_s)
    if isinstance(self.after, str) or not all(isinstance(a, str) for a in self.after):
      raise TypeError(f"{api}: after must be a tuple of kernel names, got {self.after!r}")
    object.__setattr__(self, "after", tuple(self.after))
    object.__setattr__(self, "dtype", dtype_name(self.dtype))

  @classmethod
  def gemm(
    cls,
    name: str,
    m: int,
    n: int,
    k: int,
    *,
    dtype: str = "bf16",
    stream: int = 0,
    after: tuple[str, ...] = (),
    batch: int = 1,
  ) -> Kernel:
    """A GEMM of ``batch`` x (m x k) @ (k x n), launch configuration chosen per target."""
    api = f"sim.Kernel.gemm({name!r})"
    for f, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
      _check_int(api, f, v, 1)
    elt = dtype_bytes(dtype)
    flops = 2.0 * m * n * k * batch
    byts = float(batch) * (2 * (m * k + k * n) * elt + m * n * elt)
    return cls(
      name=name,
      grid=None,
      threads=None,
      flops=flops,
      bytes=byts,
      stream=stream,
      after=tuple(after),
      kind="gemm",
      dtype=dtype,
      gemm_mnk=(m * batch, n, k),
    )

  @property
  def is_collective(self) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Collective:
  """A collective run as communication CTAs (NCCL channels) on its own stream.

  Attributes:
    name: unique name in its workload.
    kind: one of ``COLLECTIVE_KINDS``.
    bytes: per-device payload (the larger of operand and result).
    group_size: devices in the collective group.
    stream: stream index (by convention 1 for communication).
    after: names of earlier kernels this collective waits for.
    channels, threads, regs, smem: CTA launch configuration (None: target default).
    spans_hosts: whether the group crosses hosts (None: inferred from the topology).
    time_s: the collective's duration alone on the device as another model states it
      (the analysis's alpha-beta time); the simulator scales its channels' work to match,
      as :attr:`Kernel.time_s` does for kernels. None: the channel model's own time.
  """

  name: str
  kind: CollectiveKind
  bytes: float
  group_size: int = 8
  stream: int = 1
  after: tuple[str, ...] = ()
  channels: int | None = None
  threads: int | None = None
  regs: int | None = None
  smem: int | None = None
  spans_hosts: bool | None = None
  time_s: float | None = None

  def __post_init__(self):
    api = _check_name_and_kind("sim.Collective", self.name, self.kind, COLLECTIVE_KINDS)
    _check_num(api, "bytes", self.bytes)
    _check_int(api, "group_size", self.group_size, 1)
    _check_int(api, "stream", self.stream, 0)
    for f in ("channels", "threads", "regs"):
      if getattr(self, f) is not None:
        _check_int(api, f, getattr(self, f), 1)
    if self.smem is not None:
      _check_int(api, "smem", self.smem, 0)
    _check_time(api, self.time_s)
    if isinstance(self.after, str) or not all(isinstance(a, str) for a in self.after):
      raise TypeError(f"{api}: after must be a tuple of kernel names, got {self.after!r}")
    object.__setattr__(self, "after", tuple(self.after))

  @property
  def is_collective(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Workload:
  """Kernels and collectives in launch order, on streams, with cross-stream waits.

  Items of one stream run in list order (each starts after the previous one of its stream
  finished); ``after`` adds waits on earlier items of other streams (CUDA events). Because
  waits may only name earlier items, a workload can never deadlock.
  """

  items: tuple
  name: str = "workload"

  def __post_init__(self):
    items = tuple(self.items)
    object.__setattr__(self, "items", items)
    if not items:
      raise ValueError(f"sim.Workload({self.name!r}): items must not be empty")
    seen: dict[str, int] = {}
    for i, it in enumerate(items):
      if not isinstance(it, (Kernel, Collective)):
        raise TypeError(
          f"sim.Workload({self.name!r}): items[{i}] must be a sim.Kernel or sim.Collective, "
          f"got {type(it).__name__}"
        )
      if it.name in seen:
        raise ValueError(
          f"sim.Workload({self.name!r}): duplicate name {it.name!r} at items[{seen[it.name]}] "
          f"and items[{i}]"
        )
      for a in it.after:
        if a not in seen:
          raise ValueError(
            f"sim.Workload({self.name!r}): {it.name!r} waits for {a!r}, which is not an "
            "earlier item of the workload"
          )
      seen[it.name] = i

  @property
  def kernels(self) -> list[Kernel]:
    return [it for it in self.items if isinstance(it, Kernel)]

  @property
  def collectives(self) -> list[Collective]:
    return [it for it in self.items if isinstance(it, Collective)]

  def index(self, name: str) -> int:
    """Position of the item called ``name``."""
    idx = self.__dict__.get("_index")
    if idx is None:
      idx = {it.name: i for i, it in enumerate(self.items)}
      object.__setattr__(self, "_index", idx)
    if name not in idx:
      raise KeyError(f"sim.Workload({self.name!r}): no item named {name!r}")
    return idx[name]

  def item(self, name: str):
    """The kernel or collective called ``name``."""
    return self.items[self.index(name)]

  def overlap_windows(self) -> dict[str, list[str]]:
    """For each collective, the compute kernels of other streams that may run beside it.

    The window runs from the collective's position in launch order to the first item that
    waits for it (exclusive), or to the end.
    """
    out: dict[str, list[str]] = {}
    for i, c in enumerate(self.items):
      if not isinstance(c, Collective):
        continue
      names = []
      for it in self.items[i + 1 :]:
        if c.name in it.after:
          break
        if isinstance(it, Kernel) and it.stream != c.stream:
          names.append(it.name)
      # Kernels launched before the collective but still running when it starts.
      for it in reversed(self.items[:i]):
        if isinstance(it, Kernel) and it.stream != c.stream and it.name not in c.after:
          names.insert(0, it.name)
        else:
          break
      out[c.name] = names
    return out
