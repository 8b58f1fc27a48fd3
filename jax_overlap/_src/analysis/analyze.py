"""``analyze``: how a step will schedule on a GPU target, from a laptop.

Data flow: ``fn`` -> compile for the target (deviceless for NVIDIA topologies,
``compile/compiler.py``) -> XLA's scheduled HLO and thunk listing -> the flat kernel and
collective sequence with per-op costs (``schedule.py``, ``cost_model.py``) ->
placement on streams (``timeline.py``) -> :class:`Report`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jax_overlap._src import targets as targets_lib
from jax_overlap._src.analysis import calibration
from jax_overlap._src.analysis import cost_model as cm
from jax_overlap._src.analysis import hlo as hlo_lib
from jax_overlap._src.analysis import schedule as schedule_lib
from jax_overlap._src.analysis import timeline as timeline_lib
from jax_overlap._src.analysis.report import Report
from jax_overlap._src.compile import compiler as compile_lib
from jax_overlap._src.compile import dumps
from jax_overlap._src.compile.memory_stats import MemoryStats

__all__ = ["analyze", "analyze_compiled", "analyze_hlo"]


def _fn_name(fn) -> str:
  for attr in ("__name__", "__qualname__"):
    name = getattr(fn, attr, None)
    if isinstance(name, str) and name != "<lambda>":
      return name
  wrapped = getattr(fn, "__wrapped__", None)
  return _fn_name(wrapped) if wrapped is not None else "step"


def analyze(
  fn: Callable,
  *args,
  target: str | targets_lib.Topology | None = "h100x8",
  xla_options: Mapping[str, Any] | None = None,
  mesh=None,
  cost_model: cm.CostModel | None = None,
  name: str | None = None,
  **kwargs,
) -> Report:
  """Compiles ``fn`` for ``target`` once and estimates how its collectives overlap.

  Args:
    fn: a function or jitted function (shard_map programs included).
    *args: arrays or ``jax.ShapeDtypeStruct`` with shardings. For a GPU target
      the shardings are re-targeted onto the target's compile-only mesh by
      axis name.
    target: a topology such as "h100x8", "a100x8", "h200x16"; None analyses the
      program for the local devices (CPU) with a rough host cost model.
    xla_options: per-compile XLA options (e.g. ``flags.as_compiler_options(...)``).
    mesh: the mesh to compile on (default: derived from the arguments).
    cost_model: efficiency factors for the roofline and alpha-beta costs.
    name: label for the report.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    A :class:`Report` with the estimated timeline and its metrics.

  Raises:
    ValueError: for an unknown target or shardings naming axes the target mesh lacks.
    TypeError: for ``xla_options`` that is not a mapping or a ``cost_model`` that is
      not a :class:`CostModel`.
    TypeError, ValueError, ...: if ``fn`` cannot be traced on ``args`` (wrong
      arity, shapes or shardings), with the kind of error the trace raised.
    RuntimeError: if XLA cannot compile ``fn`` for the target.

  Example:
    >>> report = analyze(step, params, batch, target="h100x8")  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
  """
  if not callable(fn):
    raise TypeError(f"analyze: fn must be callable, got {type(fn).__name__}")
  if xla_options is not None and not isinstance(xla_options, Mapping):
    raise TypeError(
      f"analyze: xla_options must be a mapping of XLA option names to values, got "
      f"{type(xla_options).__name__}"
      + (
        "; an XLA_FLAGS string reads as one with jax_overlap.flags.parse_xla_flags(text)[0]"
        if isinstance(xla_options, str)
        else ""
      )
    )
  if cost_model is not None and not isinstance(cost_model, cm.CostModel):
    raise TypeError(
      f"analyze: cost_model must be a jax_overlap.analysis.CostModel (or None for the "
      f"default), got {type(cost_model).__name__} {cost_model!r}"
    )
  topo = targets_lib.get(target) if target is not None else None
  if topo is not None and not topo.gpu.deviceless:
    raise ValueError(
      f"analyze: {topo.name} cannot be compiled for on this machine (no deviceless "
      "compilation for ROCm); analyse an NVIDIA target and use jax_overlap.sim for "
      f"{topo.gpu.name}"
    )
  if hasattr(fn, "explain") and hasattr(fn, "compiler_options"):
    # A jax_overlap.overlap step: compile it with the options it chose.
    xla_options = {**fn.compiler_options(*args, **kwargs), **dict(xla_options or {})}
  step = compile_lib.compile_for_target(
    fn, *args, target=topo, xla_options=xla_options, mesh=mesh, api_name="analyze", **kwargs
  )
  if not step.hlo_text.strip():
    raise dumps.missing_dump("analyze", "optimised HLO (*after_optimizations.txt)")
  return analyze_compiled(
    step, name=name or _fn_name(fn), cost_model=cost_model, xla_options=dict(xla_options or {})
  )


def analyze_compiled(
  step: compile_lib.CompiledStep,
  *,
  name: str = "step",
  cost_model: cm.CostModel | None = None,
  xla_options: dict[str, Any] | None = None,
) -> Report:
  """Builds the Report of an already compiled step (see :func:`analyze`)."""
  report = analyze_hlo(
    step.hlo_text,
    step.thunk_text,
    thunk_metadata=step.thunk_metadata,
    kernel_names=not step.reused_kernels,
    target=step.target,
    name=name,
    cost_model=cost_model,
    memory=step.memory,
    xla_options={**(xla_options or {}), **step.fallback_options},
    compile_time_s=step.compile_time_s,
  )
  report.notes.extend(step.notes)
  report.profile_missing = step.profile_missing
  return report


def analyze_hlo(
  hlo_text: str,
  thunk_text: str = "",
  *,
  target: str | targets_lib.Topology | None = "h100x8",
  name: str = "step",
  cost_model: cm.CostModel | None = None,
  memory: MemoryStats | Mapping[str, int] | None = None,
  xla_options: dict[str, Any] | None = None,
  compile_time_s: float = 0.0,
  thunk_metadata: str = "",
  kernel_names: bool = True,
) -> Report:
  """Builds a Report from XLA's dumped HLO text (and thunk listing, for GPU dumps).

  Useful for dumps taken elsewhere (``--xla_dump_to`` on a cluster): ``hlo_text`` from
  ``*after_optimizations.txt``, ``thunk_text`` from ``*thunk_sequence.txt`` and
  ``thunk_metadata`` from ``*thunk_metadata.txt`` (the HLO instruction of each thunk,
  which finds each kernel's launch configuration even where kernel names do not match
  instruction names). ``kernel_names=False`` for a compile that took kernels from XLA's
  kernel cache (``xla_gpu_kernel_cache_file``): their names are those of the compile
  that made them, so the report leaves kernel launch names unknown.
  """
  if not hlo_text.strip():
    raise ValueError(
      "analyze: XLA wrote no optimised HLO for this compile; check that the function has "
      "any computation"
    )
  topo = targets_lib.get(target) if target is not None else None
  model = cost_model or (
    calibration.cost_model_for(topo.gpu) if topo is not None else cm.CostModel()
  )
  module = hlo_lib.parse_module(hlo_text)
  gpu = topo.gpu if topo is not None else cm.HOST_CPU
  sched = schedule_lib.build_schedule(
    module,
    thunk_text,
    topo or cm.HOST_CPU,
    gpu,
    model,
    thunk_metadata=thunk_metadata,
    kernel_names=kernel_names,
  )
  placed = timeline_lib.place(sched)
  notes = list(sched.notes) + list(placed.notes)
  if model.calibration is not None:
    notes.append(model.calibration.describe())
  if not module.is_scheduled:
    notes.append("the HLO is not scheduled; instruction order was used as the schedule")
  if not sched.collectives:
    notes.append("the program has no collectives: its step time is its compute time")
  if topo is None:
    notes.append(
      "target=None: the local CPU with a rough host model (XLA:CPU runs collectives "
      "synchronously); pass a GPU target such as 'h100x8' for overlap estimates"
    )
  comm = placed.comm_time_s
  return Report(
    name=name,
    target=topo.name if topo is not None else "cpu",
    step_time_s=placed.step_time_s,
    compute_time_s=placed.compute_time_s,
    comm_time_s=comm,
    exposed_comm_s=placed.exposed_comm_s,
    overlap_fraction=(1.0 - placed.exposed_comm_s / comm) if comm > 0 else None,
    flops=sum(k.flops for k in sched.kernels),
    kernels=sched.kernels,
    collectives=sched.collectives,
    events=placed.events,
    memory=MemoryStats.of(memory),
    xla_options=dict(xla_options or {}),
    notes=notes,
    compile_time_s=compile_time_s,
    loops=sched.loops,
    topology=topo,
    hlo_text=hlo_text,
    uncounted_costs=sched.uncounted,
  )
