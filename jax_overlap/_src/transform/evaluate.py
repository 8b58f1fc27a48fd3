"""Re-evaluating the traced program with the plan: ``shard_map`` bodies in the planned order,
collective matmul rings, pipelined loops."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Literal

import jax
from jax.experimental.xla_metadata import set_xla_metadata

from jax_overlap._src.collective_matmul.nd import gather_dots_kept
from jax_overlap._src.fsdp.pipeline import after
from jax_overlap._src.transform import batch_parts, embedding, first_pieces, scan_pipeline, ties
from jax_overlap._src.transform.explain import Action
from jax_overlap._src.transform.jaxprs import OPAQUE, contains_collectives, is_var
from jax_overlap._src.transform.planning import BodyPlan, plan_body
from jax_overlap._src.transform.settings import CollectiveMatmul, ReduceScatter
from jax_overlap._src.transform.stats import RewriteStats


def eval_eqn(eqn, invals, metadata: dict[str, str] | None):
  """Binds one equation as ``jax.core.eval_jaxpr`` does, optionally under XLA metadata."""
  from jax._src import source_info_util

  subfuns, params = [], eqn.primitive.get_bind_params(eqn.params)
  ctx = getattr(eqn, "ctx", None)
  manager = getattr(ctx, "manager", None)
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
    with manager if manager is not None else contextlib.nullcontext():
      if metadata:
        with set_xla_metadata(**metadata):
          out = eqn.primitive.bind(*subfuns, *invals, **params)
      else:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def _environment(jaxpr, consts, args):
  """The variable environment of an evaluation, and its reader (literals read as values)."""
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return v.val if not is_var(v) else env[v]

  return env, read


def _run_ring(ring, env, read, wait_for: list, kept: dict) -> bool:
  """Runs an N-D gather -> dots ring; False (and the plain gather) if a weight is not ready.
  The ring's dots wait for ``wait_for`` (weight gradients run while it travels). A
  gathered value also needed elsewhere goes to ``kept`` unassembled (``rings.Kept``)."""

  x, gather, dots, collect, opts = ring
  eqns_w = []
  for d in dots:
    lhs = d.invars[0] is gather.outvars[0]
    w = d.invars[1] if lhs else d.invars[0]
    if is_var(w) and w not in env:
      out = eval_eqn(gather, [read(x)], None)[0]
      env[gather.outvars[0]] = ties.after_all(out, wait_for)
      return False
    aval = d.outvars[0].aval
    eqns_w.append(
      (
        ties.after_all(read(w), wait_for),
        lhs,
        d.params["dimension_numbers"],
        d.params.get("precision"),
        d.params.get("preferred_element_type"),
        tuple(aval.shape),
        aval.dtype,
      )
    )
  axis = gather.params["axis_name"]
  axis = axis[0] if isinstance(axis, tuple) else axis
  outs, held = gather_dots_kept(
    read(x), eqns_w, axis=axis, gather_dim=gather.params["all_gather_dimension"], **opts
  )
  for d, o in zip(dots, outs):
    env[d.outvars[0]] = o
  if collect:
    kept[gather.outvars[0]] = held
  return True


def _assembled_beside(kept: dict, vs: list) -> tuple:
  """Takes the kept values ``vs`` out of ``kept``: the ``beside`` of a reduce-scatter in
  pieces that puts them in order while its last piece travels."""
  held = [kept.pop(v) for v in vs]
  cuts = [0]
  for h in held:
    cuts.append(cuts[-1] + len(h.parts))

  def assemble(*parts):
    return tuple(h.assemble(parts[a:b]) for h, a, b in zip(held, cuts, cuts[1:]))

  return assemble, tuple(p for h in held for p in h.parts)


def _run(jaxpr, consts, args, plan: BodyPlan | None):
  _, read = _run_env(jaxpr, consts, args, plan)
  return [read(v) for v in jaxpr.outvars]


def _scan(eqn, invals: list, plan: BodyPlan):
  """Scan ``eqn`` on ``invals`` with its body evaluated by ``plan`` (made for the body
  ``scan_pipeline.loop_body`` gives)."""
  return scan_pipeline.rescan(eqn, invals, lambda jx, cs, args: _run(jx, cs, args, plan))


def _run_env(jaxpr, consts, args, plan: BodyPlan | None, skip: frozenset = frozenset(), given=None):
  """Evaluates ``jaxpr`` under ``plan``; (its environment, its reader). Equations in
  ``skip`` are not run: their outputs come from ``given`` (eqn index -> value), if there."""
  env, read_env = _environment(jaxpr, consts, args)
  order = plan.order if plan is not None else range(len(jaxpr.eqns))
  ring_done: dict[int, bool] = {}
  pieced: dict = {}  # a first gather's value -> its pieces (first_pieces.py)
  kept: dict = {}  # gathered values rings keep, not yet put in order (rings.Kept)

  def read(v):
    if is_var(v) and v in kept:  # read before a reduce-scatter took it: assembled here
      env[v] = kept.pop(v).assemble()
    if is_var(v) and v in pieced and v not in env:  # a first gather read whole
      env[v] = pieced[v].whole()
    return read_env(v)

  def weight_gradients_before(g: int) -> list:
    """The weight gradients all-gather ``g``'s users wait for (none without a plan)."""
    return [read(jaxpr.eqns[w].outvars[0]) for w in plan.wgrad_before.get(g, ())]

  for i in order:
    eqn = jaxpr.eqns[i]
    if i in skip:
      if given and i in given:
        env[eqn.outvars[0]] = given[i]
      continue
    if plan is not None and i in plan.ring_of:
      # Every ring whose gathered value this equation reads runs first (in the order they
      # were planned: a ring's dot may read another's gathered value).
      for g in plan.ring_of[i]:
        if g not in ring_done:
          ring = plan.rings[g]
          ring_done[g] = _run_ring(
            (ring[0], ring[1], [jaxpr.eqns[u] for u in ring[2]], ring[3], ring[4]),
            env,
            read,
            weight_gradients_before(g),
            kept,
          )
      if any(ring_done[g] and i in plan.rings[g][2] for g in plan.ring_of[i]):
        continue  # this dot's output came from a ring
    if plan is not None and i in plan.skipped:
      continue  # computed by the collective matmul that replaces it
    if plan is not None and i in plan.fused:
      kind, lhs, rhs, kw = plan.fused[i]
      from jax_overlap._src import collective_matmul as cm_lib

      if kind == "all_gather_nd":  # a 2-D all-gather -> dot, in pieces
        kw = dict(kw)
        dot = (
          read(rhs),
          True,
          kw.pop("dimension_numbers"),
          kw.pop("precision"),
          kw.pop("preferred_element_type"),
          tuple(eqn.outvars[0].aval.shape),
          kw.pop("out_dtype"),
        )
        (out,), _ = cm_lib.all_gather_dot_generals(read(lhs), [dot], **kw)
        env[eqn.outvars[0]] = out
        continue
      fn = {
        "all_gather": cm_lib.all_gather_matmul,
        "reduce_scatter": cm_lib.matmul_reduce_scatter,
        "reduce_scatter_nd": cm_lib.dot_general_reduce_scatter,
      }[kind]
      a, b = read(lhs), read(rhs)
      vs = [jaxpr.eqns[g].outvars[0] for g in plan.assemble_beside.get(i, ())]
      vs = [v for v in vs if v in kept]
      if vs:
        env[eqn.outvars[0]], fulls = fn(a, b, **kw, beside=_assembled_beside(kept, vs))
        env.update(zip(vs, fulls))
      else:
        env[eqn.outvars[0]] = fn(a, b, **kw)
      continue
    if plan is not None and i in plan.lookups:  # the table stays sharded
      lk = plan.lookups[i]
      outs = embedding.eval_lookup(eqn, lk, jaxpr.eqns[lk.table], read, eval_eqn)
      env.update(zip(eqn.outvars, outs))
      continue
    if plan is not None and i in plan.row_scatters:  # its reduce-scatter's result, directly
      rs = plan.row_scatters[i]
      (out,) = embedding.eval_scatter(eqn, rs, jaxpr.eqns[rs.scatter], read, eval_eqn)
      env[jaxpr.eqns[rs.scatter].outvars[0]] = out
      continue
    if plan is not None and i in plan.batch_parts:  # the body in parts of its batch
      dims, n = plan.batch_parts[i]
      outs, _ = batch_parts.run_scan(
        eqn, [read(v) for v in eqn.invars], dims, lambda e, v: eval_eqn(e, v, None), n
      )
      env.update(zip(eqn.outvars, outs))
      continue
    if plan is not None and (i in plan.scans or i in plan.loop_bodies):
      invals = ties.tied_before(i, eqn, [read(v) for v in eqn.invars], plan, read, jaxpr)
      inner = plan.loop_bodies.get(i)  # None: the iteration as written
      if i not in plan.scans:
        outs = _scan(eqn, invals, inner)
      else:

        def layer(jx, cs, xs, skip_, given_, inner=inner):
          return _run_env(jx, cs, xs, inner, skip_, given_)

        issued = plan.prologue_after.get(i)
        outs = scan_pipeline.run(
          eqn,
          invals,
          plan.scans[i],
          eval_eqn,
          layer,
          None if issued is None else lambda x, e=jaxpr.eqns[issued]: ties.tied(x, e, read),
        )
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
      continue
    md = plan.metadata.get(i) if plan is not None else None
    if plan is not None and i in plan.piece_dots:  # the matmul first reading one, in pieces
      g = plan.piece_dots[i]
      var = jaxpr.eqns[g].outvars[0]
      invals = [None if v is var else read(v) for v in eqn.invars]
      bind = lambda e, vals, md=md: eval_eqn(e, vals, md)  # noqa: E731 - the dot's own
      env[eqn.outvars[0]] = pieced[var].dot(eqn, invals, var, bind)
      if plan.first_pieces[g].whole:  # its other readers get the pieces put together
        env[var] = pieced[var].whole()
      continue
    invals = [read(v) for v in eqn.invars]
    if plan is not None and i in plan.scatters_before_loop:
      invals = ties.tied_before(i, eqn, invals, plan, read, jaxpr)
    prev = plan.chain_prev.get(i) if plan is not None else None
    if prev is not None and invals:
      invals[0] = after(invals[0], read(jaxpr.eqns[prev].outvars[0]))
    issued = plan.issue_after.get(i) if plan is not None else None
    if issued is not None and invals and plan.ties_read_through:
      invals[0], v, through = ties.tied_through(invals[0], jaxpr.eqns[issued], read)
      if v is not None:
        env[v] = through
    elif issued is not None and invals:
      invals[0] = ties.tied(invals[0], jaxpr.eqns[issued], read)
    first = plan.after_pieces.get(i) if plan is not None else None
    if first is not None and jaxpr.eqns[first].outvars[0] in pieced:  # after its pieces
      invals[0] = pieced[jaxpr.eqns[first].outvars[0]].before(invals[0])
    if plan is not None and i in plan.first_pieces:  # a first gather, in pieces
      fp = plan.first_pieces[i]
      bind = lambda e, vals, md=md: eval_eqn(e, vals, md)  # noqa: E731
      pieced[eqn.outvars[0]] = first_pieces.Gathering(eqn, invals[0], fp, bind)
      continue
    outs = eval_eqn(eqn, invals, md)
    if plan is not None and i in plan.wgrad_before:  # its users wait for the weight gradients
      outs = [ties.after_all(outs[0], weight_gradients_before(i))]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  for v in list(kept):  # kept for the body's outputs or for nothing this order reached
    env[v] = kept.pop(v).assemble()
  return env, read


