"""The ppermute rings: partial dots, one per step, beside the exchange of the next block;
results put in the gathered order once (one fusible gather, its transpose the inverse)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Kept:
  """The gathered value of an :func:`.nd.all_gather_dot_generals` as its pieces arrived:
  ``assemble(parts)`` puts them in the gathered order (one concatenation), so a caller
  may choose where that copy runs (e.g. beside a reduce-scatter with nothing else to
  hide it: :func:`.nd.dot_general_reduce_scatter`'s ``beside``)."""

  parts: tuple
  put_in_order: Callable

  def assemble(self, parts=None):
    """The gathered value from ``parts`` (default: the pieces as they arrived)."""
    return self.put_in_order(list(self.parts if parts is None else parts))


def ring_perm(n: int, direction: int) -> list[tuple[int, int]]:
  return [(i, (i + direction) % n) for i in range(n)]


def dot_block(a, b, precision, preferred):
  return jnp.dot(a, b, precision=precision, preferred_element_type=preferred)


def _step_dot(a, b, precision, preferred):
  """A ring step's partial dot, kept separate from the other steps' dots.

  XLA's GPU dot merger (``xla_gpu_dot_merger_threshold_mb``) joins dots that
  share an operand, which would turn the ring's partial dots back into one
  GEMM after every exchange. Passing ``b`` through an optimization barrier
  with this step's ``a`` gives every step its own operand.
  """
  a, b = lax.optimization_barrier((a, b))
  return dot_block(a, b, precision, preferred)


def accumulate(received, partial):
  """A reduce-scatter ring step's sum: the partial sum that arrived plus this step's dot.

  XLA from jaxlib 0.12 fuses an ``add`` that consumes a dot into the GEMM fusion's
  epilogue, and the fused GEMM then waits for the hop that brings ``received``: the dot
  no longer runs while the partial sum travels, and the ring runs its exchanges
  synchronously. Passing the dot's result through an optimization barrier keeps the
  add a kernel of its own (as earlier XLAs left it), so the dot depends only on this
  device's operands.
  """
  return received + lax.optimization_barrier(partial)


def ag_ring(x, w, axis, n, dirs, precision, preferred, collect):
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
      [lax.ppermute(pc, axis, ring_perm(n, dj)) for pc, dj in zip(pieces, dirs)]
      if s < n - 1
      else None
    )
    for pc in pieces:
      parts.append(_step_dot(pc, w, precision, preferred).astype(out_dtype))
      held.append(pc)
    pieces = nxt
  order, inverse = ring_order(n, d, dirs)
  y = in_gathered_order(parts, order, inverse, 0)
  xf = in_gathered_order(held, order, inverse, 0) if collect else None
  return y, xf


def rs_ring(x, w, axis, n, dirs, precision, preferred):
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
    sent = [lax.ppermute(a, axis, ring_perm(n, dj)) for a, dj in zip(accs, dirs)]
    accs = [accumulate(snt, part(s, j, dj)) for j, (snt, dj) in enumerate(zip(sent, dirs))]
  return accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=0)


def ring_order(n: int, d, dirs) -> tuple[jax.Array, jax.Array]:
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


def in_gathered_order(chunks: list, order, inverse, axis: int):
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


def out_dim(ndim_x: int, ndim_w: int, x_is_lhs: bool, dn, gather_dim: int) -> int:
  """Where ``gather_dim`` of ``x`` lands in ``dot_general``'s output (batch dims, then the
  lhs's free dims, then the rhs's, each in order)."""
  (lc, rc), (lb, rb) = dn
  xc, xb = (lc, lb) if x_is_lhs else (rc, rb)
  wc, wb = (rc, rb) if x_is_lhs else (lc, lb)
  x_free = [d for d in range(ndim_x) if d not in xc and d not in xb]
  w_free = [d for d in range(ndim_w) if d not in wc and d not in wb]
  pos = x_free.index(gather_dim)
  return len(xb) + (pos if x_is_lhs else len(w_free) + pos)
