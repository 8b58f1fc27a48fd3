"""Test setup: 8 virtual CPU devices, set once before jax is imported."""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A cache directory of the session's own: remembered variant choices, option
# probes and latency profiles from other runs or other code do not leak in.
_cache = tempfile.mkdtemp(prefix="jax_overlap_tests_")
os.environ["JAX_OVERLAP_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)
# XLA's deviceless compiles, though, are shared by the session's test processes
# (pytest-xdist workers inherit the first process's folder): the same module compiled
# with the same options gives the same artefacts whichever process asks.
if not os.environ.get("JAX_OVERLAP_COMPILE_CACHE_DIR"):
  os.environ["JAX_OVERLAP_COMPILE_CACHE_DIR"] = os.path.join(_cache, "compiles")
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()


def _cpu_programs_unoptimised() -> None:
  """Programs the tests run on the CPU devices compile without LLVM's optimisations.

  The tests run small programs once or twice: XLA:CPU spends far longer optimising their
  machine code than running it. Only the machine code of CPU executables changes: XLA's
  HLO passes, schedules and collectives are the same; results are compared within
  tolerances, and bit for bit only between programs compiled the same way (``jax_disable_most_optimizations``
  is JAX's own switch for the same trade). Deviceless GPU compiles, whose kernels the
  analysis reads, keep XLA's settings (tests/test_session_setup.py checks both).
  ``JAX_OVERLAP_TEST_CPU_OPT=1`` keeps XLA:CPU's own settings."""
  if os.environ.get("JAX_OVERLAP_TEST_CPU_OPT") == "1":
    return
  import functools
  import inspect

  from jax._src import compiler

  original = compiler.get_compile_options
  signature = inspect.signature(original)
  if "backend" not in signature.parameters:
    return  # a JAX whose compile options do not name the backend: left as it is

  @functools.wraps(original)
  def get_compile_options(*args, **kwargs):
    options = original(*args, **kwargs)
    backend = signature.bind_partial(*args, **kwargs).arguments.get("backend")
    if backend is not None and getattr(backend, "platform", None) == "cpu":
      debug = options.executable_build_options.debug_options
      debug.xla_backend_optimization_level = 0
      debug.xla_llvm_disable_expensive_passes = True
    return options

  compiler.get_compile_options = get_compile_options


_cpu_programs_unoptimised()


@pytest.fixture(scope="session")
def fsdp_h100_dump():
  """The FSDP transformer example compiled deviceless for h100x8, once per session:
  (analysis report, XLA's dump directory). Shared by the tests that read the dump."""
  from jax_overlap._src import analysis
  from jax_overlap._src import compile as compile_lib
  from jax_overlap.examples import fsdp_transformer

  fn, args = fsdp_transformer.build()
  step = compile_lib.compile_for_target(fn, *args, target="h100x8", keep_dump=True)
  yield analysis.analyze_compiled(step), step.dump_dir
  shutil.rmtree(step.dump_dir, ignore_errors=True)
