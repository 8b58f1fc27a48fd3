"""Layouts of values over a mesh and the per-primitive rules that propagate them.

(Over 500 lines: one short rule per primitive family, in one table, ``RULES``.)

Used by :mod:`.to_shard_map`, which runs a GSPMD step's jaxpr on per-device values. A
rule takes the interpreter (mesh axis sizes, which values hold only parameters, the
layouts later uses asked for), an equation and its inputs' layouts, and returns the
layouts it wants its inputs in, the layouts of its outputs, the equation's parameters
for per-device shapes (None: unchanged; a function of the per-device inputs where the
equation runs as other operations) and a function applied to its per-device results
(None: nothing); or None when it has no rule for this case (the equation then runs on
whole values on every device).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from jax_overlap._src.compile.retarget import has_explicit_axes
from jax_overlap._src.transform.jaxprs import nbytes

__all__ = [
  "Axes",
  "Layout",
  "Refused",
  "RULES",
  "ELEMENTWISE",
  "elementwise",
  "is_literal",
  "bound_in_body",
  "per_device",
]

Axes = tuple[str, ...]


class Refused(ValueError):
  """The program cannot be converted; the message says why."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one value is laid out over the mesh.

  Attributes:
    dims: per dimension, the mesh axes it is split over (major first), () if whole.
    partial: mesh axes over which each device holds an addend of the value.
  """

  dims: tuple[Axes, ...]
  partial: frozenset = frozenset()

  @staticmethod
  def whole(ndim: int) -> Layout:
    return Layout(((),) * ndim)

  def valid(self) -> bool:
    """Whether no axis both splits a dimension and sums addends (a device cannot hold a
    piece of an addend)."""
    return not {a for d in self.dims for a in d} & set(self.partial)

  def axes(self) -> set[str]:
    return {a for d in self.dims for a in d} | set(self.partial)

  def spec(self) -> P:
    return P(*[None if not d else d[0] if len(d) == 1 else d for d in self.dims])

  def describe(self) -> str:
    s = str(self.spec())
    return s + (f" + unreduced over {sorted(self.partial)}" if self.partial else "")


# Elementwise primitives linear in all their operands (sums pass through them).
_LINEAR_ALL = {
  "add",
  "sub",
  "add_any",
  "neg",
  "convert_element_type",
  "reduce_precision",
  "copy",
  "copy_p",
  "stop_gradient",
  "real",
  "imag",
  "conj",
  "name",  # jax.ad_checkpoint.checkpoint_name: the value itself, named for remat policies
}
# Linear in one operand at a time (the others must be whole sums).
_LINEAR_ONE = {"mul"}
_LINEAR_FIRST = {"div"}
ELEMENTWISE = (
  _LINEAR_ALL
  | _LINEAR_ONE
  | _LINEAR_FIRST
  | set(
    "abs acos acosh and asin asinh atan atan2 atanh cbrt ceil clamp cos cosh eq erf erf_inv "
    "erfc exp exp2 expm1 floor ge gt integer_pow is_finite le lgamma digamma log log1p "
    "logistic lt max min ne nextafter not or pow rem round rsqrt select_n shift_left "
    "shift_right_arithmetic shift_right_logical sign sin sinh sqrt square tan tanh xor "
    "population_count clz bitcast_convert_type one_minus_square".split()
  )
)


def is_literal(v) -> bool:
  return isinstance(v, jcore.Literal)


# ---------------------------------------------------------------------------
# Rules: (interp, eqn, input layouts) -> (wanted input layouts, output layouts,
# bind params or None for the eqn's, post-processing or None); None: no rule applies.
# ---------------------------------------------------------------------------


def per_device(params: dict, **changes) -> dict:
  """``params`` with ``changes`` and no global sharding (the values are per-device)."""
  out = dict(params, **changes)
  for k in ("sharding", "out_sharding"):
    if out.get(k) is not None:
      out[k] = None
  return out


def bound_in_body(params: dict) -> dict:
  """:func:`per_device` ``params`` as an equation is bound in the shard_map body: a jaxpr
  parameter (a scatter's update, a reduction's body) typed on a mesh with Explicit axes
  traced again on the body's mesh, whose axes are all manual (left as JAX traced it, it
  lowers with sharding constraints that XLA cannot fold)."""
  out = per_device(params)
  for k, v in list(out.items()):
    if isinstance(v, jcore.ClosedJaxpr) and _on_explicit_mesh(v.jaxpr):
      out[k] = _unplaced(v.jaxpr, v.consts)
    elif isinstance(v, jcore.Jaxpr) and _on_explicit_mesh(v):
      consts = k.replace("jaxpr", "consts")
      closed = _unplaced(v, out.get(consts, ()))
      out[k] = closed.jaxpr
      if consts in out:
        out[consts] = tuple(closed.consts)
  return out


def _on_explicit_mesh(jaxpr) -> bool:
  """Whether a value of ``jaxpr`` is typed on a mesh with Explicit axes."""
  return any(
    has_explicit_axes(getattr(getattr(v.aval, "sharding", None), "mesh", None))
    for v in (*jaxpr.invars, *jaxpr.outvars)
  )


def _unplaced(jaxpr, consts) -> jcore.ClosedJaxpr:
  """``jaxpr`` traced again where it is bound: inside the shard_map body its values are
  typed on the body's mesh. (Equation by equation: a trace of ``jaxpr_as_fun`` keeps the
  equations' types.)"""
  import jax  # the package, for make_jaxpr (jax.extend above is a part of it)

  def run(*args):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
      return v.val if is_literal(v) else env[v]

    for e in jaxpr.eqns:
      outs = e.primitive.bind(*map(read, e.invars), **bound_in_body(e.params))
      env.update(zip(e.outvars, outs if e.primitive.multiple_results else [outs]))
    return [read(v) for v in jaxpr.outvars]

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
  return jax.make_jaxpr(run)(*avals)


