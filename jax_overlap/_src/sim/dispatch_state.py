"""The dispatcher's state: SM groups, resident batches of blocks, and each workload item
compiled once into the launch shape, residency and rates the event loop reads."""

from __future__ import annotations

from collections.abc import Mapping

from jax_overlap._src import targets
from jax_overlap._src.sim import collectives as coll
from jax_overlap._src.sim.gemm import gemm_config, launch_kind
from jax_overlap._src.sim.model import (
  Collective,
  Constants,
  Kernel,
  Workload,
  regs_per_block,
  residency_limits,
  shaped_smem,
)


class _Group:
  __slots__ = ("sms", "thr", "regs", "smem", "blk", "batches", "reserved")

  def __init__(self, sms, thr=0, regs=0, smem=0, blk=0, batches=None, reserved=False):
    self.reserved = reserved  # SMs kept for communication: compute blocks never land here
    self.sms = sms
    self.thr = thr
    self.regs = regs
    self.smem = smem
    self.blk = blk
    self.batches = batches if batches is not None else []


class _Batch:
  __slots__ = ("k", "cnt", "rem", "rate", "t0")

  def __init__(self, k, cnt, rem, t0):
    self.k = k
    self.cnt = cnt
    self.rem = rem
    self.rate = 0.0
    self.t0 = t0


