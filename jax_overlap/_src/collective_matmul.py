"""Collective matmuls: a tensor-parallel all-gather or reduce-scatter as a ring of partial dots.

A tensor-parallel layer either all-gathers its input before a matmul
(``all_gather(x) @ w``) or reduce-scatters the matmul's partial sums after it
(``psum_scatter(x @ w)``). Issued as one collective, the communication cannot
overlap the matmul that depends on it. Split into ``N - 1`` neighbour
exchanges (``ppermute``) around the ring of the ``N`` devices on the axis,
each exchange is independent of the partial dot computed next to it, and the
latency-hiding scheduler can run them concurrently:

* :func:`all_gather_matmul`: every step multiplies the row block of ``x`` that
  the device holds by ``w`` and passes the block on to its neighbour; after
  ``N`` steps every row block has visited every device.
* :func:`matmul_reduce_scatter`: every step computes the partial product of
  one output row block, adds it to the partial sum received from the
  neighbour and passes the sum on; after ``N`` steps each device holds the
  full sum of its own block.

* :func:`all_gather_dot_generals`: the general form of the first, for what
  tensor- and sequence-parallel code writes: an N-D activation gathered along
  any free dimension (the sequence), ``dot_general``s with batch dimensions,
  one gather feeding several matmuls, the gathered value also returned (the
  backward pass needs it for the weight gradient). JAX differentiates it; the
  transpose of the ring is the reverse ring. ``@overlap`` uses it for every
  such gather the cost model (or ``collective_matmul="on"``) lets through.

A gather ring's results arrive in ring order (the block held at each step, which
depends on the device); they are kept as they come and put in the gathered order
once, by one gather per output that XLA fuses into the neighbouring loop (its
transpose is the inverse gather), rather than copied slice by slice into a buffer.

The bidirectional variants split each block into halves that travel in
opposite directions, using both directions of every link; ``chunks`` splits a
block into more pieces for finer-grained overlap. Both functions have
custom VJPs whose backward passes are again collective matmuls: the transpose
of an all-gather-matmul is a matmul-reduce-scatter and vice versa.

Cost model (:func:`estimate_gain`), the analysis's own (:mod:`.cost_model`: roofline
kernels with achievable fractions of peak, alpha-beta collectives at the achievable link
bandwidth, a launch overhead per kernel), for ``y = x @ w`` with global shapes
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
* in pieces (``method="pieces"``): ``t + e + (c - 1) max(t, e)`` with ``t`` the dots of
  one of the ``c`` pieces and ``e`` the collective of one piece (``N s / c`` bytes): the
  first gather (or the last reduce-scatter) is exposed, the rest hide behind dots.

The exchange of a ring step is an NCCL send/recv, which NCCL runs on a few of its
channels (4 of 24 for a 16 MiB step on 8 H100s, ``nccl.py``), so at the analysis's
per-channel rate a large step travels well below the link's bandwidth; a piece is an NCCL
all-gather or reduce-scatter on all of them. Where steps are large the pieces win.

The link numbers come from :mod:`jax_overlap.targets` (the catalogue cites
NVIDIA/AMD datasheets and NCCL's tuning defaults).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap._src import cost_model as _cost
from jax_overlap._src import deprecations
from jax_overlap._src import targets as _targets

__all__ = [
  "GainEstimate",
  "all_gather_dot_generals",
  "all_gather_matmul",
  "dot_general_reduce_scatter",
  "estimate_gain",
  "matmul_reduce_scatter",
]

AxisName = str | tuple[str, ...]
# The simulator's short dtype names (glossary: `dtype`).
_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


def _axis_size(api: str, axis) -> int:
  if isinstance(axis, (tuple, list)):
    if len(axis) != 1:
      raise ValueError(f"{api}: axis must be a single mesh axis name for the ring, got {axis!r}")
    axis = axis[0]
  if not isinstance(axis, str):
    raise TypeError(f"{api}: axis must be a mesh axis name (str), got {axis!r}")
  try:
    return int(lax.axis_size(axis))
  except NameError:
    raise ValueError(
      f"{api}: axis {axis!r} is not bound here; call it inside a shard_map body whose mesh "
      "has that axis"
    ) from None


def _check_operands(api: str, x, w, x_desc: str) -> None:
  for name, v in (("x", x), ("w", w)):
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
      raise TypeError(f"{api}: {name} must be an array, got {type(v).__name__}")
  if np.ndim(x) != 2 or np.ndim(w) != 2:
    raise ValueError(
      f"{api}: x and w must both be rank 2 ({x_desc} and (k, n)), got x with shape "
      f"{tuple(x.shape)} and w with shape {tuple(w.shape)}"
    )
  if x.shape[1] != w.shape[0]:
    raise ValueError(
      f"{api}: the contracting dimensions must match: x.shape[1] ({x.shape[1]}) != "
      f"w.shape[0] ({w.shape[0]})"
    )


def _directions(api: str, rows: int, what: str, bidirectional: bool, chunks) -> tuple[int, ...]:
  if chunks is None:
    chunks = 2 if bidirectional else 1
  if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
    raise ValueError(f"{api}: chunks must be a positive int, got {chunks!r}")
  if bidirectional and chunks % 2:
    raise ValueError(
      f"{api}: chunks must be even with bidirectional=True (half the pieces go each way), "
      f"got {chunks}"
    )
  if rows % chunks:
    raise ValueError(
      f"{api}: {what} ({rows}) must be divisible by the number of ring pieces chunks={chunks}"
    )
  if bidirectional:
    return (1,) * (chunks // 2) + (-1,) * (chunks // 2)
  return (1,) * int(chunks)


def _perm(n: int, direction: int) -> list[tuple[int, int]]:
  return [(i, (i + direction) % n) for i in range(n)]


def _dot(a, b, precision, preferred):
  return jnp.dot(a, b, precision=precision, preferred_element_type=preferred)


def _step_dot(a, b, precision, preferred):
  """A ring step's partial dot, kept separate from the other steps' dots.

  XLA's GPU dot merger (``xla_gpu_dot_merger_threshold_mb``) joins dots that
  share an operand, which would turn the ring's partial dots back into one
  GEMM after every exchange. Passing ``b`` through an optimization barrier
  with this step's ``a`` gives every step its own operand.
  """
  a, b = lax.optimization_barrier((a, b))
  return _dot(a, b, precision, preferred)


# ---------------------------------------------------------------------------
# The rings.
# ---------------------------------------------------------------------------


def _ag_ring(x, w, axis, n, dirs, precision, preferred, collect):
  """``all_gather(x) @ w`` as a ring; also the gathered ``x`` if ``collect``."""
  d = lax.axis_index(axis)
  m_loc = x.shape[0]
  p = m_loc // len(dirs)
  pieces = [x[j * p : (j + 1) * p] for j in range(len(dirs))]
  out_dtype = jnp.result_type(x.dtype, w.dtype) if preferred is None else preferred
  parts, held = [], []
  for s in range(n):
    # Issue the next exchange before this step's dots: they are independent.
    nxt = (
      [lax.ppermute(pc, axis, _perm(n, dj)) for pc, dj in zip(pieces, dirs)] if s < n - 1 else None
    )
    for pc in pieces:
      parts.append(_step_dot(pc, w, precision, preferred).astype(out_dtype))
      held.append(pc)
    pieces = nxt
  order, inverse = _ring_order(n, d, dirs)
  y = _in_gathered_order(parts, order, inverse, 0)
  xf = _in_gathered_order(held, order, inverse, 0) if collect else None
  return y, xf


def _rs_ring(x, w, axis, n, dirs, precision, preferred):
  """``psum_scatter(x @ w, scatter_dimension=0, tiled=True)`` as a ring."""
  d = lax.axis_index(axis)
  m_loc = x.shape[0] // n
  p = m_loc // len(dirs)

  def part(step, j, dj):
    # The partial sum passing through this device at `step` ends, after the
    # remaining hops, on device d + dj * (n - 1 - step) == d - dj * (1 + step).
    row = ((d - dj * (1 + step)) % n) * m_loc + j * p
    return _step_dot(lax.dynamic_slice_in_dim(x, row, p, axis=0), w, precision, preferred)

  accs = [part(0, j, dj) for j, dj in enumerate(dirs)]
  for s in range(1, n):
    sent = [lax.ppermute(a, axis, _perm(n, dj)) for a, dj in zip(accs, dirs)]
    accs = [snt + part(s, j, dj) for j, (snt, dj) in enumerate(zip(sent, dirs))]
  return accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=0)


def _ring_order(n: int, d, dirs) -> tuple[jax.Array, jax.Array]:
  """Where each chunk of a ring's output comes from, and its inverse.

  A gather ring holds, at step ``s``, piece ``j`` (sent in direction ``dirs[j]``) of
  device ``d - dirs[j] * s``'s block. Concatenated in ring order (step, piece), chunk
  ``s * len(dirs) + j``; in the gathered order (block, piece), chunk ``b * len(dirs) + j``.
  Returns ``order`` (gathered chunk -> ring chunk) and ``inverse``.
  """
  count = len(dirs)
  k = jnp.arange(n * count, dtype=jnp.int32)
  b, j = k // count, k % count
  dj = jnp.asarray(dirs, jnp.int32)[j]
  d = jnp.asarray(d, jnp.int32)
  order = ((dj * (d - b)) % n) * count + j
  s = b  # read k as a ring chunk: step b, piece j
  inverse = ((d - dj * s) % n) * count + j
  return order, inverse


def _chunks(x, count: int, axis: int):
  shape = x.shape
  return x.reshape(shape[:axis] + (count, shape[axis] // count) + shape[axis + 1 :])


def _in_gathered_order(chunks: list, order, inverse, axis: int):
  """A ring's chunks (in ring order) as one array in the gathered order."""
  return _take_chunks(jnp.concatenate(chunks, axis=axis), order, inverse, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _take_chunks(x, order, inverse, axis: int):
  """Chunk ``order[k]`` of ``x`` (split along ``axis`` into ``len(order)``) as chunk ``k``.

  One gather, which XLA fuses into the loop that consumes (or produces) it; its
  transpose is the same gather with the inverse permutation, not a scatter.
  """
  return _gather_chunks(x, order, axis)


def _gather_chunks(x, order, axis: int):
  y = jnp.take(_chunks(x, order.shape[0], axis), order, axis=axis, unique_indices=True, mode="clip")
  return y.reshape(x.shape)


def _take_chunks_fwd(x, order, inverse, axis):
  return _gather_chunks(x, order, axis), (order, inverse)


def _take_chunks_bwd(axis, res, ct):
  order, inverse = res
  return (_gather_chunks(ct, inverse, axis), None, None)


_take_chunks.defvjp(_take_chunks_fwd, _take_chunks_bwd)


def _out_dim(ndim_x: int, ndim_w: int, x_is_lhs: bool, dn, gather_dim: int) -> int:
  """Where ``gather_dim`` of ``x`` lands in ``dot_general``'s output (batch dims, then the
  lhs's free dims, then the rhs's, each in order)."""
  (lc, rc), (lb, rb) = dn
  xc, xb = (lc, lb) if x_is_lhs else (rc, rb)
  wc, wb = (rc, rb) if x_is_lhs else (lc, lb)
  x_free = [d for d in range(ndim_x) if d not in xc and d not in xb]
  w_free = [d for d in range(ndim_w) if d not in wc and d not in wb]
  pos = x_free.index(gather_dim)
  return len(xb) + (pos if x_is_lhs else len(w_free) + pos)


def all_gather_dot_generals(
  x,
  dots,
  *,
  axis: str,
  gather_dim: int,
  collect: bool = False,
  bidirectional: bool = False,
  method: str = "ring",
  pieces: int | None = None,
):
  """``all_gather(x, axis, axis=gather_dim, tiled=True)`` fed to several ``dot_general``s, as
  one ppermute ring: each step sends this device's current block on and computes every
  dot's slice for the block it holds.

  The general form of :func:`all_gather_matmul` for what tensor- and sequence-parallel
  code writes: N-D activations gathered along any free dimension (the sequence), dots with
  batch dimensions, one gather feeding several matmuls (separate Q/K/V, gate/up), the
  gathered value needed elsewhere too (``collect``). Differentiated by JAX: the
  transpose of the ring is the reverse ring.

  Args:
    x: this device's block of the gathered value.
    dots: one ``(w, x_is_lhs, dimension_numbers, precision, preferred_element_type,
      out_shape, out_dtype)`` per dot, with ``dimension_numbers`` as for the gathered value
      and ``out_shape`` the full dot output's.
    axis: the mesh axis of the gather.
    gather_dim: the dimension of ``x`` gathered; must be free (neither contracting nor
      batch) in every dot.
    collect: also return the gathered value.
    bidirectional: split the block in halves sent in opposite directions (both link
      directions); the block's size along ``gather_dim`` must be even.
    method: ``"ring"`` (neighbour exchanges, NCCL send/recv) or ``"pieces"``: the
      all-gather issued as ``pieces`` all-gathers of a slice of every block each, one
      after the other, each piece's dots running while the next piece travels. A piece
      is an NCCL all-gather, on all of the collective's channels, where a ring step is a
      send/recv on a few (see ``nccl.py``).
    pieces: all-gathers of the ``"pieces"`` method (default: the axis size); must divide
      the block along ``gather_dim``.

  Returns:
    (list of the dots' outputs, the gathered value or None).
  """
  if method == "pieces":
    return _ag_pieces(x, dots, axis, gather_dim, collect, pieces)
  if method != "ring":
    raise ValueError(f"all_gather_dot_generals: method must be 'ring' or 'pieces', got {method!r}")
  n = int(lax.axis_size(axis))
  d = lax.axis_index(axis)
  m = x.shape[gather_dim]
  pos = [_out_dim(x.ndim, w.ndim, lhs, dn, gather_dim) for (w, lhs, dn, *_) in dots]
  dirs = (1, -1) if bidirectional else (1,)
  if m % len(dirs):
    raise ValueError(
      f"all_gather_dot_generals: a bidirectional ring needs an even block along dimension "
      f"{gather_dim}, got {m}"
    )
  p = m // len(dirs)
  pieces = [lax.slice_in_dim(x, j * p, (j + 1) * p, axis=gather_dim) for j in range(len(dirs))]
  # Each step's slices in ring order (step, piece); put in order once at the end.
  parts: list[list] = [[] for _ in dots]
  held: list = []
  for s in range(n):
    nxt = (
      [lax.ppermute(pc, axis, _perm(n, dj)) for pc, dj in zip(pieces, dirs)] if s < n - 1 else None
    )
    for piece in pieces:
      for j, (w, lhs, dn, precision, preferred, _, dtype) in enumerate(dots):
        a, b = lax.optimization_barrier((piece, w))  # one dot per step (see _step_dot)
        part = lax.dot_general(
          a if lhs else b,
          b if lhs else a,
          dn,
          precision=precision,
          preferred_element_type=preferred,
        )
        parts[j].append(part.astype(dtype))
      if collect:
        held.append(piece)
    pieces = nxt
  order, inverse = _ring_order(n, d, dirs)
  outs = [_in_gathered_order(ps, order, inverse, od) for ps, od in zip(parts, pos)]
  full = _in_gathered_order(held, order, inverse, gather_dim) if collect else None
  return outs, full


def dot_general_reduce_scatter(
  lhs,
  rhs,
  *,
  dimension_numbers,
  axis: str,
  scatter_dim: int,
  precision=None,
  preferred_element_type=None,
  out_dtype=None,
  bidirectional: bool = False,
  method: str = "ring",
  pieces: int | None = None,
):
  """``psum_scatter(dot_general(lhs, rhs), axis, scatter_dimension=scatter_dim, tiled=True)``
  as a ppermute ring of partial dots, for N-D operands.

  The general form of :func:`matmul_reduce_scatter` (a row-parallel projection of
  sequence-parallel activations: ``[batch, seq, hidden / N] @ [hidden / N, out]`` scattered
  along the sequence). ``scatter_dim`` must be a free dimension of the output (not a batch
  dimension); the operand it comes from is sliced, one block per ring step, and the
  partial sums travel round the ring, each step adding the block this device contributes.
  Differentiated by JAX: the transpose is a gather ring. ``bidirectional`` splits each
  block in halves whose partial sums travel in opposite directions (the block must be
  even). ``method="pieces"`` issues the reduce-scatter instead as ``pieces`` (default:
  the axis size) reduce-scatters of a slice of every device's block each, one after the
  other, each running while the next slice's dot computes (NCCL collectives on all their
  channels rather than send/recv on a few).

  Returns:
    This device's block of the summed output.
  """
  if method not in ("ring", "pieces"):
    raise ValueError(
      f"dot_general_reduce_scatter: method must be 'ring' or 'pieces', got {method!r}"
    )
  n = int(lax.axis_size(axis))
  d = lax.axis_index(axis)
  (lc, rc), (lb, rb) = dimension_numbers
  l_free = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
  r_free = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
  nb = len(lb)
  if scatter_dim < nb:
    raise ValueError("dot_general_reduce_scatter: scatter_dim is a batch dimension of the dot")
  if scatter_dim < nb + len(l_free):
    slice_lhs, op_dim = True, l_free[scatter_dim - nb]
  else:
    slice_lhs, op_dim = False, r_free[scatter_dim - nb - len(l_free)]
  size = (lhs if slice_lhs else rhs).shape[op_dim]
  if size % n:
    raise ValueError(
      f"dot_general_reduce_scatter: the scattered dimension ({size}) is not divisible by the "
      f"size of axis {axis!r} ({n})"
    )
  block = size // n
  if method == "pieces":
    return _rs_pieces(
      lhs,
      rhs,
      dimension_numbers,
      axis,
      scatter_dim,
      slice_lhs,
      op_dim,
      n,
      block,
      pieces,
      precision,
      preferred_element_type,
      out_dtype,
    )
  dirs = (1, -1) if bidirectional else (1,)
  if block % len(dirs):
    raise ValueError(
      f"dot_general_reduce_scatter: a bidirectional ring needs an even block, got {block}"
    )
  p = block // len(dirs)

  def part(step, j, dj):
    # The partial sum passing through this device at `step` ends, after the remaining
    # hops, on device d - dj * (1 + step): compute that device's piece j.
    idx = ((d - dj * (1 + step)) % n) * block + j * p
    a, b = (lhs, rhs)
    if slice_lhs:
      a = lax.dynamic_slice_in_dim(a, idx, p, axis=op_dim)
    else:
      b = lax.dynamic_slice_in_dim(b, idx, p, axis=op_dim)
    a, b = lax.optimization_barrier((a, b))  # one dot per step (see _step_dot)
    y = lax.dot_general(
      a, b, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
    )
    return y if out_dtype is None else y.astype(out_dtype)

  accs = [part(0, j, dj) for j, dj in enumerate(dirs)]
  for s in range(1, n):
    accs = [
      lax.ppermute(a, axis, _perm(n, dj)) + part(s, j, dj)
      for j, (a, dj) in enumerate(zip(accs, dirs))
    ]
  return accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=scatter_dim)


