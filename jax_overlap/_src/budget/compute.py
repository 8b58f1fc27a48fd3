"""Compute budgets: FLOPs per step, cumulative accounting, and a stopping rule.

A training (or adaptive inference) loop under a FLOP budget needs three things:

* the FLOPs one call of a jitted step costs (:func:`step_flops`), read from the
  compiled executable's cost analysis on platforms that provide it (CPU) and
  counted from the optimized HLO by ``jax_overlap.analyze`` for deviceless GPU
  executables, whose ``cost_analysis()`` is ``None``;
* a running total (:class:`FlopCounter`);
* a rule that stops when the marginal gain per FLOP falls below a threshold
  (:class:`ComputeGovernor`).

The governor's rule: after each evaluation ``k`` at cumulative FLOPs ``F_k``
with loss ``L_k``, the gain rate over the last ``window`` evaluations is the
negated slope of a least-squares line through ``(F_i / 1e15, L_i)``, i.e. the
loss improvement per PFLOP. With fewer than ``window`` evaluations there is not
enough evidence and the governor continues (unless the budget is spent). It
stops when the rate falls below ``min_gain_per_pflop`` or when ``F_k`` reaches
``flop_budget``. A regression over a window, rather than the last difference,
keeps one noisy evaluation from stopping a run (the "stopping rule on marginal
gain per FLOP" of the data/memory/compute survey, arXiv 2606.10706).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

from absl import logging

from jax_overlap._src import errors

PFLOP = 1e15


def step_flops(compiled_or_fn: Any, *args: Any, target: str | None = None, **kwargs: Any) -> float:
  """FLOPs of one call of a step function, summed over every device it runs on.

  Reads the ``"flops"`` entry of the compiled executable's cost analysis,
  which XLA gives per partition for SPMD programs, and multiplies it by the
  number of devices (replicated work counts once per device). A
  deviceless GPU executable has no cost analysis: for a function whose
  arguments live on a compile-only mesh, the FLOPs are counted instead from
  the optimized HLO of its one compile, by ``jax_overlap.analyze``
  (``Report.flops``, one device's, multiplied the same way).

  Args:
    compiled_or_fn: a ``jax.stages.Compiled``, a ``jax.stages.Lowered``, or a
      function (jitted or not) to be lowered with ``args``/``kwargs``.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``) when a
      function is given.
    target: for arguments on a compile-only mesh, the target
      ``jax_overlap.analyze`` compiles for (default ``"h100x8"``).
    **kwargs: keyword arguments for the function.

  Returns:
    The FLOP count as a float.

  Raises:
    RuntimeError: if a deviceless executable (no cost analysis) is given
      instead of its function.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = lambda a, b: a @ b
    >>> x = jnp.ones((8, 16)); y = jnp.ones((16, 4))
    >>> step_flops(f, x, y)  # 2 * 8 * 16 * 4
    1024.0
  """
  import jax

  compiled = compiled_or_fn
  if not hasattr(compiled, "cost_analysis") or not hasattr(compiled, "memory_analysis"):
    if hasattr(compiled, "compile") and hasattr(compiled, "as_text"):  # Lowered
      compiled = compiled.compile()
    elif _compile_only((args, kwargs)):
      # Arguments on a compile-only (deviceless GPU) mesh: XLA's executable would have no
      # cost analysis, so the one compile is the analysis's, which counts the HLO's FLOPs
      # (one device's, like XLA's per-partition count below).
      from jax_overlap._src.analysis.analyze import analyze

      report = analyze(compiled_or_fn, *args, target=target or "h100x8", **kwargs)
      return float(report.flops) * report.topology.num_devices
    else:
      fn = compiled_or_fn
      jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
      traced = errors.trace_user_fn(
        "budget.compute.step_flops", fn, args, kwargs, lambda: jitted.trace(*args, **kwargs)
      )
      compiled = traced.lower().compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, Sequence) and not isinstance(cost, dict):
    cost = cost[0] if cost else None
  if cost and "flops" in cost and cost["flops"] >= 0:
    # XLA reports one partition's FLOPs for an SPMD program: scale to every device.
    return float(cost["flops"]) * _num_devices(compiled)
  raise RuntimeError(
    "budget.compute.step_flops: the compiled executable has no cost analysis (deviceless GPU "
    "executables return None); pass the step function and its arguments instead of a "
    "Compiled (its FLOPs are then counted from the HLO), or give the FLOPs per step to "
    "FlopCounter yourself"
  )


def _compile_only(tree) -> bool:
  """Whether some argument lives on devices this process cannot run on (a compile-only
  mesh for a GPU target)."""
  import jax

  local = set(jax.devices())
  for leaf in jax.tree.leaves(tree):
    devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
    if devices is not None and not devices <= local:
      return True
  return False


def _num_devices(compiled: Any) -> int:
  """Devices an SPMD executable runs on (1 when the shardings cannot be read)."""
  import jax

  try:
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings) + jax.tree_util.tree_leaves(
      compiled.output_shardings
    )
  except Exception:  # e.g. executables that do not expose shardings
    return 1
  return max((len(s.device_set) for s in shardings if hasattr(s, "device_set")), default=1)


@dataclasses.dataclass
class FlopCounter:
  """Cumulative FLOP accounting for a training loop.

  Attributes:
    flops_per_step: FLOPs of one step (e.g. from :func:`step_flops`).
    total: FLOPs spent so far.
    steps: steps counted so far.

  Example:
    >>> counter = FlopCounter(flops_per_step=2e12)
    >>> for _ in range(3):
    ...   _ = counter.step()
    >>> counter.total, counter.pflops
    (6000000000000.0, 0.006)
  """

  flops_per_step: float
  total: float = 0.0
  steps: int = 0

  def __post_init__(self):
    if not (isinstance(self.flops_per_step, (int, float)) and math.isfinite(self.flops_per_step)):
      raise ValueError(
        f"FlopCounter: flops_per_step must be a finite number, got {self.flops_per_step!r}"
      )
    if self.flops_per_step < 0:
      raise ValueError(f"FlopCounter: flops_per_step must be >= 0, got {self.flops_per_step!r}")
    self.flops_per_step = float(self.flops_per_step)

  def step(self, n: int = 1, *, flops: float | None = None) -> float:
    """Counts ``n`` steps (or ``flops`` extra FLOPs, e.g. for a selection pass).

    Returns:
      The new cumulative total.
    """
    if flops is not None:
      if not math.isfinite(flops) or flops < 0:
        raise ValueError(f"FlopCounter.step: flops must be a finite number >= 0, got {flops!r}")
      self.total += float(flops)
      return self.total
    if n < 0:
      raise ValueError(f"FlopCounter.step: n must be >= 0, got {n!r}")
    self.total += n * self.flops_per_step
    self.steps += n
    return self.total

  @property
  def pflops(self) -> float:
    """FLOPs spent so far, in PFLOP."""
    return self.total / PFLOP


@dataclasses.dataclass(frozen=True)
class Decision:
  """One evaluation seen by a :class:`ComputeGovernor`, and what it decided.

  Attributes:
    index: evaluation number (0-based).
    flops: cumulative FLOPs at the evaluation.
    loss: the evaluated loss.
    gain_per_pflop: smoothed loss improvement per PFLOP over the window
      (``nan`` until the window is full).
    stop: whether the governor says stop.
    reason: ``"continue"``, ``"warmup"``, ``"low_gain"``, ``"budget"`` or ``"nan"``.
  """

  index: int
  flops: float
  loss: float
  gain_per_pflop: float
  stop: bool
  reason: str

  def __str__(self) -> str:
    return (
      f"eval {self.index}: flops={self.flops:.4g} loss={self.loss:.6g} "
      f"gain/PFLOP={self.gain_per_pflop:.4g} -> {'STOP' if self.stop else 'go'} ({self.reason})"
    )


class ComputeGovernor:
  """Stops a loop when the loss gain per PFLOP falls below a threshold or the budget is spent.

  Call :meth:`update` after each evaluation with the cumulative FLOPs and the
  loss; it returns a :class:`Decision`. Every decision is kept in
  :attr:`decisions` and logged with absl logging (``log=True``).

  NaN or infinite losses: with ``on_nan="stop"`` (default) the governor stops
  with reason ``"nan"`` and the last finite loss stays the best; with
  ``on_nan="raise"`` it raises ``FloatingPointError``.

  Also usable for adaptive inference loops (more samples, more refinement
  steps): feed it the cumulative inference FLOPs and a quality loss (e.g. the
  negative score of the current answer) and stop refining when it says so.

  Args:
    flop_budget: FLOPs after which the loop must stop (> 0).
    min_gain_per_pflop: stop when the smoothed loss improvement per PFLOP falls
      below this (>= 0). A sensible value is a small fraction of the early-run
      rate, e.g. ``0.02 * initial_loss / (flop_budget / 1e15)``.
    window: number of evaluations in the least-squares slope (>= 2).
    on_nan: ``"stop"`` or ``"raise"``.
    log: log each decision at INFO level.

  Example:
    >>> gov = ComputeGovernor(flop_budget=1e15, min_gain_per_pflop=1.0, window=3)
    >>> for k in range(1, 100):
    ...   d = gov.update(flops=k * 1e13, loss=1.0 / k)
    ...   if d.stop:
    ...     break
    >>> d.reason
    'low_gain'
  """

  def __init__(
    self,
    flop_budget: float,
    min_gain_per_pflop: float,
    window: int = 5,
    *,
    on_nan: Literal["stop", "raise"] = "stop",
    log: bool = True,
  ):
    if (
      not isinstance(flop_budget, (int, float)) or not (flop_budget > 0) or math.isinf(flop_budget)
    ):
      raise ValueError(
        f"ComputeGovernor: flop_budget must be a finite number > 0, got {flop_budget!r}"
      )
    if not isinstance(min_gain_per_pflop, (int, float)) or not (min_gain_per_pflop >= 0):
      raise ValueError(
        f"ComputeGovernor: min_gain_per_pflop must be a number >= 0, got {min_gain_per_pflop!r}"
      )
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
      raise ValueError(f"ComputeGovernor: window must be an integer >= 2, got {window!r}")
    if on_nan not in ("stop", "raise"):
      raise ValueError(f"ComputeGovernor: on_nan must be 'stop' or 'raise', got {on_nan!r}")
    self.flop_budget = float(flop_budget)
    self.min_gain_per_pflop = float(min_gain_per_pflop)
    self.window = window
    self.on_nan = on_nan
    self.log = log
    self.decisions: list[Decision] = []
    self._points: list[tuple[float, float]] = []

  @property
  def stopped(self) -> bool:
    """Whether the last decision was to stop."""
    return bool(self.decisions) and self.decisions[-1].stop

  @property
  def best_loss(self) -> float:
    """Lowest finite loss seen (``inf`` before any)."""
    return min((loss for _, loss in self._points), default=math.inf)

  def gain_per_pflop(self) -> float:
    """Least-squares loss decrease per PFLOP over the last ``window`` evaluations."""
    pts = self._points[-self.window :]
    if len(pts) < self.window:
      return math.nan
    xs = [f / PFLOP for f, _ in pts]
    ys = [loss for _, loss in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0.0:
      return math.nan
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return -sxy / sxx

  def update(self, flops: float, loss: float) -> Decision:
    """Records one evaluation and decides.

    Args:
      flops: cumulative FLOPs spent when ``loss`` was measured (non-decreasing).
      loss: the evaluated loss (a Python or NumPy/JAX scalar).

    Returns:
      The :class:`Decision`.

    Raises:
      TypeError: if ``flops`` or ``loss`` is not a real scalar (a string, an array of
        several values).
      ValueError: if ``flops`` is negative, not finite, or smaller than before.
      FloatingPointError: for a NaN/inf loss with ``on_nan="raise"``.
    """
    flops = _scalar("flops", flops)
    loss = _scalar("loss", loss)
    if not math.isfinite(flops) or flops < 0:
      raise ValueError(f"ComputeGovernor.update: flops must be finite and >= 0, got {flops!r}")
    if self._points and flops < self._points[-1][0]:
      raise ValueError(
        "ComputeGovernor.update: flops is cumulative and must not decrease, got "
        f"{flops!r} after {self._points[-1][0]!r}"
      )
    index = len(self.decisions)
    if not math.isfinite(loss):
      if self.on_nan == "raise":
        raise FloatingPointError(
          f"ComputeGovernor.update: loss is {loss!r} at evaluation {index} ({flops:.4g} FLOPs)"
        )
      return self._record(Decision(index, flops, loss, math.nan, True, "nan"))
    self._points.append((flops, loss))
    rate = self.gain_per_pflop()
    if flops >= self.flop_budget:
      decision = Decision(index, flops, loss, rate, True, "budget")
    elif math.isnan(rate):
      decision = Decision(index, flops, loss, rate, False, "warmup")
    elif rate < self.min_gain_per_pflop:
      decision = Decision(index, flops, loss, rate, True, "low_gain")
    else:
      decision = Decision(index, flops, loss, rate, False, "continue")
    return self._record(decision)

  def _record(self, decision: Decision) -> Decision:
    self.decisions.append(decision)
    if self.log:
      logging.info(
        "ComputeGovernor %s (threshold %.4g/PFLOP, budget %.4g FLOPs)",
        decision,
        self.min_gain_per_pflop,
        self.flop_budget,
      )
    return decision

  def summary(self) -> str:
    """All decisions, one per line."""
    return "\n".join(str(d) for d in self.decisions)


def _scalar(field: str, value: Any) -> float:
  """``value`` as a float, for a real number or a one-element NumPy/JAX array."""
  size = getattr(value, "size", 1)
  kind = getattr(getattr(value, "dtype", None), "kind", "f")
  if isinstance(value, (str, bytes)) or size != 1 or kind in "cSUOV":
    shape = getattr(value, "shape", None)
    what = f"an array of shape {tuple(shape)}" if shape is not None else type(value).__name__
    raise TypeError(
      f"ComputeGovernor.update: {field} must be a real scalar (a Python number or a "
      f"one-element array), got {what} {value!r:.60}"
    )
  try:
    return float(value.reshape(()) if hasattr(value, "reshape") else value)
  except (TypeError, ValueError):
    raise TypeError(
      f"ComputeGovernor.update: {field} must be a real scalar, got "
      f"{type(value).__name__} {value!r:.60}"
    ) from None


def keep_fraction_for_budget(
  flop_budget: float,
  *,
  flops_per_example: float,
  examples: int,
  epochs: float = 1.0,
  score_flops_per_example: float = 0.0,
  min_fraction: float = 0.05,
) -> float:
  """The fraction of scored examples to train on so a run fits ``flop_budget``.

  Each example offered costs ``score_flops_per_example`` to score (forward
  only) and, if kept, ``flops_per_example`` to train on (forward + backward).
  Solves ``examples * epochs * (score + keep * train) <= flop_budget`` for
  ``keep`` and clips it to ``[min_fraction, 1]``.

  Args:
    flop_budget: total FLOPs for the run (> 0).
    flops_per_example: training FLOPs per kept example (> 0).
    examples: examples offered per epoch (> 0).
    epochs: passes over the data.
    score_flops_per_example: scoring FLOPs per offered example (>= 0).
    min_fraction: lower clip, in (0, 1].

  Returns:
    ``keep_fraction`` in ``[min_fraction, 1]``.

  Raises:
    ValueError: for non-positive budgets or sizes, or a budget that does not
      even cover scoring.

  Example:
    >>> keep_fraction_for_budget(6e12, flops_per_example=3e6, examples=1_000_000,
    ...                          score_flops_per_example=1e6, epochs=1.0)
    1.0
    >>> round(keep_fraction_for_budget(2.5e12, flops_per_example=3e6, examples=1_000_000,
    ...                                score_flops_per_example=1e6), 3)
    0.5
  """
  for name, value in (
    ("flop_budget", flop_budget),
    ("flops_per_example", flops_per_example),
    ("examples", examples),
    ("epochs", epochs),
  ):
    if not isinstance(value, (int, float)) or not (value > 0) or math.isinf(value):
      raise ValueError(
        f"keep_fraction_for_budget: {name} must be a finite number > 0, got {value!r}"
      )
  if not (score_flops_per_example >= 0):
    raise ValueError(
      "keep_fraction_for_budget: score_flops_per_example must be >= 0, got "
      f"{score_flops_per_example!r}"
    )
  if not (0 < min_fraction <= 1):
    raise ValueError(
      f"keep_fraction_for_budget: min_fraction must be in (0, 1], got {min_fraction!r}"
    )
  offered = examples * epochs
  per_offer = flop_budget / offered - score_flops_per_example
  if per_offer <= 0:
    raise ValueError(
      f"keep_fraction_for_budget: flop_budget {flop_budget:.4g} does not cover scoring "
      f"({offered * score_flops_per_example:.4g} FLOPs for {offered:.4g} examples)"
    )
  return float(min(1.0, max(min_fraction, per_offer / flops_per_example)))
