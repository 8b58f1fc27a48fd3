"""A mistake in the user's call is reported as theirs: API, function, arguments, original kind."""

import jax
import jax.numpy as jnp
import pytest

import jax_overlap
from jax_overlap import budget


def step(w, x):
  return jnp.sum(jnp.tanh(x @ w))


W = jax.ShapeDtypeStruct((64, 32), jnp.float32)
X_BAD = jax.ShapeDtypeStruct((8, 63), jnp.float32)
SHAPES = "step(float32[64, 32], float32[8, 63]) fails when traced on these arguments"
MISMATCH = "dot_general requires contracting dimensions to have the same shape"


@pytest.mark.parametrize("target", ["h100x8", None])
def test_analyze_shape_mismatch(target):
  with pytest.raises(TypeError, match=r"analyze: step\(float32\[64, 32\], float32\[8, 63\]\)") as e:
    jax_overlap.analyze(step, W, X_BAD, target=target)
  assert MISMATCH in str(e.value) and "before any compilation" in str(e.value)
  assert "XLA could not compile" not in str(e.value)
  assert isinstance(e.value.__cause__, TypeError)


def test_analyze_wrong_arity():
  with pytest.raises(TypeError, match=r"analyze: step\(float32\[64, 32\]\) fails.*missing 1"):
    jax_overlap.analyze(step, W, target="h100x8")


def test_analyze_keyword_and_pytree_arguments_are_described():
  def f(params, *, batch):
    return params["w"] @ batch

  params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
  with pytest.raises(TypeError, match=r"f\(dict of 2 leaves, batch=float32\[5\]\)"):
    jax_overlap.analyze(f, params, batch=jnp.ones((5,)), target=None)


@pytest.mark.parametrize("api", ["overlap", "analyze"])
def test_one_array_in_a_container_is_described_not_compared(api):
  # A container of one array: the description tells them apart by identity (an array's ==
  # is elementwise, and comparing it with a dict raised inside the error path).
  def f(params, batch):
    return jnp.mean(batch["x"] @ params["w"])

  params, batch = {"w": jnp.ones((32, 16))}, {"x": jnp.ones((4, 8))}
  call = {
    "overlap": lambda: jax_overlap.overlap(f)(params, batch),
    "analyze": lambda: jax_overlap.analyze(f, params, batch, target=None),
  }[api]
  with pytest.raises(TypeError, match=rf"{api}: .*f\(dict of 1 leaf, dict of 1 leaf\) fails") as e:
    call()
  assert MISMATCH in str(e.value)


def test_overlap_reports_the_users_function():
  dec = jax_overlap.overlap(step)
  with pytest.raises(
    TypeError,
    match="overlap: "
    + SHAPES.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
  ):
    dec(jnp.ones((64, 32)), jnp.ones((8, 63)))
  with pytest.raises(TypeError, match=r"overlap: step\(float32\[64, 32\]\) fails"):
    dec.explain(jnp.ones((64, 32)))


def test_budget_memory_breakdown_reports_the_users_function():
  with pytest.raises(
    TypeError, match=r"budget.memory.breakdown: step\(float32\[64, 32\], float32\[8, 63\]\)"
  ):
    budget.memory.breakdown(step, W, X_BAD, target="h100x8")


def test_budget_step_flops_reports_the_users_function():
  with pytest.raises(
    TypeError, match=r"budget.compute.step_flops: step\(float32\[64, 32\], float32\[8, 63\]\)"
  ):
    budget.compute.step_flops(step, jnp.ones((64, 32)), jnp.ones((8, 63)))


def test_value_errors_keep_their_kind():
  def bad(x):
    raise ValueError("batch must be even")

  with pytest.raises(
    ValueError, match=r"analyze: .*bad\(float32\[3\]\) fails.*ValueError: batch must be even"
  ):
    jax_overlap.analyze(bad, jnp.ones((3,)), target=None)


def test_compile_stage_errors_are_still_compile_errors():
  # The call traces fine; XLA rejects the compile options: the error names the option and
  # what XLA did with it, not the user's function.
  x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
  with pytest.raises(
    ValueError, match=r"analyze: xla_options names 'xla_no_such_option_xyz'.*per compile, XLA"
  ) as e:
    jax_overlap.analyze(step, W, x, target="h100x8", xla_options={"xla_no_such_option_xyz": 1})
  assert "fails when traced" not in str(e.value)
  # Other compile failures stay a RuntimeError naming XLA and the target.
  with pytest.raises(RuntimeError, match="XLA could not compile the function for h100x8"):
    jax_overlap.analyze(
      step, W, x, target="h100x8", xla_options={"xla_gpu_all_reduce_combine_threshold_bytes": "x"}
    )


def test_analyze_arguments_that_are_not_what_it_takes():
  with pytest.raises(TypeError, match="xla_options must be a mapping.*parse_xla_flags"):
    jax_overlap.analyze(step, W, W, target="h100x8", xla_options="--xla_gpu_enable_x=true")
  with pytest.raises(TypeError, match="cost_model must be a jax_overlap.analysis.CostModel"):
    jax_overlap.analyze(step, W, W, target="h100x8", cost_model="fast")


@pytest.mark.parametrize("target", ["h100x16", "h100x4"])
def test_analyze_a_shard_map_step_for_a_target_of_another_size(target):
  # A shard_map body is traced for its mesh's per-device shapes: analysed for a target
  # with another device count, the error says so (XLA's verifier printed a page of
  # StableHLO), while a GSPMD step scales its mesh to the target.
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))

  def body(w, x):
    w = jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)
    return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w)), "fsdp")

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
  args = [
    jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    for s in ((128, 128), (64, 128))
  ]
  with pytest.raises(ValueError, match=r"shard_map runs on mesh \{'fsdp': 8\} \(8 devices\)"):
    jax_overlap.analyze(fn, *args, target=target)
  report = jax_overlap.analyze(lambda w, x: jnp.mean(jnp.tanh(x @ w)), *args, target=target)
  assert report.collectives
  # Scaled to 6 GPUs the mesh splits 128 rows six ways: said before any trace.
  with pytest.raises(ValueError, match=r"split along dimension 0 .* \{'fsdp': 6\} \(the "
                     r"arguments' mesh \{'fsdp': 8\} scaled to the target\): 128 does not "
                     r"divide by 6"):  # fmt: skip
    jax_overlap.analyze(lambda w, x: jnp.mean(x @ w), *args, target="h100x6")