def elementwise(it, eqn, lays):
  name = eqn.primitive.name
  nd = len(eqn.outvars[0].aval.shape)
  order = sorted(
    range(len(lays)),
    key=lambda i: (is_literal(eqn.invars[i]) or eqn.invars[i] in it.params_only, i),
  )
  dims: list[Axes] = [()] * nd
  used: set[str] = set()
  hint = it.hints.get(eqn.outvars[0])
  if hint is not None and len(hint.dims) == nd and not _only_gathers(hint, lays, nd):
    # Every use wants the result laid out so: compute it so (unless that only gathers a
    # split operand: the gather then stays after the operation, next to the uses, and the
    # operation runs on the shards).
    dims = list(hint.dims)
    used = {a for d in dims for a in d}
    order = []
  for i in order:
    lay = lays[i]
    if len(lay.dims) != nd:
      continue
    for d, ax in enumerate(lay.dims):
      if ax and not dims[d] and not set(ax) & used:  # a split dim has the full size
        dims[d] = ax
        used |= set(ax)
  # Which operands may stay unreduced sums: all of an add (a whole operand is made a sum
  # by zeroing it on all devices but one), one factor of a product, a quotient's
  # numerator; none of a nonlinear function.
  parts = [frozenset(lay.partial) - used for lay in lays]
  # x ** 1 is x (optax's first moment: (1 - b1) * g ** 1 + b1 * mu).
  if name in _LINEAR_ALL or name == "select_n" or (name == "integer_pow" and eqn.params["y"] == 1):
    first = 1 if name == "select_n" else 0
    partial = frozenset().union(*parts[first:])
    keep = {i: partial for i in range(first, len(lays))}
  elif name in _LINEAR_ONE | _LINEAR_FIRST:
    cands = [0] if name in _LINEAR_FIRST else range(len(lays))
    i = next((i for i in cands if parts[i]), None)
    partial = parts[i] if i is not None else frozenset()
    keep = {i: partial} if i is not None else {}
  else:
    partial, keep = frozenset(), {}
  out_shape = eqn.outvars[0].aval.shape
  wants = []
  for i, lay in enumerate(lays):
    part = keep.get(i, frozenset())
    if len(lay.dims) != nd:
      wants.append(Layout(lay.dims, part))
      continue
    # Operands may broadcast along size-1 dims (rank-equal broadcasting).
    shape = getattr(eqn.invars[i].aval, "shape", ())
    wants.append(
      Layout(tuple(ax if shape[d] == out_shape[d] else () for d, ax in enumerate(dims)), part)
    )
  params = per_device(eqn.params) if eqn.params.get("sharding") is not None else None
  return wants, [Layout(tuple(dims), partial) for _ in eqn.outvars], params, None


def _only_gathers(hint: Layout, lays, nd: int) -> bool:
  """Whether ``hint`` is an operand's layout with some split dimensions made whole."""
  for lay in lays:
    if len(lay.dims) != nd or lay.partial:
      continue
    if all(h in ((), ax) for h, ax in zip(hint.dims, lay.dims)) and any(
      ax and not h for h, ax in zip(hint.dims, lay.dims)
    ):
      return True
  return False


