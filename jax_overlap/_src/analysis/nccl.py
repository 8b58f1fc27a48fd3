"""NCCL's launch choices that both cost models need: channels per collective and per send/recv.

A collective runs as one CTA per channel. NCCL's collectives use the communicator's
channel count (about 2 on a PCIe box, 16 on an A100 node, 24 on an H100 node; NVIDIA/nccl
#689 and the "tail effect" report). Point-to-point operations (``ncclSend``/``ncclRecv``,
what XLA runs a collective-permute and an all-to-all as) use fewer: NCCL splits each
send/recv over a few channels chosen from the communicator size and the message size,
following ``ncclTopoComputeP2pChannels`` (src/graph/paths.cc) and ``addP2pToPlan``
(src/enqueue.cc) in NCCL 2.19-2.27, and runs them in its p2p kernel of
``NCCL_MAX_NTHREADS`` (640) threads per CTA. On an 8-GPU H100 node a 16 MiB ring step
uses 4 CTAs where an all-gather uses 24.

The analysis (:func:`jax_overlap._src.analysis.cost_model.collective_time`) and the simulator
(:mod:`jax_overlap._src.sim.collectives`) both take a point-to-point operation's channel
count from here.
"""

from __future__ import annotations

import math

from jax_overlap._src import targets

__all__ = [
  "CHANNELS",
  "P2P_KINDS",
  "P2P_THREADS",
  "collective_channels",
  "p2p_channels",
  "p2p_ctas",
]

# Collective channels per GPU: NCCL defaults on these systems (NVIDIA/nccl#689; 24 on H100
# as in the "tail effect" report; RCCL on MI250X 16; 2 over PCIe).
CHANNELS = {"a40": 2, "a100": 16, "a100-40": 16, "h100": 24, "h200": 24, "mi250x": 16}

# NCCL's defaults for point-to-point operations (src/graph/paths.cc, src/enqueue.cc,
# src/init.cc): MAXCHANNELS, NCCL_P2P_NVL_CHUNKSIZE, NCCL_P2P_NET_CHUNKSIZE /
# NCCL_P2P_PCI_CHUNKSIZE, and the p2p kernel's NCCL_MAX_NTHREADS.
_MAX_CHANNELS = 32
_P2P_NVL_CHUNK = 512 * 1024
_P2P_OTHER_CHUNK = 128 * 1024
P2P_THREADS = 640
# NVLink links per GPU (each adds two p2p channels per peer in NCCL's topology rule):
# A100 SXM has 12 third-generation links, H100/H200 SXM 18 fourth-generation links.
_NVLINK_LINKS = {"nvlink3": 12, "nvlink4": 18}
P2P_KINDS = ("collective-permute", "all-to-all")


def collective_channels(gpu: targets.Gpu | str) -> int:
  """NCCL's (RCCL's) collective channel count on ``gpu``'s usual system (16 if unknown)."""
  name = gpu if isinstance(gpu, str) else gpu.name
  return CHANNELS.get(name, 16)


def _pow2_up(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _spans(topo, group_size: int, spans_hosts: bool | None) -> bool:
  if spans_hosts is not None:
    return bool(spans_hosts)
  if isinstance(topo, targets.Topology):
    return group_size > topo.gpus_per_host and topo.num_hosts > 1
  return False


def p2p_channels(
  peer_bytes: float,
  group_size: int,
  topo: targets.Topology | targets.Gpu,
  channels: int,
  spans_hosts: bool | None = None,
) -> int:
  """CTAs NCCL gives one send/recv of ``peer_bytes`` in a communicator of ``group_size``.

  NCCL's rule on NVIDIA GPUs: the communicator's p2p channels are its collective channels
  (``channels``) rounded up to a power of two; per peer it allows two channels per NVLink
  link (two in all over PCIe or the network), also a power of two; an operation starts
  from ``per_peer`` halved until ``per_peer * group_size`` fits the p2p channels (so that
  every peer of an all-to-all gets its own), and doubles again only while a channel's part
  exceeds 32 chunks (16 MiB at the 512 KiB NVLink chunk; one chunk across hosts). Parts
  are at least 1/8 chunk (half a chunk across hosts).
  """
  p = max(int(group_size), 1)
  spans = _spans(topo, p, spans_hosts)
  gpu = topo.gpu if isinstance(topo, targets.Topology) else topo
  links = None if spans else _NVLINK_LINKS.get(gpu.link)
  p2p_total = min(int(channels), _MAX_CHANNELS)
  per_peer = min(_pow2_up(min(p2p_total, 2 * links if links else 2)), _pow2_up(p2p_total))
  p2p_total = _pow2_up(p2p_total)
  n_min = per_peer
  while n_min * p > p2p_total and n_min > 1:
    n_min //= 2
  if peer_bytes <= 0:
    return 1
  chunk = _P2P_NVL_CHUNK if links else _P2P_OTHER_CHUNK
  min_part, max_part = (chunk // 2, chunk) if spans else (chunk // 8, chunk * 32)
  n = max(min(n_min, math.ceil(peer_bytes / min_part)), 1)
  part = max(min_part, math.ceil(peer_bytes / n))
  while part > max_part and n <= per_peer // 2:
    n *= 2
    part = math.ceil(peer_bytes / n)
  return n


def p2p_ctas(
  kind: str,
  nbytes: float,
  group_size: int,
  topo: targets.Topology | targets.Gpu,
  channels: int,
  spans_hosts: bool | None = None,
) -> int:
  """CTAs of NCCL's p2p kernel for a collective-permute or all-to-all of ``nbytes``."""
  p = max(int(group_size), 1)
  if kind == "collective-permute":
    # Each device sends to one peer and receives from another in the same round: the
    # two share the same channels.
    return p2p_channels(nbytes, p, topo, channels, spans_hosts)
  # All-to-all: one send/recv pair per other peer, each on its own channels.
  per_peer = p2p_channels(nbytes / p, p, topo, channels, spans_hosts)
  total = _pow2_up(min(int(channels), _MAX_CHANNELS))
  return max(min(per_peer * (p - 1), total), 1)
