"""Tests for deviceless schedule analysis (jax_overlap.analyze)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import sim, targets
from jax_overlap._src.analysis import cost_model as cm
from jax_overlap._src.analysis import hlo
from jax_overlap._src.compile.compiler import compile_for_target

H100 = targets.get("h100x8")
MODEL = cm.CostModel()
LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}


def _ring_seconds(nbytes: float, p: int = 8) -> float:
  """By hand, for the tests: a ring all-gather or reduce-scatter of ``nbytes`` over ``p``
  GPUs takes p - 1 hops, each the link latency plus one block (nbytes / p) over the link at
  the cost model's efficiency (catalogue numbers; NVLink 4 on H100 SXM)."""
  link = H100.gpu.link_bandwidth * cm.CostModel().link_efficiency
  return (p - 1) * (H100.gpu.link_latency_s + nbytes / p / link)


def _sds(shape, mesh, spec, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _smap(f, mesh, in_specs, out_specs):
  return jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  )


# By hand: H100 SXM bf16 dense peak and HBM3 bandwidth (datasheet), the cost model's
# default efficiencies (75% of peak, 85% of HBM) and 1 us per kernel.
_PEAK_BF16, _HBM = 989.4e12, 3.352e12


def _gemm_time(m, n, k):
  flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n)
  return max(flops / (0.75 * _PEAK_BF16), nbytes / (0.85 * _HBM)) + 1e-6


def test_all_gather_feeding_a_matmul_is_fully_exposed():
  mesh = targets.compile_only_mesh("h100x8")
  n = 4096

  def f(w, x):
    wg = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)
    return x @ wg

  fn = _smap(f, mesh, (P("fsdp"), P()), P())
  r = jax_overlap.analyze(
    fn, _sds((n, n), mesh, P("fsdp")), _sds((1024, n), mesh, P()), target="h100x8", xla_options=LHS
  )
  (ag,) = r.collectives
  assert ag.kind == "all-gather" and ag.group_size == 8
  assert ag.bytes == n * n * 2  # the gathered result
  expected = _ring_seconds(n * n * 2)
  assert ag.time_s == pytest.approx(expected)
  # Nothing can run under it: all of it is exposed.
  assert r.exposed_comm_s == pytest.approx(expected, rel=1e-6)
  assert r.overlap_fraction == pytest.approx(0.0, abs=1e-9)
  assert r.step_time_s == pytest.approx(r.compute_time_s + expected, rel=1e-6)


@pytest.mark.parametrize("m", [2048, 16384])
def test_all_gather_independent_of_a_matmul(m):
  mesh = targets.compile_only_mesh("h100x8")
  n = 4096

  def f(w, a, b):
    wg = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)
    return a @ b, wg

  fn = _smap(f, mesh, (P("fsdp"), P(), P()), (P(), P()))
  args = (_sds((n, n), mesh, P("fsdp")), _sds((m, n), mesh, P()), _sds((n, n), mesh, P()))
  r = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=LHS)
  (ag,) = r.collectives
  t_comm = _ring_seconds(n * n * 2)
  t_mm = _gemm_time(m, n, n)
  (mm,) = [k for k in r.kernels if k.gemm_mnk]
  assert mm.time_s == pytest.approx(t_mm, rel=1e-6)
  assert not ag.synchronous
  assert ag.overlapped_kernels >= 1
  # Hand-computed: the gather hides under the matmul, whatever is left is exposed.
  assert r.exposed_comm_s == pytest.approx(max(0.0, t_comm - t_mm), abs=0.02 * t_comm)
  assert r.step_time_s == pytest.approx(max(t_comm, t_mm), rel=0.05)


