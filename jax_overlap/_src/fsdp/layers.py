"""The per-device layer loop of :func:`scan_layers` and its VJP: replicated values deferred
to the loop, the layers rematerialised in reverse with the same prefetching."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap._src.fsdp.checks import (
  _API,
  _Config,
)
from jax_overlap._src.fsdp.pipeline import (
  _gather,
  _index,
  _one_by_one,
  _pipeline,
  _scatter,
  _store,
  pcast_varying,
  varying,
)


def _not_differentiable(e: Exception) -> TypeError:
  return TypeError(
    f"{_API}: layer_fn could not be differentiated with respect to its params and carry "
    f"(the backward pass re-runs it under jax.vjp): {type(e).__name__}: {e}"
  )


def _scan_layers_local(layer_fn, stacked, carry, cfg: _Config):
  num_layers = int(jax.tree.leaves(stacked)[0].shape[0])
  dims, axis, k = cfg.dims, cfg.axis, cfg.prefetch
  gather = functools.partial(_gather, dims=dims, axis=axis)

  # Hoist traced values that layer_fn closes over into explicit inputs, so the
  # custom_vjp can return their cotangents.
  # Shapes and types only: tracing real gathers here would leave dead ones in the program.
  example_params = jax.eval_shape(lambda s: gather(_index(s, 0), stacked=False), stacked)
  try:
    fn, consts = jax.closure_convert(layer_fn, example_params, carry)
  except TypeError as e:
    raise TypeError(f"{_API}: tracing layer_fn(params, carry) failed: {e}") from e
  except ValueError as e:
    raise ValueError(f"{_API}: tracing layer_fn(params, carry) failed: {e}") from e
  # One trace of the converted layer: its output types and its jaxpr.
  layer_jaxpr, layer_out = jax.make_jaxpr(lambda p, c, cs: fn(p, c, *cs), return_shape=True)(
    example_params, carry, consts
  )
  _check_layer_out(layer_out, carry)
  # The last layer's reduce-scatters (nothing left to hide under but that
  # layer's own backward) go one by one, in the order the backward pass
  # produces their inputs (the reverse of the order layer_fn uses the params),
  # so the first ones overlap the rest of the layer's backward.
  order = _use_order(layer_jaxpr, len(jax.tree.leaves(example_params)))

  def scatter_last(tree):
    return _one_by_one(
      lambda x, d: lax.psum_scatter(x, axis, scatter_dimension=d, tiled=True),
      tree,
      dims,
      order[::-1],
    )

  def f(full, c, cs):
    return fn(full, c, *cs)

  # Replicated leaves: their per-layer cotangent all-reduce (inserted by
  # autodiff, one per layer) becomes one all-reduce after the loop.
  deferred = _defer_replicated(layer_fn, layer_out, example_params, stacked, carry, consts, cfg)
  if deferred is not None:
    fn_b, vary, reduce = deferred

    def f_b(full, c, cs):  # full with the replicated leaves already typed varying
      return fn_b(full, c, *cs)

  policy = cfg.remat_policy

  run_layers = functools.partial(_pipeline, n=num_layers, k=k, gather=gather, unroll=cfg.unroll)

  @jax.custom_vjp
  def run(stacked_, carry_, consts_):
    def step(full, c, _):
      return f(full, c, consts_)

    c_out, ys, _ = run_layers(step, None, carry_, stacked_)
    return c_out, ys

  def run_fwd(stacked_, carry_, consts_):
    # The input carry of every layer goes into a preallocated stack (in place).
    saved0 = jax.tree.map(
      lambda a: jnp.broadcast_to(jnp.zeros_like(a)[None], (num_layers, *a.shape)), carry_
    )

    def step(full, state, i):
      c, saved = state
      saved = _store(saved, c, i)
      if policy is None:
        c2, y = f(full, c, consts_)
        return (c2, saved), (y, None)
      (c2, y), res = _vjp_residuals(f, full, c, consts_, policy)
      return (c2, saved), (y, res)

    (c_out, saved), ys_res, last = run_layers(step, None, (carry_, saved0), stacked_)
    ys, res = (None, None) if ys_res is None else ys_res
    # The last k gathered layers are kept for the backward pass, which starts
    # with them, instead of being gathered again.
    return (c_out, ys), (stacked_, saved, res, consts_, last)

  def run_bwd(residuals, cts):
    stacked_, saved, res, consts_, last = residuals
    ct_carry, ct_ys = cts
    zeros_consts = jax.tree.map(jnp.zeros_like, consts_)
    grads0 = jax.tree.map(jnp.zeros_like, stacked_)
    if deferred is not None:
      grads0 = vary(grads0)

    def layer_vjp(full, ct_c, i):
      c_in, ct_y = _index(saved, i), _index(ct_ys, i)
      r = None if res is None else _index(res, i)
      try:
        if r is None and deferred is not None:
          _, vjp_fn = jax.vjp(f_b, vary(full), c_in, consts_)
        elif r is None:
          _, vjp_fn = jax.vjp(f, full, c_in, consts_)
        else:
          vjp_fn = _vjp_from_residuals(f, full, c_in, consts_, policy, r)
        return vjp_fn((ct_c, ct_y))
      except (TypeError, ValueError, NotImplementedError) as e:
        raise _not_differentiable(e) from e

    add = lambda a, b: jax.tree.map(jnp.add, a, b)

    if k == 0:
      # No pipelining: reduce-scatter in the iteration that produced the cotangent.
      def step(full, state, i):
        ct_c, acc, grads = state
        ct_p, ct_c2, ct_k = layer_vjp(full, ct_c, i)
        grads = _store(grads, _scatter(ct_p, dims, axis), i)
        return (ct_c2, add(acc, ct_k), grads), None

      (ct_c0, ct_consts, grads), _, _ = run_layers(
        step, None, (ct_carry, zeros_consts, grads0), stacked_, reverse=True
      )
    else:
      # The cotangent of layer i is reduce-scattered in the iteration of layer i - 1.
      def first(full, state, i):
        ct_c, acc, grads = state
        ct_p, ct_c2, ct_k = layer_vjp(full, ct_c, i)
        return (ct_c2, add(acc, ct_k), grads, ct_p), None

      def step(full, state, i):
        ct_c, acc, grads, pending = state
        scattered = _scatter(pending, dims, axis)
        ct_p, ct_c2, ct_k = layer_vjp(full, ct_c, i)
        grads = _store(grads, scattered, i + 1)
        return (ct_c2, add(acc, ct_k), grads, ct_p), None

      (ct_c0, ct_consts, grads, pending), _, _ = run_layers(
        step, first, (ct_carry, zeros_consts, grads0), stacked_, reverse=True, initial=last
      )
      grads = _store(grads, scatter_last(pending), 0)
    if deferred is not None:
      grads = reduce(grads)
    return grads, ct_c0, ct_consts

  run.defvjp(run_fwd, run_bwd)
  return run(stacked, carry, consts)


def _defer_replicated(layer_fn, layer_out, example_params, stacked, carry, consts, cfg: _Config):
  """Plans one all-reduce after the loop for the cotangents of replicated leaves.

  A leaf that is not gathered (``gather_dim`` None) and does not vary over
  ``axis`` meets activations that do; autodiff then all-reduces its cotangent
  over ``axis`` in every layer's backward, and that small all-reduce holds the
  collective stream between the reduce-scatters and gathers of the loop. If
  the backward instead differentiates with respect to the leaf typed as
  varying, each device keeps its own partial cotangent, and one ``psum``
  after the loop gives the same sums.

  This holds when every use of the leaf meets values that vary over all of
  ``axis`` (else the partials would be replicated and the sum would count them
  more than once). Checked by types: re-traced with the leaf varying,
  ``layer_fn``'s outputs must vary over exactly the axes they did before.

  ``layer_out`` are the output types of ``layer_fn`` as traced for the
  forward pass. Returns ``(fn_b, vary, reduce)`` or None (leave the per-layer reductions):
  with ``remat_policy`` (its residuals are typed by the forward), under
  ``shard_map(check_vma=False)`` or where the types cannot be read.
  """
  pcast = pcast_varying()
  axes = set(cfg.axes)
  if cfg.remat_policy is not None or pcast is None:
    return None
  leaves = jax.tree.leaves(example_params)
  stacked_leaves = jax.tree.leaves(stacked)
  types = [varying(x) for x in leaves]
  checked = [varying(x) for x, d in zip(stacked_leaves, cfg.dims) if d is not None]
  checked += [varying(x) for x in jax.tree.leaves(carry)]
  if any(t is None for t in types + checked) or not any(axes <= t for t in checked):
    return None  # types unknown, or shard_map does not check them
  mask = [
    d is None and jnp.issubdtype(x.dtype, jnp.inexact) and not (axes & t)
    for x, d, t in zip(leaves, cfg.dims, types)
  ]
  if not any(mask):
    return None

  def vary(tree):
    flat, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(
      treedef, [pcast(x, cfg.axis) if m else x for x, m in zip(flat, mask)]
    )

  def reduce(tree):
    flat, treedef = jax.tree_util.tree_flatten(tree)
    picked = lax.psum([x for x, m in zip(flat, mask) if m], cfg.axis)
    it = iter(picked)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if m else x for x, m in zip(flat, mask)])

  try:
    fn_b, consts_b = jax.closure_convert(layer_fn, jax.eval_shape(vary, example_params), carry)
    if len(consts_b) != len(consts) or any(a is not b for a, b in zip(consts_b, consts)):
      return None
    after = jax.eval_shape(lambda p, c: fn_b(vary(p), c, *consts), example_params, carry)
  except Exception:  # noqa: BLE001 - any failure keeps the per-layer reductions
    return None
  if [varying(x) for x in jax.tree.leaves(layer_out)] != [
    varying(x) for x in jax.tree.leaves(after)
  ]:
    return None
  return fn_b, vary, reduce


def _use_order(closed, n: int) -> list[int]:
  """Indices of the first ``n`` inputs of ``closed`` in the order it first uses them.

  Uses inside nested calls (jit, checkpoint, custom derivatives) count where
  the nested computation uses them.
  """
  never = (float("inf"),)

  def first_uses(jaxpr, invars) -> dict:
    pos = {v: never for v in invars}
    for k, e in enumerate(jaxpr.eqns):
      subs = [getattr(p, "jaxpr", p) for p in e.params.values()]
      subs = [j for j in subs if hasattr(j, "eqns") and len(j.invars) == len(e.invars)]
      for a, v in enumerate(e.invars):
        if hasattr(v, "val") or v not in pos or pos[v] != never:
          continue
        if subs:
          inner = first_uses(subs[0], [subs[0].invars[a]])[subs[0].invars[a]]
          pos[v] = (k, *inner) if inner != never else (k,)
        else:
          pos[v] = (k,)
    return pos

  invars = closed.jaxpr.invars[:n]
  pos = first_uses(closed.jaxpr, invars)
  return sorted(range(n), key=lambda i: (pos[invars[i]], i))


def _check_layer_out(out, carry):
  """``out``: the output shapes of one layer (``jax.make_jaxpr(..., return_shape=True)``)."""
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(
      f"{_API}: layer_fn must return a pair (carry, y), got {jax.tree.structure(out)}"
    )
  new_c = out[0]
  want = jax.tree.map(lambda x: (tuple(np.shape(x)), jnp.dtype(x.dtype)), carry)
  got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), new_c)
  if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(
    want, is_leaf=lambda x: isinstance(x, tuple)
  ) != jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, tuple)):
    raise TypeError(
      f"{_API}: layer_fn must return a carry with the structure, shapes and dtypes of "
      f"carry; expected {want}, got {got}"
    )


def _vjp_residuals(f, full, c, consts, policy):
  """Runs ``f`` under ``jax.vjp`` of a checkpointed ``f`` and returns its residuals.

  Residual leaves that are the gathered parameters or the input carry
  themselves are replaced by None: the backward pass has them (it re-gathers
  the parameters and saves the carry anyway), so they are not saved twice.
  """
  out, vjp_fn = jax.vjp(jax.checkpoint(f, policy=policy), full, c, consts)
  leaves, _ = jax.tree_util.tree_flatten(vjp_fn)
  known = {id(x) for x in jax.tree.leaves((full, c))}
  kept = [None if id(x) in known else x for x in leaves]
  return out, kept


def _vjp_from_residuals(f, full, c, consts, policy, kept):
  """Rebuilds the vjp function of :func:`_vjp_residuals` from saved residuals."""
  _, vjp_fn = jax.vjp(jax.checkpoint(f, policy=policy), full, c, consts)
  leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
  known = {id(x) for x in jax.tree.leaves((full, c))}
  if len(leaves) != len(kept):
    raise ValueError(
      f"{_API}: remat_policy residuals changed structure between forward and backward"
    )
  merged = [x if id(x) in known else r for x, r in zip(leaves, kept)]
  return jax.tree_util.tree_unflatten(treedef, merged)
