"""Virtual CPU devices for the examples, notebooks, tests and benchmarks, which run without
a GPU. Imports nothing from JAX: :func:`use_cpu_devices` must run before JAX starts."""

from __future__ import annotations

import os
import sys

__all__ = ["use_cpu_devices"]

_FLAG = "--xla_force_host_platform_device_count"


def use_cpu_devices(count: int = 8) -> None:
  """The CPU platform (unless ``JAX_PLATFORMS`` names one) with ``count`` virtual devices
  (unless ``XLA_FLAGS`` already sets a count).

  Raises:
    ValueError: for a count below 1.
    RuntimeError: when JAX has already started its backends (the setting would not apply).
  """
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"use_cpu_devices: count must be a positive integer, got {count!r}")
  bridge = sys.modules.get("jax._src.xla_bridge")
  started = getattr(bridge, "backends_are_initialized", None)
  if started is not None and started():
    raise RuntimeError(
      "use_cpu_devices: JAX has started its backends already; call it before the first "
      "JAX computation (or set JAX_PLATFORMS=cpu and XLA_FLAGS="
      f"{_FLAG}={count} in the environment)"
    )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if _FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