def test_a_collective_ready_as_a_persistent_library_gemm_starts_waits_for_it():
  # With XLA's Triton GEMMs off the dot is cuBLAS's, persistent on Hopper (measured on an
  # H200): the gather XLA starts just before it (both wait for the sine's kernel) can only
  # start when it ends, so none of it hides. On an A100 cuBLAS runs the same GEMM in waves
  # and the gather hides under it.
  n, m = 4096, 16384
  cublas = {**LHS, "xla_gpu_enable_triton_gemm": False}

  def f(w, a, b):
    wg = jax.lax.all_gather(jnp.sin(w), "fsdp", axis=0, tiled=True)
    return a @ b, wg

  reports = {}
  for target in ("h100x8", "a100x8"):
    mesh = targets.compile_only_mesh(target)
    fn = _smap(f, mesh, (P("fsdp"), P(), P()), (P(), P()))
    args = (_sds((n, n), mesh, P("fsdp")), _sds((m, n), mesh, P()), _sds((n, n), mesh, P()))
    reports[target] = jax_overlap.analyze(fn, *args, target=target, xla_options=cublas)
  h100, a100 = reports["h100x8"], reports["a100x8"]
  (mm,) = [k for k in h100.kernels if k.kind == "gemm"]
  assert mm.library and mm.persistent and not mm.launch_name
  (ag,) = h100.collectives
  assert ag.held_by == mm.name
  assert ag.start_s == pytest.approx(mm.end_s)
  assert h100.exposed_comm_s == pytest.approx(ag.time_s, rel=0.02)
  assert any("persistent library GEMM" in note for note in h100.notes)
  (mm_a,) = [k for k in a100.kernels if k.kind == "gemm"]
  (ag_a,) = a100.collectives
  assert mm_a.library and not mm_a.persistent and ag_a.held_by == ""
  assert a100.exposed_comm_s < 0.5 * ag_a.time_s
  # The simulator applies the same rule: its contention-free step is the analysis's, and
  # under XLA's priority the gather still starts only as the GEMM's last tiles run (the
  # SMs its last, partial wave leaves free).
  res = sim.realize(h100, "priority")
  assert res.ideal_s == pytest.approx(h100.step_time_s, rel=0.05)
  timing = res.results["priority"]
  (gemm,) = [k for k in res.workload.kernels if k.gemm_mnk]
  assert timing.timing(ag.name).start_s >= 0.9 * timing.timing(gemm.name).end_s
  # The same step on an A100: the gather starts at once beside the GEMM.
  res_a = sim.realize(a100, "priority").results["priority"]
  assert res_a.timing(ag_a.name).start_s < 0.1 * res_a.makespan_s


def test_reduce_scatter_after_the_last_matmul_is_exposed():
  mesh = targets.compile_only_mesh("h100x8")

  def f(x, w):
    return jax.lax.psum_scatter(x @ w, "fsdp", scatter_dimension=0, tiled=True)

  fn = _smap(f, mesh, (P(), P()), P("fsdp"))
  r = jax_overlap.analyze(
    fn,
    _sds((4096, 4096), mesh, P()),
    _sds((4096, 4096), mesh, P()),
    target="h100x8",
    xla_options=LHS,
  )
  (rs,) = r.collectives
  assert rs.kind == "reduce-scatter"
  expected = _ring_seconds(4096 * 4096 * 2)
  assert r.exposed_comm_s == pytest.approx(expected, rel=1e-6)
  assert r.overlap_fraction == pytest.approx(0.0, abs=1e-9)


def test_no_collectives_gives_a_valid_report():
  mesh = targets.compile_only_mesh("h100x8")
  x = _sds((1024, 1024), mesh, P("fsdp"))
  r = jax_overlap.analyze(lambda a: jnp.tanh(a) * 2, x, target="h100x8")
  # One fused elementwise kernel over a 128 x 1024 bf16 shard: read once, written once.
  assert r.compute_time_s == pytest.approx(2 * 128 * 1024 * 2 / (0.85 * _HBM) + 1e-6, rel=1e-6)
  assert r.collectives == []
  assert r.overlap_fraction is None
  assert r.exposed_comm_s == 0.0
  assert r.step_time_s == pytest.approx(r.compute_time_s)
  assert "no collectives" in str(r)
  assert any("no collectives" in n for n in r.notes)


def _cpu_programs():
  a = jnp.ones((256, 512), jnp.float32)
  b = jnp.ones((512, 384), jnp.float32)
  c = jnp.ones((384, 128), jnp.float32)
  q = jnp.ones((4, 64, 32), jnp.float32)
  return {
    "matmul": (lambda a, b: a @ b, (a, b)),
    "chain": (lambda a, b, c: jnp.tanh(a @ b) @ c, (a, b, c)),
    "mlp_grad": (jax.grad(lambda a, b, c: jnp.sum(jax.nn.gelu(a @ b) @ c)), (a, b, c)),
    "softmax": (lambda a: jax.nn.softmax(a, axis=-1), (a,)),
    "attention": (lambda q, k, v: jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k)) @ v, (q, q, q)),
    "layernorm": (
      lambda a: (a - a.mean(-1, keepdims=True)) * jax.lax.rsqrt(a.var(-1, keepdims=True) + 1e-5),
      (a,),
    ),
  }