def _broadcast_in_dim(it, eqn, lays):
  if len(lays) > 1:
    return None  # dynamic shapes
  (lay,) = lays
  shape = tuple(eqn.params["shape"])
  bd = eqn.params["broadcast_dimensions"]
  in_shape = eqn.invars[0].aval.shape
  dims: list[Axes] = [()] * len(shape)
  want = list(lay.dims)
  kept = set()  # output dims that are the input's, at its size
  for i, d in enumerate(bd):
    if in_shape[i] == shape[d]:
      kept.add(d)
    if lay.dims[i] and in_shape[i] == shape[d]:
      dims[d] = lay.dims[i]
    else:
      want[i] = ()
  partial = lay.partial
  if partial and math.prod(shape) > math.prod(in_shape):
    # An unreduced sum summed before it is broadcast (the RMSNorm backward's sum over the
    # split features, broadcast back over them): an all-reduce of the small value, not a
    # reduce-scatter of the large one, as the partitioner does.
    partial = frozenset()
  hint = it.hints.get(eqn.outvars[0])
  if not partial and hint is not None and not hint.partial and len(hint.dims) == len(shape):
    # A broadcast dimension is made split where its uses want it so: each device
    # broadcasts to its own piece (the values are the same along it).
    used = {a for ax in dims for a in ax}
    for d, ax in enumerate(hint.dims):
      if d not in kept and ax and not set(ax) & used and shape[d] % it.n(ax) == 0:
        dims[d] = ax
        used |= set(ax)
  out = Layout(tuple(dims), partial)
  params = per_device(eqn.params, shape=it.local_shape(shape, out))
  return [Layout(tuple(want), partial)], [out], params, None


def _reshape(it, eqn, lays):
  (lay,) = lays
  if eqn.params.get("dimensions") is not None:
    return None
  src = tuple(eqn.invars[0].aval.shape)
  dst = tuple(eqn.params["new_sizes"])
  want, out = _reshaped(it, src, dst, lay)
  # The layout the result goes to next (a sharding constraint after it), taken back to the
  # input when the reshape keeps every split: the input's producer then makes it in that
  # layout (Flax's DenseGeneral reshapes its dot's output before the constraint).
  hint = it.hints.get(eqn.outvars[0])
  if hint is not None and not hint.partial and hint != out and len(hint.dims) == len(dst):
    placed, back = _reshaped(it, dst, src, Layout(hint.dims))
    if placed.dims == hint.dims and _reshaped(it, src, dst, back)[1].dims == hint.dims:
      # A sum over the axes the hint splits is reduce-scattered on the way in.
      partial = lay.partial - {a for d in hint.dims for a in d}
      want, out = Layout(back.dims, partial), Layout(hint.dims, partial)
  params = per_device(eqn.params, new_sizes=it.local_shape(dst, out))
  return [want], [out], params, None


def _reshaped(it, src: tuple, dst: tuple, lay: Layout) -> tuple[Layout, Layout]:
  """(the layout of the input a reshape from ``src`` to ``dst`` can keep, the output's):
  a split dimension stays split where it is the major one of the dimensions it is merged
  with, or where it is split into dimensions the first of which divides by its devices."""
  dims: list[Axes] = [()] * len(dst)
  want = list(lay.dims)
  for d, ax in enumerate(lay.dims):
    if not ax:
      continue
    n = it.n(ax)
    placed = None
    pre = math.prod(src[:d])
    for e in range(len(dst)):
      if math.prod(dst[:e]) != pre or dst[e] == 1 or dst[e] % n:
        continue
      if dst[e] >= src[d]:
        # Merged with the dims after d (which must be whole), d the major one.
        k, prod = d, 1
        while k < len(src) and prod < dst[e]:
          prod *= src[k]
          k += 1
        if prod == dst[e] and all(not lay.dims[j] for j in range(d + 1, k)):
          placed = e
      else:
        k, prod = e, 1
        while k < len(dst) and prod < src[d]:
          prod *= dst[k]
          k += 1
        if prod == src[d]:
          placed = e
      if placed is not None:
        break
    if placed is None or dims[placed]:
      want[d] = ()
    else:
      dims[placed] = ax
  return Layout(tuple(want), lay.partial), Layout(tuple(dims), lay.partial)


def _transpose(it, eqn, lays):
  (lay,) = lays
  perm = eqn.params["permutation"]
  return [lay], [Layout(tuple(lay.dims[p] for p in perm), lay.partial)], None, None


def _squeeze(it, eqn, lays):
  (lay,) = lays
  gone = set(eqn.params["dimensions"])
  return (
    [lay],
    [Layout(tuple(d for i, d in enumerate(lay.dims) if i not in gone), lay.partial)],
    None,
    None,
  )


