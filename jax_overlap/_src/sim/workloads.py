"""Synthetic workloads: GEMM + collective mixes, transformer layers, random and large steps.

The transformer workload is an FSDP-style step (PyTorch FSDP2 / MaxText pattern,
BACKGROUND section 5): each layer's weights are all-gathered on the communication stream
while the previous layer computes (prefetch), and in the backward pass each layer's
gradients are reduce-scattered while the next-lower layer computes. Per layer with model
width ``d``, MLP width ``4d`` and ``T`` tokens per device:

  forward GEMMs   QKV (T x 3d x d), attention output (T x d x d), MLP up (T x 4d x d),
                  MLP down (T x d x 4d), a fused causal attention kernel, plus memory-bound
                  fusions (norm, activation);
  backward GEMMs  twice the forward (input and weight gradients);
  all-gather      the layer's weights, 12 d^2 elements, before its forward and again before
                  its backward; reduce-scatter of its gradients, the same size.
"""

from __future__ import annotations

import dataclasses
import random as _random
from collections.abc import Sequence

from jax_overlap._src.sim.model import Collective, Kernel, Workload, _check_int, dtype_bytes

__all__ = [
  "synthetic",
  "transformer_step",
  "tp_chain",
  "attention",
  "tail_effect",
  "random_workload",
  "large_step",
]


def synthetic(
  gemms: Sequence,
  collectives: Sequence = (),
  *,
  dtype: str = "bf16",
  group_size: int = 8,
  name: str = "synthetic",
) -> Workload:
  """GEMMs on stream 0 beside collectives on stream 1, all launched at the start.

  Args:
    gemms: (m, n, k) tuples or :class:`Kernel` objects, run in order on stream 0.
    collectives: (kind, bytes) tuples or :class:`Collective` objects, run in order on
      stream 1 from the start.
    dtype: GEMM element type.
    group_size: devices per collective group.
    name: workload name.

  Returns:
    A Workload whose items are the collectives then the GEMMs.

  Example:
    >>> wl = synthetic([(8192, 8192, 4096)], [("all-gather", 256 << 20)])
  """
  if isinstance(gemms, (str, bytes)) or not isinstance(gemms, Sequence):
    raise TypeError(f"sim.synthetic: gemms must be a list of (m, n, k), got {gemms!r}")
  items: list = []
  for i, c in enumerate(collectives):
    if isinstance(c, Collective):
      items.append(c)
      continue
    if not (isinstance(c, (tuple, list)) and len(c) == 2):
      raise TypeError(f"sim.synthetic: collectives[{i}] must be (kind, bytes), got {c!r}")
    items.append(Collective(f"{c[0]}.{i}", c[0], c[1], group_size=group_size, stream=1))
  for i, g in enumerate(gemms):
    if isinstance(g, Kernel):
      items.append(g)
      continue
    if not (isinstance(g, (tuple, list)) and len(g) == 3):
      raise TypeError(f"sim.synthetic: gemms[{i}] must be (m, n, k), got {g!r}")
    items.append(Kernel.gemm(f"gemm.{i}", *g, dtype=dtype))
  return Workload(tuple(items), name)


