"""The N-D collective matmuls tensor- and sequence-parallel code needs: a gather along any
free dimension feeding several ``dot_general``s, and a ``dot_general`` reduce-scattered
along a free dimension; as a ring or in pieces."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_overlap._src.collective_matmul.cost import Method
from jax_overlap._src.collective_matmul.pieces import ag_pieces, rs_pieces
from jax_overlap._src.collective_matmul.rings import (
  Kept,
  accumulate,
  in_gathered_order,
  out_dim,
  ring_order,
  ring_perm,
)


def all_gather_dot_generals(
  x,
  dots,
  *,
  axis: str,
  gather_dim: int,
  collect: bool = False,
  bidirectional: bool = False,
  method: Method = "ring",
  pieces: int | Sequence[int] | None = None,
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
      and ``out_shape`` the full dot output's (checked against the dot; None: not checked).
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
      send/recv on a few (see ``analysis/nccl.py``).
    pieces: the ``"pieces"`` method's all-gathers: a count of equal slices (default: the
      axis size; the largest count up to it that divides the block along ``gather_dim``),
      or the slices' sizes along ``gather_dim``, in issue order, adding up to the block
      (e.g. ``(128, 128, 256, 512)``: a small first gather, the only one no dots hide,
      then pieces that grow as the dots they hide behind do).

  Returns:
    (list of the dots' outputs, the gathered value or None).
  """
  outs, kept = gather_dots_kept(
    x,
    dots,
    axis=axis,
    gather_dim=gather_dim,
    bidirectional=bidirectional,
    method=method,
    pieces=pieces,
  )
  return outs, kept.assemble() if collect else None