@pytest.mark.parametrize("name", sorted(_cpu_programs()))
def test_flop_and_byte_counts_match_xla_cost_analysis(name):
  fn, args = _cpu_programs()[name]
  step = compile_for_target(fn, *args, target=None)
  module = hlo.parse_module(step.hlo_text)
  comp = module.entry_computation
  ops = [
    i
    for i in comp.instructions
    if i.opcode not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")
  ]
  flops = sum(module.instruction_flops(i) for i in ops)
  trans = sum(module.instruction_transcendentals(i) for i in ops)
  nbytes = sum(module.instruction_bytes(i) for i in ops)
  xla = step.compiled.cost_analysis()
  assert flops == pytest.approx(xla["flops"], rel=1e-9)
  assert trans == pytest.approx(xla.get("transcendentals", 0.0), rel=1e-9)
  assert nbytes == pytest.approx(xla["bytes accessed"], rel=1e-9)


def test_loop_bodies_are_counted_per_iteration():
  def scanned(ws, x):
    return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0].sum()

  ws, x = jnp.ones((3, 128, 128)), jnp.ones((64, 128))
  r = jax_overlap.analyze(scanned, ws, x, target=None)
  assert r.loops and r.loops[0].trip_count == 3
  (loop,) = r.loops
  assert isinstance(loop, jax_overlap.analysis.LoopInfo) and loop.body
  assert json.loads(r.to_json())["loops"] == [
    {"name": loop.name, "trip_count": 3, "body": loop.body}
  ]
  # 3 iterations of a 64x128x128 matmul; XLA's own analysis counts the body once.
  matmul_flops = 3 * 2 * 64 * 128 * 128
  assert matmul_flops <= r.flops <= matmul_flops * 1.01
  xla = compile_for_target(scanned, ws, x, target=None).compiled.cost_analysis()["flops"]
  assert r.flops == pytest.approx(3 * xla, rel=0.01)


def test_a_cpu_analysis_times_send_recv_and_all_to_all():
  # target=None: the local CPU's rough model, which has no NCCL channels to apportion.
  mesh = jax.make_mesh((8,), ("x",))
  perm = [(i, (i + 1) % 8) for i in range(8)]

  def body(a):
    a = jax.lax.ppermute(a, "x", perm)
    return jax.lax.all_to_all(a, "x", 0, 0, tiled=True)

  fn = _smap(body, mesh, P("x"), P("x"))
  a = jax.device_put(jnp.ones((8 * 64, 128), jnp.float32), NamedSharding(mesh, P("x")))
  r = jax_overlap.analyze(fn, a, target=None)
  kinds = {c.kind for c in r.collectives}
  assert {"collective-permute", "all-to-all"} <= kinds, kinds
  assert all(c.time_s > 0 for c in r.collectives)


@pytest.mark.parametrize("types", ["Auto", "Explicit"])
def test_a_step_run_under_the_callers_mesh_compiles_for_the_target(types):
  # Code written under ``with jax.set_mesh(mesh):`` (bare PartitionSpecs, Flax NNX's eager
  # sharding): the target's mesh takes the CPU mesh's place, with its axis types.
  axis_type = getattr(jax.sharding.AxisType, types)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)

  def step(w, x):
    h = jnp.tanh(x @ w)
    if types == "Auto":
      h = jax.lax.with_sharding_constraint(h, P("data", "model"))
    return jnp.sum(h.astype(jnp.float32))

  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.ones((256, 512), jnp.bfloat16), P(None, "model"))
    x = jax.device_put(jnp.ones((64, 256), jnp.bfloat16), P("data", None))
    r = jax_overlap.analyze(jax.jit(step), w, x, target="h100x8")
    assert jax.sharding.get_mesh() == mesh  # the caller's mesh is back
  assert r.target == "h100x8" and r.flops > 0
  assert len(r.collectives) >= 1  # the model axis' partial sums


def test_a_step_with_a_static_argument_is_compiled_on_the_targets_mesh():
  # A jitted shard_map step over the caller's CPU arrays, with a static argument that is
  # not an array: the shard_map's mesh is swapped for the target's, the static argument
  # passed as it is.
  mesh = jax.make_mesh((8,), ("x",))

  @functools.partial(jax.jit, static_argnames="act")
  def step(w, x, act):
    def body(w, x):
      return jax.lax.psum(getattr(jnp, act)(x @ w), "x")

    return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P())(w, x)

  w = jax.device_put(jnp.ones((256, 128), jnp.float32), NamedSharding(mesh, P("x")))
  x = jax.device_put(jnp.ones((64, 256), jnp.float32), NamedSharding(mesh, P(None, "x")))
  r = jax_overlap.analyze(step, w, x, act="tanh", target="h100x8")
  assert r.target == "h100x8"
  assert [c.kind for c in r.collectives] == ["all-reduce"]


