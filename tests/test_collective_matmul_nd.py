"""Collective matmuls as tensor/sequence-parallel code writes them: N-D activations gathered
along the sequence, dot_generals with batch dimensions, one gather feeding several matmuls,
the gathered value also used elsewhere; forward and backward against the plain program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src import collective_matmul as cm


def _mesh(p):
  return jax.make_mesh((8 // p, p), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def _close(a, b):
  """Equal within fp32 rounding of sums reassociated: elementwise to 3e-5 of the array's
  largest magnitude (a cancellation leaves a small element with its terms' rounding)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    scale = max(float(np.max(np.abs(x))), 1.0)
    np.testing.assert_allclose(y, x, rtol=3e-5, atol=3e-5 * scale)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  p=st.sampled_from([2, 4, 8]),
  batch=st.integers(1, 2),
  seq_block=st.integers(1, 3),
  hidden=st.sampled_from([4, 8]),
  outs=st.lists(st.sampled_from([3, 5, 8]), min_size=1, max_size=3),
  batched=st.booleans(),
  keep=st.booleans(),
  bidi=st.booleans(),
  method=st.sampled_from(["ring", "pieces"]),
  pieces=st.one_of(st.integers(1, 4), st.lists(st.integers(1, 3), min_size=1, max_size=4)),
)
def test_ring_equals_gather_then_dots_forward_and_backward(
  p, batch, seq_block, hidden, outs, batched, keep, bidi, method, pieces
):
  mesh = _mesh(p)
  seq_block *= 2 if bidi else 1  # a bidirectional ring splits each block in two
  if isinstance(pieces, list):  # the pieces' sizes: the block is what they add up to
    seq_block = sum(pieces) if method == "pieces" else seq_block
    pieces = pieces if method == "pieces" else None
  k = jax.random.key(p * 100 + seq_block)
  x = jax.random.normal(k, (batch, seq_block * p, hidden))
  if batched:  # "bsh,bhk->bsk": the batch dimension is a dot batch dimension
    ws = [
      jax.random.normal(jax.random.fold_in(k, i), (batch, hidden, o)) for i, o in enumerate(outs)
    ]
    dn = (((2,), (1,)), ((0,), (0,)))
  else:  # "bsh,hk->bsk"
    ws = [
      jax.random.normal(jax.random.fold_in(k, i), (hidden, o)) * 0.3 for i, o in enumerate(outs)
    ]
    dn = (((2,), (0,)), ((), ()))

  def plain(x, ws):
    xg = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
    ys = [jax.lax.dot_general(xg, w, dn) for w in ws]
    return ys, (xg * 2.0 if keep else None)

  def ring(x, ws):
    shapes = [
      jax.eval_shape(
        lambda w: jax.lax.dot_general(jnp.zeros((batch, seq_block * p, hidden)), w, dn), w
      )
      for w in ws
    ]
    dots = [(w, True, dn, None, None, s.shape, s.dtype) for w, s in zip(ws, shapes)]
    ys, full = cm.all_gather_dot_generals(
      x,
      dots,
      axis="tensor",
      gather_dim=1,
      collect=keep,
      bidirectional=bidi,
      method=method,
      pieces=pieces,
    )
    return ys, (full * 2.0 if keep else None)

  def loss(fn):
    def f(x, ws):
      ys, extra = fn(x, ws)
      total = sum(jnp.sum(jnp.tanh(y)) for y in ys)  # well conditioned
      if extra is not None:
        total = total + jnp.sum(extra**2)
      return jax.lax.psum(total, "tensor")

    return f

  specs = (P(None, "tensor"), [P()] * len(ws))
  run = {
    name: jax.jit(
      jax.shard_map(
        jax.value_and_grad(loss(fn), argnums=(0, 1)),
        mesh=mesh,
        in_specs=specs,
        out_specs=(P(), (P(None, "tensor"), [P()] * len(ws))),
        check_vma=False,
      )
    )(x, ws)
    for name, fn in (("plain", plain), ("ring", ring))
  }
  _close(run["plain"], run["ring"])


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  p=st.sampled_from([2, 4, 8]),
  batch=st.integers(1, 2),
  seq_block=st.integers(1, 3),
  k_local=st.sampled_from([2, 4]),
  out=st.sampled_from([3, 8]),
  batched=st.booleans(),
  bidi=st.booleans(),
  method=st.sampled_from(["ring", "pieces"]),
  pieces=st.one_of(st.integers(1, 4), st.lists(st.integers(1, 3), min_size=1, max_size=4)),
)
def test_reduce_scatter_ring_equals_dot_then_psum_scatter(
  p, batch, seq_block, k_local, out, batched, bidi, method, pieces
):
  mesh = _mesh(p)
  seq_block *= 2 if bidi else 1
  if isinstance(pieces, list):  # the pieces' sizes: the block is what they add up to
    seq_block = sum(pieces) if method == "pieces" else seq_block
    pieces = pieces if method == "pieces" else None
  key = jax.random.key(7 * p + seq_block)
  h = jax.random.normal(key, (batch, seq_block * p, k_local * p)) * 0.5
  if batched:
    w = jax.random.normal(jax.random.fold_in(key, 1), (batch, k_local * p, out)) * 0.3
    dn = (((2,), (1,)), ((0,), (0,)))
    wspec = P(None, "tensor")
  else:
    w = jax.random.normal(jax.random.fold_in(key, 1), (k_local * p, out)) * 0.3
    dn = (((2,), (0,)), ((), ()))
    wspec = P("tensor")

  def plain(h, w):
    return jax.lax.psum_scatter(
      jax.lax.dot_general(h, w, dn), "tensor", scatter_dimension=1, tiled=True
    )

  def ring(h, w):
    return cm.dot_general_reduce_scatter(
      h,
      w,
      dimension_numbers=dn,
      axis="tensor",
      scatter_dim=1,
      bidirectional=bidi,
      method=method,
      pieces=pieces,
    )

  def loss(fn):
    return lambda h, w: jax.lax.psum(jnp.sum(jnp.tanh(fn(h, w))), "tensor")

  _close(*_values_and_grads(mesh, wspec, h, w, loss(plain), loss(ring)))


