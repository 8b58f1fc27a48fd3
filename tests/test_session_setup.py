"""The test session's own settings (conftest.py, cpu_setting.py) change only what they say they
change."""

import inspect
import os

import cpu_setting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compiler
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap._src.compile import compiler as compile_lib

_UNOPTIMISED = os.environ.get("JAX_OVERLAP_TEST_CPU_OPT") != "1"
_SETTABLE = (
  "backend"
  in inspect.signature(
    getattr(compiler.get_compile_options, "__wrapped__", compiler.get_compile_options)
  ).parameters
)


def _compile_options(backend):
  return compiler.get_compile_options(num_replicas=1, num_partitions=1, backend=backend)


def _debug_options(backend):
  return _compile_options(backend).executable_build_options.debug_options


@pytest.mark.skipif(not _UNOPTIMISED, reason="JAX_OVERLAP_TEST_CPU_OPT=1 keeps XLA:CPU's settings")
@pytest.mark.skipif(not _SETTABLE, reason="this JAX's compile options do not name the backend")
def test_cpu_programs_compile_without_llvm_optimisations():
  assert hasattr(compiler.get_compile_options, "__wrapped__"), "cpu_setting.py's hook is missing"
  debug = _debug_options(jax.devices("cpu")[0].client)
  assert debug.xla_backend_optimization_level == 0
  assert debug.xla_llvm_disable_expensive_passes


def _overrides(backend):
  return dict(_compile_options(backend).env_option_overrides)


@pytest.mark.skipif(not _UNOPTIMISED, reason="JAX_OVERLAP_TEST_CPU_OPT=1 keeps XLA:CPU's settings")
@pytest.mark.skipif(not _SETTABLE, reason="this JAX's compile options do not name the backend")
def test_cpu_programs_compile_with_the_elemental_emitter_where_xla_has_it():
  cpu = jax.devices("cpu")[0].client
  if not cpu_setting.elemental_emitters_available():
    assert cpu_setting.EMITTERS_OPTION not in _overrides(cpu)
    return
  assert _overrides(cpu)[cpu_setting.EMITTERS_OPTION] is False
  with cpu_setting.default_emitters():
    assert cpu_setting.EMITTERS_OPTION not in _overrides(cpu)
  # XLA takes the option: a program compiled with it runs and computes the same values.
  x = jnp.arange(24.0).reshape(4, 6)
  np.testing.assert_allclose(jax.jit(lambda x: jnp.tanh(x).sum(0))(x), np.tanh(x).sum(0), 1e-6)


@pytest.mark.skipif(not _UNOPTIMISED, reason="JAX_OVERLAP_TEST_CPU_OPT=1 keeps XLA:CPU's settings")
@pytest.mark.skipif(not _SETTABLE, reason="this JAX's compile options do not name the backend")
def test_cpu_programs_compile_without_ynnpack_fusions():
  cpu = jax.devices("cpu")[0].client
  assert _overrides(cpu)[cpu_setting.YNN_OPTION] == ""
  with cpu_setting.default_emitters():
    assert _overrides(cpu)[cpu_setting.YNN_OPTION] == ""
  # XLA takes the option: a matmul compiled with it runs and computes the same values.
  x = jnp.arange(48.0).reshape(6, 8) / 7
  np.testing.assert_allclose(jax.jit(lambda x: x @ x.T)(x), np.asarray(x) @ np.asarray(x).T, 1e-5)


@pytest.mark.xla_default_cpu_emitters
def test_marked_tests_compile_with_xlas_default_emitters():
  assert cpu_setting.EMITTERS_OPTION not in _overrides(jax.devices("cpu")[0].client)


def test_deviceless_gpu_compiles_keep_xlas_code_generation():
  # What the analysis reads (kernels, launches, PTX) comes from XLA's own settings: the
  # dump's debug options name no change to the backend's optimisation.
  mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  step = compile_lib.compile_for_target(
    lambda x, w: jnp.tanh(x @ w).sum(), x, w, target="h100x8", xla_options={}
  )
  assert step.platform == "cuda"
  assert step.debug_options, "the compile's dump should list its non-default options"
  assert "xla_backend_optimization_level" not in step.debug_options
  assert "xla_llvm_disable_expensive_passes" not in step.debug_options
  assert cpu_setting.EMITTERS_OPTION not in step.debug_options
  assert cpu_setting.YNN_OPTION not in step.debug_options
  # The same request with the CPU's setting named is a different compile (a control: the
  # dump does show the option when it is set).
  slow = compile_lib.compile_for_target(
    lambda x, w: jnp.tanh(x @ w).sum(),
    x,
    w,
    target="h100x8",
    xla_options={"xla_backend_optimization_level": 0},
  )
  assert slow.debug_options.get("xla_backend_optimization_level") == "0"