def _shape_smem(gpu, name, threads, regs, smem, spec) -> int:
  """Shared memory per block after applying a shaping spec (int or dict).

  As the runtime library does: padding adds bytes; a blocks-per-SM cap leaves a kernel that
  already fits at most that many blocks alone, and otherwise pads to the smallest size that
  enforces the cap (see :func:`~jax_overlap._src.sim.model.shaped_smem`).
  """
  if spec is None:
    return smem
  if isinstance(spec, bool) or not isinstance(spec, (int, Mapping)):
    raise TypeError(
      f"jax_overlap.sim: shaping[{name!r}] must be blocks per SM (int) or a dict with "
      f"'blocks_per_sm' or 'padding_bytes', got {spec!r}"
    )
  if isinstance(spec, int):
    spec = {"blocks_per_sm": spec}
  bad = sorted(set(spec) - {"blocks_per_sm", "padding_bytes"})
  if bad:
    raise ValueError(
      f"jax_overlap.sim: shaping[{name!r}] has unknown key(s) {bad}; use 'blocks_per_sm' or "
      "'padding_bytes'"
    )
  out = smem
  if spec.get("padding_bytes") is not None:
    pad = spec["padding_bytes"]
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
      raise ValueError(
        f"jax_overlap.sim: shaping[{name!r}].padding_bytes must be an int >= 0, got {pad!r}"
      )
    out += pad
  if spec.get("blocks_per_sm") is not None:
    n = spec["blocks_per_sm"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(
        f"jax_overlap.sim: shaping[{name!r}].blocks_per_sm must be an int >= 1, got {n!r}"
      )
    if min(residency_limits(gpu, threads, regs, out).values()) > n:
      out = shaped_smem(gpu, out, n)
  if out > gpu.smem_per_block_optin:
    raise ValueError(
      f"jax_overlap.sim: shaping[{name!r}] asks for {out} bytes of shared memory per block, "
      f"more than {gpu.name}'s opt-in limit of {gpu.smem_per_block_optin}"
    )
  return out


class _Compiled:
  """Per-item arrays the event loop reads."""

  def __init__(
    self, wl: Workload, topo: targets.Topology, const: Constants, priorities, shaping, scale_of
  ):
    gpu = topo.gpu
    self.gpu = gpu
    n = len(wl.items)
    self.names = [it.name for it in wl.items]
    self.grid = [0] * n
    self.thr = [0] * n
    self.regs = [0] * n
    self.regs_thread = [0] * n
    self.smem = [0] * n  # per block, incl. padding and reservation
    self.smem_user = [0] * n
    self.res = [0] * n
    self.t0 = [0.0] * n
    self.w = [1.0] * n
    self.mem = [0.0] * n
    self.comm = [False] * n
    self.lat = [0.0] * n
    self.chbytes = [0.0] * n
    self.linkbw = [0.0] * n
    self.ctabw = [0.0] * n
    self.stream = [it.stream for it in wl.items]
    self.prio = [int(priorities.get(it.stream, 0)) for it in wl.items]
    self.kind = [it.kind for it in wl.items]
    # Persistent kernels keep the SMs they hold until their blocks run out; cluster
    # launches are left unshaped (the runtime library does not shape them).
    self.persistent = [False] * n
    self.cluster = [1] * n
    bw_total = gpu.memory_bandwidth
    bw_sm = const.sm_bandwidth_factor * bw_total / gpu.sm_count
    shaping = dict(shaping or {})
    names = set(self.names)
    missing = sorted(set(shaping) - names)
    if missing:
      raise ValueError(
        f"jax_overlap.sim: the plan shapes kernel(s) {missing} that are not in workload {wl.name!r}"
      )
    for i, it in enumerate(wl.items):
      if isinstance(it, Collective):
        if it.name in shaping:
          raise ValueError(
            f"jax_overlap.sim: shaping[{it.name!r}] names a collective; only compute kernels "
            "can be shaped"
          )
        cw = coll.channel_work(it, topo, const)
        grid, threads, regs, smem = cw["channels"], cw["threads"], cw["regs"], cw["smem"]
        self.comm[i] = True
        self.lat[i] = cw["latency_s"] + const.block_overhead_s
        self.chbytes[i] = cw["bytes"]
        self.linkbw[i] = cw["link_bandwidth"]
        self.ctabw[i] = cw["cta_bandwidth"]
        self.mem[i] = cw["bytes"] * const.comm_hbm_factor
      else:
        assert isinstance(it, Kernel)
        if it.grid is None or it.threads is None:
          m, nn, k = it.gemm_mnk
          cfg = gemm_config(gpu, m, nn, k, it.dtype)
          grid, threads, regs, smem = cfg.grid, cfg.threads, cfg.regs, cfg.smem
          tm, tn, _ = cfg.tile
          flops_b = 2.0 * tm * tn * k
          eff = it.efficiency if it.efficiency is not None else const.gemm_efficiency
        else:
          grid, threads, regs, smem = it.grid, it.threads, it.regs, it.smem
          flops_b = it.flops / grid
          if it.efficiency is not None:
            eff = it.efficiency
          else:
            eff = const.gemm_efficiency if it.kind == "gemm" else 1.0
        self.persistent[i], self.cluster[i] = launch_kind(it, gpu)
        bytes_b = it.bytes / grid
        # GEMMs and fused custom kernels (attention) run on the tensor cores.
        tensor = it.kind in ("gemm", "custom")
        peak = gpu.peak_flops(it.dtype) if tensor else gpu.peak_fp32_flops
        r_sm = peak / gpu.sm_count
        self.t0[i] = const.block_overhead_s + max(flops_b / (eff * r_sm), bytes_b / bw_sm)
        self.mem[i] = bytes_b
      natural = min(residency_limits(gpu, threads, regs, smem).values())
      if not self.comm[i]:
        shaped = _shape_smem(gpu, it.name, threads, regs, smem, shaping.get(it.name))
        smem = shaped if self.cluster[i] == 1 else smem
      self._check_fits(it, threads, regs, smem)
      lim = residency_limits(gpu, threads, regs, smem)
      res = min(lim.values())
      self.grid[i] = grid
      warps = -(-threads // gpu.warp_size)
      self.thr[i] = warps * gpu.warp_size
      self.regs[i] = regs_per_block(gpu, threads, regs)
      self.regs_thread[i] = regs
      self.smem[i] = smem + gpu.smem_reserved_per_block
      self.smem_user[i] = smem
      self.res[i] = res
      if not self.comm[i]:
        sat = (
          1 if it.kind == "gemm" else min(max(natural, 1), -(-const.saturating_threads // threads))
        )
        self.w[i] = 1.0 / max(sat, 1)
      # Durations from time_s (after the checks, so errors name the item).
      scale = scale_of(i, it)
      if self.comm[i]:
        self.lat[i] *= scale
        self.chbytes[i] *= scale
      else:
        self.t0[i] *= scale

  def _check_fits(self, it, threads, regs, smem):
    gpu = self.gpu
    api = f"jax_overlap.sim: kernel {it.name!r}"
    if threads > gpu.max_threads_per_block:
      raise ValueError(
        f"{api}: threads per block {threads} exceeds {gpu.name}'s limit of "
        f"{gpu.max_threads_per_block}"
      )
    if smem > gpu.smem_per_block_optin:
      raise ValueError(
        f"{api}: smem per block {smem} bytes exceeds {gpu.name}'s opt-in limit of "
        f"{gpu.smem_per_block_optin}"
      )
    if regs_per_block(gpu, threads, regs) > gpu.regs_per_block:
      raise ValueError(
        f"{api}: registers per block {threads} x {regs} exceed {gpu.name}'s limit of "
        f"{gpu.regs_per_block}"
      )
    lim = residency_limits(gpu, threads, regs, smem)
    if min(lim.values()) < 1:
      bad = [k for k, v in lim.items() if v < 1]
      raise ValueError(
        f"{api}: a block ({threads} threads, {regs} registers/thread, {smem} bytes shared "
        f"memory) cannot fit on one {gpu.name} SM at all (limited by {', '.join(bad)})"
      )
