"""A GSPMD step's first compile, started while the step is converted to shard_map.

A selection for a GSPMD step starts by compiling the step as written for the target
(:func:`.variants.compile_as_written`: its collectives give the option variants, and it
seeds the selection's kernel cache). The conversion to shard_map needs the output layouts
XLA's partitioner chooses for the step (:mod:`.out_layouts`), which that same compile
gives. :class:`FirstCompile` runs it on a thread of its own as soon as the step is traced,
so that XLA compiles while Python converts, and no second compile asks the partitioner.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax

from jax_overlap._src.compile import kernel_cache
from jax_overlap._src.transform import out_layouts, selection_cache, variants


def program_text(st, traced) -> str:
  """The traced program's text, which keys the selection cache and a multi-process job's
  agreement: printed once, and only for them (a large step's jaxpr prints slowly)."""
  return str(traced.closed) if st.cache or jax.process_count() > 1 else ""


def wanted(st, traced, planned, text: str) -> bool:
  """Whether a GSPMD step's selection will compile it as written for a target (not in a
  multi-process job, where process 0 alone compiles, nor when its choice is remembered):
  then that compile starts while the step is converted (:mod:`.first_compile`)."""
  if st.target is None or st.select == "rewrite" or jax.process_count() > 1:
    return False
  if st.cache:
    settings_key = st.key(planned.config.annotate, traced.jit_kwargs)
    if selection_cache.load(selection_cache.key(text, traced.signature, settings_key)):
      return False
  return True


class FirstCompile:
  """The step as written compiled for ``settings.target`` in the background.

  Args:
    settings: the selection's settings (a target, the user's options).
    cfg: the traced program's variant configuration (compiled as written).
    make: ``make(cfg, options)``, the jitted program of a variant.
    traced: the user's step traced by its ``jax.jit`` (``jax.stages.Traced``).
    args, kwargs: the step's arguments.

  Attributes:
    kernels: the selection's shared kernel cache, seeded by this compile.
  """

  def __init__(self, settings, cfg, make, traced, args, kwargs):
    self.kernels = kernel_cache.Shared.for_selection(settings)
    self._traced = traced
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax_overlap")
    self._future = self._pool.submit(
      variants.compile_as_written, settings, cfg, make, args, kwargs, self.kernels
    )

  def report(self):
    """The compile's report (its exception raised where it failed)."""
    return self._future.result()[0]

  def running(self) -> concurrent.futures.Future:
    """The compile's report, as a future (the selection compiles beside it)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def settle(f):
      try:
        future.set_result(f.result()[0])
      except Exception as e:  # noqa: BLE001 - handed on as the compile's failure
        future.set_exception(e)

    self._future.add_done_callback(settle)
    return future

  def output_shardings(self) -> tuple | None:
    """The partitioner's output layouts (:func:`.out_layouts.from_compiled`), or None where
    the compile failed or was read back from the store (no executable to ask); at once,
    without waiting for the compile, where they are known without it
    (:func:`.out_layouts.known`)."""
    without = out_layouts.known(self._traced)
    if without is not None:
      return without
    try:
      _, compiled = self._future.result()
    except Exception:  # noqa: BLE001 - the selection reports it; the conversion goes on
      return None
    if compiled is None:
      return None
    return out_layouts.from_compiled(self._traced, compiled)

  def close(self) -> None:
    self._pool.shutdown(wait=True)
    self.kernels.close()

  def __enter__(self) -> FirstCompile:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
