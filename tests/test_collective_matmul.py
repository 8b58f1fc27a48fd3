"""Tests for jax_overlap.collective_matmul: values, gradients, errors, schedule, cost model."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap._src import targets
from jax_overlap._src.analysis import nccl
from jax_overlap.collective_matmul import (
  GainEstimate,
  all_gather_matmul,
  estimate_gain,
  matmul_reduce_scatter,
)

shard_map = jax.shard_map if hasattr(jax, "shard_map") else None
if shard_map is None:  # pragma: no cover - older jax
  from jax.experimental.shard_map import shard_map

MESHES = {
  "tensor8": ((8,), ("tensor",)),
  "fsdp4_tensor2": ((4, 2), ("fsdp", "tensor")),
}


def _mesh(name):
  shape, names = MESHES[name]
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _value_and_grads(fn, mesh, in_specs, out_spec, x, w):
  sm = shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)

  def loss(x, w):
    y = sm(x, w).astype(jnp.float32)
    return jnp.sum(jnp.sin(y)), y

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)


def _close(a, b, dtype):
  tol = 1e-5 if dtype == jnp.float32 else 3e-2

  def check(p, q):
    p, q = np.asarray(p, np.float32), np.asarray(q, np.float32)
    scale = max(1.0, float(np.max(np.abs(p))))
    np.testing.assert_allclose(q, p, rtol=tol, atol=tol * scale)

  jax.tree.map(check, a, b)


def _operands(m, k, n, dtype, seed=0):
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (m, k)).astype(dtype)
  w = (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(dtype)
  return x, w


def _batch_axis(mesh):
  return "fsdp" if "fsdp" in mesh.axis_names else None


VARIANTS = [
  dict(bidirectional=False),
  dict(bidirectional=True),
]


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["uni", "bidi"])
def test_all_gather_matmul_matches_reference(mesh_name, dtype, variant):
  mesh = _mesh(mesh_name)
  b = _batch_axis(mesh)
  x, w = _operands(64, 32, 48, dtype)
  # x: rows sharded over the ring; w: column-parallel. On the 4 x 2 mesh the
  # columns of x are also split over "fsdp" to exercise the other axis.
  in_specs = (P("tensor", b), P(b, "tensor"))
  out_spec = P(None, "tensor")

  def ref(x, w):
    y = lax.all_gather(x, "tensor", axis=0, tiled=True) @ w
    return y if b is None else lax.psum(y, b)

  def ours(x, w):
    y = all_gather_matmul(x, w, axis="tensor", **variant)
    return y if b is None else lax.psum(y, b)

  _close(
    _value_and_grads(ref, mesh, in_specs, out_spec, x, w),
    _value_and_grads(ours, mesh, in_specs, out_spec, x, w),
    dtype,
  )


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["uni", "bidi"])
def test_matmul_reduce_scatter_matches_reference(mesh_name, dtype, variant):
  mesh = _mesh(mesh_name)
  b = _batch_axis(mesh)
  x, w = _operands(64, 32, 48, dtype, seed=1)
  in_specs = (P(b, "tensor"), P("tensor"))
  out_spec = P(("tensor",) if b is None else ("fsdp", "tensor"))

  def ref(x, w):
    return lax.psum_scatter(x @ w, "tensor", scatter_dimension=0, tiled=True)

  def ours(x, w):
    return matmul_reduce_scatter(x, w, axis="tensor", **variant)

  _close(
    _value_and_grads(ref, mesh, in_specs, out_spec, x, w),
    _value_and_grads(ours, mesh, in_specs, out_spec, x, w),
    dtype,
  )


@pytest.mark.parametrize("chunks,bidirectional", [(2, False), (4, True)])
def test_chunks(chunks, bidirectional):
  mesh = _mesh("tensor8")
  x, w = _operands(64, 32, 48, jnp.float32, seed=2)
  kw = dict(axis="tensor", chunks=chunks, bidirectional=bidirectional)
  ag_specs, rs_specs = (P("tensor"), P(None, "tensor")), (P(None, "tensor"), P("tensor"))
  _close(
    _value_and_grads(
      lambda x, w: lax.all_gather(x, "tensor", axis=0, tiled=True) @ w,
      mesh,
      ag_specs,
      P(None, "tensor"),
      x,
      w,
    ),
    _value_and_grads(
      lambda x, w: all_gather_matmul(x, w, **kw), mesh, ag_specs, P(None, "tensor"), x, w
    ),
    jnp.float32,
  )
  _close(
    _value_and_grads(
      lambda x, w: lax.psum_scatter(x @ w, "tensor", tiled=True), mesh, rs_specs, P("tensor"), x, w
    ),
    _value_and_grads(
      lambda x, w: matmul_reduce_scatter(x, w, **kw), mesh, rs_specs, P("tensor"), x, w
    ),
    jnp.float32,
  )


def test_replicated_weight_gradient_is_summed():
  # With w replicated over the ring axis, its gradient is the sum of every
  # device's contribution, as for the reference.
  mesh = _mesh("tensor8")
  x, w = _operands(64, 32, 16, jnp.float32, seed=3)
  specs = (P("tensor"), P())
  # The output is typed as varying over the axis: stack the (equal) copies.
  out = P("tensor")
  ref = _value_and_grads(
    lambda x, w: lax.all_gather(x, "tensor", axis=0, tiled=True) @ w, mesh, specs, out, x, w
  )
  got = _value_and_grads(
    lambda x, w: all_gather_matmul(x, w, axis="tensor"), mesh, specs, out, x, w
  )
  _close(ref, got, jnp.float32)
  # Every device contributes to the replicated weight's gradient.
  assert float(jnp.max(jnp.abs(got[1][1]))) > 0


def test_second_order_transpose_chain():
  # all_gather_matmul followed by matmul_reduce_scatter: a Megatron MLP block.
  mesh = _mesh("tensor8")
  x, w1 = _operands(64, 32, 64, jnp.float32, seed=4)
  _, w2 = _operands(64, 64, 32, jnp.float32, seed=5)
  specs = (P("tensor"), P(None, "tensor"), P("tensor"))

  def block(ag, rs):
    def f(x, w1, w2):
      return rs(jnp.tanh(ag(x, w1)), w2)

    sm = shard_map(f, mesh=mesh, in_specs=specs, out_specs=P("tensor"))
    return jax.jit(jax.grad(lambda *a: jnp.sum(sm(*a) ** 2), argnums=(0, 1, 2)))(x, w1, w2)

  ref = block(
    lambda x, w: lax.all_gather(x, "tensor", axis=0, tiled=True) @ w,
    lambda h, w: lax.psum_scatter(h @ w, "tensor", tiled=True),
  )
  got = block(
    lambda x, w: all_gather_matmul(x, w, axis="tensor", bidirectional=True),
    lambda h, w: matmul_reduce_scatter(h, w, axis="tensor", bidirectional=True),
  )
  _close(ref, got, jnp.float32)


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


def _call(fn, x, w, in_specs):
  mesh = _mesh("tensor8")
  return jax.jit(shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P("tensor")))(x, w)


def test_error_axis_not_bound():
  with pytest.raises(ValueError, match="all_gather_matmul: axis 'tensor' is not bound here"):
    all_gather_matmul(jnp.ones((8, 4)), jnp.ones((4, 8)), axis="tensor")
  with pytest.raises(ValueError, match="matmul_reduce_scatter: axis 'model' is not bound here"):
    _call(
      lambda x, w: matmul_reduce_scatter(x, w, axis="model"),
      jnp.ones((64, 32)),
      jnp.ones((32, 8)),
      (P(None, "tensor"), P("tensor")),
    )


def test_error_rank_mismatch():
  with pytest.raises(
    ValueError,
    match=r"all_gather_matmul: x and w must both be rank 2 .* got x "
    r"with shape \(1, 8, 4\) and w with shape \(4, 8\)",
  ):
    _call(
      lambda x, w: all_gather_matmul(x, w, axis="tensor"),
      jnp.ones((8, 8, 4)),
      jnp.ones((4, 8)),
      (P("tensor"), P()),
    )


def test_error_contracting_mismatch():
  with pytest.raises(
    ValueError,
    match=r"contracting dimensions must match: x.shape\[1\] \(4\) "
    r"!= w.shape\[0\] \(5\)",
  ):
    _call(
      lambda x, w: all_gather_matmul(x, w, axis="tensor"),
      jnp.ones((8, 4)),
      jnp.ones((5, 8)),
      (P("tensor"), P()),
    )


def test_error_rows_not_divisible():
  with pytest.raises(
    ValueError,
    match=r"matmul_reduce_scatter: x.shape\[0\] \(12\) must be "
    r"divisible by the size of axis 'tensor' \(8\)",
  ):
    _call(
      lambda x, w: matmul_reduce_scatter(x, w, axis="tensor"),
      jnp.ones((12, 32)),
      jnp.ones((32, 8)),
      (P(None, "tensor"), P("tensor")),
    )


def test_error_chunks():
  with pytest.raises(ValueError, match=r"chunks must be even with bidirectional=True .* got 3"):
    _call(
      lambda x, w: all_gather_matmul(x, w, axis="tensor", bidirectional=True, chunks=3),
      jnp.ones((48, 4)),
      jnp.ones((4, 8)),
      (P("tensor"), P()),
    )
  with pytest.raises(
    ValueError,
    match=r"x.shape\[0\] \(the local rows\) \(3\) must be divisible "
    r"by the number of ring pieces chunks=2",
  ):
    _call(
      lambda x, w: all_gather_matmul(x, w, axis="tensor", chunks=2),
      jnp.ones((24, 4)),
      jnp.ones((4, 8)),
      (P("tensor"), P()),
    )


def test_error_not_an_array():
  with pytest.raises(TypeError, match="all_gather_matmul: w must be an array, got list"):
    all_gather_matmul(jnp.ones((8, 4)), [[1.0]], axis="tensor")


# ---------------------------------------------------------------------------
# Schedule on a compile-only 8 x H100 mesh.
# ---------------------------------------------------------------------------

_HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None


@pytest.mark.skipif(not _HAS_CUDA_PLUGIN, reason="needs jax-cuda13-plugin for deviceless compiles")
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bidi"])
def test_schedule_h100_permutes_interleave_with_dots(bidirectional):
  # value_and_grad of a Megatron MLP block: the forward all-gather and
  # reduce-scatter rings and the two backward rings (their transposes).
  from jax_overlap._src.analysis import hlo, schedule
  from jax_overlap._src.compile.compiler import compile_for_target
  from jax_overlap._src.targets import compile_only_mesh

  mesh = compile_only_mesh("h100x8", {"tensor": 8})
  m, k, n = 8192, 4096, 8192

  def f(x, w1, w2):
    h = all_gather_matmul(x, w1, axis="tensor", bidirectional=bidirectional)
    return matmul_reduce_scatter(jnp.tanh(h), w2, axis="tensor", bidirectional=bidirectional)

  sm = shard_map(
    f, mesh=mesh, in_specs=(P("tensor"), P(None, "tensor"), P("tensor")), out_specs=P("tensor")
  )
  loss = lambda *a: jnp.sum(sm(*a).astype(jnp.float32) ** 2)
  s = lambda shape, spec: jax.ShapeDtypeStruct(
    shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)
  )
  args = (s((m, k), P("tensor")), s((k, n), P(None, "tensor")), s((n, k), P("tensor")))
  step = compile_for_target(
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
    *args,
    target="h100x8",
    xla_options={"xla_gpu_enable_latency_hiding_scheduler": True},
  )
  module = hlo.parse_module(step.hlo_text)
  rings = [b for b in schedule.collective_brackets(module) if b.kind == "collective-permute"]
  hops = 7 * (2 if bidirectional else 1)
  assert len(rings) == 4 * hops  # four rings, every hop a separate permute
  gemms = sum(schedule._is_gemm(module, i) for i in module.entry_computation.instructions)
  assert gemms >= 4 * 8 * (2 if bidirectional else 1)  # partial dots stay separate
  overlapped = sum(b.gemms > 0 and not b.synchronous for b in rings)
  # At most the first hop of each ring has nothing to overlap.
  assert overlapped >= len(rings) - 4, rings


# ---------------------------------------------------------------------------
# Cost model.
# ---------------------------------------------------------------------------


# H100 x8 numbers written out by hand: bf16 dense peak, HBM, NVLink per direction and
# per-hop latency; the analysis's efficiencies (compute 0.75, memory 0.85, link 0.8) and
# kernel overhead (1 us).
_PEAK, _HBM, _LINK, _ALPHA = 989.4e12, 3.352e12, 450e9, 2.5e-6


def test_estimate_gain_large_matmul_is_worthwhile_in_pieces_not_as_a_ring():
  # A fused QKV projection of a tensor-parallel block: y = all_gather(x) @ w.
  m, n, k = 8192, 24576, 8192
  est = estimate_gain(m, n, k, 8, dtype="bfloat16", target="h100x8", method="pieces")
  assert isinstance(est, GainEstimate)
  assert est.worthwhile and est.speedup > 1.05
  assert est.overlapped_s < est.baseline_s
  # 8 pieces: the first 16 MiB all-gather exposed, then each piece's dots beside the next.
  piece_comm = 7 * _ALPHA + 7 / 8 * m * k * 2 / 8 / (0.8 * _LINK)
  piece_dots = 2 * m * n * k / 8 / 8 / (0.75 * _PEAK) + 1e-6

  def copy(nbytes):  # read and written once at 85% of HBM, plus the launch
    return 2 * nbytes / (0.85 * _HBM) + 1e-6

  # The copies on the compute stream: 8 slices of this device's block, the outputs put
  # in device order.
  copies = 8 * copy(m * k * 2 / 8 / 8) + copy(m * n * 2 / 8)
  assert est.copies_s == pytest.approx(copies, rel=1e-6)
  assert est.overlapped_s == pytest.approx(
    piece_comm + piece_dots + 7 * max(piece_comm, piece_dots) + copies, rel=1e-3
  )
  # Kept for the weight gradient, the gathered x is put in order too.
  kept = estimate_gain(m, n, k, 8, dtype="bfloat16", target="h100x8", method="pieces", collect=True)
  assert kept.copies_s == pytest.approx(copies + copy(m * k * 2), rel=1e-6)
  assert kept.overlapped_s == pytest.approx(est.overlapped_s + copy(m * k * 2), rel=1e-6)
  # In one piece the all-gather is the plain one: its output is the gathered x, in order.
  whole = estimate_gain(
    m, n, k, 8, dtype="bfloat16", target="h100x8", method="pieces", chunks=1, collect=True
  )
  assert whole.copies_s == 0.0
  assert whole.overlapped_s == pytest.approx(whole.baseline_s, rel=1e-9)
  # The ring's 8 MiB half-block exchanges are NCCL send/recvs on 4 of the 24 channels:
  # far slower than the dots beside them.
  ring = estimate_gain(m, n, k, 8, dtype="bfloat16", target="h100x8")
  assert not ring.worthwhile and ring.speedup < 1.0
  assert ring.baseline_s == est.baseline_s
  assert est.baseline_s == pytest.approx(est.compute_s + est.comm_s)
  # Compute-bound: 2 m n k / N FLOPs at 75% of the bf16 peak, plus the launch.
  assert est.compute_s == pytest.approx(2 * m * n * k / 8 / (0.75 * _PEAK) + 1e-6)
  # NCCL's ring all-gather of the 128 MiB x: 7 hops, 7/8 of it over 80% of the link.
  nbytes = m * k * 2
  assert est.comm_s == pytest.approx(7 * _ALPHA + 7 / 8 * nbytes / (0.8 * _LINK))


def test_estimate_gain_pieces_of_unequal_sizes():
  # An output projection whose reduce-scatter outlasts its GEMM (k = hidden / N): a small
  # first piece's dots start the reduce-scatters early; the last one is exposed.
  m, n, k = 8192, 8192, 8192
  kw = dict(dtype="bfloat16", target="h100x8", kind="reduce_scatter", method="pieces")
  sizes = (1, 3, 4)
  est = estimate_gain(m, n, k, 8, chunks=sizes, **kw)
  f = [v / 8 for v in sizes]
  flops, nbytes = 2 * m * n * k / 8, ((m * k + k * n) / 8 + m * n) * 2
  t = [max(flops * x / (0.75 * _PEAK), nbytes * x / (0.85 * _HBM)) + 1e-6 for x in f]
  e = [7 * _ALPHA + 7 / 8 * m * n * 2 * x / (0.8 * _LINK) for x in f]
  assert sum(e) > sum(t)  # communication-bound
  copies = 2 * (m * k / 8 * 2) / (0.85 * _HBM) + 1e-6 + 2 * (m * n / 8 * 2) / (0.85 * _HBM) + 1e-6
  expected = t[0] + max(t[1], e[0]) + max(t[2], e[1]) + e[2] + copies
  assert est.overlapped_s == pytest.approx(expected, rel=1e-6)
  # Here the small piece first hides more than the same sizes in the other order, and
  # than the 2, 4 or 8 equal pieces the cost model had before.
  assert est.speedup > estimate_gain(m, n, k, 8, chunks=sizes[::-1], **kw).speedup
  assert est.speedup > max(estimate_gain(m, n, k, 8, chunks=c, **kw).speedup for c in (2, 4, 8))
  # Equal sizes are the count of equal pieces.
  assert estimate_gain(m, n, k, 8, chunks=(2, 2, 2, 2), **kw) == estimate_gain(
    m, n, k, 8, chunks=4, **kw
  )
  for bad in ((1, 0), (1.0, -2.0), (), "12"):
    with pytest.raises(ValueError, match="estimate_gain: chunks must be a positive int or a"):
      estimate_gain(m, n, k, 8, chunks=bad, **kw)


def test_estimate_gain_small_matmul_is_not():
  est = estimate_gain(256, 256, 256, 8, dtype="bfloat16", target="h100x8")
  assert not est.worthwhile and est.speedup < 1.0


def test_estimate_gain_bidirectional_halves_the_exchange():
  # Communication-bound (short k): the ring's time is its exchanges, each block's halves
  # travelling on the two link directions at once.
  m, n, k = 65536, 1024, 512
  uni = estimate_gain(m, n, k, 8, dtype="bfloat16", target="h100x8", bidirectional=False)
  bidi = estimate_gain(m, n, k, 8, dtype="bfloat16", target="h100x8", bidirectional=True)
  assert uni.comm_s == bidi.comm_s  # the baseline collective is the same NCCL ring
  block = m * k / 8 * 2

  def step(pieces):
    flops = 2 * m * n * k / 64 / pieces
    nbytes = (m * k + (k * n + m * n) / 8) * 2 / 8 / pieces
    return pieces * (max(flops / (0.75 * _PEAK), nbytes / (0.85 * _HBM)) + 1e-6)

  topo = targets.get("h100x8")
  for est, halves, pieces in ((uni, 1, 1), (bidi, 2, 2)):
    # A send/recv runs on NCCL's p2p channels for its size, each at the rate one of the 24
    # collective channels moves when they share the link.
    ctas = nccl.p2p_channels(block / halves, 8, topo, 24)
    assert ctas == 4
    exchange = _ALPHA + block / halves / (0.8 * _LINK * ctas / 24)
    assert exchange > step(pieces)
    # The steps' outputs put in device order: one copy of this device's output columns.
    copies = 2 * (m * n / 8 * 2) / (0.85 * _HBM) + 1e-6
    assert est.copies_s == pytest.approx(copies)
    assert est.overlapped_s == pytest.approx(step(pieces) + 7 * exchange + copies)
  assert bidi.overlapped_s < uni.overlapped_s


def test_estimate_gain_errors():
  with pytest.raises(ValueError, match="estimate_gain: axis_size must be a positive int, got 0"):
    estimate_gain(8, 8, 8, 0)
  with pytest.raises(
    ValueError,
    match="estimate_gain: kind must be 'all_gather' or 'reduce_scatter', got 'all_reduce'",
  ):
    estimate_gain(8, 8, 8, 8, kind="all_reduce")