def test_report_outputs(tmp_path):
  from jax_overlap.examples import fsdp_mlp

  fn, args = fsdp_mlp.build("h100x8", layers=2, hidden=1024, mlp=4096, tokens_per_device=1024)
  r = jax_overlap.analyze(
    fn, *args, target="h100x8", xla_options=jax_overlap.flags.as_compiler_options(target="h100x8")
  )
  text = str(r)
  assert "all-gather" in text and "exposed comm" in text
  d = json.loads(r.to_json())
  assert d["target"] == "h100x8" and len(d["kernels"]) == len(r.kernels)
  assert d["num_collectives"] == len(r.collectives) > 0
  # Perfetto / Chrome trace events.
  trace = json.load(open(r.to_perfetto(str(tmp_path / "t.json"))))
  xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert len(xs) == len(r.events)
  lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
  assert "compute" in lanes and any(lane.startswith("comm[") for lane in lanes)
  png = r.plot(str(tmp_path / "t.png"))
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  # Kernels carry launch configurations from XLA's thunk listing.
  gemms = [k for k in r.kernels if k.kind == "gemm"]
  assert gemms and all(k.grid_blocks > 0 and k.threads_per_block > 0 for k in gemms)
  assert all(k.gemm_mnk is not None for k in gemms)
  # Timeline invariants: kernels never overlap each other on the compute stream.
  ends = [(k.start_s, k.end_s) for k in r.kernels]
  assert all(a[1] <= b[0] + 1e-15 for a, b in zip(ends, ends[1:]))
  for c in r.collectives:
    assert c.end_s == pytest.approx(c.start_s + c.time_s)
    assert 0 <= c.exposed_s <= c.time_s + 1e-12
  assert r.exposed_comm_s <= r.comm_time_s + 1e-12
  assert r.step_time_s >= r.compute_time_s


def test_compare_table():
  from jax_overlap.examples import fsdp_mlp

  fn, args = fsdp_mlp.build("a100x8", layers=2, hidden=1024, mlp=4096, tokens_per_device=2048)
  base = jax_overlap.analyze(fn, *args, target="a100x8", name="defaults")
  rec = jax_overlap.analyze(
    fn,
    *args,
    target="a100x8",
    xla_options=jax_overlap.flags.as_compiler_options(target="a100x8"),
    name="recommended",
  )
  table = jax_overlap.compare([base, rec])
  text = str(table)
  assert "defaults" in text and "recommended" in text
  rows = table.rows()
  assert rows[0]["speedup_vs_first"] == pytest.approx(1.0)
  assert "| recommended |" in table.to_markdown()
  with pytest.raises(ValueError, match="2 names for 1 reports"):
    jax_overlap.compare([base], ["a", "b"])
  with pytest.raises(ValueError, match="at least one report"):
    jax_overlap.compare([])


def test_shardings_are_retargeted_by_axis_name():
  from jax_overlap.examples import fsdp_mlp

  fn, args = fsdp_mlp.build("h100x8", layers=2, hidden=512, mlp=1024, tokens_per_device=256)
  r16 = jax_overlap.analyze(fn, *args, target="h200x16")
  assert r16.target == "h200x16"
  assert {c.group_size for c in r16.collectives if c.kind == "all-gather"} == {16}


def test_meshes_captured_in_shard_map_are_retargeted():
  cpu_mesh = jax.make_mesh((8,), ("fsdp",))

  def f(w, x):
    def body(w, x):
      return jax.lax.psum(jnp.sum(x @ jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)), "fsdp")

    return jax.shard_map(body, mesh=cpu_mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())(w, x)

  w = jax.device_put(np.ones((256, 256), np.float32), NamedSharding(cpu_mesh, P("fsdp")))
  x = jax.device_put(np.ones((128, 256), np.float32), NamedSharding(cpu_mesh, P("fsdp")))
  r = jax_overlap.analyze(f, w, x, target="a100x8")
  assert r.target == "a100x8"
  kinds = sorted(c.kind for c in r.collectives)
  assert "all-gather" in kinds and "all-reduce" in kinds


def test_arguments_without_a_sharding_are_compiled_for_the_target():
  # jax.jit places a program by its arguments' devices: arrays with no sharding would make
  # it a compile for the host's CPU, read as if it were the target's.
  def step(x, w1, w2):
    return jnp.sum(jax.nn.relu(x @ w1) @ w2)

  shapes = [(512, 256), (256, 1024), (1024, 256)]
  unplaced = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
  concrete = [jnp.ones(s, jnp.bfloat16) for s in shapes]  # on one CPU device
  mesh = targets.compile_only_mesh("h100x1", ("fsdp",))
  placed = [_sds(s, mesh, P(), jnp.bfloat16) for s in shapes]
  grads = jax.jit(jax.grad(step, argnums=(1, 2)))
  for args in (unplaced, concrete):
    compiled = compile_for_target(grads, *args, target="h100x1")
    assert compiled.platform == "cuda" and compiled.thunk_text  # XLA:GPU's thunk listing
  reports = [jax_overlap.analyze(grads, *a, target="h100x1") for a in (unplaced, placed)]
  assert reports[0].step_time_s == pytest.approx(reports[1].step_time_s)
  assert not any(k.name.startswith("ynn") for k in reports[0].kernels)


