"""Collective matmul sites of a ``shard_map`` body: all-gather -> dot and dot ->
reduce-scatter pairs (2-D or N-D, one gather feeding several dots, the gathered value
also kept), each decomposed into a ring or into pieces where the cost model
(:func:`jax_overlap.collective_matmul.estimate_gain`) says it pays."""

from __future__ import annotations

import dataclasses
import functools
import math

from jax_overlap._src.transform.explain import Action
from jax_overlap._src.transform.jaxprs import (
  GATHER,
  SCATTER,
  gathered_dim_role,
  is_var,
  nbytes,
  var_users,
)

# Primitives whose output is their input's value (a name for remat policies, a copy).
_SAME_VALUE = {"name", "copy", "copy_p"}


def plan_collective_matmuls(
  eqns,
  outvars: set,
  mode: str,
  target: str | None,
  where: str,
  actions: list,
  exclude: frozenset = frozenset(),
):
  """Finds all_gather -> dot and dot -> reduce_scatter pairs worth decomposing (none of
  whose collective is in ``exclude``)."""
  if mode not in ("auto", "on", "ring", "pieces"):
    return {}, set(), {}, {}
  from jax_overlap._src import collective_matmul as cm_lib

  users = var_users(eqns)
  fused: dict[int, tuple] = {}
  skipped: set[int] = set()
  rings: dict[int, tuple] = {}
  ring_of: dict[int, list[int]] = {}

  def plain_dot(d):
    dn = d.params.get("dimension_numbers")
    return (
      d.primitive.name == "dot_general"
      and dn == (((1,), (0,)), ((), ()))
      and all(getattr(v.aval, "ndim", 0) == 2 for v in d.invars)
    )

  def worth(e, m, n, k, dtype, kind, block, collect=False):
    """The cost model's best decomposition of collective ``e`` over blocks of ``block``
    rows: (estimate, method, pieces, bidirectional)."""
    bidi = block % 2 == 0
    p = int(e.params.get("axis_size", 1))
    args = (cm_lib.estimate_gain, mode, target or "h100x8", m, n, k, p, dtype, kind)
    args += (bidi, block, collect)
    try:
      return (*_best_decomposition(*args), bidi)
    except TypeError:  # an unhashable target object: asked without the memo
      return (*_best_decomposition.__wrapped__(*args), bidi)

  def how(bidi, method, pieces, coll="all-gather"):
    if method == "pieces" and isinstance(pieces, tuple):
      return (
        f"issued as {len(pieces)} chained {coll}s of slices {pieces} of every block (NCCL "
        "collectives, not send/recv)"
      )
    if method == "pieces":
      return f"issued as {pieces} chained {coll}s of a slice of every block (NCCL collectives, not send/recv)"
    return f"decomposed into a {'bidirectional' if bidi else 'unidirectional'} ppermute ring"

  for i, e in enumerate(eqns):
    if i in exclude:
      continue
    name = e.primitive.name
    axes = e.params.get("axis_name")
    axis = axes[0] if isinstance(axes, tuple) and len(axes) == 1 else axes
    if not isinstance(axis, str) or e.params.get("axis_index_groups") is not None:
      continue
    if (
      name == GATHER
      and e.params.get("tiled")
      and not _simple_ag_dot(e, users, outvars, eqns, plain_dot)
    ):
      ring = _plan_ring(i, e, eqns, users, outvars)
      if ring is None:
        continue
      dots, collect = ring
      # A dot another ring computes (both its operands gathered) is a user like any other:
      # this gather's value is then kept for it.
      claimed = {d for r in rings.values() for d in r[2]}
      if claimed & set(dots):
        dots, collect = tuple(d for d in dots if d not in claimed), True
        if not dots:
          continue
      m, n, k = _ring_mnk(e, eqns, dots)
      n *= int(e.params.get("axis_size", 1))  # estimate_gain takes the global weight
      blk = e.invars[0].aval.shape[e.params["all_gather_dimension"]]
      dtype = e.outvars[0].aval.dtype
      est, method, pieces, bidi = worth(e, m, n, k, dtype, "all_gather", blk, collect)
      if not est.worthwhile:
        continue
      rings[i] = (
        e.invars[0],
        e,
        dots,
        collect,
        {"bidirectional": bidi, "method": method, "pieces": pieces},
      )
      for u in users.get(e.outvars[0], []):
        ring_of.setdefault(u, []).append(i)
      skipped.add(i)
      actions.append(
        Action(
          "collective_matmul",
          where,
          f"all-gather of {tuple(e.invars[0].aval.shape)} along dim {e.params['all_gather_dimension']} "
          f"feeding {len(dots)} matmul(s){' (the gathered value is also kept)' if collect else ''} "
          f"{how(bidi, method, pieces)}; estimated {est.speedup:.2f}x",
        )
      )
      continue
    if name == GATHER and e.params.get("tiled") and e.params.get("all_gather_dimension") == 0:
      out = e.outvars[0]
      us = users.get(out, [])
      if len(us) != 1 or out in outvars:
        continue  # the gathered value is needed elsewhere (e.g. saved for the backward pass)
      d = eqns[us[0]]
      if not plain_dot(d) or d.invars[0] is not out or d.invars[1] is out:
        continue
      (m, k), n = out.aval.shape, d.invars[1].aval.shape[1]
      blk = e.invars[0].aval.shape[0]
      est, method, pieces, bidi = worth(e, m, n, k, out.aval.dtype, "all_gather", blk)
      if not est.worthwhile:
        continue
      if method == "pieces":
        fused[us[0]] = (
          "all_gather_nd",
          e.invars[0],
          d.invars[1],
          {**_nd_kwargs(axis, d, pieces), "gather_dim": 0},
        )
      else:
        fused[us[0]] = ("all_gather", e.invars[0], d.invars[1], _ring_kwargs(axis, d, bidi))
      skipped.add(i)
      actions.append(
        Action(
          "collective_matmul",
          where,
          f"all-gather -> matmul ({m}x{k} @ {k}x{n}) "
          f"{how(bidi, method, pieces)}; estimated {est.speedup:.2f}x",
        )
      )
    elif name == SCATTER and e.params.get("tiled") and len(e.invars) == 1 and is_var(e.invars[0]):
      src = e.invars[0]
      prod = next((j for j in range(i) if src in eqns[j].outvars), None)
      if prod is None or len(users.get(src, [])) != 1 or src in outvars:
        continue
      # The matmul's output may reach the reduce-scatter through a name alone (MaxText's
      # checkpoint_name of an output projection): skipped with the matmul.
      passed = []
      while eqns[prod].primitive.name in _SAME_VALUE and is_var(eqns[prod].invars[0]):
        v = eqns[prod].invars[0]
        up = next((j for j in range(prod) if v in eqns[j].outvars), None)
        if up is None or len(users.get(v, [])) != 1 or v in outvars:
          break
        passed.append(prod)
        prod = up
      d = eqns[prod]
      if d.primitive.name != "dot_general":
        continue
      sd = e.params.get("scatter_dimension")
      if not (plain_dot(d) and sd == 0):
        nd = _plan_rs_nd(d, sd, int(e.params.get("axis_size", 1)))
        if nd is None:
          continue
        m, n, k = nd
        blk = e.outvars[0].aval.shape[sd]
        dtype = d.invars[0].aval.dtype
        est, method, pieces, bidi = worth(e, m, n, k, dtype, "reduce_scatter", blk)
        if not est.worthwhile:
          continue
        fused[i] = (
          "reduce_scatter_nd",
          d.invars[0],
          d.invars[1],
          {
            "axis": axis,
            "scatter_dim": sd,
            "dimension_numbers": d.params["dimension_numbers"],
            "precision": d.params.get("precision"),
            "preferred_element_type": d.params.get("preferred_element_type"),
            "out_dtype": d.outvars[0].aval.dtype,
            "bidirectional": bidi,
            "method": method,
            "pieces": pieces,
          },
        )
        skipped.add(prod)
        skipped.update(passed)
        actions.append(
          Action(
            "collective_matmul",
            where,
            f"matmul {tuple(d.invars[0].aval.shape)} x "
            f"{tuple(d.invars[1].aval.shape)} -> reduce-scatter along dim {sd} "
            f"{how(bidi, method, pieces, 'reduce-scatter')}; estimated {est.speedup:.2f}x",
          )
        )
        continue
      d = eqns[prod]
      (m, k), n = d.invars[0].aval.shape, d.invars[1].aval.shape[1]
      p = int(e.params.get("axis_size", 1))
      if m % p:
        continue
      dtype = d.invars[0].aval.dtype
      est, method, pieces, bidi = worth(e, m, n, k * p, dtype, "reduce_scatter", m // p)
      if not est.worthwhile:
        continue
      if method == "pieces":
        fused[i] = (
          "reduce_scatter_nd",
          d.invars[0],
          d.invars[1],
          {**_nd_kwargs(axis, d, pieces), "scatter_dim": 0},
        )
      else:
        fused[i] = ("reduce_scatter", d.invars[0], d.invars[1], _ring_kwargs(axis, d, bidi))
      skipped.add(prod)
      skipped.update(passed)
      actions.append(
        Action(
          "collective_matmul",
          where,
          f"matmul ({m}x{k} @ {k}x{n}) -> "
          f"reduce-scatter {how(bidi, method, pieces, 'reduce-scatter')}; estimated {est.speedup:.2f}x",
        )
      )
  return fused, skipped, rings, ring_of


@functools.lru_cache(maxsize=4096)
def _best_decomposition(
  estimate, mode, target, m, n, k, p, dtype, kind, bidirectional, block, collect
):
  """The best decomposition by the cost model ``estimate`` among those ``mode`` allows:
  the ring (both link directions only when the block splits in two), or the collective in
  pieces that divide ``block`` (:func:`_piece_schedules`). Returns (estimate, method,
  pieces), pieces a count of equal pieces or their sizes; the estimate is not worthwhile
  when no decomposition applies. Remembered per question: a selection plans the same
  sites once per variant, and a step repeats its layers' sites."""
  from jax_overlap._src import collective_matmul as cm_lib

  options = []
  if mode in ("auto", "on", "ring"):
    options.append(("ring", None))
  if mode in ("auto", "on", "pieces") and block is not None:
    options.extend(("pieces", sizes) for sizes in _piece_schedules(block, p))
  best = None
  for method, pieces in options:
    est = estimate(
      m,
      n,
      k,
      p,
      dtype=dtype,
      target=target,
      kind=kind,
      bidirectional=bidirectional and method == "ring",
      method=method,
      chunks=pieces,
      collect=collect,
    )
    if best is None or est.speedup > best[0].speedup:
      best = (est, method, pieces)
  if best is None:
    return cm_lib.GainEstimate(0.0, 0.0, 0.0, 0.0, 0.0, False), "ring", None
  est, method, pieces = best
  if mode != "auto" and not est.worthwhile:
    est = dataclasses.replace(est, worthwhile=True)
  return est, method, pieces


def _piece_schedules(block: int, p: int) -> list:
  """The pieces a collective of ``block`` rows per device may be issued in, for the cost
  model to choose from: 2, 4 ... ``p`` equal pieces (counts), and unequal ones (sizes in
  issue order): each way of splitting the block into 2 to ``p`` parts of whole
  ``block / u`` units (``u`` the largest of 16, 8, 4 dividing the block, at most ``2 p``),
  smallest first and largest first. A gather exposes its first piece and a reduce-scatter
  its last; which order hides more depends on whether the dots or the collective are the
  slower, which the cost model knows."""
  out: list = []
  c = 2
  while c <= p:
    if block % c == 0:
      out.append(c)
    c *= 2
  units = next((u for u in (16, 8, 4) if u <= 2 * p and block % u == 0), None)
  if units is None:
    return out
  size = block // units
  seen = set()
  for parts in _partitions(units, min(p, units)):
    if len(parts) < 2 or len(set(parts)) == 1:
      continue  # one piece, or equal pieces (counted above)
    for order in (tuple(sorted(parts)), tuple(sorted(parts, reverse=True))):
      if order not in seen:
        seen.add(order)
        out.append(tuple(u * size for u in order))
  return out


def _partitions(total: int, most: int, largest: int | None = None):
  """The multisets of positive ints adding up to ``total`` in at most ``most`` parts
  (each no larger than ``largest``), largest part first."""
  largest = total if largest is None else largest
  if total == 0:
    yield ()
    return
  if most == 0:
    return
  for first in range(min(total, largest), 0, -1):
    for rest in _partitions(total - first, most - 1, first):
      yield (first, *rest)


def _ring_kwargs(axis, dot, bidi: bool) -> dict:
  """Keyword arguments of the collective matmul that replaces ``dot``'s ring."""
  return {
    "axis": axis,
    "precision": dot.params.get("precision"),
    "preferred_element_type": dot.params.get("preferred_element_type"),
    "bidirectional": bidi,
  }


def _nd_kwargs(axis, dot, pieces) -> dict:
  """Keyword arguments of the N-D collective matmul that replaces a 2-D ``dot`` in pieces
  (the gathered or scattered dimension added by the caller)."""
  return {
    "axis": axis,
    "dimension_numbers": dot.params["dimension_numbers"],
    "precision": dot.params.get("precision"),
    "preferred_element_type": dot.params.get("preferred_element_type"),
    "out_dtype": dot.outvars[0].aval.dtype,
    "method": "pieces",
    "pieces": pieces,
  }


def _plan_rs_nd(d, sd, p) -> tuple[int, int, int] | None:
  """GEMM-equivalent (m, n, k) of an N-D dot whose output is reduce-scattered along ``sd``,
  or None when ``sd`` is a batch dimension or not divisible by ``p``."""
  (lc, rc), (lb, rb) = d.params["dimension_numbers"]
  if sd is None or sd < len(lb):
    return None
  out = d.outvars[0].aval.shape
  if out[sd] % max(p, 1):
    return None
  lhs, rhs = d.invars[0].aval.shape, d.invars[1].aval.shape
  k = int(math.prod(lhs[a] for a in lc))
  n = int(math.prod(rhs[a] for a in range(len(rhs)) if a not in rc and a not in rb))
  m = int(math.prod(out)) // max(n, 1)
  return m, n, k * p


def _simple_ag_dot(e, users, outvars, eqns, plain_dot) -> bool:
  """The 2-D case ``all_gather_matmul`` (with its custom VJP) handles."""
  if e.params.get("all_gather_dimension") != 0:
    return False
  out = e.outvars[0]
  us = users.get(out, [])
  if len(us) != 1 or out in outvars:
    return False
  d = eqns[us[0]]
  return plain_dot(d) and d.invars[0] is out and d.invars[1] is not out


def _plan_ring(i, e, eqns, users, outvars):
  """The dots an N-D gather feeds along a free dimension: (dots, collect) or None."""
  out = e.outvars[0]
  gd = e.params.get("all_gather_dimension")
  dots, other = [], False
  for u in users.get(out, []):
    if gathered_dim_role(eqns[u], out, gd) != "free":
      # not a dot, or gathered along a contracted or batch dimension: not a ring of slices
      other = True
      continue
    dots.append(u)
  if not dots:
    return None
  return tuple(dots), other or out in outvars


def _ring_mnk(e, eqns, dots) -> tuple[int, int, int]:
  """GEMM-equivalent (m, n, k) of the dots a ring replaces, for the cost model."""
  out = e.outvars[0]
  shape = out.aval.shape
  n_total, m, k = 0, 1, 1
  for u in dots:
    d = eqns[u]
    lhs = d.invars[0] is out
    (lc, rc), (lb, rb) = d.params["dimension_numbers"]
    xc = lc if lhs else rc
    w = d.invars[1] if lhs else d.invars[0]
    wc, wb = (rc, rb) if lhs else (lc, lb)
    k = int(math.prod(shape[a] for a in xc))
    m = int(math.prod(shape)) // max(k, 1)
    n_total += int(
      math.prod(w.aval.shape[a] for a in range(w.aval.ndim) if a not in wc and a not in wb)
    )
  return m, n_total, k


def kept_assembly_sites(
  eqns, order, rings: dict, ring_of: dict, fused: dict, outvars: set, target=None
) -> tuple[dict[int, tuple[int, ...]], float, float]:
  """Where the gathered values rings keep (``collect``) are put in order: (a reduce-scatter
  in pieces -> the rings whose kept value is assembled beside its last reduce-scatter, the
  one no dot hides (``dot_general_reduce_scatter``'s ``beside``); the copies' time and
  those reduce-scatters' time, by the cost model).

  A kept value may go to any such site after its ring in ``order`` and before anything
  reads it (in the forward pass the backward's weight gradient reads it, much later).
  Taken in ring order, each goes to the site with the most room left: the cost model's
  time of the site's last reduce-scatter less the copies already given to it; none when
  no site has room (it is then put in order where it is read). A kept value that is an
  output of the body (a loop body's residual) stays where XLA puts it: it fuses the
  concatenation into the write of the loop's stacked output, which a copy tied beside a
  reduce-scatter would make a second one (scanned TP+SP step, hidden 8192, h100x8:
  41.63 -> 41.82 ms, 0.38 ms more compute)."""
  from jax_overlap._src import targets as targets_lib
  from jax_overlap._src.analysis import cost_model as cost
  from jax_overlap._src.collective_matmul.validate import piece_sizes

  topo = targets_lib.get(target or "h100x8")
  pending: dict = {}  # gathered value -> its ring (gather index)
  windows: dict[int, list[int]] = {}  # ring -> the sites it may go to, in order
  room: dict[int, float] = {}
  run: set[int] = set()
  for i in order:
    for g in ring_of.get(i, ()):
      if g not in run:
        run.add(g)
        v = eqns[g].outvars[0]
        if rings[g][3] and v not in outvars:
          pending[v] = g
          windows[g] = []
    reads = list(eqns[i].invars) + (list(fused[i][1:3]) if i in fused else [])
    for v in reads:
      if is_var(v) and v in pending and i not in rings[pending[v]][2]:
        del pending[v]  # read here: put in order where it is read
    site = fused.get(i)
    if pending and site and site[0] == "reduce_scatter_nd" and site[3].get("method") == "pieces":
      e = eqns[i]
      n = int(e.params.get("axis_size", 1))
      block = e.outvars[0].aval.shape[site[3]["scatter_dim"]]
      last = piece_sizes("dot_general_reduce_scatter", site[3].get("pieces"), n, block)[-1] / block
      room[i] = cost.collective_time("reduce-scatter", nbytes(e.invars[0].aval) * last, n, topo)
      for g in pending.values():
        windows[g].append(i)
  sites: dict[int, list[int]] = {}
  copies_s = 0.0
  for g, cands in windows.items():
    best = max(cands, key=lambda i: room[i], default=None)  # the first of equals
    if best is None or room[best] <= 0:
      continue
    aval = eqns[g].outvars[0].aval
    copy = cost.kernel_time(0.0, 2.0 * nbytes(aval), topo.gpu)  # reads and writes it
    room[best] -= copy
    copies_s += copy
    sites.setdefault(best, []).append(g)
  room_s = sum(room[i] for i in sites) + copies_s
  return {i: tuple(gs) for i, gs in sites.items()}, copies_s, room_s