def _piece_count(api: str, pieces, n: int, block: int) -> int:
  c = n if pieces is None else pieces
  if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
    raise ValueError(f"{api}: pieces must be a positive int, got {pieces!r}")
  c = min(int(c), block)
  while block % c:  # the largest count up to the one asked for that divides the block
    c -= 1
  return c


def _ag_pieces(x, dots, axis, gather_dim, collect, pieces):
  """``all_gather_dot_generals`` as ``c`` chained all-gathers of a slice of every block."""
  n = int(lax.axis_size(axis))
  m = x.shape[gather_dim]
  c = _piece_count("all_gather_dot_generals", pieces, n, m)
  pos = [_out_dim(x.ndim, w.ndim, lhs, dn, gather_dim) for (w, lhs, dn, *_) in dots]
  slices = lax.split(x, [m // c] * c, axis=gather_dim)

  def gather(piece):
    return lax.all_gather(piece, axis, axis=gather_dim, tiled=True)

  gathered = [gather(slices[0])] + [None] * (c - 1)
  parts: list[list] = [[None] * c for _ in dots]
  for j in range(c):
    if j + 1 < c:
      # Piece j + 1 travels while piece j's dots run: its gather waits for gather j (one
      # collective after the other, which also keeps XLA's combiner from joining them)
      # and for piece j - 1's dots (at most one piece gathered ahead). The barrier's
      # outputs are what the rest uses, so XLA keeps it.
      ahead = [parts[i][j - 1] for i in range(len(dots))] if j >= 1 else []
      nxt, gathered[j], *ahead = lax.optimization_barrier((slices[j + 1], gathered[j], *ahead))
      for i, a in enumerate(ahead):
        parts[i][j - 1] = a
      gathered[j + 1] = gather(nxt)
    if j >= 1:
      # Piece j - 1's dots and gather j meet before piece j's dots: XLA's scheduler then
      # waits for gather j after those dots rather than before them.
      done = [parts[i][j - 1] for i in range(len(dots))]
      gathered[j], *done = lax.optimization_barrier((gathered[j], *done))
      for i, d in enumerate(done):
        parts[i][j - 1] = d
    for i, (w, lhs, dn, precision, preferred, _, dtype) in enumerate(dots):
      a, b = lax.optimization_barrier((gathered[j], w))  # one dot per piece (see _step_dot)
      part = lax.dot_general(
        a if lhs else b, b if lhs else a, dn, precision=precision, preferred_element_type=preferred
      )
      parts[i][j] = part.astype(dtype)
  outs = [_pieces_in_order(ps, od, n) for ps, od in zip(parts, pos)]
  full = _pieces_in_order(gathered, gather_dim, n) if collect else None
  return outs, full


def _pieces_in_order(parts: list, dim: int, n: int):
  """Piece-major results (piece j holds slice j of every device's block, device-major)
  put in device order along ``dim``: one transpose."""
  c = len(parts)
  y = jnp.stack(parts, axis=dim)  # [..., c, n * q, ...]
  shape = y.shape
  q = shape[dim + 1] // n
  y = y.reshape(shape[:dim] + (c, n, q) + shape[dim + 2 :])
  y = jnp.swapaxes(y, dim, dim + 1)  # [..., n, c, q, ...]
  return y.reshape(shape[:dim] + (n * c * q,) + shape[dim + 2 :])


def _rs_pieces(
  lhs,
  rhs,
  dn,
  axis,
  scatter_dim,
  slice_lhs,
  op_dim,
  n,
  block,
  pieces,
  precision,
  preferred,
  out_dtype,
):
  """``dot_general_reduce_scatter`` as ``c`` chained reduce-scatters of a slice of every
  device's block."""
  c = _piece_count("dot_general_reduce_scatter", pieces, n, block)
  q = block // c
  op = lhs if slice_lhs else rhs
  shape = op.shape
  grouped = op.reshape(shape[:op_dim] + (n, c, q) + shape[op_dim + 1 :])
  # lax.split's transpose is a concatenation: the backward assembles, it does not pad.
  slices = lax.split(grouped, [1] * c, axis=op_dim + 1)
  outs: list = []
  for sl in slices:
    sl = sl.reshape(shape[:op_dim] + (n * q,) + shape[op_dim + 1 :])
    a, b = (sl, rhs) if slice_lhs else (lhs, sl)
    a, b = lax.optimization_barrier((a, b))  # one dot per piece (see _step_dot)
    y = lax.dot_general(a, b, dn, precision=precision, preferred_element_type=preferred)
    if out_dtype is not None:
      y = y.astype(out_dtype)
    if outs:
      # One reduce-scatter after the other (and none combined with another by XLA); the
      # dot itself does not wait. The barrier's outputs are what the rest uses.
      y, outs[-1] = lax.optimization_barrier((y, outs[-1]))
    outs.append(lax.psum_scatter(y, axis, scatter_dimension=scatter_dim, tiled=True))
  return outs[0] if c == 1 else jnp.concatenate(outs, axis=scatter_dim)


def _vma(v) -> frozenset:
  typeof = getattr(jax, "typeof", None)
  if typeof is None:  # pragma: no cover - older jax
    return frozenset()
  aval = typeof(v)
  mat = getattr(aval, "mat", None)  # jax >= 0.10: the manual axis type
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", frozenset()))  # earlier jax


def _match_primal(ct, primal, checked):
  """Gives ``ct`` the varying-axes type of ``primal`` (under shard_map's check_vma).

  Axes over which the primal was replicated but the cotangent varies are
  summed over, as JAX's own transpose rules do; axes over which the primal
  varies but the cotangent does not are marked varying.
  """
  if not checked:
    return ct
  extra = tuple(sorted(_vma(ct) - _vma(primal)))
  if extra:
    ct = lax.psum(ct, extra)
  missing = tuple(sorted(_vma(primal) - _vma(ct)))
  if missing:
    if hasattr(lax, "pcast"):
      ct = lax.pcast(ct, missing, to="varying")
    else:  # pragma: no cover - older jax
      ct = lax.pvary(ct, missing)
  return ct


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def all_gather_matmul(
  x: jax.typing.ArrayLike,
  w: jax.typing.ArrayLike,
  *,
  axis: AxisName,
  bidirectional: bool = False,
  chunks: int | None = None,
  precision: Any = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """``all_gather(x, axis, tiled=True) @ w`` as a ppermute ring interleaved with partial dots.

  Call inside a ``shard_map`` body. ``x`` is this device's row block of the
  (sequence- or batch-) sharded activations; ``w`` is this device's weight
  (typically a column block of a column-parallel weight).

  Args:
    x: ``(m / N, k)`` local row block, ``N`` the size of ``axis``.
    w: ``(k, n)`` local weight.
    axis: the mesh axis name of the ring.
    bidirectional: split each block in halves sent in opposite directions,
      using both directions of every link.
    chunks: pieces per block (default 1, or 2 when bidirectional; must be
      even when bidirectional and divide ``m / N``). More pieces give the
      scheduler finer-grained work to overlap, at more kernel launches.
    precision: passed to the dots.
    preferred_element_type: passed to the dots (e.g. ``jnp.float32``).

  Returns:
    ``(m, n)``: the rows of every device, in device order, times ``w``.

  Raises:
    TypeError: if ``x`` or ``w`` is not an array or ``axis`` is not a name.
    ValueError: if the ranks are not 2, the contracting dimensions differ,
      ``axis`` is not bound, or ``chunks`` does not fit.

  Example:
    >>> from functools import partial
    >>> from jax.sharding import PartitionSpec as P
    >>> @partial(jax.shard_map, mesh=mesh, in_specs=(P("tensor"), P(None, "tensor")),
    ...          out_specs=P(None, "tensor"))  # doctest: +SKIP
    ... def layer(x, w):
    ...   return all_gather_matmul(x, w, axis="tensor", bidirectional=True)
  """
  api = "all_gather_matmul"
  _check_operands(api, x, w, "(m / N, k)")
  n = _axis_size(api, axis)
  axis = axis[0] if isinstance(axis, (tuple, list)) else axis
  dirs = _directions(api, x.shape[0], "x.shape[0] (the local rows)", bidirectional, chunks)
  return _ag_matmul(x, w, axis, n, dirs, precision, preferred_element_type)


def matmul_reduce_scatter(
  x: jax.typing.ArrayLike,
  w: jax.typing.ArrayLike,
  *,
  axis: AxisName,
  bidirectional: bool = False,
  chunks: int | None = None,
  precision: Any = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """``psum_scatter(x @ w, axis, scatter_dimension=0, tiled=True)`` as a ring of partial dots.

  Call inside a ``shard_map`` body. The contraction dimension ``k`` is sharded
  along ``axis`` (a row-parallel weight), so ``x @ w`` on each device is a
  partial sum; the result is this device's row block of the full sum.

  Args:
    x: ``(m, k / N)`` local activations, ``N`` the size of ``axis``.
    w: ``(k / N, n)`` local weight.
    axis: the mesh axis name of the ring.
    bidirectional: split each block in halves sent in opposite directions.
    chunks: pieces per block (default 1, or 2 when bidirectional; must be
      even when bidirectional and divide ``m / N``).
    precision: passed to the dots.
    preferred_element_type: passed to the dots; also the dtype in which the
      partial sums travel and accumulate.

  Returns:
    ``(m / N, n)``: this device's row block of the sum over the axis.

  Raises:
    TypeError: if ``x`` or ``w`` is not an array or ``axis`` is not a name.
    ValueError: if the ranks are not 2, the contracting dimensions differ,
      ``axis`` is not bound, ``m`` is not divisible by ``N``, or ``chunks``
      does not fit.

  Example:
    >>> @partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")),
    ...          out_specs=P("tensor"))  # doctest: +SKIP
    ... def layer(h, w):
    ...   return matmul_reduce_scatter(h, w, axis="tensor")
  """
  api = "matmul_reduce_scatter"
  _check_operands(api, x, w, "(m, k / N)")
  n = _axis_size(api, axis)
  axis = axis[0] if isinstance(axis, (tuple, list)) else axis
  if x.shape[0] % n:
    raise ValueError(
      f"{api}: x.shape[0] ({x.shape[0]}) must be divisible by the size of axis {axis!r} ({n})"
    )
  dirs = _directions(api, x.shape[0] // n, "x.shape[0] / axis size", bidirectional, chunks)
  return _rs_matmul(x, w, axis, n, dirs, precision, preferred_element_type)


# ---------------------------------------------------------------------------
# Custom VJPs: each backward pass is the other collective matmul.
# ---------------------------------------------------------------------------


def _ag_matmul(x, w, axis, n, dirs, precision, preferred):
  @jax.custom_vjp
  def f(x, w):
    return _ag_ring(x, w, axis, n, dirs, precision, preferred, collect=False)[0]

  def fwd(x, w):
    y, xf = _ag_ring(x, w, axis, n, dirs, precision, preferred, collect=True)
    return y, (xf, x, w)

  def bwd(res, ct):
    xf, x, w = res
    checked = bool(_vma(x) | _vma(w))
    dx = _rs_ring(ct, w.T.astype(ct.dtype), axis, n, dirs, precision, None)
    dw = _dot(xf.T, ct, precision, None)
    return (
      _match_primal(dx.astype(x.dtype), x, checked),
      _match_primal(dw.astype(w.dtype), w, checked),
    )

  f.defvjp(fwd, bwd)
  return f(x, w)


def _rs_matmul(x, w, axis, n, dirs, precision, preferred):
  @jax.custom_vjp
  def f(x, w):
    return _rs_ring(x, w, axis, n, dirs, precision, preferred)

  def fwd(x, w):
    return f(x, w), (x, w)

  def bwd(res, ct):
    x, w = res
    checked = bool(_vma(x) | _vma(w))
    dx, ct_full = _ag_ring(ct, w.T.astype(ct.dtype), axis, n, dirs, precision, None, collect=True)
    dw = _dot(x.T, ct_full.astype(x.dtype), precision, None)
    return (
      _match_primal(dx.astype(x.dtype), x, checked),
      _match_primal(dw.astype(w.dtype), w, checked),
    )

  f.defvjp(fwd, bwd)
  return f(x, w)


# ---------------------------------------------------------------------------
# Cost model.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GainEstimate:
  """What :func:`estimate_gain` predicts for one collective matmul.

  Attributes:
    compute_s: per-device GEMM time (roofline).
    comm_s: time of the collective alone (ring, alpha-beta).
    baseline_s: collective then GEMM, no overlap.
    overlapped_s: the ring of partial dots.
    speedup: ``baseline_s / overlapped_s``.
    worthwhile: whether ``speedup`` reaches the ``min_speedup`` asked for.
  """

  compute_s: float
  comm_s: float
  baseline_s: float
  overlapped_s: float
  speedup: float
  worthwhile: bool


@deprecations.keyword_only("dtype", "target", api="jax_overlap.collective_matmul.estimate_gain")
def estimate_gain(
  m: int,
  n: int,
  k: int,
  axis_size: int,
  *,
  dtype: Any = "bfloat16",
  target: Any = "h100x8",
  kind: str = "all_gather",
  bidirectional: bool = True,
  chunks: int | None = None,
  launch_overhead_s: float | None = None,
  min_speedup: float = 1.05,
  cost_model: _cost.CostModel | None = None,
  method: str = "ring",
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
    chunks: pieces per block (as in :func:`all_gather_matmul`).
    launch_overhead_s: fixed cost of every kernel (None: the cost model's
      ``kernel_overhead_s``).
    min_speedup: the speedup at which ``worthwhile`` becomes true.
    cost_model: efficiencies (None: the analysis's defaults).
    method: ``"ring"`` (neighbour exchanges: NCCL send/recv on a few channels) or
      ``"pieces"`` (the collective issued as ``chunks`` collectives of a slice of every
      block, default ``axis_size``, each on all of NCCL's channels; the first gather or
      the last reduce-scatter is not hidden).

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
  pieces = chunks if chunks is not None else (2 if bidirectional else 1)

  def gemm(flops, nbytes):
    return _cost.kernel_time(flops, nbytes, gpu, dtype=dt, is_dot=True, cost_model=model)

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
  if big_n == 1:
    overlapped = compute
  elif method == "pieces":
    c = chunks if chunks is not None else big_n
    t = gemm(flops / c, gemm_bytes / c)
    e = _cost.collective_time(coll, block * big_n / c, big_n, topo, cost_model=model)
    overlapped = t + e + (c - 1) * max(t, e)
  else:
    step = pieces * gemm(flops / big_n / pieces, gemm_bytes / big_n / pieces)
    half = 2.0 if bidirectional else 1.0
    exchange = _cost.collective_time(
      "collective-permute", block / half, big_n, topo, cost_model=model
    )
    overlapped = step + (big_n - 1) * max(step, exchange)
  speedup = baseline / overlapped
  return GainEstimate(
    compute_s=compute,
    comm_s=comm,
    baseline_s=baseline,
    overlapped_s=overlapped,
    speedup=speedup,
    worthwhile=speedup >= min_speedup,
  )