def _values_and_grads(mesh, wspec, h, w, *losses):
  """Each loss and its gradients in (h, w), h sharded along its last dimension and w by
  ``wspec`` over the mesh's "tensor" axis."""
  return [
    jax.jit(
      jax.shard_map(
        jax.value_and_grad(loss, argnums=(0, 1)),
        mesh=mesh,
        in_specs=(P(None, None, "tensor"), wspec),
        out_specs=(P(), (P(None, None, "tensor"), wspec)),
        check_vma=False,
      )
    )(h, w)
    for loss in losses
  ]


@pytest.mark.parametrize("method", ["pieces", "ring"])
def test_work_beside_the_last_reduce_scatter(method):
  # `beside=(fn, operands)`: fn(*operands) comes back with the reduce-scatter's block (in
  # pieces, traced between the last piece's dot and the use of its reduce-scatter); both,
  # and the gradients through both, are what the plain program computes.
  key = jax.random.key(3)
  h = jax.random.normal(key, (2, 16, 8))
  w = jax.random.normal(jax.random.fold_in(key, 1), (8, 6)) * 0.3
  dn = (((2,), (0,)), ((), ()))
  join = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
  pieces = (1, 3) if method == "pieces" else None

  def plain(h, w):
    y = jax.lax.dot_general(h, w, dn)
    return jax.lax.psum_scatter(y, "tensor", scatter_dimension=1, tiled=True), join(h, 2 * h)

  def split(h, w):
    kw = dict(dimension_numbers=dn, axis="tensor", scatter_dim=1, method=method, pieces=pieces)
    return cm.dot_general_reduce_scatter(h, w, beside=(join, (h, 2 * h)), **kw)

  def loss(fn):
    def value(h, w):
      y, extra = fn(h, w)
      return jax.lax.psum(jnp.sum(jnp.tanh(y)) + jnp.sum(jnp.sin(extra)), "tensor")

    return value

  _close(*_values_and_grads(_mesh(4), P("tensor"), h, w, loss(plain), loss(split)))


