"""The suite's CPU setting, installed by conftest.py in the test processes and by
test_notebooks.py in the notebooks' kernels."""

import os


def install() -> None:
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
