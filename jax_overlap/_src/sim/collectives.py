"""NCCL-like model of a collective: channels, one CTA each, sharing the link.

A collective of ``S`` payload bytes over ``p`` devices moves, per device, over the link
(ring algorithms; Patarasuk & Yuan 2009; NCCL docs "Performance: algorithm bandwidth vs
bus bandwidth"):

  all-gather, reduce-scatter   (p - 1) / p * S      in p - 1 steps
  all-reduce                   2 (p - 1) / p * S    in 2 (p - 1) steps
  all-to-all                   (p - 1) / p * S      in p - 1 steps
  collective-permute           S                    in 1 step
  copy                         S                    in 0 steps, through DRAM

``copy`` is not a collective: it is the stand-in the GPU benchmark
(``benchmarks/gpu/overlap_bench.cu``) launches, CTAs of an NCCL channel's size copying
``S`` bytes within the device. Its "link" is device memory: ``S`` is read and written, so
it moves at most ``memory_bandwidth / comm_hbm_factor``.

The bytes are split evenly over ``C`` channels; each channel is one CTA
(:class:`~jax_overlap._src.sim.model.Constants` ``comm_threads`` / ``comm_regs``). A
channel makes progress only while its CTA is resident; while resident it moves data at

  bw_channel = min(cta_copy_bandwidth, link_bandwidth / resident_channels)

where ``resident_channels`` counts every resident communication CTA on the device (all
collectives share the link), so the collective's throughput is
``min(link bandwidth, cta_copy_bandwidth x resident CTAs)``. A channel's time is
``steps * link_latency + bytes_per_channel / bw_channel`` (the alpha-beta model). Moved
bytes also load DRAM (``comm_hbm_factor`` bytes per link byte), so collectives and memory-
bound kernels slow each other.

Point-to-point collectives (collective-permute, all-to-all; XLA runs them as grouped
``ncclSend``/``ncclRecv``) do not use the collective channel count on NVIDIA GPUs. NCCL
splits each send/recv over a few channels chosen from the communicator size and the
message size (:func:`nccl_p2p_channels`, following NCCL's ``ncclTopoComputeP2pChannels``
in src/graph/paths.cc and ``addP2pToPlan`` in src/enqueue.cc, 2.19-2.27), and runs them in
its p2p kernel of ``NCCL_MAX_NTHREADS`` (640) threads per CTA. On an 8-GPU H100 node a
16 MiB ring step uses 4 CTAs where an all-gather uses 24.
"""

from __future__ import annotations

from jax_overlap._src import targets
from jax_overlap._src.analysis import nccl
from jax_overlap._src.sim.model import Collective, Constants

__all__ = ["link_bytes_and_steps", "channel_work", "alone_time", "nccl_p2p_channels"]


def nccl_p2p_channels(
  peer_bytes: float,
  group_size: int,
  topo: targets.Topology,
  const: Constants,
  spans_hosts: bool | None = None,
) -> int:
  """:func:`jax_overlap._src.analysis.nccl.p2p_channels` with the collective channels of ``const``."""
  return nccl.p2p_channels(peer_bytes, group_size, topo, int(const.channels), spans_hosts)


def link_bytes_and_steps(kind: str, payload: float, group_size: int) -> tuple[float, int]:
  """(bytes over the link per device, latency steps) of one collective."""
  if kind == "copy":
    return float(payload), 0
  p = max(int(group_size), 1)
  if p == 1:
    return 0.0, 0
  if kind in ("all-gather", "reduce-scatter", "all-to-all"):
    return payload * (p - 1) / p, p - 1
  if kind == "all-reduce":
    return 2.0 * payload * (p - 1) / p, 2 * (p - 1)
  if kind == "collective-permute":
    return float(payload), 1
  raise ValueError(f"sim.collectives: unknown collective kind {kind!r}")


def channel_work(c: Collective, topo: targets.Topology, const: Constants) -> dict:
  """Per-channel work and launch configuration of collective ``c`` on ``topo``.

  Returns:
    dict: channels, threads, regs, smem, bytes (link bytes per channel), latency_s
    (fixed per-channel time), link_bandwidth, cta_bandwidth.
  """
  threads = c.threads or const.comm_threads
  if c.channels:
    channels = c.channels
  elif c.kind in nccl.P2P_KINDS and topo.gpu.vendor == "nvidia":
    channels = nccl.p2p_ctas(
      c.kind, c.bytes, c.group_size, topo, int(const.channels), c.spans_hosts
    )
    threads = c.threads or max(const.comm_threads, nccl.P2P_THREADS)
  else:
    channels = const.channels
  if c.kind == "copy":
    link_bw, lat = topo.gpu.memory_bandwidth / const.comm_hbm_factor, 0.0
  else:
    link_bw, lat = topo.link_for(c.group_size, c.spans_hosts)
  moved, steps = link_bytes_and_steps(c.kind, c.bytes, c.group_size)
  return {
    "channels": channels,
    "threads": threads,
    "regs": c.regs or const.comm_regs,
    "smem": const.comm_smem if c.smem is None else c.smem,
    "bytes": moved / channels,
    "latency_s": steps * lat,
    "link_bandwidth": link_bw,
    "cta_bandwidth": const.cta_copy_bandwidth,
  }


def alone_time(c: Collective, topo: targets.Topology, const: Constants) -> float:
  """The channel model's time for ``c`` alone on the device: its latency steps plus the
  link bytes at ``min(link bandwidth, cta_copy_bandwidth x channels)``."""
  cw = channel_work(c, topo, const)
  rate = min(cw["link_bandwidth"], cw["cta_bandwidth"] * cw["channels"])
  return cw["latency_s"] + cw["bytes"] * cw["channels"] / rate
