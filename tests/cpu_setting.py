"""The suite's CPU setting, installed by conftest.py in the test processes and by
test_notebooks.py in the notebooks' kernels."""

import contextlib
import os

# XLA:CPU's option choosing its emitters (MLIR fusion emitters or the elemental IR emitter).
EMITTERS_OPTION = "xla_cpu_use_fusion_emitters"
# XLA:CPU's option naming the fusions it hands to YNNPACK ("": none).
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
_defaults_wanted = 0  # depth of default_emitters() contexts in this process


def elemental_emitters_available() -> bool:
  """Whether this jaxlib's XLA:CPU still has the elemental emitter (jaxlib 0.11 removed the
  option, and rejects a compile that names it)."""
  import jaxlib

  from jax_overlap._src.flags.validation import version_tuple

  return version_tuple(jaxlib.__version__) < (0, 11)


@contextlib.contextmanager
def default_emitters():
  """CPU programs compiled in this context use XLA:CPU's default emitters: for the tests
  whose claim is bit-identical results under XLA's own code generation."""
  global _defaults_wanted
  _defaults_wanted += 1
  try:
    yield
  finally:
    _defaults_wanted -= 1


def install() -> None:
  """Programs the tests run on the CPU devices compile without LLVM's optimisations, and
  (on a jaxlib that has it) with XLA:CPU's elemental emitter instead of its MLIR fusion
  emitters.

  The tests run small programs once or twice: XLA:CPU spends far longer generating and
  optimising their machine code than running it (the elemental emitter compiles a test's
  step in about half the time). Only the machine code of CPU executables changes: XLA's
  HLO passes, schedules and collectives are the same; results are compared within
  tolerances, and bit for bit only between programs compiled the same way, or under
  XLA's default emitters (tests marked ``xla_default_cpu_emitters``: the two emitters
  round differently, and a transformed step equals its original bit for bit under
  XLA's defaults, which is the claim those tests make). No fusion goes to YNNPACK: from
  jaxlib 0.12 XLA:CPU hands dots to it, whose kernels sum in an order that depends on the
  shapes and the CPU, so that on an AVX-512 machine a matmul done in pieces rounds
  differently from the whole (seen with jaxlib 0.12.1 in two tests whose claim is the
  pieces' bit-for-bit equality; jaxlib 0.10.2 passes them either way). ``jax_disable_most_optimizations``
  is JAX's own switch for the same trade. Deviceless GPU compiles, whose kernels the
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
  elemental = elemental_emitters_available()

  @functools.wraps(original)
  def get_compile_options(*args, **kwargs):
    options = original(*args, **kwargs)
    backend = signature.bind_partial(*args, **kwargs).arguments.get("backend")
    if backend is not None and getattr(backend, "platform", None) == "cpu":
      debug = options.executable_build_options.debug_options
      debug.xla_backend_optimization_level = 0
      debug.xla_llvm_disable_expensive_passes = True
      overrides = [(YNN_OPTION, "")]
      if elemental and not _defaults_wanted:
        overrides.append((EMITTERS_OPTION, False))
      options.env_option_overrides = [*options.env_option_overrides, *overrides]
    return options

  compiler.get_compile_options = get_compile_options
