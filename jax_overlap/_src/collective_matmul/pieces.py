"""Collective matmuls in pieces: the all-gather or reduce-scatter issued as chained NCCL
collectives of a slice of every block, each beside the dots of the previous slice."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jax_overlap._src.collective_matmul.rings import (
  Kept,
  out_dim,
)
from jax_overlap._src.collective_matmul.validate import (
  piece_sizes,
)


def ag_pieces(x, dots, axis, gather_dim, pieces):
  """``all_gather_dot_generals`` as chained all-gathers of a slice of every block (the
  slices' sizes from ``pieces``: a count of equal slices, or the sizes): (the dots'
  outputs, the gathered pieces as ``Kept``)."""
  n = int(lax.axis_size(axis))
  m = x.shape[gather_dim]
  sizes = piece_sizes("all_gather_dot_generals", pieces, n, m)
  c = len(sizes)
  pos = [out_dim(x.ndim, w.ndim, lhs, dn, gather_dim) for (w, lhs, dn, *_) in dots]
  # Every slice is cut before the first gather: a gather then waits for nothing on the
  # compute stream but the gather before it, so it is issued as soon as that one is done,
  # not after a slice copy queued behind the previous piece's dots.
  slices = list(lax.optimization_barrier(tuple(lax.split(x, sizes, axis=gather_dim))))

  def gather(piece):
    return lax.all_gather(piece, axis, axis=gather_dim, tiled=True)

  gathered = [gather(slices[0])] + [None] * (c - 1)
  parts: list[list] = [[None] * c for _ in dots]
  for j in range(c):
    if j + 1 < c:
      # Piece j + 1 travels while piece j's dots run. Its gather waits for gather j only
      # (one collective after the other, which also keeps XLA's combiner from joining
      # them); the barrier's outputs are what the rest uses, so XLA keeps it.
      nxt, gathered[j] = lax.optimization_barrier((slices[j + 1], gathered[j]))
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
  outs = [pieces_in_order(ps, od, n) for ps, od in zip(parts, pos)]
  return outs, Kept(tuple(gathered), functools.partial(pieces_in_order, dim=gather_dim, n=n))


def pieces_in_order(parts: list, dim: int, n: int):
  """Piece-major results (piece j holds slice j of every device's block, device-major)
  put in device order along ``dim``: one concatenation."""
  blocks = []
  for y in parts:
    shape = y.shape
    blocks.append(y.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1 :]))
  y = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=dim + 1)  # [..., n, m, ...]
  shape = y.shape
  return y.reshape(shape[:dim] + (n * shape[dim + 1],) + shape[dim + 2 :])


def rs_pieces(
  lhs,
  rhs,
  *,
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
  beside=None,
):
  """``dot_general_reduce_scatter`` as chained reduce-scatters of a slice of every
  device's block (the slices' sizes from ``pieces``: a count of equal slices, or the
  sizes). ``beside``: ``(fn, operands)`` traced after the last slice's dot and before the
  last reduce-scatter's result is used (the result is then ``(output, fn(*operands))``)."""
  sizes = piece_sizes("dot_general_reduce_scatter", pieces, n, block)
  op = lhs if slice_lhs else rhs
  shape = op.shape
  grouped = op.reshape(shape[:op_dim] + (n, block) + shape[op_dim + 1 :])
  # lax.split's transpose is a concatenation: the backward assembles, it does not pad.
  slices = lax.split(grouped, sizes, axis=op_dim + 1)
  outs: list = []
  extra = None
  for j, (sl, q) in enumerate(zip(slices, sizes)):
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
    if beside is None or j + 1 < len(sizes):
      outs.append(lax.psum_scatter(y, axis, scatter_dimension=scatter_dim, tiled=True))
      continue
    # The last reduce-scatter is the one no dot hides: ``beside``'s work starts after its
    # dot (its operands wait for it) and its result waits for that work, so XLA runs the
    # work on the compute stream while the reduce-scatter travels.
    fn, operands = beside
    y, operands = lax.optimization_barrier((y, tuple(operands)))
    last = lax.psum_scatter(y, axis, scatter_dimension=scatter_dim, tiled=True)
    last, extra = lax.optimization_barrier((last, fn(*operands)))
    outs.append(last)
  out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=scatter_dim)
  return out if beside is None else (out, extra)
