"""Residency arithmetic: the rule the runtime library applies at launch
(``xla_patches/runtime/shaping.h``), mirrored here for the plan checks and the simulator:

  blocks/SM = min(max_blocks_per_sm,
                  floor(max_threads_per_sm / roundup(threads, warp)),
                  floor(floor(regs_per_sm / 4 / roundup(regs * warp, reg_alloc_unit))
                        * 4 / warps),        # four register sub-partitions
                  floor(smem_per_sm / roundup(static + dynamic + reserved_per_block,
                                              smem_alloc_unit)))

and, to cap residency at N blocks per SM, the smallest dynamic shared memory
with floor(smem_per_sm / roundup(static + dyn + reserved, unit)) <= N:

  block = (floor(floor(smem_per_sm / (N + 1)) / unit) + 1) * unit
  dyn   = block - (unit - 1) - static - reserved

never below the launch's own, and never above opt-in - static (CUDA C
Programming Guide, "Occupancy" and the per-compute-capability limits table).
:func:`room_cap` lowers a cap until one communication block fits beside the
capped blocks in every resource (``shaping.h`` states the rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax_overlap._src import targets

if TYPE_CHECKING:
  from jax_overlap._src.runtime.plan import CommBlock

__all__ = [
  "blocks_per_sm",
  "capping_smem",
  "padded_dynamic_smem",
  "residency_limits",
  "room_cap",
  "shaped_dynamic_smem",
]


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


SHAPE_UNCHANGED = "unchanged"
SHAPE_SHAPED = "shaped"
SHAPE_CAPPED = "capped"


def _gpu(gpu: str | targets.Gpu) -> targets.Gpu:
  return targets.get_gpu(gpu)


def _check_launch(api: str, **values: int) -> None:
  for name, value in values.items():
    if not _is_int(value):
      raise TypeError(f"{api}: {name} must be an integer, got {value!r}")
    if value < 0 or (name in ("threads", "blocks_per_sm") and value < 1):
      bound = ">= 1" if name in ("threads", "blocks_per_sm") else ">= 0"
      raise ValueError(f"{api}: {name} must be {bound}, got {value}")


def _roundup(x: int, unit: int) -> int:
  return x if unit <= 0 else -(-x // unit) * unit


def _reg_alloc_unit(gpu: targets.Gpu) -> int:
  return gpu.reg_alloc_unit


_SUB_PARTITIONS = 4  # register-file sub-partitions per SM (one per warp scheduler)


def _regs_per_warp(g: targets.Gpu, regs_per_thread: int) -> int:
  return _roundup(regs_per_thread * g.warp_size, _reg_alloc_unit(g))


def _smem_block(g: targets.Gpu, smem_total: int) -> int:
  b = smem_total + g.smem_reserved_per_block
  return _roundup(b, g.smem_alloc_unit) if b > 0 else 0


def residency_limits(
  gpu: str | targets.Gpu, threads: int, regs_per_thread: int, smem_total: int
) -> dict[str, int]:
  """Blocks of one kernel per SM allowed by each limit (their minimum is :func:`blocks_per_sm`).

  Keys: ``"threads"``, ``"registers"`` (four sub-partitions, a warp's registers from one),
  ``"shared_memory"`` (per-block reservation, allocation unit) and ``"blocks"``.

  Example:
    >>> residency_limits("h100", 384, 168, 200 * 1024)["registers"]
    1
  """
  g = _gpu(gpu)
  threads_rounded = _roundup(threads, g.warp_size)
  warps = threads_rounded // g.warp_size
  by_regs = g.max_blocks_per_sm
  if regs_per_thread > 0:
    per_partition = g.regs_per_sm // _SUB_PARTITIONS // _regs_per_warp(g, regs_per_thread)
    by_regs = per_partition * _SUB_PARTITIONS // warps
  smem = _smem_block(g, smem_total)
  return {
    "threads": g.max_threads_per_sm // threads_rounded,
    "registers": by_regs,
    "shared_memory": g.smem_per_sm // smem if smem > 0 else g.max_blocks_per_sm,
    "blocks": g.max_blocks_per_sm,
  }


def blocks_per_sm(
  gpu: str | targets.Gpu, threads: int, regs_per_thread: int, smem_total: int
) -> int:
  """Resident blocks of one kernel per SM (0 if it cannot run).

  Args:
    gpu: catalogue name or :class:`~jax_overlap.targets.Gpu`.
    threads: threads per block.
    regs_per_thread: registers per thread (0: unknown, not limiting).
    smem_total: static plus dynamic shared memory per block, in bytes.

  Example:
    >>> blocks_per_sm("h100", 256, 32, 0)
    8
  """
  _check_launch(
    "jax_overlap.runtime.blocks_per_sm",
    threads=threads,
    regs_per_thread=regs_per_thread,
    smem_total=smem_total,
  )
  return _natural(_gpu(gpu), threads, regs_per_thread, smem_total)


def _no_room(
  g: targets.Gpu, c: CommBlock, blocks: int, threads: int, regs: int, smem_total: int
) -> tuple[str, ...]:
  """Limits that keep ``c`` from fitting beside ``blocks`` compute blocks (shaping.h)."""
  out = []
  w = g.warp_size
  if blocks * _roundup(threads, w) + _roundup(c.threads, w) > g.max_threads_per_sm:
    out.append("threads")
  if c.regs_per_thread > 0 or regs > 0:
    free = [g.regs_per_sm // _SUB_PARTITIONS] * _SUB_PARTITIONS
    comm_per_warp = _regs_per_warp(g, c.regs_per_thread) if c.regs_per_thread > 0 else 0
    for i in range(_roundup(c.threads, w) // w):
      free[i % _SUB_PARTITIONS] -= comm_per_warp
    fits = min(free) >= 0
    per_warp = _regs_per_warp(g, regs) if regs > 0 else 0
    for _ in range(blocks * (_roundup(threads, w) // w)):
      if not fits:
        break
      best = free.index(max(free))
      free[best] -= per_warp
      fits = free[best] >= 0
    if not fits:
      out.append("registers")
  if blocks * _smem_block(g, smem_total) + _smem_block(g, c.smem_bytes) > g.smem_per_sm:
    out.append("shared_memory")
  if blocks + 1 > g.max_blocks_per_sm:
    out.append("blocks")
  return tuple(out)


def room_cap(
  gpu: str | targets.Gpu,
  comm: CommBlock,
  threads: int,
  regs_per_thread: int,
  static_smem: int,
  dynamic_smem: int,
  blocks_per_sm: int,
) -> tuple[int, tuple[str, ...]]:
  """The largest cap ``r <= blocks_per_sm`` that leaves room for ``comm`` beside the kernel.

  Same rule as the runtime library (``jor_room_cap`` in ``shaping.h``): ``r`` blocks
  with the dynamic shared memory that caps them at ``r`` and one communication block
  must fit together on an SM in threads, registers (per sub-partition), shared memory
  and blocks.

  Returns:
    ``(r, ())`` when a cap leaves room (``r`` equal to the kernel's own residency
    means: launch it as is), or ``(0, limits)`` with the limits that stand in the way
    at one block per SM (``"registers"``, ``"threads"``, ``"shared_memory"``,
    ``"blocks"``): padding cannot make room beside this kernel.

  Example:
    >>> room_cap("h100", CommBlock.nccl("h100", 544), 384, 168, 0, 200 * 1024, 1)
    (0, ('registers', 'shared_memory'))
    >>> room_cap("h100", CommBlock(256, 96, 82240), 128, 32, 0, 0, 4)
    (1, ())
  """
  g = _gpu(gpu)
  _check_launch(
    "jax_overlap.runtime.room_cap",
    threads=threads,
    regs_per_thread=regs_per_thread,
    static_smem=static_smem,
    dynamic_smem=dynamic_smem,
    blocks_per_sm=blocks_per_sm,
  )
  from jax_overlap._src.runtime.plan import CommBlock  # here: plan imports this module

  if not isinstance(comm, CommBlock):
    raise TypeError(f"jax_overlap.runtime.room_cap: comm must be a CommBlock, got {comm!r}")
  # ``blocks_per_sm`` is shadowed by the argument here.
  natural = _natural(g, threads, regs_per_thread, static_smem + dynamic_smem)
  last: tuple[str, ...] = ()
  for r in range(min(blocks_per_sm, natural), 0, -1):
    dyn, status = _shape(g, threads, regs_per_thread, static_smem, dynamic_smem, r)
    if status == SHAPE_CAPPED:
      last = ("shared_memory",)
      continue
    last = _no_room(g, comm, r, threads, regs_per_thread, static_smem + dyn)
    if not last:
      return r, ()
  return 0, last if natural >= 1 else ()


def capping_smem(gpu: targets.Gpu, blocks: int) -> int:
  """Smallest per-block shared memory (static + dynamic) of which ``blocks + 1`` blocks do
  not fit on an SM: whole allocation units, with the per-block reservation."""
  unit = max(gpu.smem_alloc_unit, 1)
  block = (gpu.smem_per_sm // (blocks + 1) // unit + 1) * unit
  return block - (unit - 1) - gpu.smem_reserved_per_block


def _natural(g: targets.Gpu, threads: int, regs: int, smem_total: int) -> int:
  return max(min(residency_limits(g, threads, regs, smem_total).values()), 0)


def _shape(
  gpu: targets.Gpu,
  threads: int,
  regs_per_thread: int,
  static_smem: int,
  dynamic_smem: int,
  blocks: int,
) -> tuple[int, str]:
  if _natural(gpu, threads, regs_per_thread, static_smem + dynamic_smem) <= blocks:
    return dynamic_smem, SHAPE_UNCHANGED
  dyn = capping_smem(gpu, blocks) - static_smem
  dyn = max(dyn, dynamic_smem)
  if static_smem + dyn > gpu.smem_per_block_optin:
    capped = gpu.smem_per_block_optin - static_smem
    if capped <= dynamic_smem:
      return dynamic_smem, SHAPE_UNCHANGED
    return capped, SHAPE_CAPPED
  return dyn, SHAPE_SHAPED


def shaped_dynamic_smem(
  gpu: str | targets.Gpu,
  threads: int,
  regs_per_thread: int,
  static_smem: int,
  dynamic_smem: int,
  blocks_per_sm: int,
) -> int:
  """Dynamic shared memory that caps a kernel at ``blocks_per_sm`` resident blocks per SM.

  Same arithmetic as the runtime library: returns ``dynamic_smem`` unchanged when
  the kernel is already at or below the cap, and at most ``opt-in - static_smem``.

  Example:
    >>> shaped_dynamic_smem("h100", 256, 32, 1024, 0, 2)  # 233472 // 3 + 1 - 1024 - 1024
    75777
  """
  g = _gpu(gpu)
  _check_launch(
    "jax_overlap.runtime.shaped_dynamic_smem",
    threads=threads,
    regs_per_thread=regs_per_thread,
    static_smem=static_smem,
    dynamic_smem=dynamic_smem,
    blocks_per_sm=blocks_per_sm,
  )
  return _shape(g, threads, regs_per_thread, static_smem, dynamic_smem, blocks_per_sm)[0]


def padded_dynamic_smem(
  gpu: str | targets.Gpu, static_smem: int, dynamic_smem: int, padding_bytes: int
) -> int:
  """Dynamic shared memory after adding ``padding_bytes``, capped at the opt-in limit."""
  g = _gpu(gpu)
  _check_launch(
    "jax_overlap.runtime.padded_dynamic_smem",
    static_smem=static_smem,
    dynamic_smem=dynamic_smem,
    padding_bytes=padding_bytes,
  )
  dyn = dynamic_smem + padding_bytes
  if static_smem + dyn > g.smem_per_block_optin:
    return max(dynamic_smem, g.smem_per_block_optin - static_smem)
  return dyn
