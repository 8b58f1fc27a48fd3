"""jax_overlap.examples.cpu_devices: virtual CPU devices set before JAX starts."""

import os
import subprocess
import sys

import jax
import pytest

from jax_overlap.examples.cpu_devices import use_cpu_devices


def test_sets_the_device_count_before_jax_starts():
  code = (
    "import sys\n"
    "from jax_overlap.examples.cpu_devices import use_cpu_devices\n"
    "use_cpu_devices(3)\n"
    "assert 'jax' not in sys.modules\n"
    "import jax\n"
    "print(jax.default_backend(), jax.device_count())\n"
  )
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["cpu", "3"]


def test_refuses_a_bad_count_and_a_started_jax():
  jax.devices()  # this process's backends are up
  with pytest.raises(RuntimeError, match="started its backends already; call it before"):
    use_cpu_devices(8)
  for bad in (0, -1, 2.0, True, "8"):
    with pytest.raises(ValueError, match="count must be a positive integer"):
      use_cpu_devices(bad)
