"""Row lookups of a table sharded by rows, without gathering the table.

FSDP shards an embedding table by rows and gathers it whole before ``jnp.take(table,
tokens)``; autodiff scatter-adds the activations' cotangents into a table-sized gradient and
reduce-scatters it. When the tokens are fewer than the rows, moving the activations is
cheaper than moving the table:

* forward: the token ids are all-gathered (a few KiB), each device looks up the rows it
  holds for every device's tokens (zeros elsewhere) and a reduce-scatter over the batch
  gives each device its own tokens' rows (one device adds a row, the others add zeros);
* backward: the token ids and the cotangents are all-gathered and each device scatter-adds
  into the rows it holds; every source device's updates are added into a partial of their
  own, in their own order, and the partials summed in device order, as the reduce-scatter
  of the table-sized gradient sums them on CPU devices.

Which form runs is the cost model's choice (:func:`plan`): the table's all-gather and
reduce-scatter against the activations'. Ids outside the table keep the lookup's mode (filled
or clipped rows, dropped updates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

from jax_overlap._src.fsdp.pipeline import pcast_varying, varying
from jax_overlap._src.transform.explain import Action
from jax_overlap._src.transform.jaxprs import GATHER, SCATTER, is_var, nbytes, producers

_CALLS = ("pjit", "jit")


@dataclasses.dataclass(frozen=True)
class Lookup:
  """A row lookup (``gather``, possibly inside a call ``eqn``) of all-gathered table ``table``
  (the all-gather's equation index), run without the table's all-gather."""

  eqn: int
  table: int
  gather: object  # the gather equation (inside the call, or ``eqn``'s own)
  dim: int = 0  # the table's sharded dimension: 0 by rows, a later one by columns


@dataclasses.dataclass(frozen=True)
class RowScatter:
  """A scatter-add into a zero table (possibly inside a call ``eqn``) whose result only a
  reduce-scatter over rows (``scatter``) reads, run without the table-sized reduce-scatter."""

  eqn: int
  scatter: int
  scatter_add: object
  dim: int = 0  # the table's sharded dimension: 0 by rows, a later one by columns


def _inner(e):
  """The call's jaxpr, or None for another equation."""
  if e.primitive.name in _CALLS and "jaxpr" in e.params:
    return e.params["jaxpr"].jaxpr
  return None


def _row_gather(g, operand) -> bool:
  """``g`` is a ``gather`` of whole rows of ``operand`` by trailing-vector indices whose
  batch dimension 0 stays dimension 0."""
  if g.primitive.name != "gather" or g.invars[0] is not operand:
    return False
  dn = g.params["dimension_numbers"]
  shape = operand.aval.shape
  idx = g.invars[1].aval
  return (
    len(shape) >= 1
    and tuple(dn.collapsed_slice_dims) == (0,)
    and tuple(dn.start_index_map) == (0,)
    and not tuple(getattr(dn, "operand_batching_dims", ()))
    and tuple(g.params["slice_sizes"]) == (1, *shape[1:])
    and idx.shape[-1:] == (1,)
    and len(idx.shape) >= 2
    and tuple(dn.offset_dims)
    == tuple(range(len(idx.shape) - 1, len(idx.shape) - 1 + len(shape) - 1))
  )


def _row_scatter(s) -> bool:
  """``s`` is a ``scatter-add`` of whole rows by trailing-vector indices (batch dim 0)."""
  if s.primitive.name != "scatter-add":
    return False
  dn = s.params["dimension_numbers"]
  shape = s.invars[0].aval.shape
  idx = s.invars[1].aval
  return (
    tuple(dn.inserted_window_dims) == (0,)
    and tuple(dn.scatter_dims_to_operand_dims) == (0,)
    and not tuple(getattr(dn, "operand_batching_dims", ()))
    and idx.shape[-1:] == (1,)
    and len(idx.shape) >= 2
    and tuple(dn.update_window_dims)
    == tuple(range(len(idx.shape) - 1, len(idx.shape) - 1 + len(shape) - 1))
  )


def _only_reader(users: dict, v) -> int | None:
  readers = users.get(v, [])
  return readers[0] if len(readers) == 1 else None


def _find_lookup(e, table_var):
  """The row gather reading ``table_var`` in ``e`` (directly, or in its call body where
  nothing else reads it); None if ``e`` reads it otherwise."""
  if _row_gather(e, table_var):
    return e
  inner = _inner(e)
  if inner is None:
    return None
  pos = [k for k, v in enumerate(e.invars) if v is table_var]
  if len(pos) != 1:
    return None
  tv = inner.invars[pos[0]]
  readers = [g for g in inner.eqns if any(v is tv for v in g.invars)]
  if len(readers) != 1 or not _row_gather(readers[0], tv) or tv in inner.outvars:
    return None
  return readers[0]


# Operations that leave a zero a zero (a cast of where it varies, a copy, a dtype change).
_SAME_ZERO = ("pvary", "pcast", "copy", "copy_p", "convert_element_type")


def _zeros(v, eqns) -> bool:
  """``v`` is a broadcast zero made by ``eqns`` (autodiff's zero table)."""
  for x in eqns:
    if x.outvars and x.outvars[0] is v:
      src = x.invars[0] if x.invars else None
      if x.primitive.name in _SAME_ZERO and is_var(src):
        return _zeros(src, eqns)
      return x.primitive.name == "broadcast_in_dim" and not is_var(src) and not src.val
  return False


def _find_scatter(e, out_var, eqns):
  """The row scatter-add into a zero table producing ``out_var`` of ``e`` (directly, zeros
  made by one of ``eqns``, or as its call body's output); None otherwise."""
  if _row_scatter(e) and e.outvars[0] is out_var:
    return e if _zeros(e.invars[0], eqns) else None
  inner = _inner(e)
  if inner is None or len(e.outvars) != 1:
    return None
  (ov,) = inner.outvars
  for s in inner.eqns:
    if s.outvars and s.outvars[0] is ov:
      return s if _row_scatter(s) and _zeros(s.invars[0], inner.eqns) else None
  return None


def _times(table_kind: str, table: int, rows_kind: str, rows: int, ids: int, n: int, topo):
  """The table's collective against the ids' all-gather and the rows' collective, by the
  cost model (seconds)."""
  from jax_overlap._src.analysis import cost_model as cost

  t_table = cost.collective_time(table_kind, table, n, topo)
  t_rows = cost.collective_time("all-gather", ids, n, topo) + cost.collective_time(
    rows_kind, rows, n, topo
  )
  return t_table, t_rows


def plan(eqns, users: dict, kinds: dict, target, where: str) -> tuple[dict, dict, list]:
  """The row lookups and row scatters of a body to run without the table's collectives,
  where the cost model says the activations' collectives are cheaper: ({call eqn:
  Lookup}, {call eqn: RowScatter}, actions)."""
  from jax_overlap._src import targets as targets_lib

  topo = targets_lib.get(target or "h100x8")
  producer = producers(eqns)
  lookups: dict[int, Lookup] = {}
  scatters: dict[int, RowScatter] = {}
  actions: list[Action] = []
  for t, e in enumerate(eqns):
    if e.primitive.name == GATHER and kinds.get(t) == "parameter" and e.params.get("tiled"):
      d = int(e.params.get("all_gather_dimension", 0))
      n = int(e.params.get("axis_size", 1))
      f = _only_reader(users, e.outvars[0])
      g = None if f is None else _find_lookup(eqns[f], e.outvars[0])
      if g is None or n <= 1 or g.invars[1].aval.shape[0] < 1:
        continue
      table = nbytes(e.outvars[0].aval)
      ids = nbytes(g.invars[1].aval) * n
      if d == 0:  # every device's tokens' rows, reduce-scattered
        moved, how = nbytes(g.outvars[0].aval) * n, "reduce-scatter"
        told = "rows looked up where they are held and reduce-scattered"
      else:  # every device's tokens in this device's columns, exchanged
        moved, how = nbytes(g.outvars[0].aval), "all-to-all"
        told = "rows looked up in the columns each device holds and exchanged all-to-all"
      t_table, t_rows = _times("all-gather", table, how, moved, ids, n, topo)
      if t_rows < t_table:
        lookups[f] = Lookup(f, t, g, d)
        actions.append(
          Action(
            "embedding",
            where,
            f"lookup at equation {f} without gathering its table (all-gather #{t}, "
            f"{table / 2**20:.1f} MiB, {t_table * 1e3:.3f} ms): token ids gathered, {told} "
            f"({moved / 2**20:.1f} MiB, {t_rows * 1e3:.3f} ms by the cost model)",
          )
        )
    elif e.primitive.name == SCATTER and kinds.get(t) == "gradient":
      p = e.params
      if not p.get("tiled"):
        continue
      d = int(p.get("scatter_dimension", 0))
      n = int(p.get("axis_size", 1))
      src = e.invars[0]
      b = producer.get(src)
      if b is None or n <= 1 or _only_reader(users, src) != t:
        continue
      s = _find_scatter(eqns[b], src, eqns)
      if s is None:
        continue
      table = nbytes(src.aval)
      ids = nbytes(s.invars[1].aval) * n
      if d == 0:  # every device's cotangents, gathered
        moved, how = nbytes(s.invars[2].aval) * n, "all-gather"
        told = "token ids and cotangents all-gathered"
      else:  # every device's cotangents in this device's columns, exchanged
        moved, how = nbytes(s.invars[2].aval), "all-to-all"
        told = "token ids all-gathered, cotangents exchanged all-to-all"
      t_table, t_rows = _times("reduce-scatter", table, how, moved, ids, n, topo)
      if t_rows < t_table:
        scatters[b] = RowScatter(b, t, s, d)
        actions.append(
          Action(
            "embedding",
            where,
            f"gradient of a lookup (equation {b}) scatter-added where its rows are held "
            f"instead of reduce-scattering the table-sized gradient (reduce-scatter #{t}, "
            f"{table / 2**20:.1f} MiB, {t_table * 1e3:.3f} ms): {told} "
            f"({moved / 2**20:.1f} MiB, {t_rows * 1e3:.3f} ms by the cost model)",
          )
        )
  return lookups, scatters, actions


def _axis(params):
  a = params["axis_name"]
  return a[0] if isinstance(a, tuple) and len(a) == 1 else a


def _local_ids(ids, rows: int, axis):
  """Ids relative to this device's rows, and whether it holds them."""
  local = ids - lax.axis_index(axis).astype(ids.dtype) * rows
  return local, (local >= 0) & (local < rows)


def lookup_columns(shard, ids, g, axis, dim: int):
  """``gather`` ``g`` (a row lookup in the full table) on the local ``shard`` of its
  columns (the table's dimension ``dim``): every device's tokens looked up in them, and each
  device's own tokens' rows put together by an all-to-all."""
  every = lax.all_gather(ids, axis, axis=0, tiled=True)
  params = dict(g.params)
  params["slice_sizes"] = (1, *shard.shape[1:])
  out = lax.gather_p.bind(shard, every, **params)
  # The table's dimension `dim` is the output's dimension after the ids' batch dimensions.
  return lax.all_to_all(out, axis, 0, ids.ndim - 1 + dim - 1, tiled=True)


def lookup(shard, ids, g, axis, n: int):
  """``gather`` ``g`` (a row lookup in the full table) on the local ``shard`` of its rows."""
  rows = shard.shape[0]
  full_rows = rows * n
  mode = g.params["mode"]
  fill = mode == lax.GatherScatterMode.FILL_OR_DROP
  own = ids
  if not fill:  # clipped (or promised in bounds): clip against the whole table
    own = jnp.clip(ids, 0, full_rows - 1)
  every = lax.all_gather(own, axis, axis=0, tiled=True)
  local, held = _local_ids(every, rows, axis)
  params = dict(g.params)
  params["mode"] = lax.GatherScatterMode.PROMISE_IN_BOUNDS
  out = lax.gather_p.bind(shard, jnp.where(held, local, 0), **params)
  mask = held.reshape(held.shape[:-1] + (1,) * (out.ndim - held.ndim + 1))
  out = jnp.where(mask, out, jnp.zeros((), out.dtype))
  out = lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
  if fill:  # ids outside the table: the lookup's fill value
    outside = (own < 0) | (own >= full_rows)
    outside = outside.reshape(outside.shape[:-1] + (1,) * (out.ndim - outside.ndim + 1))
    value = g.params.get("fill_value")
    value = jnp.nan if value is None and jnp.issubdtype(out.dtype, jnp.inexact) else (value or 0)
    out = jnp.where(outside, jnp.asarray(value, out.dtype), out)
  return out


def _partials_in_device_order(zero, local, upd, params, n: int):
  """The scatter-adds of each source device's ``upd`` (``n`` equal blocks of dimension 0)
  into ``zero`` by ``local``, each into a partial of its own, summed in device order."""
  vary = pcast_varying()
  if vary is not None and varying(upd) and not varying(zero):
    zero = vary(zero, tuple(sorted(varying(upd))))
  b = local.shape[0] // n
  total = None
  for k in range(n):  # one partial per source device, summed in device order
    part = lax.scatter_add_p.bind(
      zero, local[k * b : (k + 1) * b], upd[k * b : (k + 1) * b], **params
    )
    # The barrier keeps XLA from folding the sum into the scatter-adds (add(scatter(0, ...),
    # x) -> scatter(x, ...)), which would add duplicate ids in another order.
    part = lax.optimization_barrier(part)
    total = part if total is None else total + part
  return total


def scatter_rows(zeros_shape, dtype, ids, updates, s, axis, n: int):
  """``scatter-add`` ``s`` (of ``updates`` into a zero table of ``zeros_shape`` rows by
  ``ids``), reduce-scattered over rows, computed as this device's rows of the sum."""
  rows = zeros_shape[0] // n
  mode = s.params["mode"]
  if mode != lax.GatherScatterMode.FILL_OR_DROP:
    ids = jnp.clip(ids, 0, zeros_shape[0] - 1)
  every = lax.all_gather(ids, axis, axis=0, tiled=True)
  upd = lax.all_gather(updates, axis, axis=0, tiled=True)
  local, held = _local_ids(every, rows, axis)
  local = jnp.where(held, local, rows)  # out of this device's rows: dropped
  params = dict(s.params)
  params["mode"] = lax.GatherScatterMode.FILL_OR_DROP
  zero = jnp.zeros((rows, *zeros_shape[1:]), dtype)
  return _partials_in_device_order(zero, local, upd, params, n)


def scatter_columns(zeros_shape, dtype, ids, updates, s, axis, n: int, dim: int):
  """``scatter-add`` ``s`` (of ``updates`` into a zero table of ``zeros_shape`` by
  ``ids``), reduce-scattered over the table's dimension ``dim``, computed as this device's
  columns of the sum: every device's cotangents in those columns come by an all-to-all."""
  every = lax.all_gather(ids, axis, axis=0, tiled=True)
  upd = lax.all_to_all(updates, axis, ids.ndim - 1 + dim - 1, 0, tiled=True)
  shape = list(zeros_shape)
  shape[dim] //= n
  return _partials_in_device_order(jnp.zeros(shape, dtype), every, upd, dict(s.params), n)


def run_call(e, invals: list, inner_gather_or_scatter, replace: Callable, eval_eqn: Callable):
  """Evaluates ``e`` (a call, or the gather/scatter itself) with ``replace(eqn, vals)``
  computing the equation ``inner_gather_or_scatter``."""
  if e is inner_gather_or_scatter:
    return [replace(e, invals)]
  jaxpr = e.params["jaxpr"]
  env = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
  env.update(zip(jaxpr.jaxpr.invars, invals))

  def read(v):
    return v.val if not is_var(v) else env[v]

  for x in jaxpr.jaxpr.eqns:
    vals = [read(v) if (not is_var(v) or v in env) else None for v in x.invars]
    outs = [replace(x, vals)] if x is inner_gather_or_scatter else eval_eqn(x, vals, None)
    env.update(zip(x.outvars, outs))
  return [read(v) for v in jaxpr.jaxpr.outvars]


def eval_lookup(e, lk: Lookup, table_eqn, read, eval_eqn):
  """The outputs of call ``e`` with its row lookup on the local shard (``lk``)."""
  n = int(table_eqn.params["axis_size"])
  axis = _axis(table_eqn.params)
  shard = read(table_eqn.invars[0])

  def replace(g, vals):
    if lk.dim:
      return lookup_columns(shard, vals[1], g, axis, lk.dim)
    return lookup(shard, vals[1], g, axis, n)

  invals = [None if (is_var(v) and v is table_eqn.outvars[0]) else read(v) for v in e.invars]
  return run_call(e, invals, lk.gather, replace, eval_eqn)


def eval_scatter(e, rs: RowScatter, scatter_eqn, read, eval_eqn):
  """The outputs of call ``e`` with its row scatter-add computed as this device's rows."""
  n = int(scatter_eqn.params["axis_size"])
  axis = _axis(scatter_eqn.params)

  def replace(s, vals):
    z = s.invars[0].aval
    if rs.dim:
      return scatter_columns(z.shape, z.dtype, vals[1], vals[2], s, axis, n, rs.dim)
    return scatter_rows(z.shape, z.dtype, vals[1], vals[2], s, axis, n)

  return run_call(e, [read(v) for v in e.invars], rs.scatter_add, replace, eval_eqn)
