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
gradient, carried unscattered; the last one is scattered after the loop). The cost: one
gathered layer and one unscattered gradient carried between iterations, and per loop one
gather (the last iteration's, of the first layer again) and one reduce-scatter (the first
iteration's, of zeros) whose results are unused, both issued where the layer's compute can
hide them.

Where the loop has iterations to spare (``length - 2 > prefetch``) its first and last
iterations run outside it (``ScanPlan.peel``). XLA keeps no asynchronous collective in
flight across a loop, so what comes before and after the loop otherwise has only the
compute outside it to hide under: the step's first gathers, the reduce-scatter of a
gradient computed before the backward loop (the output projection's), the last
iteration's reduce-scatters. Peeled, the first iteration gathers its layer where it uses
it (the first matmul waits for its own weight only), the next layer is gathered beside it
and its gradient is carried into the loop unscattered (no reduce-scatter of zeros); the
last iteration takes its layer from the loop and reduce-scatters each gradient where it
computes it, beside the previous iteration's. The peeled iterations run the body's own
operations; what goes in and out of each passes an optimization barrier, as a loop's carry
does (no fusion across it: without it, bfloat16 results differed from the loop's on CPU),
which also keeps the first iteration's gathers from starting before its carry exists (XLA
would issue a backward loop's at the start of the step). They cost a little memory, what
XLA keeps live around them outside the loop (on the 8-layer Llama step, h100x8: 3.28 ->
3.35 GiB per device by XLA's buffer assignment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_overlap._src.fsdp.pipeline import varying
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
    peel: the first and the last iteration run outside the loop (:func:`run`).
  """

  gathers: tuple[int, ...] = ()
  chains: dict = dataclasses.field(default_factory=dict)
  scatters: tuple[int, ...] = ()
  outputs: dict = dataclasses.field(default_factory=dict)
  tails: dict = dataclasses.field(default_factory=dict)
  reason: str = ""
  depth: int = 1
  peel: bool = False

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


def rescan(
  eqn,
  invals: list,
  evaluate: Callable,
  pack: Callable | None = None,
  unpack: Callable | None = None,
) -> list:
  """Scan ``eqn`` run on ``invals`` with each iteration's body evaluated by ``evaluate(body,
  consts, args)`` (the body as :func:`loop_body` gives it; args its constants, carries and
  one iteration's slices), the loop's length, direction and unrolling kept. ``pack(consts,
  carries, xs)`` and ``unpack(carries, ys)``: the constants, the carries and the sliced
  inputs as the loop holds them, and its carries and stacked outputs back (``evaluate`` then
  takes and gives the loop's form)."""
  jaxpr, body_consts = loop_body(eqn)
  n_consts, n_carry = scan_sizes(eqn)
  consts, carry0 = list(invals[:n_consts]), list(invals[n_consts : n_consts + n_carry])
  xs = list(invals[n_consts + n_carry :])
  if pack is not None:
    consts, carry0, xs = pack(consts, carry0, xs)

  def body(carry, x):
    outs = evaluate(jaxpr, body_consts, [*consts, *carry, *x])
    return outs[: len(carry)], outs[len(carry) :]

  carry, ys = jax.lax.scan(
    body,
    carry0,
    xs,
    length=int(eqn.params["length"]),
    reverse=bool(eqn.params["reverse"]),
    unroll=eqn.params.get("unroll", 1),
  )
  if unpack is not None:
    carry, ys = unpack(carry, ys)
  return [*carry, *ys]


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

  def slice_at(k: int) -> list:
    return [x[k] for x in xs]

  def outputs(env_read, scattered_inline: bool):
    """One iteration's carry out and stacked outputs (None where a moved reduce-scatter
    goes, unless it ran in place)."""
    outs = [
      None if (k in p.outputs.values() and not scattered_inline) else env_read(v)
      for k, v in enumerate(jaxpr.outvars)
    ]
    return outs[:n_carry], outs[n_carry:]

  def layer(carry: list, step_xs: list, gathered: list):
    """One iteration of the body with its gathers given; its carry out, its stacked
    outputs (None where a moved reduce-scatter goes) and the unscattered gradients."""
    given = dict(zip(p.gathers, gathered))
    env, read = layer_env(jaxpr, body_consts, [*consts, *carry, *step_xs], skip, given)
    pending = [read(eqns[s].invars[0]) for s in p.scatters]
    return *outputs(read, False), pending

  depth = p.depth  # 1 <= depth < length, as the planner sets it
  first = issue or (lambda x: x)
  peel = p.peel and length - 2 > depth
  if peel:
    # The first iteration runs before the loop with its gathers where the body has them
    # (the step's first gathers, per use) and its gradients left unscattered for the loop's
    # first iteration; the next `depth` layers are gathered after its gathers, beside its
    # compute. The loop runs the middle iterations; the last runs after it with its gathers
    # carried out of the loop and its reduce-scatters in place, where the compute after
    # the loop (and before it, for the first) can hide what they move.
    # Its inputs through one barrier: its gathers start once its carry exists, as in the
    # loop (XLA would otherwise issue them anywhere before: a backward loop's at the start
    # of the step, beside the forward's first gathers).
    entry = _fenced([*carry0, *[first(x) for x in slice_at(idx(0))]])
    env, read = layer_env(jaxpr, body_consts, [*consts, *entry], skip - frozenset(p.gathers), {})
    own = [read(eqns[g].outvars[0]) for g in p.gathers]
    carry, ys0 = outputs(read, False)
    carry, ys0 = _fenced(carry), [None if y is None else _fenced([y])[0] for y in ys0]
    pending = _fenced([read(eqns[s].invars[0]) for s in p.scatters])
    ahead = [gather([_after(x, own) for x in slice_at(idx(j))]) for j in range(1, depth + 1)]
    lo, last_pos = 1, length - 2
  else:
    # The first `depth` layers are gathered before the loop; iteration i gathers layer
    # i+depth (the last `depth` ones gather the first layers again, unused) and scatters
    # iteration i-1's gradient (the first one scatters zeros, unused); the last gradient
    # is scattered after the loop.
    carry = list(carry0)
    ahead = [gather([first(x) for x in slice_at(idx(j))]) for j in range(depth)]
    pending = [_zeros(eqns[s], eqns[s].invars[0]) for s in p.scatters]
    lo, last_pos = 0, length - 1
  # The scattered gradients go straight into their stacked outputs (updated in place).
  stacks = [_zeros(eqns[s], _final(s), (length,)) for s in p.scatters]
  n_loop = last_pos - lo + 1
  # The loop runs positions lo..last_pos, layers 1..length-2 when peeled (either way round).

  step = -1 if reverse else 1

  def body(state, k):
    """Layer ``k``."""
    carry, ahead, pending, stacks = state
    step_xs = [jax.lax.dynamic_index_in_dim(x, k, keepdims=False) for x in xs]
    if peel:  # at iteration position j; past the last position: a loop layer again, unused
      j = length - 1 - k if reverse else k
      nxt_j = j + depth
      nxt = idx(jnp.where(nxt_j < length, nxt_j, lo + (nxt_j - lo) % n_loop))
    else:  # past the end: the first layers again, unused
      nxt = (k + depth * step) % length
    nxt_xs = [jax.lax.dynamic_index_in_dim(x, nxt, keepdims=False) for x in xs]
    following = gather(nxt_xs)  # nothing in this layer waits for it
    # The previous iteration's gradient: without peeling, the first iteration's is zeros,
    # overwritten after the loop; peeled, the first iteration's is the peeled one's.
    prev = idx(j - 1) if peel else (k - step) % length
    stacks = [
      jax.lax.dynamic_update_index_in_dim(st, r, prev, 0) for st, r in zip(stacks, scatter(pending))
    ]
    new_carry, ys, new_pending = layer(list(carry), step_xs, list(ahead[0]))
    ahead = [*ahead[1:], following]
    return (new_carry, ahead, new_pending, stacks), [y for y in ys if y is not None]

  (carry, ahead, pending, stacks), ys_all = jax.lax.scan(
    body,
    (carry, ahead, pending, stacks),
    jnp.arange(1, length - 1) if peel else jnp.arange(length),
    reverse=reverse,
    unroll=eqn.params.get("unroll", 1),
  )
  stacks = [
    jax.lax.dynamic_update_index_in_dim(st, r, idx(last_pos), 0)
    for st, r in zip(stacks, scatter(pending))
  ]
  if peel:
    given = dict(zip(p.gathers, ahead[0]))
    env, read = layer_env(
      jaxpr,
      body_consts,
      [*consts, *_fenced(carry), *slice_at(idx(length - 1))],
      frozenset(p.gathers),
      given,
    )
    carry, ys_last = outputs(read, True)
    carry, ys_last = _fenced(carry), [None if y is None else _fenced([y])[0] for y in ys_last]
    stacks = [
      jax.lax.dynamic_update_index_in_dim(st, ys_last[p.outputs[s] - n_carry], idx(length - 1), 0)
      for st, s in zip(stacks, p.scatters)
    ]
  out_ys = []
  kept = 0
  for k in range(n_carry, n_out):
    moved = [j for j, sc in enumerate(p.scatters) if p.outputs[sc] == k]
    if moved:
      out_ys.append(stacks[moved[0]])
      continue
    ys = ys_all[kept]  # in layer order
    if peel:  # layers 0 and length-1 ran outside the loop
      at_0, at_end = ys0[k - n_carry][None], ys_last[k - n_carry][None]
      if reverse:
        at_0, at_end = at_end, at_0
      ys = jnp.concatenate([at_0.astype(ys.dtype), ys, at_end.astype(ys.dtype)])
    out_ys.append(ys)
    kept += 1
  return [*carry, *out_ys]


def _fenced(values: list) -> list:
  """``values`` through optimization barriers: computed as a loop iteration's carry is, with
  no fusion across them (a peeled iteration then rounds what it hands on as the loop would,
  and its results are the loop's). One barrier per set of mesh axes the values vary over
  (a barrier's outputs vary over all its inputs' axes, which would retype the others)."""
  values = list(values)
  groups: dict = {}
  for k, v in enumerate(values):
    groups.setdefault(varying(v), []).append(k)
  for ks in groups.values():
    for k, v in zip(ks, jax.lax.optimization_barrier(tuple(values[k] for k in ks))):
      values[k] = v
  return values


def _after(x, values: list):
  """``x``, computed after ``values`` exist (an optimization barrier ties them)."""
  if not values:
    return x
  tied = jax.lax.optimization_barrier((x, *values))
  return tied[0]


def _zeros(eqn, var, lead: tuple = ()):
  """Zeros shaped like ``var`` of collective ``eqn`` (with leading ``lead`` dimensions),
  varying over the axes ``var`` varies over (the collective's axes when unknown)."""
  aval = var.aval
  z = jnp.zeros((*lead, *aval.shape), aval.dtype)
  axes = eqn.params["axis_name"]
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  vma = tuple(getattr(aval, "vma", ()) or ()) or axes
  return jax.lax.pcast(z, vma, to="varying")
