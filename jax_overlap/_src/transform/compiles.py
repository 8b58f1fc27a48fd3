"""Compiling a selection's variants: on a few threads (XLA compiles without holding Python's
lock), sharing the kernels they have in common through XLA's kernel cache
(:class:`~jax_overlap._src.compile.kernel_cache.Shared`), and passing on the fallback for
XLA's deviceless Triton tiling failure once one variant needed it."""

from __future__ import annotations

import concurrent.futures
import os
import threading

from jax_overlap._src.compile import kernel_cache

# Set on every compile a selection makes for a target (unless the user's options set them):
# compiled deviceless, XLA cannot time its candidate kernels, yet with autotuning on it
# still compiles every fusion apart to choose among its emitters, which takes half of a
# compile of a large step; and ptxas's optimisations, which shape registers and
# instructions, not the launches, shared memory and HLO schedule the analysis reads. On the
# steps checked (tests/test_selection_compiles.py) neither changes a kernel, grid or
# estimate. The built step keeps XLA's autotuning and ptxas's optimisations.
NO_AUTOTUNING = {"xla_gpu_autotune_level": 0, "xla_gpu_disable_gpuasm_optimizations": True}


def for_selection(settings, options: dict) -> dict:
  """``options`` for a compile the selection makes: :data:`NO_AUTOTUNING` added for a
  target, where the installed jaxlib takes it and the options do not set it."""
  from jax_overlap._src import flags as flags_lib

  if settings.target is None:
    return options
  extra = {
    k: v
    for k, v in NO_AUTOTUNING.items()
    if k not in options
    and k not in getattr(settings, "xla_options", {})
    and flags_lib.accepted_by_jaxlib(k, v)
  }
  return {**options, **extra}


def workers() -> int:
  """Variants compiled at once: XLA compiles without holding Python's lock, so a second
  core compiles a second variant (``JAX_OVERLAP_SELECT_WORKERS`` overrides)."""
  env = os.environ.get("JAX_OVERLAP_SELECT_WORKERS")
  if env is not None:
    try:
      return max(1, int(env))
    except ValueError:
      raise ValueError(
        f"JAX_OVERLAP_SELECT_WORKERS must be a positive integer, got {env!r}"
      ) from None
  return max(1, min(4, os.cpu_count() or 1))


def analyze_all(
  settings,
  jobs,
  make,
  args,
  kwargs,
  errors,
  kernels=None,
  learned=None,
  busy=(),
):
  """Reports (or the exception) for ``jobs`` (:class:`~.variants.Candidate`), in their order,
  compiled by :func:`workers` threads. ``kernels`` (a :class:`kernel_cache.Shared`): seeded
  by the first job if no compile has; the others take the kernels of those finished
  before them. The first job of a program not compiled yet (:func:`program`) starts
  beside any other; the program's other jobs wait for it, to start from its kernels.

  Variants share the program's dots: once one compile needed the fallback for XLA's
  deviceless Triton tiling failure (``compile.TILING_FALLBACK``), the variants compiled
  after it start with it instead of failing first, unless they set those options.
  ``learned``: where that fallback is kept between calls of one selection (a dict, filled
  in place). ``busy``: futures of compiles running beside these (the selection's first
  compile): each takes a thread's place until it is done."""
  from jax_overlap._src.analysis import analyze as analysis
  from jax_overlap._src.compile import compiler as compile_lib

  kernels = kernels or kernel_cache.Shared(enabled=False)
  learned = {} if learned is None else learned
  lock = threading.Lock()
  fallback_keys = set(compile_lib.TILING_FALLBACK)

  def one(job, seed=False):
    name, cfg_c, options = job.name, job.config, job.options
    with lock:
      inherited = dict(learned) if not fallback_keys & set(options) else {}
    compile_options = for_selection(settings, {**options, **inherited})
    compile_options = (
      kernels.seed(compile_options, program(cfg_c)) if seed else kernels.copy(compile_options)
    )

    def analyzed(compile_options):
      return analysis.analyze(
        make(cfg_c, options),
        *args,
        target=settings.target,
        name=name,
        xla_options=compile_options,
        **kwargs,
      )

    try:
      try:
        report = analyzed(compile_options)
      except errors as e:
        if kernel_cache.OPTION not in compile_options or not kernel_cache.refused(e):
          raise
        # XLA refused the shared kernels (a constraint of its cache the files broke): this
        # variant and the rest of the selection compile without them.
        kernels.stop()
        compile_options = {k: v for k, v in compile_options.items() if k != kernel_cache.OPTION}
        report = analyzed(compile_options)
    except errors as e:
      return e
    kernels.done(compile_options)
    fell_back = {
      k: v for k, v in report.xla_options.items() if k in fallback_keys and k not in options
    }
    if inherited:
      report.notes.append(
        f"compiled with {compile_lib.spelled(inherited)} from the start: XLA's Triton GEMM "
        "emitter found no tile sizes for a dot in an earlier variant of this selection "
        "(GEMMs are cuBLAS calls in this report)"
      )
    elif fell_back:
      with lock:
        learned.update(fell_back)
    return report

  seeding = bool(jobs) and kernels.needs_seed()
  threads = min(workers(), len(jobs) + len(busy))
  busy = [f for f in busy if not f.done()]
  if threads <= 1 and not busy:
    return [one(j, seed=seeding and n == 0) for n, j in enumerate(jobs)]
  sharing = kernels.sharing()
  # The first variant of a program not compiled yet (its leader) starts at once, beside
  # any other; the program's other variants start once it has finished, from its kernels
  # (two that started together would each compile the new program's kernels). Kernels
  # of leaders compiled side by side are merged (kernel_cache.Shared.done).
  leader: dict = {}
  waiting = []
  for n, job in enumerate(jobs):
    key = program(job.config)
    if sharing and kernels.first_of(key):
      leader[key] = n
    waiting.append((n, job, key))
  out: list = [None] * len(jobs)
  finished: set[int] = set()
  with concurrent.futures.ThreadPoolExecutor(
    max(1, threads), thread_name_prefix="jax_overlap"
  ) as pool:
    running: dict[concurrent.futures.Future, int] = {}
    while waiting or running:
      busy = [f for f in busy if not f.done()]
      for item in list(waiting):
        if len(running) + len(busy) >= max(1, threads):
          break
        n, job, key = item
        if leader.get(key, n) == n or leader[key] in finished:
          running[pool.submit(one, job, seeding and n == 0)] = n
          waiting.remove(item)
      if not running and not busy:
        break
      ended, _ = concurrent.futures.wait(
        [*running, *busy], return_when=concurrent.futures.FIRST_COMPLETED
      )
      for f in ended:
        if f in running:
          n = running.pop(f)
          out[n] = f.result()
          finished.add(n)
  return out


def program(cfg) -> tuple:
  """Which program a variant compiles, as far as its kernels go: the step as traced or its
  shard_map form, as written or rewritten (variants differing in the options only, or in
  how the rewrite orders the collectives, share most kernels)."""
  return (cfg.program, cfg == cfg.as_written(), cfg.collective_matmul, cfg.loops)