Program = Literal["traced", "shard_map"]
Loops = Literal["all", "forward", "none"]


@dataclasses.dataclass(frozen=True)
class VariantConfig:
  """How one variant evaluates the step: the rewrite's settings (from ``Settings``) and
  what the variant changes (which program, how the collectives are ordered).

  Made once per build by :meth:`from_settings`; the variants derive theirs from it with
  ``dataclasses.replace`` (or :meth:`as_written`)."""

  prefetch: int
  reduce_scatter: ReduceScatter
  annotate: bool
  collective_matmul: CollectiveMatmul = "off"
  target: Any = None  # a targets.Topology, or None for the cost model's default
  # Tie each gather where the cost model issues it; the step's first gathers and every
  # reduce-scatter one by one.
  chain: bool = False
  # id(shard_map body) -> positions of its inputs that carry parameters (parameter_inputs)
  param_inputs: dict | None = dataclasses.field(default=None, compare=True, hash=False)
  param_avals: frozenset | None = None  # parameter_avals
  # Which program the variant evaluates: the step as traced, or its shard_map form
  # (a GSPMD step converted by to_shard_map).
  program: Program = "traced"
  # Row lookups of a table sharded by rows run without gathering it, where the cost model
  # says so (embedding.py).
  embedding: bool = True
  # Backward weight gradients run while the next activation all-gather travels.
  defer_weight_gradients: bool = True
  # Which lax.scan bodies get collective matmuls and deferred weight gradients of their own:
  # "all", "forward" (not the reversed scans of the backward pass) or "none".
  loops: Loops = "all"
  # The most bytes of parameters gathered ahead of first use in a body (None: no cap).
  prefetch_memory: int | None = None
  # Loop bodies with activation collectives evaluated in this many parts of their batch
  # (batch_parts.py), in place of their own plans; 1: as one.
  batch_parts: int = 1

  @classmethod
  def from_settings(
    cls, settings, annotate: bool, param_inputs: dict | None, param_avals: frozenset | None
  ) -> VariantConfig:
    """The rewrite ``settings`` (a checked :class:`~.settings.Settings`) ask for, with the
    parameter evidence read from the traced program."""
    return cls(
      prefetch=settings.prefetch,
      reduce_scatter=settings.reduce_scatter,
      annotate=annotate,
      collective_matmul=settings.collective_matmul,
      target=settings.target,
      param_inputs=param_inputs,
      param_avals=param_avals,
      defer_weight_gradients=settings.weight_gradients == "defer",
      prefetch_memory=settings.prefetch_memory,
    )

  def as_written(self) -> VariantConfig:
    """The same program evaluated as written (nothing moved, no rings)."""
    return dataclasses.replace(
      self,
      prefetch=0,
      reduce_scatter="as_written",
      collective_matmul="off",
      chain=False,
      defer_weight_gradients=False,
      loops="none",
      embedding=False,
      batch_parts=1,
    )