def _reduce(it, eqn, lays):
  (lay,) = lays
  name = eqn.primitive.name
  axes = set(eqn.params["axes"])
  split = [a for d in sorted(axes) for a in lay.dims[d]]
  kept = tuple(d for i, d in enumerate(lay.dims) if i not in axes)
  params = per_device(eqn.params)
  if name == "reduce_sum":
    if set(split) & set(lay.partial):
      return None
    return [lay], [Layout(kept, lay.partial | frozenset(split))], params, None
  if name in ("reduce_max", "reduce_min") and split:
    whole = Layout(lay.dims)  # unreduced sums reduced first
    red = tuple(a for a in it.sizes if a in split)
    op = lax.pmax if name == "reduce_max" else lax.pmin
    return [whole], [Layout(kept)], params, lambda outs: [op(o, red) for o in outs]
  want = Layout(tuple(() if i in axes else d for i, d in enumerate(lay.dims)))
  return [want], [Layout(kept)], params, None


def _argreduce(it, eqn, lays):
  (lay,) = lays
  axes = set(eqn.params["axes"])
  want = Layout(tuple(() if i in axes else d for i, d in enumerate(lay.dims)))
  kept = tuple(d for i, d in enumerate(want.dims) if i not in axes)
  return [want], [Layout(kept)], None, None


def _cumulative(it, eqn, lays):
  (lay,) = lays
  ax = eqn.params["axis"]
  linear = eqn.primitive.name == "cumsum"
  want = Layout(
    tuple(() if i == ax else d for i, d in enumerate(lay.dims)),
    lay.partial if linear else frozenset(),
  )
  return [want], [want], None, None


def _dot_general(it, eqn, lays):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = lays
  lv, rv = eqn.invars
  L, R = list(lhs.dims), list(rhs.dims)
  l_params, r_params = _holds_params(it, lv), _holds_params(it, rv)
  for a, b in zip(lb, rb):
    if L[a] != R[b]:
      # A batch dimension split on one side only: a parameter's split is gathered (an
      # RMSNorm scale multiplied in by an einsum: FSDP), unless the activation holds
      # those axes on another dimension and moving them (an all-to-all of its piece)
      # costs less than gathering the parameter (experts' weights split by expert, the
      # tokens by batch); an activation's split is followed.
      if L[a] and not R[b]:
        if l_params and not r_params and not _moved_to(it, rv, rhs, L[a], lv):
          L[a] = ()
        else:
          R[b] = L[a]
      elif R[b] and not L[a]:
        if r_params and not l_params and not _moved_to(it, lv, lhs, R[b], rv):
          R[b] = ()
        else:
          L[a] = R[b]
      elif l_params != r_params:  # split on both sides, differently: the activation's
        if l_params:
          L[a] = R[b]
        else:
          R[b] = L[a]
      elif it.n(R[b]) > it.n(L[a]):
        # The more split one (experts' tokens split by batch over one axis more): the
        # other reaches it by a slice, or an all-to-all where the axis splits another of
        # its dimensions, instead of this one gathered.
        L[a] = R[b]
      else:
        R[b] = L[a]
  # An axis that now splits a batch dimension splits no other dimension of that operand.
  for side, batch in ((L, lb), (R, rb)):
    used = {x for d in batch for x in side[d]}
    for d in range(len(side)):
      if d not in batch and set(side[d]) & used:
        side[d] = ()
  partial: set[str] = set()
  for a, b in zip(lc, rc):
    if L[a] == R[b]:
      partial |= set(L[a])
      continue
    if L[a] and R[b]:
      L[a] = R[b] = ()
      continue
    # One side split: gather it if it holds parameters (FSDP), else the cheaper of
    # gathering it and slicing the other side into an unreduced sum.
    side, other = ("L", "R") if L[a] else ("R", "L")
    ax = L[a] or R[b]
    sharded_params = l_params if side == "L" else r_params
    sharded_aval = (lv if side == "L" else rv).aval
    gather = sharded_params or nbytes(sharded_aval) <= 2 * nbytes(eqn.outvars[0].aval)
    # (Not sliced by axes that split another of the other side's contracting dimensions:
    # a free one is gathered below, where the output would hold the axis twice.)
    others = [R[d] for d in rc if d != b] if side == "L" else [L[d] for d in lc if d != a]
    gather = gather or bool(set(ax) & {x for d in others for x in d})
    if gather:
      if side == "L":
        L[a] = ()
      else:
        R[b] = ()
    else:
      if side == "L":
        R[b] = ax
      else:
        L[a] = ax
      partial |= set(ax)
  l_part, r_part = set(lhs.partial), set(rhs.partial)
  if l_part and r_part:
    r_part = set()
  hint = it.hints.get(eqn.outvars[0])
  if hint is not None and (hint.partial or len(hint.dims) != len(eqn.outvars[0].aval.shape)):
    hint = None
  # Resolve axes used twice in the output: gather free dims (parameters first).
  lf = [d for d in range(len(L)) if d not in lc and d not in lb]
  rf = [d for d in range(len(R)) if d not in rc and d not in rb]
  # Each free dim's position in the output.
  pos = {("L", d): len(lb) + i for i, d in enumerate(lf)}
  pos.update({("R", d): len(lb) + len(lf) + i for i, d in enumerate(rf)})
  for _ in range(8):
    out_dims = [L[a] for a in lb] + [L[d] for d in lf] + [R[d] for d in rf]
    seen: collections.Counter = collections.Counter(a for d in out_dims for a in d)
    for a in partial | l_part | r_part:
      seen[a] += 1
    dup = [a for a, c in seen.items() if c > 1]
    if not dup:
      break
    a = dup[0]
    if a in l_part:
      l_part.discard(a)
    elif a in r_part:
      r_part.discard(a)
    else:
      cands = [("R", d) for d in rf if a in R[d]] + [("L", d) for d in lf if a in L[d]]
      if not cands:
        return None
      # Gather first the side whose output dim the later uses do not want split over
      # ``a`` (a sequence-split activation is gathered where the result's constraint
      # splits the weight's dim: tensor parallelism), then one another use gathers anyway
      # (a weight gradient reuses the cotangent its input's gradient gathers, and keeps
      # the split of the other operand, the parameter's), then parameters (FSDP), then
      # the smaller operand (a weight gradient keeps the larger activation's split).
      wanted_split = {c for c in cands if hint is not None and a in hint.dims[pos[c]]}
      cands.sort(
        key=lambda c: (
          c in wanted_split,
          not _gathered_elsewhere(it, eqn, rv if c[0] == "R" else lv, c[1], a),
          not (r_params if c[0] == "R" else l_params),
          nbytes((rv if c[0] == "R" else lv).aval),
        )
      )
      side, d = cands[0]
      if side == "R":
        R[d] = ()
      else:
        L[d] = ()
  else:
    return None
  out = Layout(tuple(out_dims), frozenset(partial | l_part | r_part))
  params = per_device(eqn.params)
  return (
    [Layout(tuple(L), frozenset(l_part)), Layout(tuple(R), frozenset(r_part))],
    [out],
    params,
    None,
  )


