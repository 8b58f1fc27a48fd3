"""Pipelining the collectives of a user's own ``lax.scan`` over layers.

A scan over stacked layers written the usual way (``lax.scan`` over a body that
all-gathers its layer's parameters, under ``jax.checkpoint`` or not; the transposed scan
that autodiff makes of it, whose body reduce-scatters each layer's gradient into the
scan's stacked outputs; the rematerialized forward inside it) issues each collective
where its layer's compute needs it, so nothing hides it. :func:`plan` finds, in one scan
body:

* gathers of the iteration's own slice of a stacked input (``xs``), possibly through
  pure operations on that slice alone (a cast of f32 master weights to bf16), and
* reduce-scatters whose result is one of the scan's stacked outputs (``ys``) and nothing
  else,

and :func:`run` evaluates the scan with the gathers one iteration early (the first layer
is gathered before the loop, iteration i gathers layer i+1 and carries it to iteration
i+1; with ``prefetch`` = d, d iterations early, d gathered layers carried) and the
reduce-scatters one iteration late (iteration i scatters iteration i-1's
gradient, carried unscattered; the last one is scattered after the loop). Every layer
still runs inside the loop, as the scan it replaces compiled it, so results are
bit-identical. The cost: one gathered layer and one unscattered gradient carried between
iterations, and per loop one gather (the last iteration's, of the first layer again) and
one reduce-scatter (the first iteration's, of zeros) whose results are unused, both issued
where the layer's compute can hide them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_overlap._src.transform.jaxprs import (
  GATHER,
  SCATTER,
  is_var,
  producers,
  scan_sizes,
  var_users,
)

__all__ = ["ScanPlan", "plan", "run"]

_EFFECTFUL = ("all_gather", "reduce_scatter", "psum", "ppermute", "all_to_all", "axis_index")


@dataclasses.dataclass(frozen=True)
class ScanPlan:
  """What :func:`run` moves in one scan (indices into the body's equations).

  Attributes:
    gathers: all-gathers of one stacked input's slice, issued one iteration early.
    chains: gather -> the body equations that compute its input from the slice (in order)
      and the position of that slice among the body's inputs.
    scatters: reduce-scatters whose result is a stacked output, issued one iteration late.
    outputs: reduce-scatter -> position of its result among the body's outputs.
    tails: reduce-scatter -> the pure equations between it and that output (in order).
    reason: why nothing was moved (empty when something was).
    depth: how many iterations early the gathers go (``prefetch``): the first ``depth``
      layers are gathered before the loop and ``depth`` gathered layers are carried.
  """

  gathers: tuple[int, ...] = ()
  chains: dict = dataclasses.field(default_factory=dict)
  scatters: tuple[int, ...] = ()
  outputs: dict = dataclasses.field(default_factory=dict)
  tails: dict = dataclasses.field(default_factory=dict)
  reason: str = ""
  depth: int = 1

  @property
  def moved(self) -> frozenset:
    """The body equations taken out of the iteration: the moved collectives and the
    operations after each reduce-scatter."""
    tails = (j for s in self.scatters for j in self.tails.get(s, ()))
    return frozenset(self.gathers) | frozenset(self.scatters) | frozenset(tails)

  def __bool__(self) -> bool:
    return bool(self.gathers or self.scatters)


# Rematerialization markers (jax.checkpoint): after autodiff they only group equations, so
# their bodies are inlined into the scan body where collectives can be seen and moved.
_REMAT = ("remat2", "checkpoint", "remat")
_INLINED: dict[int, tuple] = {}


def _inline(jaxpr):
  """``jaxpr`` with the bodies of its rematerialization equations inlined (recursively)."""
  if not any(e.primitive.name in _REMAT for e in jaxpr.eqns):
    return jaxpr
  alias: dict = {}

  def sub(a):
    while is_var(a) and a in alias:
      a = alias[a]
    return a

  eqns = []
  for e in jaxpr.eqns:
    inner = e.params.get("jaxpr") if e.primitive.name in _REMAT else None
    if inner is None:
      eqns.append(e.replace(invars=[sub(v) for v in e.invars]))
      continue
    inner = _inline(getattr(inner, "jaxpr", inner))
    if getattr(inner, "constvars", ()):
      eqns.append(e.replace(invars=[sub(v) for v in e.invars]))
      continue
    boundary = dict(zip(inner.invars, [sub(v) for v in e.invars]))
    for ie in inner.eqns:
      eqns.append(ie.replace(invars=[boundary.get(v, v) if is_var(v) else v for v in ie.invars]))
    for ov, iv in zip(e.outvars, inner.outvars):
      alias[ov] = boundary.get(iv, iv) if is_var(iv) else iv
  return jaxpr.replace(eqns=eqns, outvars=[sub(v) for v in jaxpr.outvars])


def loop_body(eqn):
  """The scan's body (rematerialization inlined; the same object for the same scan) and
  its constants."""
  closed = eqn.params["jaxpr"]
  hit = _INLINED.get(id(closed))
  if hit is None or hit[0] is not closed:
    hit = (closed, _inline(closed.jaxpr))
    _INLINED[id(closed)] = hit
  return hit[1], tuple(getattr(closed, "consts", ()))


def plan(eqn, *, gathers: bool = True, scatters: bool = True) -> ScanPlan:
  """The collectives of scan ``eqn`` that :func:`run` can move, or the reason it cannot."""
  if eqn.primitive.name != "scan":
    return ScanPlan(reason=f"a {eqn.primitive.name} loop (only lax.scan is pipelined)")
  length = int(eqn.params["length"])
  if length < 2:
    return ScanPlan(reason=f"{length} iteration(s): nothing to pipeline across")
  jaxpr, _ = loop_body(eqn)
  n_consts, n_carry = scan_sizes(eqn)
  xs = {v: i for i, v in enumerate(jaxpr.invars) if i >= n_consts + n_carry}
  consts = set(jaxpr.invars[:n_consts])
  producer = producers(jaxpr.eqns)
  users = var_users(jaxpr.eqns)

  def chain_to_slice(v) -> tuple[int, tuple[int, ...]] | None:
    """(xs position, equations) if ``v`` is computed from one xs slice by pure equations."""
    if v in xs:
      return xs[v], ()
    i = producer.get(v)
    if i is None:
      return None
    e = jaxpr.eqns[i]
    if e.primitive.name in _EFFECTFUL or e.effects or "jaxpr" in e.params:
      return None
    src, chain = None, []
    for u in e.invars:
      if not is_var(u) or u in consts:
        continue
      sub = chain_to_slice(u)
      if sub is None or (src is not None and sub[0] != src):
        return None
      src = sub[0]
      chain.extend(j for j in sub[1] if j not in chain)
    if src is None:
      return None
    return src, (*chain, i)

  found_g, chains = [], {}
  found_s, outputs, tails = [], {}, {}
  outvars = list(jaxpr.outvars)
  for i, e in enumerate(jaxpr.eqns):
    if gathers and e.primitive.name == GATHER and is_var(e.invars[0]):
      src = chain_to_slice(e.invars[0])
      if src is not None:
        found_g.append(i)
        chains[i] = (src[0], src[1])
    if scatters and e.primitive.name == SCATTER:
      # The result may reach its stacked output through pure operations on it alone (the
      # cast back to f32 of a bf16 gradient).
      out, tail = e.outvars[0], []
      while len(users.get(out, [])) == 1 and not any(v is out for v in outvars):
        (j,) = users[out]
        t = jaxpr.eqns[j]
        others = [v for v in t.invars if is_var(v) and v is not out and v not in consts]
        if (
          t.primitive.name in _EFFECTFUL
          or t.effects
          or "jaxpr" in t.params
          or others
          or len(t.outvars) != 1
        ):
          break
        tail.append(j)
        out = t.outvars[0]
      pos = [k for k, v in enumerate(outvars) if v is out]
      if len(pos) == 1 and pos[0] >= n_carry and not users.get(out):
        found_s.append(i)
        outputs[i] = pos[0]
        tails[i] = tuple(tail)
  if not found_g and not found_s:
    return ScanPlan(
      reason="no all-gather of a layer's slice and no reduce-scatter into the stacked outputs "
      "in its body"
    )
  return ScanPlan(tuple(found_g), chains, tuple(found_s), outputs, tails)


def run(
  eqn,
  invals: list,
  p: ScanPlan,
  eval_eqn: Callable,
  layer_env: Callable,
  issue: Callable | None = None,
):
  """Evaluates scan ``eqn`` on ``invals`` with the collectives of ``p`` moved (module
  docstring). ``eval_eqn(eqn, invals, metadata)`` binds one equation; ``layer_env(jaxpr,
  consts, args, skip, given)`` evaluates one iteration's body without the equations in
  ``skip`` (their outputs from ``given``: eqn index -> value, where there), returning its
  environment and reader. ``issue(x)``: ``x`` ordered where the gathers before the loop are
  to be issued (prefetch by time), applied to their inputs; None: where XLA puts them."""
  jaxpr, body_consts = loop_body(eqn)
  n_consts, n_carry = scan_sizes(eqn)
  length, reverse = int(eqn.params["length"]), bool(eqn.params["reverse"])
  consts, carry0, xs = (
    invals[:n_consts],
    invals[n_consts : n_consts + n_carry],
    invals[n_consts + n_carry :],
  )
  n_out = len(jaxpr.outvars)
  eqns = jaxpr.eqns
  skip = p.moved
  idx = (lambda k: length - 1 - k) if reverse else (lambda k: k)

  def equations(indices, given: dict) -> dict:
    """Runs body equations ``indices`` in order, from the constants and ``given``."""
    env = dict(zip(jaxpr.constvars, body_consts))
    env.update(zip(jaxpr.invars[:n_consts], consts))
    env.update(given)
    for j in indices:
      e = eqns[j]
      vals = [v.val if not is_var(v) else env[v] for v in e.invars]
      env.update(zip(e.outvars, eval_eqn(e, vals, None)))
    return env

  def gather(step_xs: list) -> list:
    """The moved gathers of one iteration, from its slices of the stacked inputs."""
    out = []
    for g in p.gathers:
      pos, chain = p.chains[g]
      env = equations((*chain, g), {jaxpr.invars[pos]: step_xs[pos - n_consts - n_carry]})
      out.append(env[eqns[g].outvars[0]])
    return out

  def _final(s):
    """The variable a moved reduce-scatter's chain ends in (the stacked output's slice)."""
    tail = p.tails.get(s, ())
    return eqns[tail[-1]].outvars[0] if tail else eqns[s].outvars[0]

  def scatter(pending: list) -> list:
    """The moved reduce-scatters (and the operations after them) of unscattered values."""
    return [
      equations((s, *p.tails.get(s, ())), {eqns[s].invars[0]: u})[_final(s)]
      for s, u in zip(p.scatters, pending)
    ]

  def layer(carry: list, step_xs: list, gathered: list):
    """One iteration of the body with its gathers given; its carry out, its stacked
    outputs (None where a moved reduce-scatter goes) and the unscattered gradients."""
    given = dict(zip(p.gathers, gathered))
    env, read = layer_env(jaxpr, body_consts, [*consts, *carry, *step_xs], skip, given)
    pending = [read(eqns[s].invars[0]) for s in p.scatters]
    outs = [None if k in p.outputs.values() else read(v) for k, v in enumerate(jaxpr.outvars)]
    return outs[:n_carry], outs[n_carry:], pending

  def slice_at(k: int) -> list:
    return [x[k] for x in xs]

  # The first `depth` layers are gathered before the loop; iteration i gathers layer
  # i+depth (the last `depth` ones gather the first layers again, unused) and scatters
  # iteration i-1's gradient (the first one scatters zeros, unused); the last gradient is
  # scattered after the loop. Every layer runs inside the loop, as the scan it replaces
  # compiled it, so results are bit-identical.
  depth = p.depth  # 1 <= depth < length, as the planner sets it
  first = issue or (lambda x: x)
  ahead = [gather([first(x) for x in slice_at(idx(j))]) for j in range(depth)]
  pending = [_zeros(eqns[s], eqns[s].invars[0]) for s in p.scatters]
  step = -1 if reverse else 1
  # The scattered gradients go straight into their stacked outputs (updated in place).
  stacks = [_zeros(eqns[s], _final(s), (length,)) for s in p.scatters]

  def body(state, k):
    carry, ahead, pending, stacks = state
    step_xs = [jax.lax.dynamic_index_in_dim(x, k, keepdims=False) for x in xs]
    nxt = (k + depth * step) % length
    nxt_xs = [jax.lax.dynamic_index_in_dim(x, nxt, keepdims=False) for x in xs]
    following = gather(nxt_xs)  # nothing in this layer waits for it
    prev = (k - step) % length  # the first iteration's is unused and overwritten later
    stacks = [
      jax.lax.dynamic_update_index_in_dim(st, r, prev, 0) for st, r in zip(stacks, scatter(pending))
    ]
    new_carry, ys, new_pending = layer(list(carry), step_xs, list(ahead[0]))
    ahead = [*ahead[1:], following]
    return (new_carry, ahead, new_pending, stacks), [y for y in ys if y is not None]

  (carry, _, pending, stacks), ys_all = jax.lax.scan(
    body,
    (list(carry0), ahead, pending, stacks),
    jnp.arange(length),
    reverse=reverse,
    unroll=eqn.params.get("unroll", 1),
  )
  last = idx(length - 1)
  stacks = [
    jax.lax.dynamic_update_index_in_dim(st, r, last, 0) for st, r in zip(stacks, scatter(pending))
  ]
  out_ys = []
  kept = 0
  for k in range(n_carry, n_out):
    moved = [j for j, sc in enumerate(p.scatters) if p.outputs[sc] == k]
    if moved:
      out_ys.append(stacks[moved[0]])
    else:
      out_ys.append(ys_all[kept])
      kept += 1
  return [*carry, *out_ys]


def _zeros(eqn, var, lead: tuple = ()):
  """Zeros shaped like ``var`` of collective ``eqn`` (with leading ``lead`` dimensions),
  varying over the axes ``var`` varies over (the collective's axes when unknown)."""
  aval = var.aval
  z = jnp.zeros((*lead, *aval.shape), aval.dtype)
  axes = eqn.params["axis_name"]
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  vma = tuple(getattr(aval, "vma", ()) or ()) or axes
  return jax.lax.pcast(z, vma, to="varying")