def evaluate_program(closed, args, cfg: VariantConfig):
  """Evaluates a top-level jaxpr, rewriting the bodies of its shard_maps."""
  jaxpr = closed.jaxpr
  env, read = _environment(jaxpr, closed.consts, args)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name == "shard_map":
      outs = _run_shard_map(eqn, invals, cfg)
    elif name in ("pjit", "jit") and "jaxpr" in eqn.params:
      outs = evaluate_program(eqn.params["jaxpr"], invals, cfg)
      outs = _constrain(outs, eqn.params.get("out_shardings"))
    else:
      outs = eval_eqn(eqn, invals, None)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _constrain(outs, shardings):
  if not shardings:
    return outs
  res = []
  for o, s in zip(outs, shardings):
    if isinstance(s, jax.sharding.NamedSharding):
      o = jax.lax.with_sharding_constraint(o, s)
    res.append(o)
  return res


def collect_stats(
  jaxpr, cfg: VariantConfig, actions: list, counter: list, stats: RewriteStats | None = None
) -> RewriteStats:
  """Plans every shard_map body the evaluator will rewrite, in the same order; the
  statistics of ``stats`` and those bodies."""
  stats = RewriteStats() if stats is None else stats
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "shard_map":
      counter[0] += 1
      plan = _plan_for(cfg, eqn, f"shard_map #{counter[0]}")
      actions.extend(plan.actions)
      stats = stats.including(plan)
    elif name in ("pjit", "jit") and "jaxpr" in eqn.params:
      stats = collect_stats(eqn.params["jaxpr"].jaxpr, cfg, actions, counter, stats)
    elif name in OPAQUE and contains_collectives(eqn):
      actions.append(
        Action(
          "left_alone",
          name,
          "collectives inside a custom derivative or loop are left as "
          "written (use jax_overlap.fsdp.scan_layers for scanned layers)",
        )
      )
  return stats