def _holds_params(it, var) -> bool:
  """Whether ``var`` is a literal or depends only on parameters."""
  return is_literal(var) or var in it.params_only


def _moved_to(it, var, lay: Layout, axes: Axes, param) -> bool:
  """Whether the activation ``var`` (laid out ``lay``) should follow a parameter's split
  over ``axes`` of a batch dimension: ``axes`` split one other dimension of it, as its
  last axes (one all-to-all moves them), and its piece is smaller than the parameter
  whole (what each device receives either way)."""
  if is_literal(var) or not axes:
    return False
  if not any(d[len(d) - len(axes) :] == axes for d in lay.dims):
    return False
  piece = nbytes(var.aval) // it.n([x for d in lay.dims for x in d])
  return piece < nbytes(param.aval)


def _conv(it, eqn, lays):
  """A convolution: its batch split stays split (data parallelism: the input's batch, an
  input gradient's), its output features split as the kernel's, a contraction over input
  features split alike on both sides an unreduced sum (a weight gradient contracts the
  batch); spatial dimensions whole (no halo exchange), and grouped features whole."""
  dn = eqn.params["dimension_numbers"]
  (lb, lf, *lsp), (ro, ri, *rsp), (ob, of, *_) = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  groups = eqn.params["feature_group_count"] > 1 or eqn.params["batch_group_count"] > 1
  lhs, rhs = lays
  lv, rv = eqn.invars
  L, R = list(lhs.dims), list(rhs.dims)
  for d in lsp:
    L[d] = ()
  for d in rsp:
    R[d] = ()
  if groups:  # grouped: features (and a grouped batch) whole
    L[lf] = R[ri] = R[ro] = ()
    if eqn.params["batch_group_count"] > 1:
      L[lb] = ()
  if L[lf] != R[ri]:
    L[lf] = R[ri] = ()
  partial = set(L[lf])
  # An axis splitting both the batch and the kernel's output features: the kernel (a
  # parameter: FSDP) gathered, else the activation's batch.
  if set(L[lb]) & set(R[ro]):
    if _holds_params(it, rv) or not _holds_params(it, lv):
      R[ro] = ()
    else:
      L[lb] = ()
  l_part, r_part = set(lhs.partial), set(rhs.partial)
  if l_part and r_part:
    r_part = set()
  used = set(L[lb]) | set(R[ro]) | partial
  l_part -= used
  r_part -= used
  out = [()] * len(eqn.outvars[0].aval.shape)
  out[ob], out[of] = L[lb], R[ro]
  return (
    [Layout(tuple(L), frozenset(l_part)), Layout(tuple(R), frozenset(r_part))],
    [Layout(tuple(out), frozenset(partial | l_part | r_part))],
    per_device(eqn.params),
    None,
  )