def _tp_sp_step(p, n_layers, qkv_separate):
  mesh = _mesh(p)
  S, H = 4 * p, 8

  def block(x, ws):
    xg = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
    if qkv_separate:  # three matmuls on one gathered activation
      q, k_, v = (jnp.einsum("bsh,hk->bsk", xg, w) for w in ws[:3])
      a = jax.nn.gelu(q + k_ * v)
      o = jnp.einsum("bsk,kh->bsh", a, ws[3])
    else:
      a = jax.nn.gelu(jnp.einsum("bsh,hk->bsk", xg, ws[0]))
      o = jnp.einsum("bsk,kh->bsh", a, ws[1])
    return x + jax.lax.psum_scatter(o, "tensor", scatter_dimension=1, tiled=True)

  def loss(params, x):
    for ws in params:
      x = block(x, ws)
    return jax.lax.pmean(jnp.mean(x**2), ("data", "tensor"))

  def step(params, x):
    return jax.value_and_grad(loss)(params, x)

  n_w = 4 if qkv_separate else 2
  col, row = P(None, "tensor"), P("tensor", None)
  wspec = [col] * (n_w - 1) + [row]
  specs = [wspec] * n_layers
  f = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data", "tensor")), out_specs=(P(), specs))
  )
  key = jax.random.key(p)
  K = 2 * p
  params = [
    [
      jax.random.normal(jax.random.fold_in(key, 10 * i + j), (H, K) if j < n_w - 1 else (K, H))
      * 0.3
      for j in range(n_w)
    ]
    for i in range(n_layers)
  ]
  x = jax.random.normal(jax.random.fold_in(key, 999), (2 * (8 // p), S, H))
  return f, params, x


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("qkv_separate", [False, True])
def test_transform_rings_tensor_sequence_parallel_steps(p, qkv_separate):
  f, params, x = _tp_sp_step(p, 2, qkv_separate)
  ov = jax_overlap.overlap(f, collective_matmul="ring")
  _close(f(params, x), ov(params, x))
  rings = [a.detail for a in ov.explain(params, x).of_kind("collective_matmul")]
  # Every sequence gather feeding matmuls, forward and backward, became a ring; the forward
  # ones keep the gathered value (the backward needs it for the weight gradient).
  assert len(rings) >= 2 * 2
  feeding = "feeding 3 matmul(s)" if qkv_separate else "feeding 1 matmul(s)"
  assert any(feeding in r and "also kept" in r for r in rings)
  # The row-parallel projections' reduce-scatters along the sequence are rings too.
  assert sum("-> reduce-scatter along dim 1" in r for r in rings) >= 2
  jaxpr = str(jax.make_jaxpr(lambda a, b: ov(a, b))(params, x))
  assert jaxpr.count("ppermute") >= 2 * (p - 1)


def test_auto_leaves_small_gathers_to_the_cost_model():
  f, params, x = _tp_sp_step(8, 1, False)
  ov = jax_overlap.overlap(f, collective_matmul="auto", target="h100x8", select="rewrite")
  # Tiny blocks: the ring's per-step overhead outweighs the overlap; nothing decomposed.
  assert ov.explain(params, x).of_kind("collective_matmul") == []


def test_bidirectional_needs_an_even_block():
  mesh = _mesh(2)
  x = jnp.ones((1, 2, 4))
  w = jnp.ones((4, 3))
  dn = (((2,), (0,)), ((), ()))

  def f(x, w):
    dots = [(w, True, dn, None, None, (1, 2, 3), jnp.float32)]
    return cm.all_gather_dot_generals(x, dots, axis="tensor", gather_dim=1, bidirectional=True)[0][
      0
    ]

  g = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tensor"), P()), out_specs=P(), check_vma=False)
  with pytest.raises(
    ValueError, match="bidirectional ring needs an even block along dimension 1, got 1"
  ):
    jax.jit(g)(x, w)


def test_dimensions_that_the_dots_do_not_have_are_refused():
  # A gathered dimension the dots contract, or one x does not have, an output shape that
  # is not the dot's, and a scatter dimension the output does not have: named, before any
  # trace of the ring.
  mesh = _mesh(2)
  x, w = jnp.ones((1, 8, 4)), jnp.ones((4, 3))
  dn = (((2,), (0,)), ((), ()))
  dots = [(w, True, dn, None, None, (1, 16, 3), jnp.float32)]
  cases = [
    (lambda x, w: cm.all_gather_dot_generals(x, dots, axis="tensor", gather_dim=2),
     r"gather_dim 2 is a contracting dimension of dots\[0\]"),
    (lambda x, w: cm.all_gather_dot_generals(x, dots, axis="tensor", gather_dim=7),
     r"gather_dim must be a dimension of x \(0 to 2\), got 7"),
    (lambda x, w: cm.all_gather_dot_generals(x, [dots[0][:3]], axis="tensor", gather_dim=1),
     r"dots\[0\] must be \(w, x_is_lhs, dimension_numbers"),
    (lambda x, w: cm.all_gather_dot_generals(
        x, [(*dots[0][:5], (1, 8, 3), jnp.float32)], axis="tensor", gather_dim=1),
     r"dots\[0\] gives out_shape \(1, 8, 3\), but the dot of the gathered value "
     r"\(1, 16, 4\) with w \(4, 3\) is \(1, 16, 3\)"),
    (lambda x, w: cm.dot_general_reduce_scatter(
        x, w, dimension_numbers=dn, axis="tensor", scatter_dim=5),
     r"scatter_dim must be a dimension of the dot's 3-D output \(0 to 2\), got 5"),
  ]  # fmt: skip
  for fn, message in cases:
    g = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=message):
      jax.jit(g)(x, w)


@pytest.mark.parametrize(
  "pieces, message",
  [
    ((1, 2), r"the pieces' sizes \(1, 2\) add up to 3, but this device's block is 4"),
    ((2, 0, 2), "pieces must be a positive int .* or a sequence of positive ints"),
    ((2.0, 2.0), "pieces must be a positive int .* or a sequence of positive ints"),
    (0, "pieces must be a positive int"),
  ],
)
def test_bad_piece_sizes_are_refused(pieces, message):
  mesh = _mesh(2)
  x = jnp.ones((1, 8, 4))
  w = jnp.ones((4, 3))
  dn = (((2,), (0,)), ((), ()))

  def gather(x, w):
    dots = [(w, True, dn, None, None, (1, 8, 3), jnp.float32)]
    return cm.all_gather_dot_generals(
      x, dots, axis="tensor", gather_dim=1, method="pieces", pieces=pieces
    )[0][0]

  def scatter(x, w):
    return cm.dot_general_reduce_scatter(
      x, w, dimension_numbers=dn, axis="tensor", scatter_dim=1, method="pieces", pieces=pieces
    )

  for fn, spec in ((gather, P(None, "tensor")), (scatter, P())):
    g = jax.shard_map(fn, mesh=mesh, in_specs=(spec, P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=message):
      jax.jit(g)(x, w)


@pytest.mark.slow
def test_rings_assemble_their_outputs_with_one_gather_each_and_try_cublas():
  # Compiled deviceless for h100x8 as XLA runs it: every ring's output (and the gathered
  # activation kept for the backward) is put in order by one gather, not by a copy of
  # each step's slice into a buffer; the selection also tries the rings on cuBLAS GEMMs.
  from jax_overlap._src.analysis import hlo
  from jax_overlap.examples import tp_sp

  fn, args = tp_sp.build("h100x8", layers=1, hidden=256, mlp=512, heads=8, seq=256)
  chosen = jax_overlap.overlap(
    fn, target="h100x8", collective_matmul="ring", schedule_from_estimates=False, cache=False
  )
  names = [n for n, _ in chosen.explain(*args).candidates]
  assert "rewritten, one layer per collective, cuBLAS GEMMs (XLA's Triton GEMMs off)" in names
  rewritten = jax_overlap.overlap(
    fn, target="h100x8", collective_matmul="ring", select="rewrite", cache=False
  )
  rings = rewritten.explain(*args).of_kind("collective_matmul")
  assert rings
  report = jax_overlap.analyze(rewritten, *args, target="h100x8")
  module = hlo.parse_module(report.hlo_text)
  ops = [i.opcode for c in module.computations.values() for i in c.instructions]
  assert "dynamic-update-slice" not in ops
  fed = [re.search(r"feeding (\d+) matmul", a.detail) for a in rings]
  outputs = sum(int(f.group(1)) for f in fed if f) + sum("also kept" in a.detail for a in rings)
  assert outputs > 0 and ops.count("gather") >= outputs


@pytest.mark.parametrize("p", [2, 8])
def test_transform_pieces_tensor_sequence_parallel_steps(p):
  # The same steps with every decomposition in pieces: chained all-gathers and
  # reduce-scatters (NCCL collectives), no send/recv; numerics as written, both passes.
  f, params, x = _tp_sp_step(p, 2, True)
  ov = jax_overlap.overlap(f, collective_matmul="pieces")
  _close(f(params, x), ov(params, x))
  done = [a.detail for a in ov.explain(params, x).of_kind("collective_matmul")]
  assert len(done) >= 2 * 2 and all("chained" in d for d in done), done
  assert any("feeding 3 matmul(s)" in d and "also kept" in d for d in done)
  # The kept gathered values are put in order beside a later reduce-scatter's last piece
  # (the numerics above include them).
  kept = [a.detail for a in ov.explain(params, x).of_kind("kept_gather")]
  assert kept and re.match(r"\d+ gathered value\(s\) kept .* while the last piece", kept[0]), kept
  # At these sizes the cost model splits the blocks unequally (the numerics above cover
  # those pieces, forward and backward).
  assert any(re.search(r"chained \S+ of slices \(\d+, \d+\)", d) for d in done), done
  jaxpr = str(jax.make_jaxpr(lambda a, b: ov(a, b))(params, x))
  assert "ppermute" not in jaxpr
  assert jaxpr.count("all_gather") > 4 and jaxpr.count("reduce_scatter") > 2
  # The backward's weight gradients wait for the next activation all-gather's input (the
  # numerics above include them); "as_written" leaves them to XLA.
  deferred = ov.explain(params, x).of_kind("weight_gradient")
  assert deferred and re.match(r"\d+ weight gradient", deferred[0].detail), deferred
  kept = jax_overlap.overlap(f, collective_matmul="pieces", weight_gradients="as_written")
  assert not kept.explain(params, x).of_kind("weight_gradient")
  with pytest.raises(ValueError, match="weight_gradients must be 'defer' or 'as_written'"):
    jax_overlap.overlap(f, weight_gradients="late")


@pytest.mark.parametrize("mode", ["on", "ring", "pieces"])
def test_a_dot_reading_two_gathered_values(mode):
  # FSDP x sequence parallel on a 2-D mesh: a layer's weight all-gathered over "data" and
  # its activation over "tensor" feed the same dot, and a dot of two activations gathered
  # along their free dimensions (scores of every row against every row). Each gathered
  # value is ready before any dot reads it, whichever decomposition computes the dot;
  # the step computes what it computes as written, forward and backward.
  mesh = _mesh(2)
  layers, hidden, seq = 2, 32, 16

  def loss(ws, x):
    h = x
    for w in ws:
      wg = jax.lax.all_gather(w, "data", axis=0, tiled=True)  # [hidden, hidden / 2]
      xg = jax.lax.all_gather(h, "tensor", axis=1, tiled=True)  # [b, seq, hidden]
      y = jnp.tanh(xg @ wg)  # [b, seq, hidden / 2]
      hg = jax.lax.all_gather(jnp.sin(h), "tensor", axis=1, tiled=True)  # [b, seq, hidden]
      scores = jnp.einsum("bsh,bth->bst", xg, hg)  # both gathered along a free dimension
      h = jnp.concatenate([y, y], axis=2)[:, : seq // 2] * jnp.mean(jnp.tanh(scores))
    return jnp.sum(h**2)

  def inner(ws, x):
    value, grads = jax.value_and_grad(loss)(ws, x)
    return jax.lax.psum(value, ("data", "tensor")), grads

  spec_w, spec_x = P("data", "tensor"), P("data", "tensor")
  f = jax.jit(
    jax.shard_map(
      inner, mesh=mesh, in_specs=([spec_w] * layers, spec_x), out_specs=(P(), [spec_w] * layers)
    )
  )
  keys = jax.random.split(jax.random.key(0), layers + 1)
  ws = [
    jax.device_put(
      jax.random.normal(k, (hidden, hidden)) * 0.2, jax.sharding.NamedSharding(mesh, spec_w)
    )
    for k in keys[:-1]
  ]
  x = jax.device_put(
    jax.random.normal(keys[-1], (8, seq, hidden)), jax.sharding.NamedSharding(mesh, spec_x)
  )
  ov = jax_overlap.overlap(f, collective_matmul=mode)
  _close(f(ws, x), ov(ws, x))
  assert ov.explain(ws, x).of_kind("collective_matmul")


def test_pieces_compile_to_nccl_collectives_for_h100():
  # Deviceless for h100x8 as XLA compiles it: the pieces stay separate all-gathers and
  # reduce-scatters (the data dependence between them keeps XLA's combiners off).
  from jax_overlap._src.analysis import hlo
  from jax_overlap.examples import tp_sp

  fn, args = tp_sp.build("h100x8", layers=1, hidden=1024, mlp=4096, heads=8, seq=4096)
  ov = jax_overlap.overlap(fn, target="h100x8", collective_matmul="pieces", select="rewrite")
  done = ov.explain(*args).of_kind("collective_matmul")
  pieces = [int(m) for a in done for m in re.findall(r"issued as (\d+) chained", a.detail)]
  assert pieces and min(pieces) >= 2
  report = jax_overlap.analyze(ov, *args, target="h100x8")
  ops = [
    i.opcode
    for c in hlo.parse_module(report.hlo_text).computations.values()
    for i in c.instructions
  ]
  starts = sum(o in ("all-gather-start", "all-gather") for o in ops)
  assert "collective-permute-start" not in ops and "collective-permute" not in ops
  assert starts >= sum(pieces) // 2
  # XLA's schedule runs each piece after the first beside the dots of the piece before (the
  # barriers that tie a piece to those dots keep its scheduler from issuing every piece
  # first): a GEMM lies between the start and the done of at least half the gathers (at
  # this size the pieces are 2 per gather).
  gathers = [c for c in report.collectives if c.kind == "all-gather"]
  beside = [
    any(report.kernels[i].kind == "gemm" for i in range(c.start_index, c.done_index))
    for c in gathers
  ]
  assert sum(beside) >= len(gathers) // 2, beside
  # The gathered values kept for the backward pass (x [1, 4096, 1024] bf16, 8 MiB) are put
  # in order while a reduce-scatter's last piece travels: the concatenation, reading and
  # writing them, lies between that reduce-scatter's start and done.
  kept = ov.explain(*args).of_kind("kept_gather")
  n_kept = int(re.match(r"(\d+) gathered value", kept[0].detail).group(1))
  assert n_kept == 3, kept
  scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
  hidden = [
    c
    for c in scatters
    if any(
      report.kernels[i].op_name.endswith("concatenate")
      and report.kernels[i].bytes_accessed == 2 * 4096 * 1024 * 2
      for i in range(c.start_index, c.done_index)
    )
  ]
  assert len(hidden) == n_kept, [(c.name, c.start_index, c.done_index) for c in scatters]


def test_kept_gathered_values_go_where_the_reduce_scatters_leave_most_time():
  # The TP+SP step at hidden 8192 (planned only, nothing compiled): four gathered values
  # are kept in the forward pass and two in the backward. The forward's output-projection
  # reduce-scatters end on a 72 MiB piece, the MLP's on an 8 MiB one: the first layer's
  # MLP input goes beside the second layer's output projection rather than the first
  # reduce-scatter after it, so six values share five reduce-scatters.
  from jax_overlap.examples import tp_sp

  fn, args = tp_sp.build("h100x8", layers=2, hidden=8192, mlp=28672, heads=64, seq=8192)
  ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite")
  (kept,) = ov.explain(*args).of_kind("kept_gather")
  m = re.match(r"(\d+) gathered value\(s\) .* the last piece of (\d+) later", kept.detail)
  assert m and (int(m.group(1)), int(m.group(2))) == (6, 5), kept.detail


@pytest.mark.slow
def test_weight_gradients_run_beside_the_backward_all_gathers_on_h100():
  # Deviceless for h100x8 as XLA schedules it (the TP+SP step at hidden 8192, sequence
  # 8192, 2 blocks; the cost model leaves the backward's attention-output all-gathers
  # whole). Left to XLA, every weight gradient runs at the end of the step and the first of
  # those 128 MiB all-gathers has no GEMM beside it; deferred, a weight gradient runs
  # between the start and the done of each, and the analysis finds less exposed.
  from jax_overlap.examples import tp_sp

  fn, args = tp_sp.build("h100x8", layers=2, hidden=8192, mlp=28672, heads=64, seq=8192)
  reports = {}
  for mode in ("defer", "as_written"):
    ov = jax_overlap.overlap(fn, target="h100x8", select="rewrite", weight_gradients=mode)
    reports[mode] = jax_overlap.analyze(ov, *args, target="h100x8")
    assert bool(ov.explain(*args).of_kind("weight_gradient")) == (mode == "defer")

  def whole_gathers(report):
    """(GEMMs beside, exposed) of each all-gather of a full activation (not in pieces)."""
    return [
      (
        sum(report.kernels[i].kind == "gemm" for i in range(c.start_index, c.done_index)),
        c.exposed_s,
      )
      for c in report.collectives
      if c.kind == "all-gather" and c.bytes >= 128 << 20
    ]

  deferred, written = whole_gathers(reports["defer"]), whole_gathers(reports["as_written"])
  assert len(deferred) == len(written) >= 2
  assert any(g == 0 and e > 0 for g, e in written), written
  assert all(g >= 1 for g, _ in deferred), deferred
  assert reports["defer"].exposed_comm_s < reports["as_written"].exposed_comm_s
  assert reports["defer"].step_time_s < reports["as_written"].step_time_s
  # The same work: only its order changed (XLA fuses a few elementwise ops differently).
  assert reports["defer"].flops == pytest.approx(reports["as_written"].flops, rel=1e-5)


def test_the_planner_asks_the_cost_model_about_the_global_matmul(monkeypatch):
  # estimate_gain takes the global GEMM (m, n, k) of y = all_gather(x) @ w and of
  # psum_scatter(x @ w): on a TP step with hidden h, MLP f over 8 devices, the up
  # projection's gather is (seq, f, h) and the down projection's reduce-scatter (seq, h, f),
  # not the per-device slices.
  from jax_overlap.examples import tp_sp

  seen = []
  real = cm.estimate_gain

  def spy(m, n, k, p, **kw):
    seen.append((kw.get("kind"), m, n, k, p))
    return real(m, n, k, p, **kw)

  monkeypatch.setattr(cm, "estimate_gain", spy)
  h, f, s = 512, 2048, 1024
  fn, args = tp_sp.build("h100x8", layers=1, hidden=h, mlp=f, heads=8, seq=s)
  jax_overlap.overlap(fn, target="h100x8", select="rewrite", cache=False).explain(*args)
  assert ("all_gather", s, f, h, 8) in seen
  assert ("reduce_scatter", s, h, f, 8) in seen


@pytest.mark.slow
def test_explain_judges_the_step_as_written_by_both_models():
  # The tensor + sequence parallel step at hidden 4096 on h100x8: the analysis prefers a
  # rewritten variant; explain() also gives the step as written's contention-aware
  # estimate, and says so in a line of its own when the simulator orders the two the
  # other way.
  from jax_overlap.examples import tp_sp

  fn, args = tp_sp.build("h100x8", layers=2, hidden=4096, mlp=14336, heads=32, seq=4096)
  e = jax_overlap.overlap(fn, target="h100x8", cache=False).explain(*args)
  assert not e.chosen.startswith("as written")
  estimates = dict(e.candidates)
  (chosen,) = [n for n in e.notes if n.startswith("chosen variant judged twice")]
  (written,) = [n for n in e.notes if n.startswith("step as written (")]
  name = written[len("step as written (") : written.index(")")]
  assert f"the analysis {estimates[name] * 1e3:.3f} ms" in written
  assert f"the analysis {estimates[e.chosen] * 1e3:.3f} ms" in chosen
  sim_chosen = float(chosen.rsplit(" ", 2)[-2])
  sim_written = float(written.rsplit(" ", 2)[-2])
  disagree = [n for n in e.notes if n.startswith("the two models disagree")]
  assert bool(disagree) == (sim_written < sim_chosen)
  if disagree:
    # Both estimates are printed to 3 decimals, their difference from the unrounded ones.
    faster = float(re.search(r"([0-9.]+) ms faster", disagree[0]).group(1))
    assert faster == pytest.approx(sim_chosen - sim_written, abs=1.5e-3)


def test_a_named_matmul_output_is_reduce_scattered_in_pieces():
  """A row-parallel projection whose output is named for a remat policy before its
  reduce-scatter (MaxText's ``checkpoint_name(out, "out_proj")``): the name is the
  matmul's value, so the pair is still a collective matmul, forward and backward, and the
  step computes the same values."""
  from jax.ad_checkpoint import checkpoint_name

  mesh = _mesh(8)
  S, H, K = 16, 32, 64

  def loss(ws, x):
    xg = jax.lax.all_gather(x, "tensor", axis=2, tiled=True)
    a = jnp.tanh(jnp.einsum("bsh,hk->bsk", xg, ws[0]))
    o = checkpoint_name(jnp.einsum("bsk,kh->bsh", a, ws[1]), "out_proj")
    y = x + jax.lax.psum_scatter(o, "tensor", scatter_dimension=2, tiled=True)
    return jax.lax.pmean(jnp.mean(y**2), ("data", "tensor"))

  f = jax.jit(
    jax.shard_map(
      jax.value_and_grad(loss),
      mesh=mesh,
      in_specs=((P(None, "tensor"), P("tensor", None)), P("data", None, "tensor")),
      out_specs=(P(), (P(None, "tensor"), P("tensor", None))),
    )
  )
  key = jax.random.key(4)
  ws = (
    jax.random.normal(jax.random.fold_in(key, 0), (8 * H, 8 * K)) * 0.1,
    jax.random.normal(jax.random.fold_in(key, 1), (8 * K, 8 * H)) * 0.1,
  )
  x = jax.random.normal(jax.random.fold_in(key, 2), (8, S, 8 * H))
  ov = jax_overlap.overlap(f, collective_matmul="pieces")
  _close(f(ws, x), ov(ws, x))
  found = [a.detail for a in ov.explain(ws, x).of_kind("collective_matmul")]
  assert any("-> reduce-scatter along dim 2" in r for r in found), found