def _plan_for(cfg: VariantConfig, eqn, where: str) -> BodyPlan:
  """The plan of shard_map ``eqn``'s body under ``cfg``."""
  return plan_body(
    eqn.params["jaxpr"],
    where,
    cfg.prefetch,
    cfg.reduce_scatter,
    cfg.annotate,
    cfg.chain,
    cfg.collective_matmul,
    cfg.target,
    _params_of(cfg, eqn),
    cfg.param_avals,
    cfg.defer_weight_gradients,
    cfg.param_inputs,
    frozenset(),
    cfg.loops,
    lookups=cfg.embedding,
    prefetch_memory=cfg.prefetch_memory,
    batch_split=cfg.batch_parts,
  )


def _params_of(cfg: VariantConfig, eqn) -> frozenset | None:
  if cfg.param_inputs is None:
    return None
  return cfg.param_inputs.get(id(eqn.params["jaxpr"]), frozenset())


def _run_shard_map(eqn, invals, cfg: VariantConfig):
  params = eqn.params
  body = params["jaxpr"]
  plan = _plan_for(cfg, eqn, "")
  consts = getattr(body, "consts", ())
  inner = body.jaxpr if hasattr(body, "jaxpr") and not hasattr(body, "eqns") else body

  def new_body(*args):
    return tuple(_run(inner, consts, args, plan))

  kwargs = dict(
    mesh=params["mesh"], in_specs=tuple(params["in_specs"]), out_specs=tuple(params["out_specs"])
  )
  if "check_vma" in params:
    kwargs["check_vma"] = params["check_vma"]
  manual = params.get("newly_manual_axes", params.get("manual_axes"))
  mesh_axes = set(params["mesh"].axis_names)
  if manual is not None and set(manual) != mesh_axes:
    kwargs["axis_names"] = set(manual)
  out = jax.shard_map(new_body, **kwargs)(*invals)
  return list(out) if isinstance(out, (tuple, list)) else [out]