def _windowed(it, eqn, lays):
  """A reduction over windows (max and average pooling) or its gradient: a dimension whose
  window is one element, unstrided, unpadded and undilated (the batch, the channels)
  keeps its split; the others are whole. Sums are reduced first."""
  p = eqn.params
  n = len(p["window_dimensions"])
  ones = (1,) * n

  def trivial(d: int) -> bool:
    return (
      p["window_dimensions"][d] == 1
      and p["window_strides"][d] == 1
      and tuple(p["padding"][d]) == (0, 0)
      and p.get("base_dilation", ones)[d] == 1
      and p.get("window_dilation", ones)[d] == 1
    )

  lay = Layout(tuple(ax if trivial(d) else () for d, ax in enumerate(lays[0].dims)))
  # (A generic reduce_window's initial values are scalars.)
  ins = [lay if len(v.aval.shape) == n else Layout.whole(len(v.aval.shape)) for v in eqn.invars]
  return ins, [lay] * len(eqn.outvars), per_device(p), None


def _gathered_elsewhere(it, eqn, var, d: int, axis: str) -> bool:
  """Whether another use of ``var`` (in the previous abstract run) wants its dimension
  ``d`` not split over ``axis``, where this one has it split."""
  if is_literal(var):
    return False
  return any(
    i != id(eqn) and len(w.dims) > d and axis not in w.dims[d]
    for i, w in it.wanted_before.get(var, ())
  )


def _iota(it, eqn, lays):
  params = per_device(eqn.params) if eqn.params.get("sharding") is not None else None
  return [], [Layout.whole(len(eqn.params["shape"]))], params, None