def gather_dots_kept(x, dots, *, axis, gather_dim, bidirectional=False, method="ring", pieces=None):
  """:func:`all_gather_dot_generals` returning the gathered value unassembled:
  (the dots' outputs, :class:`Kept`)."""
  _check_gather(x, dots, gather_dim)
  _check_out_shapes(x, dots, gather_dim, int(lax.axis_size(axis)))
  if method == "pieces":
    return ag_pieces(x, dots, axis, gather_dim, pieces)
  if method != "ring":
    raise ValueError(f"all_gather_dot_generals: method must be 'ring' or 'pieces', got {method!r}")
  n = int(lax.axis_size(axis))
  d = lax.axis_index(axis)
  m = x.shape[gather_dim]
  pos = [out_dim(x.ndim, w.ndim, lhs, dn, gather_dim) for (w, lhs, dn, *_) in dots]
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
      [lax.ppermute(pc, axis, ring_perm(n, dj)) for pc, dj in zip(pieces, dirs)]
      if s < n - 1
      else None
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
      held.append(piece)
    pieces = nxt
  order, inverse = ring_order(n, d, dirs)
  outs = [in_gathered_order(ps, order, inverse, od) for ps, od in zip(parts, pos)]
  return outs, Kept(
    tuple(held),
    functools.partial(in_gathered_order, order=order, inverse=inverse, axis=gather_dim),
  )


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
  method: Method = "ring",
  pieces: int | Sequence[int] | None = None,
  beside: tuple[Callable, Sequence] | None = None,
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
  even). ``method="pieces"`` issues the reduce-scatter instead as reduce-scatters of a
  slice of every device's block each, one after the other, each running while the next
  slice's dot computes (NCCL collectives on all their channels rather than send/recv on a
  few). ``pieces`` is their count (equal slices; default the axis size) or the slices'
  sizes along ``scatter_dim`` in issue order, adding up to this device's block (e.g.
  ``(512, 256, 128, 128)``: the last reduce-scatter, the only one no dot hides, small).
  ``beside=(fn, operands)`` gives the compute stream work for that last reduce-scatter:
  ``fn(*operands)`` is traced to run after the last dot and before the output is used,
  i.e. while the last reduce-scatter travels (e.g. putting a kept gathered value in order,
  a copy with no dot of its own to hide behind); with ``method="ring"`` it runs where XLA
  places it.

  Returns:
    This device's block of the summed output; with ``beside``, (that block,
    ``fn(*operands)``).
  """
  if method not in ("ring", "pieces"):
    raise ValueError(
      f"dot_general_reduce_scatter: method must be 'ring' or 'pieces', got {method!r}"
    )
  n = int(lax.axis_size(axis))
  d = lax.axis_index(axis)
  try:
    (lc, rc), (lb, rb) = dimension_numbers
  except (TypeError, ValueError):
    raise ValueError(
      "dot_general_reduce_scatter: dimension_numbers must be ((lhs_contracting, "
      "rhs_contracting), (lhs_batch, rhs_batch)) as for lax.dot_general, got "
      f"{dimension_numbers!r}"
    ) from None
  l_free = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
  r_free = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
  nb = len(lb)
  out_ndim = nb + len(l_free) + len(r_free)
  if not isinstance(scatter_dim, int) or not 0 <= scatter_dim < out_ndim:
    raise ValueError(
      f"dot_general_reduce_scatter: scatter_dim must be a dimension of the dot's "
      f"{out_ndim}-D output (0 to {out_ndim - 1}), got {scatter_dim!r}"
    )
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
    return rs_pieces(
      lhs,
      rhs,
      dn=dimension_numbers,
      axis=axis,
      scatter_dim=scatter_dim,
      slice_lhs=slice_lhs,
      op_dim=op_dim,
      n=n,
      block=block,
      pieces=pieces,
      precision=precision,
      preferred=preferred_element_type,
      out_dtype=out_dtype,
      beside=beside,
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
      accumulate(lax.ppermute(a, axis, ring_perm(n, dj)), part(s, j, dj))
      for j, (a, dj) in enumerate(zip(accs, dirs))
    ]
  out = accs[0] if len(accs) == 1 else jnp.concatenate(accs, axis=scatter_dim)
  return out if beside is None else (out, beside[0](*beside[1]))


def _check_out_shapes(x, dots, gather_dim: int, n: int) -> None:
  """Refuses an ``out_shape`` other than the shape of the dot of the gathered value."""
  shape = list(x.shape)
  shape[gather_dim] *= n
  full = jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  for i, (w, lhs, dn, _, preferred, out_shape, _) in enumerate(dots):
    if out_shape is None:
      continue
    ws = jax.ShapeDtypeStruct(tuple(w.shape), w.dtype)
    want = jax.eval_shape(
      lambda a, b, dn=dn, pt=preferred: lax.dot_general(a, b, dn, preferred_element_type=pt),
      full if lhs else ws,
      ws if lhs else full,
    ).shape
    if tuple(out_shape) != tuple(want):
      raise ValueError(
        f"all_gather_dot_generals: dots[{i}] gives out_shape {tuple(out_shape)}, but the dot "
        f"of the gathered value {tuple(shape)} with w {tuple(w.shape)} is {tuple(want)} "
        "(the full output's shape, or None)"
      )


def _check_gather(x, dots, gather_dim) -> None:
  """Refuses a ``dots`` entry of the wrong form, or a ``gather_dim`` that is not a free
  dimension of ``x`` in every dot."""
  api = "all_gather_dot_generals"
  if not isinstance(gather_dim, int) or not 0 <= gather_dim < x.ndim:
    raise ValueError(
      f"{api}: gather_dim must be a dimension of x (0 to {x.ndim - 1}), got {gather_dim!r}"
    )
  for i, dot in enumerate(dots):
    if not isinstance(dot, (tuple, list)) or len(dot) != 7:
      raise ValueError(
        f"{api}: dots[{i}] must be (w, x_is_lhs, dimension_numbers, precision, "
        f"preferred_element_type, out_shape, out_dtype), got {dot!r}"
      )
    _, lhs, dn, *_ = dot
    (lc, rc), (lb, rb) = dn
    taken = (tuple(lc) + tuple(lb)) if lhs else (tuple(rc) + tuple(rb))
    if gather_dim in taken:
      role = "contracting" if gather_dim in (lc if lhs else rc) else "batch"
      raise ValueError(
        f"{api}: gather_dim {gather_dim} is a {role} dimension of dots[{i}] "
        f"(dimension_numbers {dn}); the gathered dimension must be free in every dot"
      )