def test_a_function_without_array_arguments_is_refused_not_analysed_for_the_cpu():
  def made_inside():
    return jnp.ones((256, 256)) @ jnp.ones((256, 256))

  with pytest.raises(ValueError, match="compiled for the host's CPU, not for h100x1"):
    jax_overlap.analyze(made_inside, target="h100x1")


def test_bad_input_messages():
  mesh = targets.compile_only_mesh("h100x8", {"fsdp": 4, "tensor": 2})
  x = _sds((64, 64), mesh, P("fsdp", "tensor"))
  with pytest.raises(ValueError, match="unknown target 'z100x8'"):
    jax_overlap.analyze(lambda a: a, x, target="z100x8")
  with pytest.raises(ValueError, match="names mesh axes \\['tensor'\\] that the target mesh"):
    jax_overlap.analyze(lambda a: a * 2, x, target="h100x8", mesh={"fsdp": 8})
  with pytest.raises(ValueError, match="no deviceless compilation for ROCm"):
    jax_overlap.analyze(lambda a: a, x, target="mi250xx8")
  with pytest.raises(TypeError, match="fn must be callable"):
    jax_overlap.analyze(3, x)

  def needs_missing_custom_call(a):
    return jax.ffi.ffi_call("jax_overlap_no_such_target", jax.ShapeDtypeStruct(a.shape, a.dtype))(a)

  with pytest.raises(RuntimeError, match="XLA could not compile the function for h100x8"):
    jax_overlap.analyze(needs_missing_custom_call, _sds((8, 8), mesh, P()), target="h100x8")


def test_collective_brackets_and_while_bodies():
  from jax_overlap._src.analysis import schedule

  mesh = targets.compile_only_mesh("h100x8")

  def f(w, a, b):
    return a @ b, jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)

  fn = _smap(f, mesh, (P("fsdp"), P(), P()), (P(), P()))
  args = (
    _sds((4096, 4096), mesh, P("fsdp")),
    _sds((16384, 4096), mesh, P()),
    _sds((4096, 4096), mesh, P()),
  )
  step = compile_for_target(fn, *args, target="h100x8", xla_options=LHS)
  module = hlo.parse_module(step.hlo_text)
  (b,) = schedule.collective_brackets(module)
  assert (b.kind, b.gemms, b.synchronous) == ("all-gather", 1, False)
  assert schedule.while_bodies(module) == []
  scanned = compile_for_target(
    lambda ws, x: jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0],
    jnp.ones((3, 64, 64)),
    jnp.ones((8, 64)),
    target=None,
  )
  assert len(schedule.while_bodies(hlo.parse_module(scanned.hlo_text))) == 1


@pytest.mark.slow
def test_deviceless_gemm_tiling_failure_falls_back_to_cublas():
  # The small GPT's 8 x 63 token rows: XLA's Triton GEMM emitter, with no GPU to
  # autotune on, finds no tile sizes for some dots (one layer has them).
  from jax_overlap.examples import gpt

  fn, args = gpt.build("h100x8", layers=1)
  try:
    jax_overlap.analyze(
      fn, *args, target="h100x8", xla_options={"xla_gpu_enable_triton_gemm": True}
    )
  except RuntimeError as e:
    # A choice the user made is kept; the failure names XLA's reason.
    assert "Couldn't find output tile sizes" in str(e)
  else:
    pytest.skip("this XLA finds tile sizes for these dots")
  report = jax_overlap.analyze(fn, *args, target="h100x8")
  assert any("Triton GEMM emitter found no tile sizes" in n for n in report.notes)
  assert report.xla_options["xla_gpu_enable_triton_gemm"] is False
  assert report.kernels and report.step_time_s > 0
  # The transform's variants compile through the same path; once one has fallen back, the
  # variants compiled after it start with the fallback instead of failing first.
  from jax_overlap._src.compile import compiler as compile_lib

  failed_first = []
  original = compile_lib.fallback_for

  def counted(*a):
    out = original(*a)
    failed_first.append(out is not None)
    return out

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(compile_lib, "fallback_for", counted)
    e = jax_overlap.overlap(
      fn, target="h100x8", schedule_from_estimates=False, cache=False
    ).explain(*args)
  assert all(t < float("inf") for _, t in e.candidates)
  from jax_overlap._src.transform import compiles

  # At most the compiles already running when the first fell back fail first.
  assert len(e.candidates) >= 4 and 1 <= sum(failed_first) <= compiles.workers(), failed_first