def _slice(it, eqn, lays):
  (lay,) = lays
  shape = eqn.invars[0].aval.shape
  start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
  strides = eqn.params.get("strides") or (1,) * len(shape)
  dims = []
  for d, ax in enumerate(lay.dims):
    full = start[d] == 0 and limit[d] == shape[d] and strides[d] == 1
    dims.append(ax if full else ())
  out = Layout(tuple(dims), lay.partial)
  local_limit = tuple(lim // it.n(ax) if ax else lim for lim, ax in zip(limit, dims))
  return [out], [out], dict(eqn.params, limit_indices=local_limit), None


def _dynamic_slice(it, eqn, lays):
  lay = lays[0]
  shape = eqn.invars[0].aval.shape
  sizes = eqn.params["slice_sizes"]
  dims = tuple(ax if sizes[d] == shape[d] else () for d, ax in enumerate(lay.dims))
  out = Layout(dims, lay.partial)
  params = dict(eqn.params, slice_sizes=it.local_shape(sizes, out))
  return [out] + [Layout(()) for _ in lays[1:]], [out], params, None


def _dynamic_update_slice(it, eqn, lays):
  op, up = lays[:2]
  shape = eqn.invars[0].aval.shape
  ushape = eqn.invars[1].aval.shape
  dims = tuple(
    op.dims[d] if op.dims[d] == up.dims[d] and ushape[d] == shape[d] else ()
    for d in range(len(shape))
  )
  part = op.partial | up.partial
  out = Layout(dims, part)
  return [out, out] + [Layout(()) for _ in lays[2:]], [out], None, None


def _concatenate(it, eqn, lays):
  dim = eqn.params["dimension"]
  nd = len(lays[0].dims)
  dims: list[Axes] = [()] * nd
  for lay in lays:
    for d, ax in enumerate(lay.dims):
      if d != dim and ax and not dims[d]:
        dims[d] = ax
  part = frozenset().union(*[lay.partial for lay in lays])
  out = Layout(tuple(dims), part)
  return [out] * len(lays), [out], None, None


def _rev(it, eqn, lays):
  (lay,) = lays
  gone = set(eqn.params["dimensions"])
  out = Layout(tuple(() if d in gone else ax for d, ax in enumerate(lay.dims)), lay.partial)
  return [out], [out], None, None


def _pad(it, eqn, lays):
  lay = lays[0]
  cfg = eqn.params["padding_config"]
  dims = tuple(ax if tuple(c) == (0, 0, 0) else () for ax, c in zip(lay.dims, cfg))
  # Padding with zeros is linear (the transpose of a slice): a sum stays a sum.
  pad = it.constant(eqn.invars[1])
  zero = pad is not None and not np.any(np.asarray(pad))
  out = Layout(dims, lay.partial if zero else frozenset())
  return [out, Layout(())], [out], None, None


def _sort(it, eqn, lays):
  dim = eqn.params["dimension"]
  nd = len(lays[0].dims)
  dims = [()] * nd
  for lay in lays:
    for d, ax in enumerate(lay.dims):
      if d != dim and ax and not dims[d]:
        dims[d] = ax
  out = Layout(tuple(dims))
  return [out] * len(lays), [out] * len(eqn.outvars), None, None


def _gather(it, eqn, lays):
  op, idx = lays
  dn = eqn.params["dimension_numbers"]
  oshape = eqn.invars[0].aval.shape
  ishape = eqn.invars[1].aval.shape
  sizes = eqn.params["slice_sizes"]
  out_nd = len(eqn.outvars[0].aval.shape)
  offset = list(dn.offset_dims)
  ob = tuple(getattr(dn, "operand_batching_dims", ()))
  ib = tuple(getattr(dn, "start_indices_batching_dims", ()))
  out_dims: list[Axes] = [()] * out_nd
  # The indices' batch dims keep their split (the batch), paired operand batching dims
  # split alike; then operand dims taken whole by every slice keep theirs where no axis
  # repeats (else the table is gathered).
  batch_out = [d for d in range(out_nd) if d not in offset]
  batch_in = [d for d in range(len(ishape)) if d != len(ishape) - 1]
  op_want: list[Axes] = [()] * len(oshape)
  idx_want: list[Axes] = [()] * len(ishape)
  used: set[str] = set()
  for bi, bo in zip(batch_in, batch_out):
    pair = ob[ib.index(bi)] if bi in ib else None
    ax = idx.dims[bi] or (op.dims[pair] if pair is not None else ())
    if ax and not set(ax) & used:
      out_dims[bo] = idx_want[bi] = ax
      if pair is not None:
        op_want[pair] = ax
      used |= set(ax)
  looked_up = _split_table_lookup(it, eqn, op, used, out_dims, idx_want)
  if looked_up is not None:
    return looked_up
  window = [d for d in range(len(oshape)) if d not in dn.collapsed_slice_dims and d not in ob]
  local_sizes = list(sizes)
  for k, d in enumerate(window):
    ax = op.dims[d]
    if ax and sizes[d] == oshape[d] and d not in dn.start_index_map and not set(ax) & used:
      out_dims[offset[k]] = op_want[d] = ax
      local_sizes[d] = sizes[d] // it.n(ax)
      used |= set(ax)
  if used & set(op.partial):
    return None
  op_l = Layout(tuple(op_want), op.partial)
  out = Layout(tuple(out_dims), op.partial)
  params = dict(eqn.params, slice_sizes=tuple(local_sizes))
  return [op_l, Layout(tuple(idx_want))], [out], params, None


_LOOKUP_MODES = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _split_table_lookup(it, eqn, op: Layout, used: set, out_dims: list, idx_want: list):
  """A row lookup in a table split along the dimension its indices pick rows from (a
  vocabulary-parallel embedding), where every device holds the same indices: each device
  looks up the rows it holds, zeros for the others', and the devices' sum is reduced (what
  XLA's partitioner does: on MaxText's tensor-parallel step a 128 MiB reduce-scatter of the
  rows instead of its 250 MiB table gathered whole). None where the lookup is not one
  such."""
  dn = eqn.params["dimension_numbers"]
  oshape = eqn.invars[0].aval.shape
  sizes = eqn.params["slice_sizes"]
  split = [d for d, ax in enumerate(op.dims) if ax]
  if (
    len(split) != 1
    or op.partial
    or getattr(dn, "operand_batching_dims", ())
    or eqn.params.get("mode") not in _LOOKUP_MODES
  ):
    return None
  (d,) = split
  ax = op.dims[d]
  if (
    d not in dn.collapsed_slice_dims
    or d not in dn.start_index_map
    or sizes[d] != 1
    or set(ax) & used
    or oshape[d] % it.n(ax)
  ):
    return None
  batch_out = [o for o in range(len(out_dims)) if o not in dn.offset_dims]
  k = dn.start_index_map.index(d)
  local = oshape[d] // it.n(ax)
  clip = eqn.params["mode"] == lax.GatherScatterMode.CLIP
  # Rows another device holds are clipped to one of this device's (then zeroed).
  params = per_device(eqn.params, mode=lax.GatherScatterMode.CLIP, unique_indices=False)

  def lookup(table, idx):
    row = idx[..., k]
    if clip:  # clipped into the whole table first, as the lookup did
      row = jnp.clip(row, 0, oshape[d] - 1)
    row = row - (it._index(ax) * local).astype(row.dtype)
    held = (row >= 0) & (row < local)
    row = jnp.clip(row, 0, local - 1)[..., None]
    idx = lax.dynamic_update_index_in_dim(idx, row, k, idx.ndim - 1)
    rows = lax.gather_p.bind(table, idx, **params)
    held = lax.broadcast_in_dim(held, rows.shape, batch_out)
    return [lax.select(held, rows, lax.full_like(rows, 0))]

  # The devices' sum, reduced right away: reduce-scattered along a dimension of the rows
  # where every use wants it split so (a tensor-parallel layer's input), else all-reduced.
  hint = it.hints.get(eqn.outvars[0])
  shape = eqn.outvars[0].aval.shape
  summed = Layout(tuple(out_dims), frozenset(ax))
  along = next(
    (
      o
      for o in dn.offset_dims
      if hint is not None
      and len(hint.dims) == len(shape)
      and hint.dims[o] == ax
      and not out_dims[o]
      and shape[o] % it.n(ax) == 0
    ),
    None,
  )
  if along is not None:
    out_dims[along] = ax
  out = Layout(tuple(out_dims))
  return [op, Layout(tuple(idx_want))], [out], lookup, it.reduced(summed, out)


def _scatter_add(it, eqn, lays):
  op, idx, up = lays
  dn = eqn.params["dimension_numbers"]
  ob = tuple(getattr(dn, "operand_batching_dims", ()))
  ib = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
  ushape = eqn.invars[2].aval.shape
  ishape = eqn.invars[1].aval.shape
  scatter_u = [d for d in range(len(ushape)) if d not in dn.update_window_dims]
  batch_in = [d for d in range(len(ishape)) if d != len(ishape) - 1]
  u_of = dict(zip(batch_in, scatter_u))
  op_dims: list[Axes] = [()] * len(op.dims)
  up_want: list[Axes] = [()] * len(ushape)
  idx_want: list[Axes] = [()] * len(ishape)
  taken = set(op.partial) | set(up.partial)
  # Batching dims split alike in operand, indices and updates: the result is split.
  for o, i in zip(ob, ib):
    ax = op.dims[o] or idx.dims[i] or up.dims[u_of[i]]
    if ax and not set(ax) & taken:
      op_dims[o] = idx_want[i] = up_want[u_of[i]] = ax
      taken |= set(ax)
  # Other scatter dims split: each device adds its updates; the result is a sum.
  split: set[str] = set()
  for i in batch_in:
    if i in ib:
      continue
    ax = up.dims[u_of[i]] or idx.dims[i]
    if ax and not set(ax) & taken:
      up_want[u_of[i]] = idx_want[i] = ax
      split |= set(ax)
      taken |= set(ax)
  part = frozenset(split) | op.partial | up.partial
  out = Layout(tuple(op_dims), part)
  return [out, Layout(tuple(idx_want)), Layout(tuple(up_want), part - split)], [out], None, None


def _top_k(it, eqn, lays):
  """The k largest along one dimension (a router's top-2 experts): that dimension whole,
  the others keep their split, for the values and their indices."""
  (lay,) = lays
  ax = eqn.params.get("axis", len(lay.dims) - 1)
  want = Layout(tuple(() if i == ax else d for i, d in enumerate(lay.dims)))
  return [want], [want] * len(eqn.outvars), None, None


def _split(it, eqn, lays):
  (lay,) = lays
  ax = eqn.params["axis"]
  out = Layout(tuple(() if i == ax else d for i, d in enumerate(lay.dims)), lay.partial)
  return [out], [out] * len(eqn.outvars), None, None


RULES = {
  "broadcast_in_dim": _broadcast_in_dim,
  "reshape": _reshape,
  "transpose": _transpose,
  "squeeze": _squeeze,
  "reduce_sum": _reduce,
  "reduce_max": _reduce,
  "reduce_min": _reduce,
  "reduce_prod": _reduce,
  "reduce_and": _reduce,
  "reduce_or": _reduce,
  "argmax": _argreduce,
  "argmin": _argreduce,
  "cumsum": _cumulative,
  "cumprod": _cumulative,
  "cummax": _cumulative,
  "cummin": _cumulative,
  "cumlogsumexp": _cumulative,
  "dot_general": _dot_general,
  "conv_general_dilated": _conv,
  "reduce_window_sum": _windowed,
  "reduce_window_max": _windowed,
  "reduce_window_min": _windowed,
  "reduce_window": _windowed,
  "select_and_scatter_add": _windowed,
  "select_and_gather_add": _windowed,
  "iota": _iota,
  "slice": _slice,
  "dynamic_slice": _dynamic_slice,
  "dynamic_update_slice": _dynamic_update_slice,
  "concatenate": _concatenate,
  "rev": _rev,
  "pad": _pad,
  "sort": _sort,
  "gather": _gather,
  "scatter-add": _scatter_add,
  "scatter_add": _scatter_add,
  "split": _split,
  "top_k": _top_k,
}
