"""A GSPMD step in its shard_map form, converted equation by equation.

(Over 500 lines: one interpreter, whose loops, branches and rematerialization must share
its state; the per-primitive rules are in :mod:`.layouts`.)

A program written for ``jax.jit`` over sharded arrays has no collectives in its jaxpr:
XLA's SPMD partitioner inserts them while compiling, where ``@overlap`` cannot move
them. :func:`convert` writes the same program as one ``shard_map`` over the arguments'
mesh. It follows each value's *layout* through the jaxpr, as the partitioner does:

- which mesh axes split each dimension (a :class:`Layout`'s ``dims``), and
- over which axes the value is an unreduced sum (``partial``: each device holds an
  addend, as after a matmul that contracts a dimension split across devices).

Every equation gets the layouts its rule needs, by exact conversions:

- an all-gather where a split dimension must be whole (a parameter at its use, the
  FSDP gather);
- a local slice where a whole dimension may be split (free);
- an all-to-all where a split moves from one dimension to another (tokens split by batch
  going to the experts that process them), when the cost model of the target says it at
  least halves the time of gathering the value and slicing it (:mod:`.relayout`);
- a reduce-scatter where an unreduced sum meets a split value (the gradient at the
  optimizer update, the FSDP reduce-scatter), an all-reduce where it must be whole;
- a zero on all but one device where a whole value joins a sum.

Gradients are reduce-scattered where autodiff computed them, not where they are used:
a first pass records which layout each unreduced sum is wanted in, and the conversion
runs right after the equation that made it (inside the loop body for a scanned layer's
gradient, so that the scan pipeliner finds one reduce-scatter per iteration).

Each rule is exact, so the converted program computes the original's values (up to the
order of floating-point sums, which the partitioner also splits). A primitive without a
rule runs on whole values on every device (its inputs gathered, correct but redundant),
and :attr:`Converted.replicated` names it. Arguments may be split along several
dimensions over different mesh axes (FSDP on one axis and tensor parallelism on another,
as logical axis rules lay a model out on a 2-D mesh): each dimension's axes are followed
alike. On a mesh with Explicit axes (sharding in types, ``jax.make_mesh``'s default) the
same rules apply: the arguments' layouts are their types', a ``jax.sharding.reshard`` is a
constraint like ``with_sharding_constraint``, an ``out_sharding=`` (a matmul's, a gather's)
is dropped for the layout the rule arrives at (converted where a use needs another), each
output is returned in its type's layout, and no parameter of an equation in the body keeps
a global sharding. What cannot be converted (effects, arguments on several meshes or with
other shardings, a value split and summed over one axis) is refused with
:class:`Refused`, whose message says why; the caller then keeps the program as written.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap._src import targets as targets_lib
from jax_overlap._src.analysis import cost_model
from jax_overlap._src.compile.retarget import has_explicit_axes
from jax_overlap._src.transform import jaxprs, relayout
from jax_overlap._src.transform.jaxprs import scan_sizes
from jax_overlap._src.transform.layouts import (
  ELEMENTWISE,
  RULES,
  Axes,
  Layout,
  Refused,
  bound_in_body,
  elementwise,
  is_literal,
)

__all__ = ["Layout", "Converted", "Refused", "convert", "input_layouts"]


@dataclasses.dataclass
class Converted:
  """A converted step.

  Attributes:
    fn: the step as ``shard_map`` over ``mesh``, taking and returning the original's
      flattened arguments and outputs (global arrays).
    in_specs / out_specs: the PartitionSpecs of its inputs and outputs.
    collectives: kind -> count of the collectives the conversion inserted (loop bodies
      counted once).
    replicated: primitives computed whole on every device because no rule splits them.
  """

  fn: Any
  in_specs: tuple
  out_specs: tuple
  collectives: dict[str, int]
  replicated: list[str]

  def summary(self) -> str:
    parts = [f"{n} {k}{'s' if n > 1 else ''}" for k, n in sorted(self.collectives.items()) if n]
    text = "inserted " + (", ".join(parts) if parts else "no collectives")
    if self.replicated:
      text += "; computed whole on every device: " + ", ".join(sorted(set(self.replicated)))
    return text


_INLINE = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
           "custom_vjp_call_jaxpr"}  # fmt: skip
_REMAT = {"remat2", "checkpoint", "remat"}
# Primitives whose output is their input's value (where its layout is the input's).
_SAME_VALUE = {"name", "copy", "copy_p", "sharding_constraint", "reshard"}


def _sub_closed(eqn):
  """The jaxpr an inlined call runs, as (jaxpr, consts)."""
  p = eqn.params
  for k in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    if k in p:
      j = p[k]
      if hasattr(j, "jaxpr") and hasattr(j, "consts"):
        return j.jaxpr, list(j.consts)
      return j, []
  raise Refused(f"{eqn.primitive.name}: no jaxpr to inline")


# ---------------------------------------------------------------------------
# The interpreter.
# ---------------------------------------------------------------------------


class Interpreter:
  """Runs a jaxpr on per-device values (``abstract``: on layouts only)."""

  def __init__(
    self,
    sizes: dict[str, int],
    params_only: set,
    hints: dict,
    abstract: bool,
    wanted_before: dict | None = None,
    topology=None,
    all_to_all: bool = True,
  ):
    self.sizes = sizes
    self.topology = topology or targets_lib.get("h100x8")  # what collectives cost
    self._size_one = frozenset(a for a, n in sizes.items() if n == 1)
    self.all_to_all = all_to_all  # False: no split moved between dimensions by all-to-all
    self.params_only = params_only  # vars that depend only on parameters
    self.constants: dict = {}  # vars that are a constant laid out (reshard of a literal)
    self.hints = hints  # var -> Layout it is converted to right after it is made
    self.abstract = abstract
    # var -> [(id of an equation using it, the layout that use wanted)]: this run's, and
    # the previous abstract run's (what a rule may ask of the other uses of an operand)
    self.wanted: dict = collections.defaultdict(list)
    self.wanted_before: dict = wanted_before if wanted_before is not None else {}
    self.demands: dict = collections.defaultdict(list)  # root var -> wanted layouts
    self.uses: dict = {}  # other var -> (its layout, the layouts its uses want)
    self.counts: collections.Counter = collections.Counter()
    self.replicated: list[str] = []
    # var holding a sum -> (the var the sum was made in, which of its dims each of the
    # var's dims is: None where they are the same)
    self.root: dict = {}
    self.in_loop = False  # running a loop body
    self._memo: list[dict] = []  # per jaxpr being run: (var, layout) -> converted value
    # An inlined call's input var -> (the caller's var it is, the caller's memo): a value
    # passed into two calls is converted once, in the caller's scope.
    self._alias: dict = {}

  def abstract_copy(self) -> Interpreter:
    """An abstract interpreter with this one's settings (for a loop or branch body's
    layouts, run to a fixed point)."""
    return Interpreter(
      self.sizes,
      set(self.params_only),
      self.hints,
      True,
      self.wanted_before,
      self.topology,
      self.all_to_all,
    )

  # -- layout helpers --------------------------------------------------------

  def n(self, axes: Sequence[str]) -> int:
    return math.prod(self.sizes[a] for a in axes)

  def local_shape(self, shape, lay: Layout) -> tuple[int, ...]:
    return tuple(s // self.n(d) for s, d in zip(shape, lay.dims))

  def _index(self, axes: Sequence[str]):
    idx = 0
    for a in axes:
      idx = idx * self.sizes[a] + lax.axis_index(a)
    return idx

  def convert(self, var, x, src: Layout, dst: Layout):
    """``x`` (laid out ``src``) laid out ``dst``; records the demand in abstract mode."""
    if var is not None and not is_literal(var):
      if src.partial:
        root, perm = self.root.get(var, (var, None))
        demand = dst
        if perm is not None:  # the layout asked for, in the root's dimensions
          dims: list = [()] * len(perm)
          for d, p in enumerate(perm):
            dims[p] = dst.dims[d]
          demand = Layout(tuple(dims), dst.partial)
        self.demands[root].append(demand)
      else:
        self.uses[var] = (src, self.uses.get(var, (src, []))[1] + [dst])
    if src == dst:
      return x
    memo = self._memo[-1] if self._memo and var is not None and not is_literal(var) else None
    key = var
    if memo is not None and var in self._alias:
      key, memo = self._alias[var]
    if memo is not None and (key, dst) in memo:
      return memo[key, dst]  # gathered once per scope (a parameter's forward and backward uses)
    if self.abstract:
      self._count(src, dst, jaxprs.nbytes(var.aval) if var is not None else 0)
      if memo is not None:
        memo[key, dst] = None
      return None
    x = self._converted(x, src, dst)
    if memo is not None:
      memo[key, dst] = x
    return x

  def _real(self, lay: Layout) -> Layout:
    """``lay`` without the mesh axes of size 1 (they split and sum nothing): no
    collective is inserted over them."""
    if not self._size_one & lay.axes():
      return lay
    dims = tuple(tuple(a for a in d if a not in self._size_one) for d in lay.dims)
    return Layout(dims, frozenset(lay.partial) - self._size_one)

  def _moves(self, local_bytes: int):
    """Whether moving a split over some axes by an all-to-all of a piece of
    ``local_bytes`` at least halves the time of gathering it over them. Only then: NCCL
    runs an all-to-all as send/recv on fewer channels, and XLA combines small gathers
    into one collective, not all-to-alls, so where both are latency-bound (a small
    model's activations) the gathers cost less in the step."""

    def pays(axes) -> bool:
      if not self.all_to_all:
        return False
      n, topology = self.n(axes), self.topology
      a2a = cost_model.collective_time("all-to-all", local_bytes, n, topology)
      return 2 * a2a <= cost_model.collective_time("all-gather", local_bytes * n, n, topology)

    return pays

  def _plan(self, src: Layout, dst: Layout, whole_bytes: int) -> list[tuple]:
    """The collectives and slices that convert a value of ``whole_bytes`` from ``src`` to
    ``dst`` (axes of size 1 left out), in order: ``("reduce-scatter", axes, d)`` along the
    dimensions the result splits over summed axes (an FSDP gradient over "fsdp", and over
    "tensor" along its other dimension where that splits it too), then
    ``("all-reduce", axes)`` over the others on the scattered piece (over "data" where the
    batch is also split there: what the partitioner does for a 2-D mesh), then
    :func:`relayout.steps`."""
    src, dst = self._real(src), self._real(dst)
    dims, plan = list(src.dims), []
    red = set(src.partial) - set(dst.partial)
    if red:
      scattered, red = relayout.scatter_dims(src, dst, red)
      for d in scattered:
        plan.append(("reduce-scatter", dst.dims[d], d))
        dims[d] = dst.dims[d]
      if red:
        plan.append(("all-reduce", tuple(a for a in self.sizes if a in red)))
    local = whole_bytes // self.n([a for d in dims for a in d])
    return plan + relayout.steps(dims, dst.dims, self._moves(local))

  def _converted(self, x, src: Layout, dst: Layout):
    whole = jaxprs.nbytes(x) * self.n([a for d in src.dims for a in d])
    for step in self._plan(src, dst, whole):
      kind, axes = step[:2]
      if kind == "reduce-scatter":
        x = lax.psum_scatter(x, axes, scatter_dimension=step[2], tiled=True)
      elif kind == "all-reduce":
        x = lax.psum(x, axes)
      elif kind == "all-to-all":
        x = lax.all_to_all(x, axes, split_axis=step[3], concat_axis=step[2], tiled=True)
      elif kind == "all-gather":
        x = lax.all_gather(x, axes, axis=step[2], tiled=True)
      else:
        d, size = step[2], x.shape[step[2]] // self.n(axes)
        x = lax.dynamic_slice_in_dim(x, self._index(axes) * size, size, axis=d)
    add = (set(dst.partial) - set(src.partial)) - self._size_one
    if add:
      axes = tuple(a for a in self.sizes if a in add)
      x = jnp.where(self._index(axes) == 0, x, jnp.zeros_like(x))
    return x

  def reduced(self, src: Layout, dst: Layout):
    """A rule's post-processing that converts its one result from ``src`` to ``dst`` (a
    sum reduced where it is made), counted as the collectives the conversion inserts."""

    def post(outs):
      return [self._converted(outs[0], src, dst)]

    post.layouts = (src, dst)
    return post

  def _count(self, src: Layout, dst: Layout, whole_bytes: int) -> None:
    """Counts the collectives :meth:`_converted` inserts for a value of ``whole_bytes``."""
    for step in self._plan(src, dst, whole_bytes):
      if step[0] != "slice":
        self.counts[step[0]] += 1

  # -- running a jaxpr -------------------------------------------------------

  def run(self, jaxpr, consts, vals, lays, out_wants=None):
    """Per-device outputs and layouts of ``jaxpr`` given its inputs' values and layouts."""
    self._memo.append({})
    try:
      return self._run(jaxpr, consts, vals, lays, out_wants)
    finally:
      self._memo.pop()
      for v in getattr(jaxpr, "eqns", ()) and [o for e in jaxpr.eqns for o in e.outvars]:
        self._alias.pop(v, None)

  def _run(self, jaxpr, consts, vals, lays, out_wants):
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = (c, Layout.whole(len(getattr(c, "shape", ()))))
    for v, x, lay in zip(jaxpr.invars, vals, lays):
      env[v] = (x, lay)

    def read(v):
      if is_literal(v):
        return v.val, Layout.whole(len(getattr(v.aval, "shape", ())))
      return env[v]

    for eqn in jaxpr.eqns:
      if eqn.effects and any(
        type(e).__name__ not in ("NamedAxisEffect", "InternalMutableArrayEffect")
        for e in eqn.effects
      ):
        raise Refused(f"{eqn.primitive.name} has side effects ({eqn.effects})")
      ins = [read(v) for v in eqn.invars]
      if all(not is_literal(v) and v in self.params_only for v in eqn.invars if not is_literal(v)):
        for o in eqn.outvars:
          self.params_only.add(o)
      outs = self.eqn(eqn, ins)
      if eqn.primitive.name in _SAME_VALUE and self._memo:
        # The same value under another name (a checkpoint name, a constraint it already
        # met): converted once for both.
        for u, v, (_, lay) in zip(eqn.invars, eqn.outvars, outs):
          if not is_literal(u) and not isinstance(v, jcore.DropVar) and lay == read(u)[1]:
            self._alias[v] = self._alias.get(u, (u, self._memo[-1]))
      for v, (x, lay) in zip(eqn.outvars, outs):
        if isinstance(v, jcore.DropVar):
          continue
        want = self.hints.get(v)
        if want is not None and want != lay:
          x = self.convert(v, x, lay, want)
          lay = want
        env[v] = (x, lay)
    outs = [read(v) for v in jaxpr.outvars]
    if out_wants is not None:
      outs = [
        (self.convert(v, x, lay, w), w) for v, (x, lay), w in zip(jaxpr.outvars, outs, out_wants)
      ]
    return outs

  def eqn(self, eqn, ins):
    name = eqn.primitive.name
    if name in _INLINE:
      jaxpr, consts = _sub_closed(eqn)
      if len(jaxpr.invars) != len(ins):
        raise Refused(f"{name}: its jaxpr takes {len(jaxpr.invars)} inputs, given {len(ins)}")
      self._mark(jaxpr.invars, eqn.invars)
      # Evaluated in the caller's trace: a conversion of one of its inputs is the caller's.
      before = {v: self._alias[v] for v in jaxpr.invars if v in self._alias}
      if self._memo:
        for v, u in zip(jaxpr.invars, eqn.invars):
          if not is_literal(u):
            self._alias[v] = self._alias.get(u, (u, self._memo[-1]))
      try:
        outs = self.run(jaxpr, consts, [x for x, _ in ins], [lay for _, lay in ins])
        # An input the call returns as it is (an identity, a pass-through) is the same value.
        for inner, outer, (_, lay) in zip(jaxpr.outvars, eqn.outvars, outs):
          if (
            not is_literal(inner) and inner in self._alias and not isinstance(outer, jcore.DropVar)
          ):
            src = dict(zip(jaxpr.invars, ins)).get(inner)
            if src is not None and src[1] == lay:
              self._alias[outer] = self._alias[inner]
      finally:
        for v in jaxpr.invars:
          self._alias.pop(v, None)
        self._alias.update(before)
      return self._link(jaxpr, eqn, outs)
    if name in _REMAT:
      return self._link(eqn.params["jaxpr"], eqn, self._remat(eqn, ins))
    if name == "scan":
      return self._scan(eqn, ins)
    if name == "while":
      return self._while(eqn, ins)
    if name == "cond":
      return self._cond(eqn, ins)
    if name in ("sharding_constraint", "reshard"):
      return self._constraint(eqn, ins)
    if name in ("shard_map", "axis_index", "psum", "all_gather", "ppermute"):
      raise Refused(f"{name} already names mesh axes; the program is not a GSPMD program")
    rule = RULES.get(name)
    if rule is None and name in ELEMENTWISE:
      rule = elementwise
    planned = rule(self, eqn, [lay for _, lay in ins]) if rule is not None else None
    if planned is None:
      return self._replicated(eqn, ins)
    wants, out_lays, params, post = planned
    bad = [lay for lay in (*wants, *out_lays) if not lay.valid()]
    if bad:  # a rule's mistake: refused rather than computed wrong
      raise Refused(
        f"{name}: no layout can be both split and summed over one axis ({bad[0].describe()})"
      )
    return self._bind(eqn, ins, wants, out_lays, params, post)

  def _link(self, jaxpr, eqn, outs):
    """``outs`` of a called ``jaxpr``; a sum it returns keeps, outside, the root it has
    inside (so that the layout its uses want reaches where it was made)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for inner, outer, (_, lay) in zip(jaxpr.outvars, eqn.outvars, outs):
      if lay.partial and not is_literal(inner) and not isinstance(outer, jcore.DropVar):
        self.root[outer] = self.root.get(inner, (inner, None))
    return outs

  def _mark(self, inner, outer) -> None:
    """Marks the inputs of a called jaxpr that hold parameters."""
    for v, u in zip(inner, outer):
      if is_literal(u) or u in self.params_only:
        self.params_only.add(v)

  def _bind(self, eqn, ins, wants, out_lays, params=None, post=None):
    for v, w in zip(eqn.invars, wants):
      if not is_literal(v):
        self.wanted[v].append((id(eqn), w))
    vals = [self.convert(v, x, lay, w) for v, (x, lay), w in zip(eqn.invars, ins, wants)]
    if not self.abstract:
      if callable(params):  # the equation as other operations
        outs = params(*vals)
      else:
        # No global sharding inside the body (Explicit axes put one in the parameters).
        outs = eqn.primitive.bind(
          *vals, **bound_in_body(params if params is not None else eqn.params)
        )
        outs = outs if eqn.primitive.multiple_results else [outs]
      if post is not None:
        outs = post(outs)
    else:
      outs = [None] * len(eqn.outvars)
      if getattr(post, "layouts", None) is not None:  # a conversion (Interpreter.reduced)
        self._count(*post.layouts, jaxprs.nbytes(eqn.outvars[0].aval))
      elif post is not None:  # a rule's own collective (a pmax, a pmin)
        self.counts["all-reduce"] += 1
    # A sum made here is its own root; one passed through an elementwise linear op keeps
    # its root (whose dimensions are the same), also where the sums it combines share one
    # (a clipped gradient: select_n(norm > max, g * scale, g)); a transposed one keeps it
    # with its dimensions permuted (a scanned layer's stacked gradient, laid out as the
    # parameter), so that the layout its uses want reaches where the sum was made.
    name = eqn.primitive.name
    for v, lay in zip(eqn.outvars, out_lays):
      if lay.partial:
        src = [
          u
          for u, (_, l_in), w in zip(eqn.invars, ins, wants)
          if not is_literal(u) and w.partial and l_in.partial
        ]
        roots = {self.root.get(u, (u, None)) for u in src}
        shape = tuple(v.aval.shape)
        if name in ELEMENTWISE and len(roots) == 1 and all(u.aval.shape == shape for u in src):
          self.root[v] = roots.pop()
        elif name == "transpose" and len(roots) == 1:
          root, perm = roots.pop()
          order = eqn.params["permutation"]
          self.root[v] = (
            root,
            tuple(order[d] if perm is None else perm[order[d]] for d in range(len(order))),
          )
        else:
          self.root[v] = (v, None)
    return list(zip(outs, out_lays))

  def _replicated(self, eqn, ins):
    """A primitive without a rule: whole inputs, whole outputs on every device."""
    wants = [Layout.whole(len(getattr(v.aval, "shape", ()))) for v in eqn.invars]
    if any(lay != w for (_, lay), w in zip(ins, wants)):
      self.replicated.append(eqn.primitive.name)
    outs = [Layout.whole(len(getattr(v.aval, "shape", ()))) for v in eqn.outvars]
    return self._bind(eqn, ins, wants, outs)

  # -- structured primitives ---------------------------------------------------

  def constant(self, v):
    """The value of ``v`` where it is a literal or a literal laid out, else None."""
    if is_literal(v):
      return v.val
    return self.constants.get(v)

  def _constraint(self, eqn, ins):
    (x, lay), (v,) = ins[0], eqn.invars[:1]
    if is_literal(v):
      # A constant laid out (from jax 0.12.1 a transpose's zero padding, reshard(0.0)):
      # the same constant, known as one to the rules that read it.
      self.constants[eqn.outvars[0]] = v.val
      return [(x, lay)]
    sharding = eqn.params.get("sharding", eqn.params.get("dst_sharding"))
    where = {
      "reshard": "a reshard (the jit's in_shardings or out_shardings, or jax.sharding.reshard)",
      "sharding_constraint": "a with_sharding_constraint",
    }.get(eqn.primitive.name, eqn.primitive.name)
    want = _layout_of(sharding, len(v.aval.shape), self.sizes, where)
    if want is None:
      return [(x, lay)]
    if lay.partial:
      # A constraint on an unreduced sum (the cotangent of a gathered parameter) is
      # left to the sum's use: reduce-scattered to the parameter's layout where GSPMD
      # would all-reduce and slice (which XLA then rewrites into the same reduce-scatter).
      return [(x, lay)]
    free = eqn.params.get("unconstrained_dims") or ()
    shape = v.aval.shape
    # A split the dim's size does not divide (the partitioner pads it) stays whole here.
    dims = tuple(
      lay.dims[d] if d in free else want.dims[d] if shape[d] % self.n(want.dims[d]) == 0 else ()
      for d in range(len(want.dims))
    )
    want = Layout(dims)
    return [(self.convert(v, x, lay, want), want)]

  def _remat(self, eqn, ins):
    p = eqn.params
    jaxpr = p["jaxpr"]
    jaxpr, consts = (jaxpr.jaxpr, list(jaxpr.consts)) if hasattr(jaxpr, "consts") else (jaxpr, [])
    vals = [x for x, _ in ins]
    self._mark(jaxpr.invars, eqn.invars)
    if not self.abstract and not self.in_loop and p.get("differentiated") and p.get("prevent_cse"):
      # What the remat lowering does: keep XLA from merging the recomputation with the
      # forward pass. In a loop body (a scanned layer's backward) there is no forward
      # pass to merge with, and the scan pipeliner finds the gathers without a barrier.
      cse = p["prevent_cse"]
      cse = (cse,) * len(vals) if isinstance(cse, bool) else tuple(cse)
      idx = [i for i, c in enumerate(cse) if c]
      held = lax.optimization_barrier([vals[i] for i in idx])
      for i, h in zip(idx, held):
        vals[i] = h
    return self.run(jaxpr, consts, vals, [lay for _, lay in ins])

  def _loop_carry(self, body, consts, const_lays, carry_lays, rest_lays, n_out):
    """A fixed point of the carry's layouts through ``body`` (abstract runs).

    A carry the body leaves unreduced stays an unreduced sum from one iteration to the
    next (a gradient accumulated over microbatches is reduced once, after the loop),
    unless the body reduces it where it reads it: then it is reduced where the body makes
    it. Both cost one reduction per iteration; reduced, the carry is also saved whole for
    the backward pass (a scanned layer's residual stream under tensor parallelism, which
    a rematerialized backward would otherwise reduce again per layer)."""
    carry = list(carry_lays)
    reduced: dict[int, Layout] = {}  # carries the body reduces at their use
    first = len(const_lays)
    for _ in range(6):
      sub = self.abstract_copy()
      outs = sub.run(body, consts, [None] * len(body.invars), const_lays + carry + rest_lays)
      for k, lay in enumerate(carry):
        added = set(lay.partial) - set(carry_lays[k].partial)
        wants = sub.demands.get(body.invars[first + k], ())
        if added and any(added - set(w.partial) for w in wants):
          reduced[k] = Layout(lay.dims, carry_lays[k].partial)
      new = [reduced.get(k, lay) for k, (_, lay) in enumerate(outs[:n_out])]
      if new == carry:
        return carry, [lay for _, lay in outs]
      carry = new
    carry = [Layout.whole(len(c.dims)) for c in carry]
    sub = self.abstract_copy()
    outs = sub.run(body, consts, [None] * len(body.invars), const_lays + carry + rest_lays)
    return carry, [lay for _, lay in outs]

  def _scan(self, eqn, ins):
    p = eqn.params
    nc, nk = scan_sizes(eqn)
    body, bconsts = p["jaxpr"].jaxpr, list(p["jaxpr"].consts)
    lays = [lay for _, lay in ins]
    xs_want = [Layout(((),) + lay.dims[1:], lay.partial) for lay in lays[nc + nk :]]
    xs_body = [Layout(lay.dims[1:], lay.partial) for lay in xs_want]
    self._mark(body.invars[:nc], eqn.invars[:nc])
    self._mark(body.invars[nc + nk :], eqn.invars[nc + nk :])
    carry, outs = self._loop_carry(body, bconsts, lays[:nc], lays[nc : nc + nk], xs_body, nk)
    ys = [lay for lay in outs[nk:]]
    for i, v in enumerate(eqn.outvars[nk:]):
      hint = self.hints.get(v)
      if hint is not None and not hint.dims[0]:
        ys[i] = Layout(hint.dims[1:], hint.partial)
    out_lays = carry + [Layout(((),) + y.dims, y.partial) for y in ys]
    wants = lays[:nc] + carry + xs_want
    vals = [self.convert(v, x, lay, w) for v, (x, lay), w in zip(eqn.invars, ins, wants)]
    for v, lay in zip(eqn.outvars[nk:], out_lays[nk:]):
      if lay.partial:
        self.root[v] = (v, None)
    inner = self
    if self.abstract:
      self.run(body, bconsts, [None] * len(body.invars), lays[:nc] + carry + xs_body, carry + ys)
      return [(None, lay) for lay in out_lays]
    consts_v = vals[:nc]

    def step(c, xs):
      outer, inner.in_loop = inner.in_loop, True
      outs = inner.run(body, bconsts, [*consts_v, *c, *xs], lays[:nc] + carry + xs_body, carry + ys)
      inner.in_loop = outer
      return [x for x, _ in outs[:nk]], [x for x, _ in outs[nk:]]

    kw = {}
    if "_split_transpose" in p:
      kw["_split_transpose"] = p["_split_transpose"]
    c, y = lax.scan(
      step,
      vals[nc : nc + nk],
      vals[nc + nk :],
      length=p["length"],
      reverse=p["reverse"],
      unroll=p["unroll"],
      **kw,
    )
    return list(zip([*c, *y], out_lays))

  def _while(self, eqn, ins):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    lays = [lay for _, lay in ins]
    carry, _ = self._loop_carry(
      body.jaxpr, list(body.consts), lays[cn : cn + bn], lays[cn + bn :], [], len(lays) - cn - bn
    )
    wants = lays[: cn + bn] + carry
    vals = [self.convert(v, x, lay, w) for v, (x, lay), w in zip(eqn.invars, ins, wants)]
    if self.abstract:
      self.run(body.jaxpr, list(body.consts), [None] * len(body.jaxpr.invars), wants[cn:], carry)
      return [(None, lay) for lay in carry]
    cvals, bvals = vals[:cn], vals[cn : cn + bn]
    inner = self

    def cond_fn(c):
      ((x, lay),) = inner.run(
        cond.jaxpr, list(cond.consts), [*cvals, *c], lays[:cn] + carry, [Layout(())]
      )
      return x

    def body_fn(c):
      outer, inner.in_loop = inner.in_loop, True
      outs = inner.run(body.jaxpr, list(body.consts), [*bvals, *c], wants[cn:], carry)
      inner.in_loop = outer
      return [x for x, _ in outs]

    out = lax.while_loop(cond_fn, body_fn, vals[cn + bn :])
    return list(zip(out, carry))

  def _cond(self, eqn, ins):
    branches = eqn.params["branches"]
    lays = [Layout.whole(0)] + [lay for _, lay in ins[1:]]
    per = []
    for br in branches:
      sub = self.abstract_copy()
      per.append(
        [
          lay
          for _, lay in sub.run(br.jaxpr, list(br.consts), [None] * len(br.jaxpr.invars), lays[1:])
        ]
      )
    out_lays = [
      ls[0] if all(x == ls[0] for x in ls) else Layout.whole(len(ls[0].dims)) for ls in zip(*per)
    ]
    vals = [self.convert(v, x, lay, w) for v, (x, lay), w in zip(eqn.invars, ins, lays)]
    if self.abstract:
      for br in branches:
        self.run(br.jaxpr, list(br.consts), [None] * len(br.jaxpr.invars), lays[1:], out_lays)
      return [(None, lay) for lay in out_lays]
    fns = [functools.partial(self._branch, br, lays[1:], out_lays) for br in branches]
    out = lax.switch(vals[0], fns, *vals[1:])
    return list(zip(out, out_lays))

  def _branch(self, br, lays, out_lays, *args):
    return [x for x, _ in self.run(br.jaxpr, list(br.consts), list(args), lays, out_lays)]


# ---------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------


def _layout_of(sharding, ndim: int, sizes: dict[str, int], where: str) -> Layout | None:
  """The layout a NamedSharding asks for (None: not a NamedSharding, nothing asked)."""
  if not isinstance(sharding, NamedSharding):
    if sharding is None or type(sharding).__name__ in ("UnspecifiedValue", "AUTO"):
      return None
    if getattr(sharding, "is_fully_replicated", False):
      return Layout.whole(ndim)
    raise Refused(f"{where} has a {type(sharding).__name__}, not a NamedSharding")
  mesh = sharding.mesh
  if dict(mesh.shape) != sizes:
    raise Refused(
      f"{where} is laid out on mesh {dict(mesh.shape) or '{} (no axes)'}, not the "
      f"arguments' mesh {sizes}: build the step with the arguments' mesh"
    )
  dims: list[Axes] = []
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  for entry in spec[:ndim]:
    if entry is None or entry is P.UNCONSTRAINED:
      dims.append(())
    else:
      dims.append(tuple(entry) if isinstance(entry, tuple) else (entry,))
  if getattr(sharding, "_partial", None) or getattr(sharding.spec, "unreduced", None):
    raise Refused(f"{where} is unreduced")
  return Layout(tuple(dims))


def input_layouts(leaves) -> tuple[Any, list[Layout]]:
  """The mesh of the arguments and each leaf's layout on it.

  Raises:
    Refused: no argument is laid out over a mesh, or they use different meshes, or an
      argument has a sharding other than a NamedSharding.
  """
  mesh = None
  for x in leaves:
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding) and math.prod(s.mesh.shape.values()) > 1:
      if mesh is None:
        mesh = s.mesh
      elif dict(s.mesh.shape) != dict(mesh.shape) or s.mesh.axis_names != mesh.axis_names:
        raise Refused(f"arguments lie on two meshes: {dict(mesh.shape)} and {dict(s.mesh.shape)}")
  if mesh is None:
    raise Refused("no argument is laid out over a mesh of more than one device")
  sizes = dict(mesh.shape)
  lays = []
  for i, x in enumerate(leaves):
    nd = len(getattr(x, "shape", ()))
    s = getattr(x, "sharding", None)
    lay = _layout_of(s, nd, sizes, f"argument leaf {i}") if s is not None else None
    if lay is None or not isinstance(s, NamedSharding):
      lay = Layout.whole(nd)
    lays.append(lay)
  return mesh, lays


def convert(
  closed,
  leaves,
  out_shardings=None,
  params_leaves: Sequence[int] = (),
  target=None,
  all_to_all: bool = True,
) -> Converted:
  """The step ``closed`` (a ClosedJaxpr over the flattened ``leaves``) as a shard_map.

  Args:
    closed: the step's jaxpr, traced over global shapes.
    leaves: the flattened arguments (arrays or ShapeDtypeStructs with NamedShardings).
    out_shardings: the step's requested output shardings, flattened (None entries or
      None: the layouts the conversion arrives at, unreduced sums reduced).
    params_leaves: positions of the leaves holding parameters (gathered at use where a
      layout conflict needs one side whole).
    target: the topology whose collective costs choose between an all-to-all and a
      gather where a split moves between dimensions (None: h100x8).
    all_to_all: False gathers and slices every split moved between dimensions (what
      the all-to-alls gain, measured against it).

  Raises:
    Refused: the program cannot be converted; the message says why.
  """
  mesh, in_lays = input_layouts(leaves)
  sizes = dict(mesh.shape)
  topology = targets_lib.get(target or "h100x8")
  jaxpr, consts = closed.jaxpr, list(closed.consts)
  n_out = len(jaxpr.outvars)
  asked: list[Layout | None] = [None] * n_out
  if out_shardings is not None:
    for i, (s, v) in enumerate(zip(out_shardings, jaxpr.outvars)):
      asked[i] = _layout_of(s, len(v.aval.shape), sizes, f"output {i}")
  for i, v in enumerate(jaxpr.outvars):
    if asked[i] is None and has_explicit_axes(getattr(v.aval.sharding, "mesh", None)):
      # On Explicit axes an output's layout is in its type, as the step returns it.
      asked[i] = _layout_of(v.aval.sharding, len(v.aval.shape), sizes, f"output {i}")
  params = {jaxpr.invars[i] for i in params_leaves}

  def outs_wanted(got: list[Layout]) -> list[Layout]:
    return [a if a is not None else Layout(g.dims) for a, g in zip(asked, got)]

  hints: dict = {}
  # Primitives computed whole: from every pass (a later one gathers their inputs where
  # they are made, following the hints, so it no longer sees them gathered).
  replicated: list[str] = []
  wanted_before: dict = {}
  for _ in range(8):
    it = Interpreter(sizes, set(params), hints, True, wanted_before, topology, all_to_all)
    got = [lay for _, lay in it.run(jaxpr, consts, [None] * len(in_lays), in_lays)]
    replicated += [r for r in it.replicated if r not in replicated]
    for v, lay, want in zip(jaxpr.outvars, got, outs_wanted(got)):
      it.convert(v, None, lay, want)  # what the outputs ask for, recorded like any use
    new: dict = {}
    # A sum goes, right where it is made, to the most split layout its uses want (a
    # gradient reduce-scattered, not all-reduced, where one use is a split parameter's).
    for root, wanted in it.demands.items():
      best = max(wanted, key=lambda w: (sum(bool(d) for d in w.dims), -len(w.partial)))
      new[root] = best
    # Another value goes to the layout all its uses want, when they agree (an optimizer's
    # elementwise update runs on the shards its state lives on).
    # A hint its uses still agree with stays (its value is now made in, or converted
    # right away to, the layout they want).
    for var, (lay, wanted) in it.uses.items():
      if len(set(wanted)) == 1 and not wanted[0].partial:
        if wanted[0] != lay or hints.get(var) == wanted[0]:
          new[var] = wanted[0]
    if new == hints and it.wanted == wanted_before:
      break
    hints, wanted_before = new, dict(it.wanted)
  out_lays = outs_wanted(got)
  counts = dict(it.counts)

  def body(*local):
    run = Interpreter(sizes, set(params), hints, False, wanted_before, topology, all_to_all)
    outs = run.run(jaxpr, consts, list(local), in_lays, out_lays)
    return tuple(x for x, _ in outs)

  in_specs = tuple(lay.spec() for lay in in_lays)
  out_specs = tuple(lay.spec() for lay in out_lays)
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  return Converted(fn, in_specs, out_specs, counts, replicated)
