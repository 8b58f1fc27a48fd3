"""Parameter, input and activation collectives on FSDP x tensor/sequence-parallel meshes.

In these models the mesh axis a collective runs over says by construction what it moves:
over ``fsdp`` the step gathers parameter shards and reduce-scatters their gradients; over
``tensor`` it gathers the sequence of the activations and reduce-scatters row-parallel
partial sums. The classifier does not look at axis names; the tests compare its answer
with them.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.transform import jaxprs, planning

B, S, H, F = 8, 16, 32, 64


def _mesh():
  return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)


def _block(x, w1, w2):
  # x: [B/4, S/2, H], sequence-parallel over tensor; w1: [H/4, F/2]; w2: [F/2, H/4].
  w1 = jax.lax.all_gather(w1, "fsdp", axis=0, tiled=True)  # parameter
  w2 = jax.lax.all_gather(w2, "fsdp", axis=1, tiled=True)  # parameter
  xg = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)  # activation (sequence)
  h = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", xg, w1))  # column parallel
  o = jnp.einsum("bsf,fh->bsh", h, w2)  # row parallel: partial sums
  return x + jax.lax.psum_scatter(o, "tensor", scatter_dimension=1, tiled=True)


def _loss(params, x):
  for w1, w2 in params:
    x = _block(x, w1, w2)
  return jax.lax.pmean(jnp.mean(x**2), ("fsdp", "tensor"))


def _args(layers):
  mesh = _mesh()
  k = jax.random.key(0)
  params = [
    (
      jax.random.normal(jax.random.fold_in(k, 2 * i), (H, F)) * 0.1,
      jax.random.normal(jax.random.fold_in(k, 2 * i + 1), (F, H)) * 0.1,
    )
    for i in range(layers)
  ]
  x = jax.random.normal(jax.random.fold_in(k, 99), (B, S, H))
  specs = [(P("fsdp", "tensor"), P("tensor", "fsdp"))] * layers
  return mesh, params, x, specs


def _grad_inside(layers):
  mesh, params, x, specs = _args(layers)

  def step(params, x):
    loss, grads = jax.value_and_grad(_loss)(params, x)
    return loss, grads

  f = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(specs, P("fsdp", "tensor")), out_specs=(P(), specs))
  )
  return f, params, x


def _grad_outside(layers):
  mesh, params, x, specs = _args(layers)
  loss = jax.shard_map(_loss, mesh=mesh, in_specs=(specs, P("fsdp", "tensor")), out_specs=P())
  return jax.jit(jax.value_and_grad(loss)), params, x


def _truth(eqn):
  """What the collective moves, from its axis: the set of right answers."""
  axis = eqn.params["axis_name"]
  axis = axis[0] if isinstance(axis, tuple) else axis
  if eqn.primitive.name == "all_gather":
    # Over tensor: the batch itself ("input"), an activation computed in the step, or
    # in a transposed body a cotangent received as the body's input ("input").
    return {"parameter"} if axis == "fsdp" else {"input", "activation"}
  return {"gradient"} if axis == "fsdp" else {"activation"}


def _bodies(jaxpr):
  for e in jaxpr.eqns:
    if e.primitive.name == "shard_map":
      yield e.params["jaxpr"]
    for sub in jaxprs.subjaxprs(e):
      yield from _bodies(sub)


@pytest.mark.parametrize(
  "build", [_grad_inside, _grad_outside], ids=["grad_inside", "grad_outside"]
)
@pytest.mark.parametrize("layers", [1, 3])
def test_every_collective_classified_as_its_axis_says(build, layers):
  f, params, x = build(layers)
  closed = f.trace(params, x).jaxpr
  n_params = len(jax.tree.leaves(params))
  evidence = planning.parameter_inputs(closed.jaxpr, closed.jaxpr.invars[:n_params])
  shapes = planning.parameter_avals(closed.jaxpr, evidence)
  seen = {"parameter": 0, "input": 0, "activation": 0, "gradient": 0}
  for body in _bodies(closed.jaxpr):
    kinds = planning.classify_collectives(body, evidence[id(body)], shapes)
    for i, e in enumerate(body.eqns):
      if e.primitive.name in ("all_gather", "reduce_scatter"):
        assert kinds[i] in _truth(e), (i, e.primitive.name, e.params["axis_name"])
        seen[kinds[i]] += 1
  # Forward: two parameter gathers, one gather of the sequence and one activation
  # reduce-scatter per layer; backward: a gradient reduce-scatter per parameter and the
  # transposes of the sequence collectives.
  assert seen["parameter"] == 2 * layers and seen["gradient"] == 2 * layers
  # At least each layer's forward reduce-scatter and its gather of the sequence.
  assert seen["activation"] >= layers and seen["activation"] + seen["input"] >= 2 * layers


def test_explain_prefetches_parameters_only_and_says_which_is_which():
  f, params, x = _grad_inside(3)
  e = jax_overlap.overlap(f, prefetch=1).explain(params, x)
  (line,) = [a.detail for a in e.of_kind("classify")]
  assert line.startswith("6 parameter all-gather(s)")
  assert "1 all-gather(s) of other inputs (the batch)" in line
  assert "6 gradient reduce-scatter(s)" in line
  # The six parameter gathers are issued by time, each listed; no activation gather is.
  (prefetched,) = [a.detail for a in e.of_kind("prefetch")]
  assert prefetched.startswith("6 parameter all-gather(s) issued by the cost model's time")
  assert len(e.of_kind("gather_timing")) == 6


def test_forward_only_programs_and_params_argnums():
  # Inference: the parameters are still the first argument.
  mesh, params, x, specs = _args(2)
  fwd = jax.jit(
    jax.shard_map(
      lambda p, x: _block(_block(x, *p[0]), *p[1]),
      mesh=mesh,
      in_specs=(specs, P("fsdp", "tensor")),
      out_specs=P("fsdp", "tensor"),
    )
  )
  e = jax_overlap.overlap(fwd, prefetch=1).explain(params, x)
  (line,) = [a.detail for a in e.of_kind("classify")]
  assert line.startswith("4 parameter all-gather(s)") and "1 all-gather(s) of other inputs" in line
  assert "1 activation all-gather(s)" in line
  # The arguments the other way round: step(batch, params) with params_argnums=1.
  swapped = jax.jit(
    jax.shard_map(
      lambda x, p: _block(_block(x, *p[0]), *p[1]),
      mesh=mesh,
      in_specs=(P("fsdp", "tensor"), specs),
      out_specs=P("fsdp", "tensor"),
    )
  )
  e = jax_overlap.overlap(swapped, prefetch=1, params_argnums=1).explain(x, params)
  (line2,) = [a.detail for a in e.of_kind("classify")]
  assert line2 == line
  with pytest.raises(ValueError, match="params_argnums must be a non-negative int"):
    jax_overlap.overlap(swapped, params_argnums=-1)


def test_tensor_sequence_parallel_example_has_no_parameter_gathers():
  # jax_overlap.examples.tp_sp: a Megatron-style TP+SP step. Its weights are sharded over
  # the tensor axis and never gathered; every all-gather moves the sequence (the batch for
  # the first, activations computed in the step for the others), and nothing is prefetched.
  from jax_overlap.examples import tp_sp

  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(AxisType.Auto,))
  fn, args = tp_sp.build(mesh=mesh, layers=2, hidden=64, mlp=128, heads=8, seq=64, dtype="float32")
  e = jax_overlap.overlap(fn, prefetch=1).explain(*args)
  (line,) = [a.detail for a in e.of_kind("classify")]
  assert line.startswith("0 parameter all-gather(s)")
  assert "1 all-gather(s) of other inputs" in line
  assert "7 activation all-gather(s) and 7 activation reduce-scatter(s)" in line
  assert "0 gradient reduce-scatter(s)" in line
  assert e.of_kind("prefetch") == []


def test_only_weight_gradients_of_activation_gathers_wait_for_a_later_gather():
  # Here a parameter gather's dots contract its gathered dimension too (the forward's
  # x @ w1 contracts w1's gathered rows): those are the layers, never deferred (in a
  # training step they are also ancestors of every later gather). What waits for a later
  # activation all-gather is each weight gradient x_gathered^T dy of a gathered
  # activation, and only for a gather that does not depend on it.
  from jax_overlap._src.transform import weight_gradients

  f, params, x = _grad_inside(3)
  closed = f.trace(params, x).jaxpr
  n_params = len(jax.tree.leaves(params))
  evidence = planning.parameter_inputs(closed.jaxpr, closed.jaxpr.invars[:n_params])
  shapes = planning.parameter_avals(closed.jaxpr, evidence)
  deferred_total = 0
  for body in _bodies(closed.jaxpr):
    eqns = body.eqns
    kinds = planning.classify_collectives(body, evidence[id(body)], shapes)
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    variables = [[v for v in e.invars if not hasattr(v, "val")] for e in eqns]  # no literals
    deps = [[producer[v] for v in vs if v in producer] for vs in variables]
    gathered_by = {eqns[g].outvars[0]: g for g in kinds if eqns[g].primitive.name == "all_gather"}
    deferred = weight_gradients.plan(eqns, deps, kinds, list(range(len(eqns))))
    for w, (p, g) in deferred.items():
      (source,) = [gathered_by[v] for v in variables[w] if v in gathered_by]
      assert kinds[source] in ("activation", "input") and kinds[g] in ("activation", "input")
      assert w < g and p < g and p == producer[eqns[g].invars[0]]
    param_dots = {
      u
      for u, e in enumerate(eqns)
      if e.primitive.name == "dot_general"
      and any(kinds.get(gathered_by.get(v)) == "parameter" for v in variables[u])
    }
    assert not param_dots & set(deferred)
    deferred_total += len(deferred)
  assert deferred_total >= 2  # the weight gradients of layers 2 and 3's gathered activations
  # And the step computes what it computed.
  ov = jax_overlap.overlap(f)
  assert ov.explain(params, x).of_kind("weight_gradient")
  for a, b in zip(jax.tree.leaves(f(params, x)), jax.tree.leaves(ov(params, x))):
    assert jnp.allclose(a, b, rtol=1e-6, atol=1e-7)
