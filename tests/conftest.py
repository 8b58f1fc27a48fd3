"""Test setup: 8 virtual CPU devices, set once before jax is imported."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A cache directory of the session's own: remembered variant choices, option
# probes and latency profiles from other runs or other code do not leak in.
_cache = tempfile.mkdtemp(prefix="jax_overlap_tests_")
os.environ["JAX_OVERLAP_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