def _fusion(
  name: str, elements: float, dtype: str, *, reads: int = 2, stream: int = 0, after=()
) -> Kernel:
  """A memory-bound elementwise fusion: 256 threads, 8 elements per thread."""
  threads, per_thread = 256, 8
  grid = max(1, int(-(-elements // (threads * per_thread))))
  return Kernel(
    name,
    grid=grid,
    threads=threads,
    regs=32,
    smem=0,
    flops=4.0 * elements,
    bytes=(reads + 1) * elements * dtype_bytes(dtype),
    stream=stream,
    after=tuple(after),
    kind="fusion",
    dtype=dtype,
  )


def attention(
  name: str,
  tokens: int,
  d: int,
  seq: int,
  *,
  dtype: str = "bf16",
  backward: bool = False,
  stream: int = 0,
  after=(),
) -> Kernel:
  """A fused (flash) attention kernel, FlashAttention-2 style launch configuration.

  128 threads (4 warps) per block, one block per 128 queries and head (head dim 128),
  ~200 registers per thread and 64 KB of shared memory for the K/V tiles, so two blocks
  share an SM on A100/H100 (Dao, "FlashAttention-2", 2023; its kernel traits for
  head dim 128). Causal: ``2 * tokens * seq * d`` flops forward (half of the full
  ``4 * tokens * seq * d``); backward 2.5 times that.
  """
  for field, value in (("tokens", tokens), ("d", d), ("seq", seq)):
    _check_int("sim.attention", field, value, 1)
  heads = max(1, d // 128)
  grid = max(1, -(-tokens // 128)) * heads
  flops = 2.0 * tokens * seq * d * (2.5 if backward else 1.0)
  elt = dtype_bytes(dtype)
  nbytes = (8 if backward else 4) * tokens * d * elt
  return Kernel(
    name,
    grid=grid,
    threads=128,
    regs=200,
    smem=64 * 1024,
    flops=flops,
    bytes=nbytes,
    stream=stream,
    after=tuple(after),
    kind="custom",
    dtype=dtype,
    efficiency=0.6,
  )


def tp_chain(
  n: int = 6,
  m: int = 8192,
  d: int = 8192,
  *,
  group_size: int = 8,
  dtype: str = "bf16",
  lag: int | None = None,
  kernel=None,
  name: str | None = None,
) -> Workload:
  """Tensor-parallel chain: GEMM i's output is reduce-scattered while GEMM i+1 runs.

  Each reduce-scatter waits (event) for its GEMM; the next GEMM reaches the dispatcher
  first (same-stream launch is faster than a cross-stream event), so without priority the
  reduce-scatter's CTAs wait until that GEMM has placed all its blocks. With ``lag``, GEMM
  ``i + lag`` consumes reduce-scatter ``i`` (the collective is on the critical path).
  ``kernel(i)`` may supply the compute kernel instead of a GEMM (named ``<its name>.<i>``).
  """
  for field, value in (("n", n), ("m", m), ("d", d), ("group_size", group_size)):
    _check_int("sim.tp_chain", field, value, 1)
  if lag is not None:
    _check_int("sim.tp_chain", "lag", lag, 0)
  elt = dtype_bytes(dtype)
  items: list = []
  for i in range(n):
    after = (f"rs.{i - lag}",) if lag and i - lag >= 0 else ()
    if kernel is not None:
      k = kernel(i)
      items.append(dataclasses.replace(k, name=f"{k.name}.{i}", after=after))
    else:
      items.append(Kernel.gemm(f"gemm.{i}", m, d, d, dtype=dtype, after=after))
    items.append(
      Collective(
        f"rs.{i}",
        "reduce-scatter",
        m * d * elt,
        group_size=group_size,
        stream=1,
        after=(items[-1].name,),
      )
    )
  return Workload(tuple(items), name or f"tp_chain_{n}x{m}x{d}")


def transformer_step(
  layers: int = 4,
  d: int = 4096,
  tokens: int = 4096,
  *,
  group_size: int = 8,
  dtype: str = "bf16",
  backward: bool = True,
  seq: int = 2048,
  name: str | None = None,
) -> Workload:
  """An FSDP transformer step: prefetched all-gathers forward, reduce-scatters backward.

  Args:
    layers: transformer layers.
    d: model width.
    tokens: tokens per device (batch x sequence).
    group_size: FSDP group size.
    dtype: element type.
    backward: include the backward pass.
    seq: attention context length (causal flash attention after the QKV GEMM).
    name: workload name.

  Returns:
    A Workload on two streams (0 compute, 1 communication).
  """
  counts = (
    ("layers", layers),
    ("d", d),
    ("tokens", tokens),
    ("seq", seq),
    ("group_size", group_size),
  )
  for field, value in counts:
    _check_int("sim.transformer_step", field, value, 1)
  elt = dtype_bytes(dtype)
  wbytes = 12 * d * d * elt
  items: list = []
  shapes = [
    ("qkv", tokens, 3 * d, d),
    ("attn_out", tokens, d, d),
    ("mlp_up", tokens, 4 * d, d),
    ("mlp_down", tokens, d, 4 * d),
  ]
  items.append(Collective("ag.0", "all-gather", wbytes, group_size=group_size, stream=1))
  for layer in range(layers):
    if layer + 1 < layers:
      items.append(
        Collective(f"ag.{layer + 1}", "all-gather", wbytes, group_size=group_size, stream=1)
      )
    first = True
    for s, m, n, k in shapes:
      after = (f"ag.{layer}",) if first else ()
      items.append(Kernel.gemm(f"fwd{layer}.{s}", m, n, k, dtype=dtype, after=after))
      first = False
      if s in ("qkv", "mlp_up"):
        items.append(_fusion(f"fwd{layer}.{s}.act", tokens * n, dtype))
      if s == "qkv":
        items.append(attention(f"fwd{layer}.attn", tokens, d, seq, dtype=dtype))
  if backward:
    # FSDP re-gathers each layer's weights for its backward (reshard after forward) and
    # reduce-scatters its gradients; both queue on the one communication stream.
    for layer in reversed(range(layers)):
      if layer > 0:
        items.append(
          Collective(f"agb.{layer - 1}", "all-gather", wbytes, group_size=group_size, stream=1)
        )
      for s, m, n, k in reversed(shapes):
        after = (f"agb.{layer}",) if (s == "mlp_down" and layer < layers - 1) else ()
        items.append(Kernel.gemm(f"bwd{layer}.{s}.dx", m, k, n, dtype=dtype, after=after))
        items.append(Kernel.gemm(f"bwd{layer}.{s}.dw", k, n, m, dtype=dtype))
        if s in ("qkv", "mlp_up"):
          items.append(_fusion(f"bwd{layer}.{s}.act", tokens * n, dtype))
        if s == "attn_out":
          items.append(attention(f"bwd{layer}.attn", tokens, d, seq, dtype=dtype, backward=True))
      items.append(
        Collective(
          f"rs.{layer}",
          "reduce-scatter",
          wbytes,
          group_size=group_size,
          stream=1,
          after=(items[-1].name,),
        )
      )
  return Workload(tuple(items), name or f"transformer_{layers}x{d}_T{tokens}")


def tail_effect(
  gpu_sms: int = 132, channels: int = 24, *, k: int = 8192, comm_bytes: float = 1 << 30
) -> Workload:
  """One wave of GEMM blocks (one per SM) launched just after a long all-gather.

  The all-gather's CTAs take ``channels`` SMs first, so the GEMM's last blocks wait for a
  second wave (the "tail effect" seen on H100, BACKGROUND section 2).
  """
  _check_int("sim.tail_effect", "gpu_sms", gpu_sms, 12)
  _check_int("sim.tail_effect", "channels", channels, 1)
  _check_int("sim.tail_effect", "k", k, 1)
  n_tiles = gpu_sms
  # Hopper 128x256 tiles: a (128 * 12) x (256 * 11) GEMM is 132 tiles.
  m, n = 128 * 12, 256 * (n_tiles // 12)
  items = (
    Collective("all-gather", "all-gather", comm_bytes, channels=channels, stream=1),
    Kernel.gemm("gemm", m, n, k),
  )
  return Workload(items, "tail_effect")


def random_workload(
  seed: int, *, n_items: int = 8, max_grid: int = 400, streams: int = 3
) -> Workload:
  """A small random workload (tests): kernels with random launch configurations that fit."""
  for field, value in (("n_items", n_items), ("max_grid", max_grid), ("streams", streams)):
    _check_int("sim.random_workload", field, value, 1)
  rng = _random.Random(seed)
  items: list = []
  for i in range(n_items):
    s = rng.randrange(streams)
    earlier = [it.name for it in items if it.stream != s]
    after = tuple(rng.sample(earlier, min(len(earlier), rng.randrange(2)))) if earlier else ()
    if rng.random() < 0.25:
      items.append(
        Collective(
          f"c{i}",
          rng.choice(
            ["all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"]
          ),
          rng.choice([1 << 16, 1 << 20, 1 << 24]),
          channels=rng.randrange(1, 33),
          stream=s,
          after=after,
        )
      )
    else:
      threads = rng.choice([32, 64, 128, 256, 384, 512, 1024])
      items.append(
        Kernel(
          f"k{i}",
          grid=rng.randrange(1, max_grid + 1),
          threads=threads,
          regs=rng.choice([16, 32, 64, 128]) if threads <= 512 else 32,
          smem=rng.choice([0, 1024, 16384, 40000, 60000]),
          flops=rng.uniform(0, 1e10),
          bytes=rng.uniform(0, 1e8),
          stream=s,
          after=after,
          kind=rng.choice(["gemm", "fusion", "reduction"]),
        )
      )
  return Workload(tuple(items), f"random{seed}")


def large_step(
  n_kernels: int = 2000, blocks: int = 1_000_000, *, comm_every: int = 20, seed: int = 0
) -> Workload:
  """A step of ``n_kernels`` kernels with about ``blocks`` blocks in all (speed benchmark).

  A mix of GEMM-like kernels (1 block/SM tiles) and elementwise fusions, with a collective on
  stream 1 every ``comm_every`` kernels that the kernel ``comm_every`` later waits for.
  """
  for field, value in (("n_kernels", n_kernels), ("blocks", blocks), ("comm_every", comm_every)):
    _check_int("sim.large_step", field, value, 1)
  rng = _random.Random(seed)
  per = blocks / n_kernels
  items: list = []
  waits: dict[int, str] = {}
  for i in range(n_kernels):
    after = (waits.pop(i),) if i in waits else ()
    if i % comm_every == 0:
      c = Collective(f"c{i}", rng.choice(["all-gather", "reduce-scatter"]), 32 << 20, stream=1)
      items.append(c)
      waits[i + comm_every - 1] = c.name
    if i % 3 == 0:
      grid = max(1, int(rng.uniform(0.5, 1.5) * per))
      items.append(
        Kernel(
          f"k{i}",
          grid=grid,
          threads=384,
          regs=168,
          smem=200 * 1024,
          flops=grid * 2.0 * 128 * 256 * 512,
          bytes=grid * 2e5,
          kind="gemm",
          after=after,
        )
      )
    else:
      grid = max(1, int(rng.uniform(0.5, 1.5) * per))
      items.append(
        Kernel(
          f"k{i}",
          grid=grid,
          threads=256,
          regs=32,
          smem=0,
          flops=grid * 4096.0,
          bytes=grid * 4096 * 6.0,
          kind="fusion",
          after=after,
        )
      )
  return Workload(tuple(items), f"large_{n_kernels}_{blocks}")
