"""Test setup: 8 virtual CPU devices, set once before jax is imported."""

import atexit
import os
import pathlib
import shutil
import tempfile

import pytest

from jax_overlap.examples.cpu_devices import use_cpu_devices  # imports no JAX

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
use_cpu_devices(8)


import cpu_setting  # noqa: E402 - after the environment above
from hypothesis import settings as hypothesis_settings  # noqa: E402

cpu_setting.install()


@pytest.fixture(autouse=True)
def _xla_default_cpu_emitters(request):
  """Tests marked ``xla_default_cpu_emitters`` compile with XLA:CPU's default emitters."""
  if request.node.get_closest_marker("xla_default_cpu_emitters") is None:
    yield
    return
  with cpu_setting.default_emitters():
    yield


# Property tests draw the same examples on every run (derandomized, no example database), so
# a CI run repeats and so does its time; HYPOTHESIS_PROFILE=explore draws new ones each run.
hypothesis_settings.register_profile("repeatable", derandomize=True, database=None)
hypothesis_settings.register_profile("explore")
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(scope="session")
def fsdp_h100_dump():
  """The FSDP transformer example compiled deviceless for h100x8, once per session:
  (analysis report, XLA's dump directory). Shared by the tests that read the dump."""
  from jax_overlap._src.analysis import analyze as analysis
  from jax_overlap._src.compile import compiler as compile_lib
  from jax_overlap.examples import fsdp_transformer

  fn, args = fsdp_transformer.build()
  step = compile_lib.compile_for_target(fn, *args, target="h100x8", keep_dump=True)
  yield analysis.analyze_compiled(step), step.dump_dir
  shutil.rmtree(step.dump_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def gpu_records():
  """``benchmarks/gpu/records.py`` (the GPU benchmark's post-processing), imported by path."""
  import importlib.util

  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "records.py"
  spec = importlib.util.spec_from_file_location("gpu_records", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod
