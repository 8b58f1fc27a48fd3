"""Cost model (:func:`estimate_gain`), the analysis's own
(:mod:`jax_overlap._src.analysis.cost_model`: roofline kernels with achievable fractions
of peak, alpha-beta collectives at the achievable link bandwidth, a launch overhead per
kernel), for ``y = x @ w`` with global shapes
``x: (m, k)``, ``w: (k, n)`` on an axis of ``N`` devices:

* per-device GEMM ``T_c = kernel_time(2 m k n / N, B)`` with ``B`` the bytes the
  per-device GEMM reads and writes;
* collective ``T_x = collective_time(all-gather or reduce-scatter, N s, N)`` with ``s``
  the bytes of one device's block (``m k / N`` elements gathered, or ``m n / N``
  scattered): what XLA's NCCL collective costs in the analysis;
* baseline (no overlap) ``T_c + T_x``; ring ``t + (N - 1) max(t, e)`` with
  ``t = p kernel_time(2 m k n / N^2 / p, B / N / p)`` the step's ``p`` partial dots and
  ``e = collective_time(collective-permute, s / d, N)`` the neighbour exchange, ``d = 2``
  for the bidirectional ring (each half travels on its own link direction);
* in pieces (``method="pieces"``), pieces of fractions ``f_0 .. f_{c-1}`` of the block
  (equal, or the sizes ``chunks`` gives): ``t_j`` the dots of piece ``j``, ``e_j`` its
  collective (``N s f_j`` bytes). A gather: ``e_0 + sum_{j<c-1} max(t_j, e_{j+1}) +
  t_{c-1}``: the first gather is exposed, each later one travels beside the previous
  piece's dots. A reduce-scatter, mirrored: ``t_0 + sum_{j>0} max(t_j, e_{j-1}) +
  e_{c-1}``. Equal pieces give ``t + e + (c - 1) max(t, e)``; a small first gather (last
  reduce-scatter) and growing (shrinking) pieces expose less with fewer collectives;
* the copies a decomposition adds on the compute stream (``copies_s``, in
  ``overlapped_s``), each a memory-bound kernel that reads and writes its bytes: the
  slices a gather's pieces are cut into, the outputs put in device order, the gathered
  value put in order when it is also kept (``collect``), a reduce-scatter's operand cut
  into its slices and its pieces' outputs joined.

The exchange of a ring step is an NCCL send/recv, which NCCL runs on a few of its
channels (4 of 24 for a 16 MiB step on 8 H100s, ``analysis/nccl.py``), so at the analysis's
per-channel rate a large step travels well below the link's bandwidth; a piece is an NCCL
all-gather or reduce-scatter on all of them. Where steps are large the pieces win.

The link numbers come from :mod:`jax_overlap.targets` (the catalogue cites
NVIDIA/AMD datasheets and NCCL's tuning defaults).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from jax_overlap._src import deprecations
from jax_overlap._src import targets as _targets
from jax_overlap._src.analysis import cost_model as _cost

# How a collective matmul is decomposed (glossary: `method`).
Method = Literal["ring", "pieces"]

# The simulator's short dtype names (glossary: `dtype`).
_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}


@dataclasses.dataclass(frozen=True)
class GainEstimate:
  """What :func:`estimate_gain` predicts for one collective matmul.

  Attributes:
    compute_s: per-device GEMM time (roofline).
    comm_s: time of the collective alone (ring, alpha-beta).
    baseline_s: collective then GEMM, no overlap.
    overlapped_s: the ring of partial dots (or the pieces), its copies included.
    speedup: ``baseline_s / overlapped_s``.
    worthwhile: whether ``speedup`` reaches the ``min_speedup`` asked for.
    copies_s: the copy kernels the decomposition adds (part of ``overlapped_s``).
  """

  compute_s: float
  comm_s: float
  baseline_s: float
  overlapped_s: float
  speedup: float
  worthwhile: bool
  copies_s: float = 0.0


@deprecations.keyword_only("dtype", "target", api="jax_overlap.collective_matmul.estimate_gain")
def estimate_gain(
  m: int,
  n: int,
  k: int,
  axis_size: int,
  *,
  dtype: Any = "bfloat16",
  target: Any = "h100x8",
  kind: Literal["all_gather", "reduce_scatter"] = "all_gather",
  bidirectional: bool = True,
  chunks: int | Sequence[int] | None = None,
  launch_overhead_s: float | None = None,
  min_speedup: float = 1.05,
  cost_model: _cost.CostModel | None = None,
  method: Method = "ring",
  collect: bool = False,
) -> GainEstimate:
  """Predicts the gain of a collective matmul over a collective followed by a GEMM.

  The formulas are in the module docstring: the analysis's roofline and alpha-beta costs
  (:class:`~jax_overlap.analysis.CostModel`), and a ring of ``axis_size`` steps each
  costing the larger of its partial dots and its neighbour exchange.

  Args:
    m: rows of the global ``x`` (e.g. batch x sequence).
    n: columns of the global ``w``.
    k: the contracting dimension.
    axis_size: devices on the tensor-parallel axis.
    dtype: element type of the operands (name or dtype).
    target: topology name or object from :mod:`jax_overlap.targets`.
    kind: ``"all_gather"`` (``x`` is gathered, ``m k`` elements move) or
      ``"reduce_scatter"`` (the ``m n`` output is scattered).
    bidirectional: whether the ring uses both link directions.
    chunks: pieces per block (as in :func:`all_gather_matmul`); for ``"pieces"`` also the
      pieces' relative sizes in issue order (e.g. ``(1, 1, 2, 4)``).
    launch_overhead_s: fixed cost of every kernel (None: the cost model's
      ``kernel_overhead_s``).
    min_speedup: the speedup at which ``worthwhile`` becomes true.
    cost_model: efficiencies (None: the analysis's defaults).
    method: ``"ring"`` (neighbour exchanges: NCCL send/recv on a few channels) or
      ``"pieces"`` (the collective issued as ``chunks`` collectives of a slice of every
      block, default ``axis_size``, each on all of NCCL's channels; the first gather or
      the last reduce-scatter is not hidden).
    collect: the gathered value is also kept (a gather's: the backward's weight gradient
      needs it), so the decomposition puts it in order too.

  Returns:
    A :class:`GainEstimate`.

  Raises:
    ValueError: for non-positive sizes, an unknown ``kind`` or target.

  Example:
    >>> est = estimate_gain(8192, 8192, 8192, 8, dtype="bfloat16", target="h100x8")
    >>> est.speedup > 1.0
    True
  """
  api = "estimate_gain"
  for name, v in (("m", m), ("n", n), ("k", k), ("axis_size", axis_size)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{api}: {name} must be a positive int, got {v!r}")
  if kind not in ("all_gather", "reduce_scatter"):
    raise ValueError(f"{api}: kind must be 'all_gather' or 'reduce_scatter', got {kind!r}")
  if method not in ("ring", "pieces"):
    raise ValueError(f"{api}: method must be 'ring' or 'pieces', got {method!r}")
  model = cost_model or _cost.CostModel()
  if launch_overhead_s is not None:
    model = dataclasses.replace(model, kernel_overhead_s=launch_overhead_s)
  topo = _targets.get(target)
  gpu = topo.gpu
  np_dtype = jnp.dtype(_DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
  itemsize = np_dtype.itemsize
  dname = np_dtype.name
  short = {v: k for k, v in _DTYPE_NAMES.items()}
  dt = short.get(dname, dname)
  big_n = int(axis_size)
  fractions = _fractions(api, chunks, method, big_n)

  def gemm(flops, nbytes):
    return _cost.kernel_time(flops, nbytes, gpu, dtype=dt, is_dot=True, cost_model=model)

  def copy(nbytes):  # a memory-bound kernel that reads and writes nbytes
    return _cost.kernel_time(0.0, 2.0 * nbytes, gpu, dtype=dt, cost_model=model)

  flops = 2.0 * m * n * k / big_n
  if kind == "all_gather":  # reads the gathered x, its w columns; writes its y columns
    gemm_bytes = (m * k + (k * n + m * n) / big_n) * itemsize
  else:  # reads its x columns and w rows; writes a full partial y
    gemm_bytes = ((m * k + k * n) / big_n + m * n) * itemsize
  compute = gemm(flops, gemm_bytes)
  block = (m * k if kind == "all_gather" else m * n) / big_n * itemsize
  coll = "all-gather" if kind == "all_gather" else "reduce-scatter"
  comm = _cost.collective_time(coll, block * big_n, big_n, topo, cost_model=model)
  baseline = compute + comm
  out_local = m * n / big_n * itemsize  # this device's output columns (or rows)
  x_local = m * k / big_n * itemsize  # this device's block of x (or its columns)
  copies = 0.0
  if big_n == 1:
    overlapped = compute
  elif method == "pieces":
    t = [gemm(flops * f, gemm_bytes * f) for f in fractions]
    e = [
      _cost.collective_time(coll, block * big_n * f, big_n, topo, cost_model=model)
      for f in fractions
    ]
    c = len(fractions)
    if kind == "all_gather":
      overlapped = e[0] + sum(max(t[j], e[j + 1]) for j in range(c - 1)) + t[-1]
      if c > 1:  # one piece is the plain all-gather: nothing cut, nothing put in order
        copies = sum(copy(x_local * f) for f in fractions) + copy(out_local)
        if collect:
          copies += copy(m * k * itemsize)
    else:
      overlapped = t[0] + sum(max(t[j], e[j - 1]) for j in range(1, c)) + e[-1]
      if c > 1:
        copies = copy(x_local) + copy(out_local)
  else:
    pieces = chunks or (2 if bidirectional else 1)  # of each ring step's block
    step = pieces * gemm(flops / big_n / pieces, gemm_bytes / big_n / pieces)
    half = 2.0 if bidirectional else 1.0
    exchange = _cost.collective_time(
      "collective-permute", block / half, big_n, topo, cost_model=model
    )
    overlapped = step + (big_n - 1) * max(step, exchange)
    if kind == "all_gather":  # the steps' outputs (and x if kept) put in order
      copies = copy(out_local) + (copy(m * k * itemsize) if collect else 0.0)
    else:  # each step's rows of x cut out
      copies = big_n * pieces * copy(x_local / big_n / pieces)
  overlapped += copies
  speedup = baseline / overlapped
  return GainEstimate(
    compute_s=compute,
    comm_s=comm,
    baseline_s=baseline,
    overlapped_s=overlapped,
    speedup=speedup,
    worthwhile=speedup >= min_speedup,
    copies_s=copies,
  )


def _fractions(api: str, chunks, method: str, axis_size: int) -> list[float]:
  """The pieces' fractions of the block (``method="pieces"``; default ``axis_size`` equal
  pieces), or ``[]`` for a ring."""
  if method != "pieces":
    if chunks is not None and (
      isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1
    ):
      raise ValueError(f"{api}: chunks must be a positive int for a ring, got {chunks!r}")
    return []
  if chunks is None:
    return [1.0 / axis_size] * axis_size
  if isinstance(chunks, (int, np.integer)) and not isinstance(chunks, bool) and chunks >= 1:
    return [1.0 / int(chunks)] * int(chunks)
  sizes = list(chunks) if isinstance(chunks, (list, tuple)) else None
  if not sizes or any(
    isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or v <= 0
    for v in sizes
  ):
    raise ValueError(
      f"{api}: chunks must be a positive int or a sequence of the pieces' positive relative "
      f"sizes, got {chunks!r}"
    )
  total = float(sum(sizes))
  return [float(v) / total for v in sizes]