_PARTIAL_READS = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_split (p0: f32[4,256,1536]) -> bf16[256,512] {
  %p0 = f32[4,256,1536]{2,1,0} parameter(0)
  %c = f32[] constant(0)
  %r = f32[256,1536]{1,0} reduce(%p0, %c), dimensions={0}, to_apply=%add
  %cv = bf16[256,1536]{1,0} convert(%r)
  ROOT %s = bf16[256,512]{1,0} slice(%cv), slice={[0:256], [512:1024]}
}

%fused_dot (p0: bf16[256,1536], p1: bf16[1536,64]) -> bf16[128,64] {
  %p0 = bf16[256,1536]{1,0} parameter(0)
  %p1 = bf16[1536,64]{1,0} parameter(1)
  %d = bf16[256,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %s = bf16[128,64]{1,0} slice(%d), slice={[0:128], [0:64]}
}

%fused_both (p0: bf16[256,1536]) -> (bf16[256,512], bf16[256,1536]) {
  %p0 = bf16[256,1536]{1,0} parameter(0)
  %s = bf16[256,512]{1,0} slice(%p0), slice={[0:256], [0:512]}
  %n = bf16[256,1536]{1,0} negate(%p0)
  ROOT %t = (bf16[256,512]{1,0}, bf16[256,1536]{1,0}) tuple(%s, %n)
}

ENTRY %main (x: f32[4,256,1536], y: bf16[256,1536], w: bf16[1536,64]) -> bf16[256,512] {
  %x = f32[4,256,1536]{2,1,0} parameter(0)
  %y = bf16[256,1536]{1,0} parameter(1)
  %w = bf16[1536,64]{1,0} parameter(2)
  %f1 = bf16[128,64]{1,0} fusion(%y, %w), kind=kLoop, calls=%fused_dot
  %f2 = (bf16[256,512]{1,0}, bf16[256,1536]{1,0}) fusion(%y), kind=kLoop, calls=%fused_both
  ROOT %f0 = bf16[256,512]{1,0} fusion(%x), kind=kLoop, calls=%fused_split
}
"""


def test_fusions_read_only_the_share_of_a_parameter_their_result_needs():
  module = hlo.parse_module(_PARTIAL_READS)
  comp = module.entry_computation
  # The split-K partials are summed and converted, and a third of the columns kept: the
  # emitter reads a third of the f32 partials, whatever lies between them and the slice.
  split = comp.by_name["f0"]
  assert module.instruction_bytes(split) == 4 * 256 * 1536 * 4 // 3 + 256 * 512 * 2
  # A dot needs all of both operands for any part of its result.
  dot = comp.by_name["f1"]
  assert module.instruction_bytes(dot) == 256 * 1536 * 2 + 1536 * 64 * 2 + 128 * 64 * 2
  # A parameter read whole by one user and in part by another is read whole, once.
  both = comp.by_name["f2"]
  assert module.instruction_bytes(both) == 256 * 1536 * 2 + 256 * 512 * 2 + 256 * 1536 * 2


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_cublas_gemms_are_counted_like_xla_emits_them(out):
  # With XLA's Triton GEMMs off the dot is a cuBLAS custom call, `__cublas$lt$matmul`,
  # returning (result, scratch workspace): the GEMM's FLOPs, and its operands and result.
  # A bfloat16 GEMM that writes float32 (preferred_element_type) runs at the bfloat16
  # rate: the dtype is its operands', not its result's.
  mesh = targets.compile_only_mesh("h100x8")
  x = _sds((8 * 512, 1024), mesh, P("fsdp"), jnp.bfloat16)
  w = _sds((1024, 2048), mesh, P(), jnp.bfloat16)
  r = jax_overlap.analyze(
    lambda x, w: jnp.dot(x, w, preferred_element_type=out),
    x,
    w,
    target="h100x8",
    xla_options={"xla_gpu_enable_triton_gemm": False},
  )
  assert 'custom_call_target="__cublas$lt$matmul"' in r.hlo_text
  (k,) = [k for k in r.kernels if k.kind == "gemm"]
  assert k.flops == 2 * 512 * 1024 * 2048
  itemsize = jnp.dtype(out).itemsize
  assert k.bytes_accessed == 2 * (512 * 1024 + 1024 * 2048) + itemsize * 512 * 2048
  assert k.dtype == "bf16"
  assert k.time_s == pytest.approx(
    cm.kernel_time(k.flops, k.bytes_accessed, targets.get_gpu("h100"), dtype="bf16", is_dot=True),
    rel=1e-9,
  )


def test_send_recv_collectives_run_on_nccl_p2p_channels():
  # A collective-permute is NCCL send/recv: on 8 H100s a 16 MiB step gets 4 of the 24
  # channels an all-gather uses, each at the rate a collective's channel moves.
  h100 = targets.get("h100x8")
  link, alpha = 0.8 * h100.gpu.link_bandwidth, h100.gpu.link_latency_s
  s = 16 << 20
  permute = cm.collective_time("collective-permute", s, 8, h100)
  assert permute == pytest.approx(alpha + s / (link * 4 / 24))
  # At 1 GiB NCCL splits it over all 32 p2p channels: the link binds again.
  big = cm.collective_time("collective-permute", 1 << 30, 8, h100)
  assert big == pytest.approx(alpha + (1 << 30) / link)
  # An all-to-all's peers each get their own channels (7 x 4 of 32): the link binds.
  a2a = cm.collective_time("all-to-all", s, 8, h100)
  assert a2a == pytest.approx(7 * alpha + 7 / 8 * s / link)
  # RCCL (MI250X) keeps the link-rate time.
  mi = targets.get("mi250x")
  assert cm.collective_time("collective-permute", s, 8, mi) == pytest.approx(
    mi.gpu.link_latency_s + s / (0.8 * mi.gpu.link_bandwidth)
  )


def test_the_same_compile_from_two_threads_runs_once(monkeypatch):
  # Two variants of a selection that lower to the same module with the same options: the
  # thread that comes second waits for the first's compile; if that compile fails, it tries.
  import threading
  import time

  from jax_overlap._src.compile import compiler as compile_lib

  compile_lib.clear_memo()
  mesh = targets.compile_only_mesh("h100x8", ("fsdp",))
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  monkeypatch.setenv("JAX_OVERLAP_COMPILE_CACHE", "0")  # only the in-process memo
  calls = []
  real = jax.stages.Lowered.compile
  fail = threading.Event()

  def slow(self, *a, **k):
    calls.append(threading.get_ident())
    time.sleep(1.0)  # the other thread arrives while this one compiles
    if fail.is_set():
      raise RuntimeError("XLA failed")
    return real(self, *a, **k)

  monkeypatch.setattr(jax.stages.Lowered, "compile", slow)

  def both(f):
    out = [None, None]
    start = threading.Barrier(2)

    def one(i):
      start.wait()
      try:
        out[i] = compile_lib.compile_for_target(f, x, target="h100x8")
      except RuntimeError as e:
        out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    return out

  a, b = both(lambda x: jnp.cos(x @ x.T).sum())
  assert len(calls) == 1 and a.hlo_text == b.hlo_text and a.hlo_text
  assert compile_lib._IN_FLIGHT == {}
  calls.clear()
  fail.set()
  a, b = both(lambda x: jnp.sin(x @ x.T).sum())
  assert len(calls) == 2 and len(set(calls)) == 2
  assert all(isinstance(e, RuntimeError) and "XLA failed" in str(e.__cause__) for e in (a, b))
  assert compile_lib._IN_FLIGHT == {}


def test_deviceless_compiles_are_remembered_in_the_process(monkeypatch):
  # The same program, options and target compiled again reuse XLA's result; other options,
  # another program or a kept dump compile anew.
  from jax_overlap._src.compile import compiler as compile_lib

  compile_lib.clear_memo()
  mesh = targets.compile_only_mesh("h100x8", ("fsdp",))
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

  def f(x):
    return jnp.tanh(x @ x.T).sum()

  calls = []
  real = jax.stages.Lowered.compile

  def counting(self, *a, **k):
    calls.append(1)
    return real(self, *a, **k)

  monkeypatch.setattr(jax.stages.Lowered, "compile", counting)
  a = compile_lib.compile_for_target(f, x, target="h100x8")
  b = compile_lib.compile_for_target(f, x, target="h100x8")
  assert len(calls) == 1 and a.hlo_text == b.hlo_text and b.notes is not a.notes
  compile_lib.compile_for_target(
    f, x, target="h100x8", xla_options={"xla_gpu_enable_triton_gemm": False}
  )
  compile_lib.compile_for_target(lambda x: jnp.sin(x).sum(), x, target="h100x8")
  assert len(calls) == 3
  kept = compile_lib.compile_for_target(f, x, target="h100x8", keep_dump=True)
  assert len(calls) == 4 and kept.dump_dir
  import shutil

  shutil.rmtree(kept.dump_dir, ignore_errors=True)


def test_thunk_listings_of_both_formats_read_the_same_launches():
  # XLA's thunk sequence lists a kernel's launch as "name grid: [...] threads: [...]
  # shared_memory: N bytes" up to jaxlib 0.12.0 and as "kernel=name, ..., launch
  # dimensions=blocks: {...}, threads/block: {...}, ..., shmem_bytes=N" from 0.12.1 (lines
  # of the two versions' listings of the same FSDP step).
  from jax_overlap._src.analysis import schedule

  old = (
    "031: kCustomKernel [prev=027 (3)   | next=032 (1)  ] gemm_fusion_dot_528 grid: "
    "[131072, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes\n"
    "025: kAsyncStart   [source         | next=219 (168)] stream=communication_stream[1], "
    "async_id=25\n026: kAllGather    [source         | next=033 (30) ] kAllGather\n"
  )
  new = (
    "031: kCustomKernel [prev=027 (3)   | next=032 (1)  ] kernel=gemm_fusion_dot_528, "
    "profile_annotation=gemm_fusion_dot.528, launch dimensions=blocks: {65536, 2, 1}, "
    "threads/block: {32, 2, 1}, cluster_dim=nullopt, shmem_bytes=768, use_pdl=true\n"
    "025: kAsyncStart   [source         | next=213 (162)] stream=communication_stream[1], "
    "async_id=25\n026: kAllGather    [source         | next=033 (30) ] kAllGather\n"
  )
  expected = ({"gemm_fusion_dot_528": (131072, 64, 768)}, [1])
  assert schedule.parse_thunks(old) == expected
  assert schedule.parse_thunks(new) == expected
  meta = 'thunk_metadata {\n  thunk_info {\n    profile_annotation: "gemm_fusion_dot.528"\n    thunk_id: 31\n  }\n}\n'
  for text in (old, new):
    launched = schedule.launches_by_instruction(text, meta)
    assert launched == {"gemm_fusion_dot.528": [("gemm_fusion_dot_528", (131072, 64, 768))]}
  # Cluster launches: none in either listing; a cluster's three dimensions where given.
  assert schedule.parse_clusters(old) == schedule.parse_clusters(new) == {}
  clustered = new.replace("cluster_dim=nullopt", "cluster_dim={2, 1, 1}")
  assert schedule.parse_clusters(clustered) == {"gemm_fusion_dot_528": 2}
  assert schedule.parse_thunks(clustered) == expected


def test_persistent_kernels_hold_what_becomes_ready_while_they_run():
  from jax_overlap._src.analysis import timeline

  gemm = [("gemm", 1.0, 3.0)]
  # Ready just as it starts (both waited for the kernel before), or while it runs: held.
  held = timeline.held_behind_persistent(gemm, [("a", 1.0, 1.5), ("b", 2.0, 2.2)], {})
  assert held == {"a": (3.0, "gemm"), "b": (3.0, "gemm")}
  # At the step's start the collective, launched first, goes first; one that started
  # before the kernel keeps running; after it, nothing holds it.
  assert timeline.held_behind_persistent([("g", 0.0, 2.0)], [("c", 0.0, 1.0)], {}) == {}
  assert timeline.held_behind_persistent(gemm, [("c", 0.5, 1.5), ("d", 3.0, 4.0)], {}) == {}
  # A collective running when the kernel started kept SMs from it: one ready during the
  # kernel (queued behind it on its stream) takes them as it ends.
  assert timeline.held_behind_persistent(gemm, [("c", 0.5, 1.5), ("e", 1.5, 2.5)], {}) == {}
  # Already held: not reported again, unless its kernel has moved (a later placement).
  assert timeline.held_behind_persistent(gemm, [("a", 3.0, 3.5)], {"a": (3.0, "gemm")}) == {}
  moved = [("gemm", 2.0, 4.0)]
  assert timeline.held_behind_persistent(moved, [("a", 3.0, 3.5)], {"a": (3.0, "gemm")}) == {
    "a": (4.0, "gemm")
  }


def test_explain_says_which_variants_wait_behind_persistent_gemms():
  from types import SimpleNamespace as NS

  from jax_overlap._src.transform import explain

  def report(*held):
    return NS(collectives=[NS(held_by=h) for h in held])

  names = ["as written", "cuBLAS GEMMs", "broken"]
  reports = [report("", ""), report("custom-call.1", "custom-call.4", ""), None]
  (note,) = explain.held_notes(names, 1, reports)
  assert "wait for its end on this GPU" in note and "in cuBLAS GEMMs (2)" in note
  assert "the chosen variant's wait behind custom-call.1, custom-call.4" in note
  assert "as written" not in note
  (note,) = explain.held_notes(names, 0, reports)
  assert "chosen variant" not in note
  assert explain.held_notes(names[:1], 0, reports[:1]) == []
