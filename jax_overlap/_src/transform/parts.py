"""Evaluating a jaxpr with values held as equal parts along a dimension (:class:`Parts`),
each equation once per part where a rule keeps the parts apart: the evaluator behind
:mod:`.batch_parts`.

(Over 500 lines: one evaluator, whose per-primitive rules share the parts' representation,
the evaluation's state and the fallback that puts the parts together.)

A matmul or a sum over the split dimension adds the parts' partial results (accumulated in
float32 for 16-bit types); an equation no rule keeps apart is evaluated on the parts put
together. Every rule is exact: the split is a representation of the value, so the program
computes what it computed before, up to the order of the additions a split reduction makes.
Equations repeated on the same values (a rematerialized body's) are evaluated once. Each
collective is issued after the one of its kind before it (the first part's, then the
next's); no reader of a collective's result waits for that order
(:func:`~jax_overlap._src.fsdp.pipeline.after`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap._src.fsdp.pipeline import after
from jax_overlap._src.transform.jaxprs import COLLECTIVES, is_var

# Primitives computed element by element (operands of the output's shape, of size 1 along a
# dimension they are broadcast in, or scalars).
ELEMENTWISE = frozenset(
  """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
  convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
  floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
  nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
  shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan
  tanh xor name threefry2x32""".split()
)
# Nested jaxprs evaluated in place, by parameter name.
_NESTED = {
  "pjit": "jaxpr",
  "jit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "checkpoint": "jaxpr",
  "remat": "jaxpr",
  "custom_jvp_call": "call_jaxpr",
}
_LOW = (jnp.bfloat16, jnp.float16)
# A computed whole value up to this size gets a copy per part (Context.own): writing it
# out costs little; a larger one stays common.
SMALL_BYTES = 1 << 20


class Context:
  """One evaluation's state: how equations are bound, each collective kind's last result
  (the next one of its kind is issued after it), and counts of what was split.

  ``keys``: a value of each part (its part of a carry). Given keys, each part reads a small
  whole value that every part reads (a norm's scale) through its own copy (an optimization
  barrier with the part's key, :meth:`own`), and a broadcast of a whole value is broadcast
  again per part from its copy. Without that, XLA's sibling fusion joins kernels that read a common
  operand into one kernel with an output per part, and every part waits for the slowest
  (the layer norms of all parts after the last part's reduce-scatter). Only small values
  get copies: an optimization barrier writes its operand out (a broadcast mask that XLA
  computes inside each kernel reading it would take 2 GiB written out for MaxText's
  attention); the parts of a carry are carried apart instead (:mod:`.batch_parts`).
  """

  def __init__(self, bind: Callable, *, keys: Sequence | None = None):
    self.bind = bind
    self.keys = None if keys is None else tuple(keys)
    self.last: dict[str, Any] = {}
    self.split = 0
    self.summed = 0
    self.collectives = 0
    self.joined: list[str] = []
    self._own: dict = {}
    self._broadcasts: dict = {}

  def own(self, v, j: int):
    """Part ``j``'s own copy of the whole value ``v``, tied to the part's key (``v`` itself
    where it stays common: without keys, a scalar, or a large value)."""
    if self.keys is None or np.ndim(v) == 0 or not jnp.issubdtype(v.dtype, jnp.floating):
      return v
    if math.prod(np.shape(v)) * np.dtype(v.dtype).itemsize > SMALL_BYTES:
      return v
    key = (id(v), j)
    if key not in self._own:
      # v + 0 * (an element of the part's key), written out: XLA keeps a float product
      # with zero (it may be a NaN) and a barrier's operand in memory, and no two parts'
      # copies are equal expressions that its CSE would merge (a barrier of v alone).
      k = self.keys[j]
      k = lax.convert_element_type(
        lax.reshape(lax.slice(k, (0,) * k.ndim, (1,) * k.ndim), ()), v.dtype
      )
      self._own[key] = (v, lax.optimization_barrier(v + jnp.zeros((), v.dtype) * k))
    return self._own[key][1]

  def note_broadcast(self, eqn, invals, outs) -> None:
    """Records a broadcast of a whole value (broadcast again per part where parts read it)."""
    if self.keys is not None and eqn.primitive.name == "broadcast_in_dim" and len(invals) == 1:
      self._broadcasts[id(outs[0])] = (outs[0], eqn, invals[0])

  def broadcast_of(self, v):
    """``(eqn, operand)`` where ``v`` is a recorded broadcast, else None."""
    entry = self._broadcasts.get(id(v))
    return entry[1:] if entry is not None and entry[0] is v else None


@dataclasses.dataclass(frozen=True)
class Parts:
  """A value held as equal parts along ``dim``, first to last."""

  parts: tuple
  dim: int

  def whole(self):
    return lax.concatenate(list(self.parts), self.dim)

  @property
  def n(self) -> int:
    return len(self.parts)

  @property
  def shape(self) -> tuple[int, ...]:
    s = list(np.shape(self.parts[0]))
    s[self.dim] *= self.n
    return tuple(s)


def cut(x, dim: int, n: int) -> Parts:
  """``x`` as ``n`` equal parts along ``dim`` (its size there must divide by ``n``)."""
  return Parts(tuple(_part(x, dim, n, j) for j in range(n)), dim)


def _part(x, dim: int, n: int, j: int):
  """The ``j``-th of ``x``'s ``n`` equal parts along ``dim``."""
  size = np.shape(x)[dim] // n
  return lax.slice_in_dim(x, j * size, (j + 1) * size, axis=dim)


def whole(x):
  return x.whole() if isinstance(x, Parts) else x


def _cut_apart(x, dim: int, n: int, ctx: Context) -> Parts:
  """:func:`cut`, each part from its own copy of ``x`` (:meth:`Context.own`)."""
  return Parts(tuple(_part(ctx.own(x, j), dim, n, j) for j in range(n)), dim)


def run(jaxpr, consts, args: Sequence, ctx: Context) -> list:
  """Evaluates ``jaxpr`` on ``args`` (values or :class:`Parts`); its outputs, each a value or
  :class:`Parts` (put them together with :func:`whole`)."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return v.val if not is_var(v) else env[v]

  seen: dict = {}
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    # The same equation on the same values once (a rematerialized body repeats work that
    # XLA's CSE would merge, but not across the ties this evaluation adds).
    key = _cse_key(eqn, invals)
    if key is not None and key in seen:
      outs = seen[key]
    else:
      outs = _eval(eqn, invals, ctx)
      if not any(isinstance(v, Parts) for v in invals):
        ctx.note_broadcast(eqn, invals, outs)
      if key is not None:
        seen[key] = outs
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _cse_key(eqn, invals):
  """Equal for equations computing the same thing from the same values (None: not merged:
  effects other than naming a mesh axis)."""
  if any(type(eff).__name__ != "NamedAxisEffect" for eff in eqn.effects):
    return None
  params = []
  for k, v in sorted(eqn.params.items()):
    try:
      hash(v)
      params.append((k, v))
    except TypeError:
      params.append((k, id(v)))
  ins = tuple(
    ("literal", repr(v.val), str(v.aval)) if not is_var(v) else id(x)
    for v, x in zip(eqn.invars, invals)
  )
  return (eqn.primitive, tuple(params), ins)


def _eval(eqn, invals: list, ctx: Context) -> list:
  if not any(isinstance(v, Parts) for v in invals):
    return ctx.bind(eqn, invals)
  name = eqn.primitive.name
  try:
    if name in _NESTED:
      out = _nested(eqn, invals, ctx)
    else:
      rule = _RULES.get(name)
      if rule is None and name in ELEMENTWISE:
        rule = _elementwise
      if rule is None and name in COLLECTIVES:
        rule = _collective
      out = None if rule is None else rule(eqn, invals, ctx)
  except _Join:
    out = None
  if out is None:
    ctx.joined.append(name)
    return ctx.bind(eqn, [whole(v) for v in invals])
  ctx.split += 1
  return out


class _Join(Exception):
  """The equation cannot keep the parts apart: evaluated on the whole values."""


def _dim_of(invals) -> int:
  return next(v.dim for v in invals if isinstance(v, Parts))


def _n_of(invals) -> int:
  return next(v.n for v in invals if isinstance(v, Parts))


def _shape(v) -> tuple[int, ...]:
  return v.shape if isinstance(v, Parts) else tuple(np.shape(v))


def _parts(v, dim: int, full_shape, n: int, ctx: Context | None = None) -> tuple:
  """``v``'s ``n`` parts along ``dim``: a scalar or a value of size 1 there (broadcast along
  it) is shared, a whole value of the full size there cut. Given ``ctx`` (an elementwise
  equation's operands: what XLA's sibling fusion would join), each part reads a whole
  value through its own copy (:class:`Context`)."""
  if isinstance(v, Parts):
    if v.dim != dim:
      v = cut(v.whole(), dim, n)
    return v.parts
  shape = np.shape(v)
  shared = len(shape) == 0 or (len(shape) == len(full_shape) and shape[dim] == 1)
  if not shared and (len(shape) != len(full_shape) or shape[dim] != full_shape[dim]):
    raise _Join
  per_part = None if ctx is None else _rebroadcast(ctx, v, dim, n)
  if per_part is not None:
    return per_part
  if ctx is None:
    return (v,) * n if shared else cut(v, dim, n).parts
  if shared:
    return tuple(ctx.own(v, j) for j in range(n))
  return _cut_apart(v, dim, n, ctx).parts


def _rebroadcast(ctx: Context, v, dim: int, n: int) -> tuple | None:
  """A recorded broadcast ``v``'s parts along ``dim``, each broadcast from its part's copy
  of the operand (None where ``v`` is no such broadcast, or where its operand varies
  along ``dim``)."""
  found = ctx.broadcast_of(v)
  if found is None:
    return None
  eqn, operand = found
  dims = tuple(eqn.params["broadcast_dimensions"])
  shape = list(eqn.params["shape"])
  if dim in dims and np.shape(operand)[dims.index(dim)] != 1:
    return None
  shape[dim] = shape[dim] // n if shape[dim] > 1 else 1
  params = {**eqn.params, "shape": tuple(shape)}
  return tuple(lax.broadcast_in_dim_p.bind(ctx.own(operand, j), **params) for j in range(n))


def _per_part(ctx: Context, fn: Callable, operands: list, dims) -> list:
  """``fn`` (operands -> outputs) on each part's operands (``operands``: one list per
  operand, of its parts); the outputs as :class:`Parts` along ``dims``."""
  n = len(operands[0])
  outs = [fn([op[j] for op in operands]) for j in range(n)]
  return [Parts(tuple(o[k] for o in outs), d) for k, d in enumerate(dims)]


def _bound(ctx: Context, eqn) -> Callable:
  return lambda vals: ctx.bind(eqn, vals)


def _with(prim, **params) -> Callable:
  return lambda vals: [prim.bind(*vals, **params)]


def _elementwise(eqn, invals, ctx):
  dim, n = _dim_of(invals), _n_of(invals)
  full = tuple(eqn.outvars[0].aval.shape)
  if any(tuple(o.aval.shape) != full for o in eqn.outvars):
    return None
  ops = [_parts(v, dim, full, n, ctx) for v in invals]
  return _per_part(ctx, _bound(ctx, eqn), ops, [dim] * len(eqn.outvars))


def _collective(eqn, invals, ctx):
  name = eqn.primitive.name
  p = eqn.params
  dim, n = _dim_of(invals), _n_of(invals)
  out_dim = dim
  if name == "all_gather":
    if p["all_gather_dimension"] == dim and p.get("tiled"):
      return None
    if not p.get("tiled") and p["all_gather_dimension"] <= dim:
      out_dim = dim + 1
  elif name == "reduce_scatter":
    if not p.get("tiled") or p["scatter_dimension"] == dim:
      return None
  elif name == "all_to_all":
    if dim in (p["split_axis"], p["concat_axis"]):
      return None
  elif name not in ("psum", "pmax", "pmin", "ppermute", "psum_invariant"):
    return None
  ops = [_parts(v, dim, _shape(v), n) for v in invals]
  outs = []
  for j in range(n):
    vals = [op[j] for op in ops]
    last = ctx.last.get(name)
    if last is not None:
      vals[0] = after(vals[0], last)
    out = ctx.bind(eqn, vals)
    ctx.last[name] = out[0]
    outs.append(out)
  ctx.collectives += 1
  return [Parts(tuple(o[k] for o in outs), out_dim) for k in range(len(outs[0]))]


def _dot_general(eqn, invals, ctx):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = invals
  n = _n_of(invals)
  shapes = [_shape(v) for v in invals]
  lfree = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
  rfree = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
  hl = isinstance(lhs, Parts)
  d = lhs.dim if hl else rhs.dim
  mine_c, mine_b, other_c, other_b = (lc, lb, rc, rb) if hl else (rc, rb, lc, lb)
  if d in mine_b:
    role, partner, out_dim = "batch", other_b[list(mine_b).index(d)], list(mine_b).index(d)
  elif d in mine_c:
    role, partner, out_dim = "contracting", other_c[list(mine_c).index(d)], None
  else:
    role, partner = "free", None
    out_dim = len(lb) + (lfree.index(d) if hl else len(lfree) + rfree.index(d))
  bind = _bound(ctx, eqn)
  if role == "free":
    other = rhs if hl else lhs
    if isinstance(other, Parts):
      return None
    mine = (lhs if hl else rhs).parts
    # A small operand (a norm's scale: XLA makes such a matmul a multiply) per part.
    others = tuple(ctx.own(other, j) for j in range(n))
    ops = [mine, others] if hl else [others, mine]
    return _per_part(ctx, bind, ops, [out_dim])
  ld, rd = (d, partner) if hl else (partner, d)
  ops = [_parts(lhs, ld, shapes[0], n), _parts(rhs, rd, shapes[1], n)]
  if role == "batch":
    return _per_part(ctx, bind, ops, [out_dim])
  # Contracting: the parts' partial products added.
  out_dtype = eqn.outvars[0].aval.dtype
  params = dict(eqn.params)
  acc = params.get("preferred_element_type") or out_dtype
  params["preferred_element_type"] = jnp.float32 if acc in _LOW else acc
  total = None
  for a, b in zip(*ops):
    y = lax.dot_general_p.bind(a, b, **params)
    total = y if total is None else total + y
  ctx.summed += 1
  return [lax.convert_element_type(total, out_dtype)]


def _reduce(eqn, invals, ctx):
  (x,) = invals
  axes = tuple(eqn.params["axes"])
  d = x.dim
  if d not in axes:
    return _per_part(ctx, _bound(ctx, eqn), [x.parts], [d - sum(a < d for a in axes)])
  name = eqn.primitive.name
  out_dtype = eqn.outvars[0].aval.dtype
  if name == "reduce_sum":
    acc = jnp.float32 if out_dtype in _LOW else out_dtype
    rest = {k: v for k, v in eqn.params.items() if k != "axes"}
    ys = [
      lax.reduce_sum_p.bind(lax.convert_element_type(h, acc), axes=axes, **rest) for h in x.parts
    ]
    ctx.summed += 1
    return [lax.convert_element_type(functools.reduce(lax.add, ys), out_dtype)]
  combine = {
    "reduce_max": lax.max,
    "reduce_min": lax.min,
    "reduce_and": lax.bitwise_and,
    "reduce_or": lax.bitwise_or,
  }.get(name)
  if combine is None:
    return None
  return [functools.reduce(combine, [ctx.bind(eqn, [h])[0] for h in x.parts])]


def _one(eqn, invals, ctx, fn, out_dim):
  """``fn`` on each part of the one split operand (the rest of ``invals`` whole)."""
  x, *rest = invals
  return _per_part(ctx, fn, [x.parts, *[(r,) * x.n for r in rest]], [out_dim])


def _broadcast_in_dim(eqn, invals, ctx):
  x, *dyn = invals
  if dyn:
    return None
  out_dim = eqn.params["broadcast_dimensions"][x.dim]
  shape = list(eqn.params["shape"])
  if shape[out_dim] != x.shape[x.dim]:
    return None
  shape[out_dim] //= x.n
  fn = _with(lax.broadcast_in_dim_p, **{**eqn.params, "shape": tuple(shape)})
  return _one(eqn, invals, ctx, fn, out_dim)


def _reshape(eqn, invals, ctx):
  x, *dyn = invals
  if dyn or eqn.params.get("dimensions") is not None:
    return None
  new = list(eqn.params["new_sizes"])
  before = math.prod(x.shape[: x.dim])
  # The output dimension whose leading elements are the split dimension's: the same
  # elements before it, then the parts of everything from it on.
  out_dim = next((j for j in range(len(new)) if math.prod(new[:j]) == before and new[j] > 1), None)
  if out_dim is None or new[out_dim] % x.n:
    return None
  new[out_dim] //= x.n
  fn = _with(lax.reshape_p, **{**eqn.params, "new_sizes": tuple(new)})
  return _one(eqn, invals, ctx, fn, out_dim)


def _transpose(eqn, invals, ctx):
  (x,) = invals
  perm = list(eqn.params["permutation"])
  return _one(eqn, invals, ctx, _bound(ctx, eqn), perm.index(x.dim))


def _squeeze(eqn, invals, ctx):
  (x,) = invals
  dims = eqn.params["dimensions"]
  return _one(eqn, invals, ctx, _bound(ctx, eqn), x.dim - sum(a < x.dim for a in dims))


def _concatenate(eqn, invals, ctx):
  dim, n = _dim_of(invals), _n_of(invals)
  if eqn.params["dimension"] == dim:
    return None
  size = next(v.shape[dim] for v in invals if isinstance(v, Parts))
  ops = []
  for v in invals:
    s = _shape(v)
    if s[dim] != size:
      return None
    ops.append(_parts(v, dim, s, n))
  return _per_part(ctx, _bound(ctx, eqn), ops, [dim])


def _along(eqn, invals, ctx):
  """cumsum and its kind, sort, split: along one axis."""
  dim, n = _dim_of(invals), _n_of(invals)
  axis = eqn.params.get("axis", eqn.params.get("dimension"))
  if axis == dim:
    return None
  full = next(v.shape for v in invals if isinstance(v, Parts))
  ops = [_parts(v, dim, full, n) for v in invals]
  return _per_part(ctx, _bound(ctx, eqn), ops, [dim] * len(eqn.outvars))


def _pad(eqn, invals, ctx):
  x, value = invals
  if not isinstance(x, Parts) or isinstance(value, Parts):
    return None
  if tuple(eqn.params["padding_config"][x.dim]) != (0, 0, 0):
    return None
  return _one(eqn, invals, ctx, _bound(ctx, eqn), x.dim)


def _slice(eqn, invals, ctx):
  (x,) = invals
  p = eqn.params
  d = x.dim
  strides = p.get("strides") or (1,) * len(x.shape)
  if p["start_indices"][d] != 0 or p["limit_indices"][d] != x.shape[d] or strides[d] != 1:
    return None
  limit = list(p["limit_indices"])
  limit[d] //= x.n
  return _one(eqn, invals, ctx, _with(lax.slice_p, **{**p, "limit_indices": tuple(limit)}), d)


def _dynamic_slice(eqn, invals, ctx):
  x, *idx = invals
  if not isinstance(x, Parts) or any(isinstance(i, Parts) for i in idx):
    return None
  sizes = list(eqn.params["slice_sizes"])
  if sizes[x.dim] != x.shape[x.dim]:
    return None
  sizes[x.dim] //= x.n
  fn = _with(lax.dynamic_slice_p, **{**eqn.params, "slice_sizes": tuple(sizes)})
  return _one(eqn, invals, ctx, fn, x.dim)


def _dynamic_update_slice(eqn, invals, ctx):
  x, upd, *idx = invals
  if any(isinstance(i, Parts) for i in idx):
    return None
  dim, n = _dim_of(invals[:2]), _n_of(invals[:2])
  xs, us = _shape(x), _shape(upd)
  if us[dim] != xs[dim]:
    return None
  ops = [_parts(x, dim, xs, n), _parts(upd, dim, us, n), *[(i,) * n for i in idx]]
  return _per_part(ctx, _bound(ctx, eqn), ops, [dim])


def _per_operand(eqn, invals, ctx):
  """An identity on each operand (an optimization barrier, a type cast): once per part, a
  whole operand through the first part's."""
  n = _n_of(invals)
  lists: list[list] = [[] for _ in range(n)]
  where = []
  for v in invals:
    if isinstance(v, Parts):
      where.append(([len(lst) for lst in lists], v.dim))
      for lst, part in zip(lists, v.parts):
        lst.append(part)
    else:
      where.append(([len(lists[0])], None))
      lists[0].append(v)
  outs = [ctx.bind(eqn, lst) for lst in lists]
  return [
    outs[0][pos[0]] if d is None else Parts(tuple(o[i] for o, i in zip(outs, pos)), d)
    for pos, d in where
  ]


def _nested(eqn, invals, ctx):
  sub = eqn.params[_NESTED[eqn.primitive.name]]
  inner, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
  return run(inner, consts, invals, ctx)


_RULES: dict[str, Callable] = {
  "dot_general": _dot_general,
  **dict.fromkeys(
    ("reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or", "argmax", "argmin"),
    _reduce,
  ),
  "broadcast_in_dim": _broadcast_in_dim,
  "reshape": _reshape,
  "transpose": _transpose,
  "squeeze": _squeeze,
  "concatenate": _concatenate,
  **dict.fromkeys(
    ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "split"), _along
  ),
  "pad": _pad,
  "slice": _slice,
  "dynamic_slice": _dynamic_slice,
  "dynamic_update_slice": _dynamic_update_slice,
  "optimization_barrier": _per_operand,
  "pvary": _per_operand,
}
