"""Tests for jax_overlap.flags: registry, validation, recommendations, configure."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap import ConfigError, flags, targets
from jax_overlap._src import flags as flags_impl
from jax_overlap._src.flags import aborts
from jax_overlap._src.flags import probe as probe_lib
from jax_overlap._src.flags.validation import version_tuple

REMOVED = sorted(n for n, f in flags.REGISTRY.items() if f.removed_in)


def test_registry_entries_are_complete():
  for name, f in flags.REGISTRY.items():
    assert f.meaning, name
    assert f.kind in ("xla", "env")
    if f.kind == "xla":
      assert name.startswith("xla_"), name
  # The families named in BACKGROUND section 3 are all there.
  for n in [
    "xla_gpu_enable_async_all_gather",
    "xla_gpu_enable_async_reduce_scatter",
    "xla_gpu_enable_async_all_reduce",
    "xla_gpu_enable_async_collectives",
    "xla_gpu_lhs_enable_gpu_async_tracker",
    "xla_gpu_enable_nccl_per_stream_comms",
    "xla_gpu_graph_level",
    "xla_gpu_enable_custom_fusions",
    "xla_gpu_enable_triton_softmax_fusion",
    "xla_gpu_enable_triton_hopper",
    "xla_gpu_cudnn_gemm_fusion",
  ]:
    assert flags.REGISTRY[n].removed_in, n


def _default_text(f):
  if f.default is None:
    if f.choices:
      return f.choices[0]
    return {"bool": "true", "int": "0", "float": "0"}.get(f.type, "")
  return flags_impl.format_value(f.default)


def test_live_registry_flags_have_the_type_xla_gives_them():
  installed = version_tuple(probe_lib.jaxlib_version())

  def live_here(f) -> bool:
    if f.removed_in and version_tuple(f.removed_in) <= installed:
      return False
    return not f.since or version_tuple(f.since) <= installed

  xla = [f for f in flags.REGISTRY.values() if f.kind == "xla"]
  live = [f for f in xla if live_here(f)]
  assert len(live) > 20
  # A flag the registry says comes later is one the installed XLA does not know yet.
  later = [f.name for f in xla if f.since and version_tuple(f.since) > installed]
  assert [n for n in later if probe_lib.flag_type(n) is not None] == []
  expected = {"bool": {"bool"}, "int": {"int32", "int64"}, "float": {"float"}, "str": {"string"}}
  for f in live:
    # XLA's own answer for the type, read by the values its flag parser takes.
    got = probe_lib.flag_type(f.name)
    assert got in expected.get(f.type, {"choice", "string"}), (f.name, f.type, got)
  problems = flags.validate({f.name: _default_text(f) for f in live})
  assert [p for p in problems if p.severity == "error"] == []


@pytest.mark.parametrize("name", REMOVED)
def test_every_removed_flag_is_reported(name):
  problems = flags.validate(f"--{name}=true")
  assert [p.kind for p in problems] in (["removed"], ["renamed"])
  assert name in problems[0].message
  assert "aborts the process" in problems[0].message


def test_removed_flags_are_reported_without_aborting_where_xla_aborts():
  # All at once: validate reports each, from this process; XLA itself aborts on the string.
  text = " ".join(f"--{n}=true" for n in REMOVED)
  problems = flags.validate(text)
  assert {p.name for p in problems} == set(REMOVED)
  assert all(p.severity == "error" for p in problems)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=text, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True
  )
  assert proc.returncode != 0 and "Unknown flag" in proc.stderr


def test_renamed_flag_suggests_the_new_name():
  (p,) = flags.validate("--xla_gpu_graph_level=0")
  assert p.kind == "renamed"
  assert p.suggestion == "xla_gpu_enable_command_buffer"


def test_newer_spelling_on_older_jaxlib():
  import jaxlib

  problems = flags.validate({"xla_gpu_pipeline_all_gather": "on"})
  if tuple(int(x) for x in jaxlib.__version__.split(".")[:2]) < (0, 11):
    assert problems[0].kind == "not_yet_supported"
    assert problems[0].suggestion == "xla_gpu_enable_pipelined_all_gather"
  else:
    assert all(p.kind != "unknown" for p in problems)


@pytest.mark.parametrize(
  "text,kind,match",
  [
    (
      "--xla_gpu_enable_latency_hiding_scheduler=maybe",
      "bad_value",
      "Couldn't interpret value maybe for flag xla_gpu_enable_latency_hiding_scheduler.); it "
      "takes a bool (true, false, 1 or 0)",
    ),
    (
      "--xla_gpu_all_gather_combine_threshold_bytes=12x",
      "bad_value",
      "it takes a base-10 int64",
    ),
    (
      "--xla_gpu_enable_latency_hidng_scheduler=true",
      "unknown",
      "did you mean xla_gpu_enable_latency_hiding_scheduler",
    ),
    ("--xla_gpu_frobnicate=1", "unknown", "it aborts the process at backend start"),
    (
      "xla_gpu_enable_latency_hiding_scheduler=true",
      "malformed",
      "XLA takes 'xla_gpu_enable_latency_hiding_scheduler=true' as the name of a flag file",
    ),
    ("--xla_gpu_enable_command_buffer=FUSION,BOGUS", "bad_value", "Illegal value"),
    ("--xla_dump_to", "no_value", "takes a string"),
    ("--xla_gpu_enable_latency_hiding_scheduler=true --", "malformed", "'--' ends XLA's flag list"),
    ("-xla_gpu_autotune_level=0", "malformed", "is not an XLA flag"),
    ("--NCCL_MAX_CTAS=4", "unknown", "export NCCL_MAX_CTAS=4"),
  ],
)
def test_validate_reports_bad_input(text, kind, match):
  problems = flags.validate(text)
  assert len(problems) == 1, problems
  assert problems[0].kind == kind
  assert problems[0].severity == "error"
  assert match in problems[0].message


def test_validate_env_variables_and_warnings():
  problems = flags.validate({"NCCL_MAX_CTAS": "many", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
  kinds = sorted((p.name, p.kind, p.severity) for p in problems)
  assert kinds == [
    ("CUDA_DEVICE_MAX_CONNECTIONS", "counterproductive", "warning"),
    ("NCCL_MAX_CTAS", "bad_value", "error"),
  ]
  (w,) = flags.validate("--xla_gpu_enable_highest_priority_async_stream=false")
  assert w.severity == "warning" and "priority" in w.message
  # NCCL's older channel names are known; other NCCL variables are not XLA's to check and
  # nothing XLA aborts on: a warning that says so, not an error.
  assert flags.validate({"NCCL_MAX_NCHANNELS": "8", "NCCL_MIN_NCHANNELS": "4"}) == []
  (d,) = flags.validate({"NCCL_DEBUG": "INFO"})
  assert (d.severity, d.kind) == ("warning", "unknown") and "not checked" in d.message
  (x,) = flags.validate({"NCCL_DEBUGG": "INFO", "xla_gpu_enable_latency_hiding_scheduler": True})
  assert x.name == "NCCL_DEBUGG" and x.severity == "warning"


def test_validate_good_flags_and_types():
  assert (
    flags.validate(
      "--xla_gpu_enable_latency_hiding_scheduler --xla_gpu_memory_limit_slop_factor=90"
    )
    == []
  )
  assert flags.validate({}) == []
  with pytest.raises(TypeError, match="XLA_FLAGS string or a dict"):
    flags.validate(42)


def test_parse_and_format_round_trip():
  opts = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_command_buffer": ""}
  text = flags.format_xla_flags(opts)
  parsed, bad = flags.parse_xla_flags(text)
  assert bad == []
  assert parsed == {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_command_buffer": "",
  }


@pytest.mark.parametrize("target", ["a40x8", "a100x8", "h100x8", "h200x8", "h200x16"])
@pytest.mark.parametrize("workload", flags.WORKLOADS)
def test_every_recommended_profile_compiles_deviceless(target, workload):
  opts = flags.as_compiler_options(target=target, workload=workload)
  assert flags.validate(opts) == []
  topo = targets.get(target)
  mesh = targets.compile_only_mesh(topo, {"fsdp": topo.num_devices // 2, "tensor": 2})
  w = jax.ShapeDtypeStruct(
    (256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", "tensor"))
  )
  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))

  def step(w, x):
    loss = lambda w: jnp.sum(jnp.tanh(x @ w).astype(jnp.float32))
    return w - 0.1 * jax.grad(loss)(w)

  compiled = jax.jit(step).lower(w, x).compile(opts)
  assert compiled.memory_analysis() is not None


def test_recommended_differs_by_gpu_and_workload():
  h = flags.recommended(target="h100x8", workload="fsdp")
  a = flags.recommended(target="a100x8", workload="fsdp")
  assert h["xla_gpu_enable_latency_hiding_scheduler"] is True
  assert "xla_gpu_enable_analytical_latency_estimator" not in h
  # Ampere's gets the analytical estimator, unless the installed XLA aborts with it.
  estimator_aborts = aborts.aborts("xla_gpu_enable_analytical_latency_estimator")[0]
  assert a.get("xla_gpu_enable_analytical_latency_estimator") is (
    None if estimator_aborts else True
  )
  tp = flags.recommended(target="h100x8", workload="tensor_parallel")
  windowed_aborts = aborts.aborts("xla_gpu_threshold_for_windowed_einsum_mib")[0]
  assert tp.get("xla_gpu_threshold_for_windowed_einsum_mib") == (None if windowed_aborts else 0)
  # NCCL's own choice on a PCIe box (2 channels) is under every cap judged: none is set.
  assert not [k for k in flags.recommended(target="a40x8") if k.startswith("NCCL_")]
  for opts in (h, a, tp):
    for name in opts:
      assert flags.REGISTRY[name].why or flags.REGISTRY[name].meaning


def test_recommended_bad_input():
  with pytest.raises(ValueError, match="unknown workload 'pipeline'; valid choices: fsdp"):
    flags.recommended(target="h100x8", workload="pipeline")
  with pytest.raises(ValueError, match="unknown target 'b300x8'"):
    flags.recommended(target="b300x8", workload="fsdp")


def test_as_compiler_options_rejects_bad_overrides():
  with pytest.raises(ConfigError, match="xla_gpu_enable_async_all_gather was removed"):
    flags.as_compiler_options(
      target="h100x8", workload="fsdp", xla_options={"xla_gpu_enable_async_all_gather": True}
    )
  with pytest.raises(ConfigError, match="environment variables, not compile options"):
    flags.as_compiler_options(target="h100x8", workload="fsdp", xla_options={"NCCL_MAX_CTAS": 8})
  opts = flags.as_compiler_options(
    target="h100x8", workload="fsdp", xla_options={"xla_gpu_memory_limit_slop_factor": 80}
  )
  assert opts["xla_gpu_memory_limit_slop_factor"] == 80


def test_configure_edits_a_given_environment():
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_gpu_enable_latency_hiding_scheduler=false"}
  with pytest.raises(
    ConfigError,
    match="xla_gpu_enable_latency_hiding_scheduler: XLA_FLAGS has false, recommended true",
  ):
    flags.configure(target="h100x8", workload="fsdp", environ=env)
  assert env["XLA_FLAGS"].endswith("=false")  # nothing changed on refusal
  flags.configure(target="h100x8", workload="fsdp", environ=env, on_conflict="keep")
  parsed, _ = flags.parse_xla_flags(env["XLA_FLAGS"])
  assert parsed["xla_dump_to"] == "/tmp/x"
  assert parsed["xla_gpu_enable_latency_hiding_scheduler"] == "false"
  assert parsed["xla_gpu_enable_pipelined_all_gather"] == "true"
  env2 = {"XLA_FLAGS": "--xla_gpu_enable_async_all_gather=true"}
  with pytest.raises(ConfigError, match="already holds flags XLA would abort on"):
    flags.configure(target="h100x8", workload="fsdp", environ=env2)
  env5 = {"XLA_FLAGS": "--xla_dump_to"}  # XLA aborts on it; '=true' would dump to ./true
  with pytest.raises(ConfigError, match="--xla_dump_to has no value"):
    flags.configure(target="h100x8", workload="fsdp", environ=env5)
  assert env5["XLA_FLAGS"] == "--xla_dump_to"
  env3 = {"XLA_FLAGS": "oops"}
  with pytest.raises(ConfigError, match="malformed token"):
    flags.configure(target="h100x8", workload="fsdp", environ=env3)
  env4: dict = {}
  applied = flags.configure(target="a40x8", workload="fsdp", environ=env4, NCCL_MAX_CTAS=4)
  assert env4["NCCL_MAX_CTAS"] == "4" and applied["NCCL_MAX_CTAS"] == "4"


def _run(code: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )


def test_configure_after_backend_start_raises():
  proc = _run(
    """
      import jax, jax_overlap
      jax.devices()
      try:
        jax_overlap.flags.configure("h100x8", "fsdp")
      except jax_overlap.ConfigError as e:
        print("CONFIGERROR", e)
      """
  )
  assert "CONFIGERROR configure: the JAX backend is already initialized" in proc.stdout, proc.stderr


def test_configure_before_start_reaches_the_compile():
  proc = _run(
    """
      import json, jax, jax.numpy as jnp, jax_overlap
      from jax.sharding import NamedSharding, PartitionSpec as P
      from jax_overlap._src.compile.compiler import compile_for_target
      applied = jax_overlap.flags.configure("a100x8", "fsdp")
      mesh = jax_overlap.targets.compile_only_mesh("a100x8")
      x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
      step = compile_for_target(lambda a: (a @ a.T).sum(), x, target="a100x8")
      print("SEEN" + json.dumps(step.debug_options))
      """
  )
  line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SEEN")), None)
  assert line is not None, proc.stderr[-2000:]
  seen = json.loads(line[4:])
  assert seen["xla_gpu_enable_latency_hiding_scheduler"] == "true"
  estimator_aborts = aborts.aborts("xla_gpu_enable_analytical_latency_estimator")[0]
  assert seen.get("xla_gpu_enable_analytical_latency_estimator") == (
    None if estimator_aborts else "true"
  )
  assert seen["xla_gpu_enable_while_loop_double_buffering"] == "true"


def test_sharded_step_for_h100_has_async_collective_pairs():
  from jax_overlap._src.compile.compiler import compile_for_target

  mesh = targets.compile_only_mesh("h100x8")
  ps = NamedSharding(mesh, P("fsdp"))
  ws = [
    (
      jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=ps),
      jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=ps),
    )
    for _ in range(3)
  ]
  x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=ps)

  def loss(ws, x):
    rep = NamedSharding(mesh, P())
    for w1, w2 in ws:
      w1 = jax.lax.with_sharding_constraint(w1, rep)
      w2 = jax.lax.with_sharding_constraint(w2, rep)
      x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.mean(x.astype(jnp.float32) ** 2)

  step = compile_for_target(
    jax.jit(jax.grad(loss), out_shardings=ps),
    ws,
    x,
    target="h100x8",
    xla_options=flags.as_compiler_options(target="h100x8"),
  )
  hlo = step.hlo_text
  # jaxlib 0.10 writes all-gather-start/-done, later ones an async-start wrapping the gather
  # (and a gather with nothing beside it synchronous): read as the analysis reads them.
  from jax_overlap._src.analysis import hlo as hlo_lib
  from jax_overlap._src.analysis import schedule

  pairs = schedule.collective_brackets(hlo_lib.parse_module(hlo))
  assert any(b.kind == "all-gather" and b.gemms and not b.synchronous for b in pairs), pairs
  assert '"is_sync":false' in hlo
  assert "kAsyncStart" in step.thunk_text
  assert "stream=communication_stream" in step.thunk_text


@pytest.mark.parametrize(
  "given",
  [
    {"xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_all_reduce": False},
    {"xla_gpu_pipeline_all_gather": "on", "xla_gpu_pipeline_reduce_scatter": "off"},
  ],
  ids=["bool_spelling", "enum_spelling"],
)
def test_per_compile_spelling_is_what_the_installed_jaxlib_compiles_with(given):
  # XLA_FLAGS and compiler_options= are read by different parsers: since jaxlib 0.11 the
  # loop pipeliner's switches are enums whose per-compile values are proto names, and the
  # earlier bool names are taken only in XLA_FLAGS. Either spelling in, one XLA compiles out.
  from jax_overlap._src.flags import per_compile

  spelled = per_compile.spelled({**given, "xla_gpu_enable_latency_hiding_scheduler": True})
  assert spelled["xla_gpu_enable_latency_hiding_scheduler"] is True  # one spelling: unchanged
  assert len(spelled) == len(given) + 1
  jax.jit(lambda x: x + 1, compiler_options=spelled).lower(1.0).compile()
  on = [v for k, v in spelled.items() if "all_gather" in k]
  assert on in ([True], ["COLLECTIVE_PIPELINING_MODE_ON"])
  # No spelling the installed jaxlib takes: kept as given, so XLA's own error names it.
  assert per_compile.spelled({"xla_no_such_option": 1}) == {"xla_no_such_option": 1}


def test_a_topology_built_by_the_user_is_recommended_for_as_its_gpu_is():
  # A topology not in the catalogue by name (the user's own host count, say) gets the
  # recommendation of its GPU, not "unknown target".
  import dataclasses

  mine = dataclasses.replace(targets.get("h100x8"), name="my_h100_pod", num_hosts=3)
  for workload in ("fsdp", "tensor_parallel"):
    want = flags.recommended(target="h100x8", workload=workload)
    assert flags.recommended(target=mine, workload=workload) == want
  a100 = dataclasses.replace(targets.get("a100x8"), name="my_a100_pod")
  assert flags.recommended(target=a100) == flags.recommended(target="a100x8")
