"""Measured selection (``overlap(select="measure")``): the cost model's best few variants
timed on the devices the step runs on, the fastest measured kept.

The cost model ranks every variant; the best :data:`MEASURED_VARIANTS` of them (distinct
estimates: the same program compiled under options that changed nothing is timed once) are
compiled for the devices, run :data:`WARMUP_STEPS` times, then timed over
:data:`TIMED_STEPS` calls each (the median). In a multi-process job every process times
the same variants in the same order and the slowest process's time counts (a step is as
slow as its slowest host). Timing runs the step on the caller's arguments, so the variants
are timed without donation: the caller's buffers stay valid.

Where the step does not run on GPUs (CPU devices, abstract arguments of a compile-only
mesh), nothing is timed: the choice stays the cost model's and ``explain()`` says why.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jax_overlap._src.transform import arguments
from jax_overlap._src.transform.variants import Candidate, Choice, Estimate

__all__ = [
  "GPU_PLATFORMS",
  "MEASURED_VARIANTS",
  "TIMED_STEPS",
  "WARMUP_STEPS",
  "measured_choice",
  "not_measurable",
  "time_variants",
]

MEASURED_VARIANTS = 3
WARMUP_STEPS = 2
TIMED_STEPS = 5
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def not_measurable(args, kwargs, platforms: Sequence[str] = GPU_PLATFORMS) -> str | None:
  """Why the step cannot be timed on its devices (None where it can): every argument must
  be a concrete array on devices of ``platforms``."""
  leaves = jax.tree.leaves((args, kwargs))
  if not all(isinstance(x, jax.Array) for x in leaves if hasattr(x, "shape")):
    return "the arguments are abstract (jax.ShapeDtypeStruct), not arrays on devices"
  devices = arguments.devices(args, kwargs, None)
  if not devices:
    return "the arguments carry no devices"
  found = sorted({d.platform for d in devices})
  if not set(found) <= set(platforms):
    return f"the step runs on {', '.join(found)} devices, not on {'/'.join(platforms)}"
  return None


def time_variants(
  fns: Sequence[Callable],
  args,
  kwargs,
  *,
  warmup: int = WARMUP_STEPS,
  steps: int = TIMED_STEPS,
) -> list[float]:
  """Median seconds per call of each of ``fns`` on ``(args, kwargs)``, after ``warmup``
  calls; in a multi-process job, the slowest process's median.

  Raises:
    ValueError: for fewer than one timed step or a negative warm-up.
  """
  if steps < 1 or warmup < 0:
    raise ValueError(
      f"measure: need at least one timed step and no negative warm-up, got steps={steps}, "
      f"warmup={warmup}"
    )
  medians = []
  for fn in fns:
    for _ in range(warmup):
      jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args, **kwargs))
      times.append(time.perf_counter() - t0)
    medians.append(statistics.median(times))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(np.asarray(medians, np.float64)))
    medians = [float(t) for t in every.reshape(jax.process_count(), -1).max(axis=0)]
  return medians


def _to_time(choice: Choice) -> list[int]:
  """The cost model's best variants, fastest first, one per distinct estimate."""
  order = sorted(
    (i for i, e in enumerate(choice.estimates) if e.step_time_s < float("inf")),
    key=lambda i: (choice.estimates[i].step_time_s, i),
  )
  picked, seen = [], set()
  for i in order:
    t = choice.estimates[i].step_time_s
    if t in seen:
      continue
    seen.add(t)
    picked.append(i)
    if len(picked) == MEASURED_VARIANTS:
      break
  return picked


def measured_choice(
  choice: Choice,
  runner: Callable[[Candidate], Callable],
  args,
  kwargs,
  notes: list[str],
  *,
  platforms: Sequence[str] = GPU_PLATFORMS,
  warmup: int = WARMUP_STEPS,
  steps: int = TIMED_STEPS,
) -> Choice:
  """``choice`` (the cost model's) with its best variants timed on the devices and the
  fastest measured chosen; unchanged, with a note saying why, where nothing can be timed.

  Args:
    choice: the cost model's choice; its ``estimates`` follow ``candidates``.
    runner: a candidate -> the callable that runs it on the devices (compiled with its
      options, without donation).
    args, kwargs: the step's arguments, concrete arrays.
    notes: where the reason nothing was timed goes.
    platforms: the device platforms timing is meant for (GPUs).
  """
  why = not_measurable(args, kwargs, platforms)
  if why is not None:
    notes.append(f"select='measure': nothing timed ({why}); the cost model's choice is kept")
    return choice
  picked = _to_time(choice)
  if not picked:
    return choice
  times = time_variants(
    [runner(choice.candidates[i]) for i in picked], args, kwargs, warmup=warmup, steps=steps
  )
  measured = dict(zip(picked, times))
  best = min(picked, key=lambda i: (measured[i], i))
  timed = tuple(Estimate(choice.candidates[i].name, measured[i]) for i in picked)
  return dataclasses.replace(choice, index=best, measured=timed, how="measured")
