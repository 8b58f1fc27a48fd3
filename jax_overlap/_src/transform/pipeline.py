"""``@overlap``'s pipeline: the named steps it runs once per input signature, each
returning a frozen record (:mod:`.records`) the next one reads, as
``jax.jit(f).trace(...).lower().compile()`` does:

1. :func:`resolve`: the decoration's :class:`~.settings.Settings` for these arguments (with
   ``target=None`` on GPU devices, the topology of those devices);
2. :func:`trace`: the step as ``jax.jit`` traces it (:class:`~.records.TracedStep`);
3. :func:`plan`: its collectives classified and every ``shard_map`` body planned
   (:class:`~.records.PlannedProgram`);
4. :func:`convert`: a GSPMD step's shard_map form, planned the same way (a second
   ``PlannedProgram``, or None);
5. :func:`candidates`: the variants (:class:`~.records.Candidate`);
6. :func:`select`: the choice among them (:class:`~.records.Choice`): the only one, a
   remembered one, the cost model's, timed on the devices (``select="measure"``);
7. :func:`build`: the chosen variant jitted with its options, and what ``explain()`` shows
   (:class:`~.records.Built`).

:func:`run` chains them. The decorated function reaches every step as a
:class:`StepFunction`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jax_overlap._src import errors
from jax_overlap._src import flags as flags_lib
from jax_overlap._src import targets as targets_lib
from jax_overlap._src.compile import kernel_cache
from jax_overlap._src.transform import (
  arguments,
  compiles,
  first_compile,
  measure,
  out_layouts,
  search,
  selection_cache,
  shared_choice,
  to_shard_map,
  variants,
)
from jax_overlap._src.transform.evaluate import VariantConfig, collect_stats, evaluate_program
from jax_overlap._src.transform.explain import Action, Explanation
from jax_overlap._src.transform.planning import parameter_avals, parameter_inputs
from jax_overlap._src.transform.records import (
  Built,
  Candidate,
  Choice,
  Estimate,
  PlannedProgram,
  TracedStep,
)
from jax_overlap._src.transform.settings import Settings

__all__ = [
  "StepFunction",
  "build",
  "candidates",
  "convert",
  "plan",
  "resolve",
  "run",
  "select",
  "trace",
]


@dataclasses.dataclass(frozen=True)
class StepFunction:
  """The decorated step as the pipeline reads it.

  Attributes:
    fn: the user's function.
    settings: ``overlap``'s checked keywords.
    base: the step as ``jax.jit`` traces it (``fn`` itself if jitted).
    statics: its static arguments.
  """

  fn: Callable
  settings: Settings
  base: Any
  statics: arguments.Statics

  def param_inputs(self, closed, args, kwargs) -> dict | None:
    """Positions of parameter inputs per shard_map body, from ``params_argnums``."""
    dyn_args, dyn_kwargs = self.statics.dynamic(args, kwargs)
    n_all = len(jax.tree.leaves((dyn_args, dyn_kwargs)))
    invars = closed.jaxpr.invars
    if n_all != len(invars):
      return None  # the jaxpr does not take the arguments leaf for leaf: no evidence
    params = [invars[j] for j in self.param_leaves(args)]
    return parameter_inputs(closed.jaxpr, params) if params else None

  def param_leaves(self, args) -> list[int]:
    """Positions, among the flattened dynamic arguments, of the leaves of
    ``params_argnums`` (positions among all the arguments, static ones included)."""
    static = self.statics.positions(len(args))
    counts = [0 if i in static else len(jax.tree.leaves(a)) for i, a in enumerate(args)]
    starts = np.cumsum([0, *counts])
    return [
      j
      for i in self.settings.params_argnums
      if i < len(args)
      for j in range(starts[i], starts[i + 1])
    ]


@shared_choice.reports_failures  # multi-process: a failed build stops the other processes
def run(step: StepFunction, args, kwargs, signature) -> Built:
  """The whole pipeline for one input signature."""
  notes: list[str] = []
  st = resolve(step, args, kwargs, notes)
  traced = trace(step, args, kwargs, signature)
  planned = plan(step, traced, st, args, kwargs)
  converted = None
  program_text = first_compile.program_text(st, traced)
  with contextlib.ExitStack() as stack:
    first = None
    if planned.shard_maps == 0:
      notes.append(
        "no shard_map in this program: its collectives are inserted by the SPMD partitioner"
        + (
          ""
          if st.converts()
          else ", so only compiler options apply; the full rewrite (prefetch, per-layer "
          "reduce-scatter, annotations) needs shard_map (gspmd='convert', or a target with "
          "select='cost_model', converts the step) or jax_overlap.fsdp.scan_layers"
        )
      )
      if st.converts():
        if first_compile.wanted(st, traced, planned, program_text):
          make = _maker({"traced": planned.program}, traced, step.statics)
          first = stack.enter_context(
            first_compile.FirstCompile(st, planned.config, make, traced.traced, args, kwargs)
          )
        converted = convert(step, st, traced, planned, args, kwargs, notes, first)
    choice = select(step, st, traced, planned, converted, args, kwargs, notes, program_text, first)
  return build(step, st, traced, planned, converted, choice, notes)


def _maker(programs: Mapping[str, Any], traced: TracedStep, statics):
  """``make(cfg, options)``: the jitted program of variant ``cfg``."""

  def make(cfg: VariantConfig, options: Mapping[str, Any]):
    return jax.jit(_rewritten(programs, cfg, traced, statics), **traced.jit_kwargs)

  return make


def resolve(step: StepFunction, args, kwargs, notes: list[str]) -> Settings:
  """The settings for these arguments: ``target=None`` on GPU devices becomes the
  topology of the devices the step runs on, so the selection runs as with a named
  target."""
  st = step.settings
  if st.target is not None:
    return st
  devices = arguments.devices(args, kwargs, st.mesh)
  if not devices or devices[0].platform == "cpu":
    return st
  try:
    topo = targets_lib.from_devices(devices)
  except ValueError as e:
    notes.append(f"no target: {e}; the step is rewritten without comparing variants")
    return st
  notes.append(
    f"target: {topo.name} ({topo.num_hosts} host(s) x {topo.gpus_per_host} "
    f"{topo.gpu.name}), the devices the step runs on"
  )
  return dataclasses.replace(st, target=topo)


def trace(step: StepFunction, args, kwargs, signature) -> TracedStep:
  """Step 2: the step as ``jax.jit`` traces it."""
  base, statics = step.base, step.statics
  traced = errors.trace_user_fn(
    "overlap", step.fn, args, kwargs, lambda: base.trace(*args, **kwargs)
  )
  # The user's jit settings that the variants keep: donation (of a jitted step, unless
  # given to overlap itself) and static arguments.
  jit_kwargs = {**step.settings.jit_kwargs, **statics.jit_kwargs()}
  if not {"donate_argnums", "donate_argnames"} & set(jit_kwargs):
    jit_kwargs.update(arguments.donation(traced, args, kwargs, statics))
  out_tree = jax.tree.structure(traced.out_info)
  # And its output shardings (unless given to overlap): every variant returns them.
  jit_kwargs.update(out_layouts.jit_kwargs(traced, out_tree, jit_kwargs))
  return TracedStep(traced, traced.jaxpr, out_tree, signature, jit_kwargs)


def plan(step: StepFunction, traced: TracedStep, st: Settings, args, kwargs) -> PlannedProgram:
  """Step 3: the collectives classified and every shard_map body planned."""
  closed = traced.closed
  annotate = st.annotate
  if annotate == "auto":
    annotate = st.target is not None or arguments.platform(args, kwargs, st.mesh) != "cpu"
  param_inputs = step.param_inputs(closed, args, kwargs)
  cfg = VariantConfig.from_settings(
    st,
    annotate,
    param_inputs,
    None if param_inputs is None else parameter_avals(closed.jaxpr, param_inputs),
  )
  actions: list[Action] = []
  counter = [0]  # shard_map bodies seen
  stats = collect_stats(closed.jaxpr, cfg, actions, counter)
  groups = stats.gather_groups
  if groups and st.prefetch > groups:
    raise ValueError(
      f"overlap: prefetch must be between 0 and the number of layers ({groups}), got {st.prefetch}"
    )
  return PlannedProgram(closed, cfg, tuple(actions), stats, counter[0])


def convert(
  step: StepFunction,
  st: Settings,
  traced: TracedStep,
  planned: PlannedProgram,
  args,
  kwargs,
  notes: list[str],
  first: first_compile.FirstCompile | None = None,
) -> PlannedProgram | None:
  """Step 4: a GSPMD step's shard_map form planned like a shard_map program, or None
  with a note saying why it was not converted. ``first``: the step's first compile,
  running, whose output layouts are the partitioner's choice."""
  statics, closed = step.statics, traced.closed
  leaves = jax.tree.leaves(statics.dynamic(args, kwargs))
  if len(leaves) != len(closed.jaxpr.invars):
    notes.append("not converted to shard_map: the traced program does not take the "
                 "arguments leaf for leaf")  # fmt: skip
    return None
  params = step.param_leaves(args)
  jit_params = getattr(traced.traced, "_params", {})
  avals = arguments.abstract_leaves(leaves, closed.jaxpr.invars, jit_params.get("in_shardings"))
  # The layouts jax.jit(step) returns (asked for, or the partitioner's), for its outputs.
  out_shardings = first.output_shardings() if first is not None else None
  if out_shardings is None:
    # (Compiled without autotuning for a target: its kernels are not what is read.)
    cheap = compiles.for_selection(st, {})
    out_shardings = out_layouts.partitioner_choice(traced.traced, cheap)
  try:
    conv = to_shard_map.convert(closed, avals, out_shardings, params, st.target)
    smap = jax.make_jaxpr(conv.fn)(*avals)
  except to_shard_map.Refused as e:
    notes.append(f"not converted to shard_map: {e}")
    return None
  param_inputs = step.param_inputs(smap, args, kwargs)
  cfg = dataclasses.replace(
    planned.config,
    program="shard_map",
    param_inputs=param_inputs,
    param_avals=None if param_inputs is None else parameter_avals(smap.jaxpr, param_inputs),
  )
  actions: list[Action] = [
    Action("convert", "program", f"GSPMD step in its shard_map form: {conv.summary()}")
  ]
  stats = collect_stats(smap.jaxpr, cfg, actions, [0])
  notes.append(
    "converted to shard_map (the variants named 'shard_map form'): each equation's layout "
    f"followed as the partitioner would, {conv.summary()}"
  )
  return PlannedProgram(smap, cfg, tuple(actions), stats, 1)


def candidates(
  st: Settings, planned: PlannedProgram, converted: PlannedProgram | None
) -> list[Candidate]:
  """Step 5: the variants of the planned program (of its shard_map form, if any)."""
  out = []
  if converted is not None:
    out = [
      c.renamed(variants.CONVERTED_PREFIX + c.name)
      for c in variants.candidates(st, converted.config, converted.stats)
    ]
  if planned.shard_maps == 0 and st.target is not None and st.select != "rewrite":
    # A GSPMD step compiled for a target: the step as written first (its compiler-option
    # variants are found by compiling it: see _select).
    return [
      Candidate(
        "as written, recommended flags", planned.config.as_written(), variants.recommended(st)
      ),
      *out,
    ]
  if converted is not None:
    return out
  return variants.candidates(st, planned.config, planned.stats)


def select(
  step: StepFunction,
  st: Settings,
  traced: TracedStep,
  planned: PlannedProgram,
  converted: PlannedProgram | None,
  args,
  kwargs,
  notes: list[str],
  program_text: str | None = None,
  first: first_compile.FirstCompile | None = None,
) -> Choice:
  """Step 6: the variant to run: the only one, a remembered one, or the cost model's
  (then timed on the devices with ``select="measure"``); in a multi-process job, process
  0's (:mod:`.shared_choice`). ``program_text``: :func:`.first_compile.program_text`, if made already;
  ``first``: the GSPMD step's first compile, started already."""
  cands = candidates(st, planned, converted)
  gspmd_step = planned.shard_maps == 0 and st.target is not None and st.select != "rewrite"
  if len(cands) == 1 and not gspmd_step:
    return Choice(tuple(cands), 0, how="only_candidate")
  settings_key = st.key(planned.config.annotate, traced.jit_kwargs)
  if program_text is None:
    program_text = first_compile.program_text(st, traced)
  entry_key = (
    selection_cache.key(program_text, traced.signature, settings_key) if st.cache else None
  )
  # A GSPMD step's compiler-option variants all evaluate the step as written.
  fallback = planned.config.as_written() if gspmd_step else None
  agreement = shared_choice.begin(program_text, traced.signature, settings_key)
  if shared_choice.follows(agreement):  # process 0 chooses; no compiles, no cache here
    choice = shared_choice.receive(agreement, cands, fallback)
    if choice is None:
      choice = Choice(tuple(cands), 0, how="only_candidate")
  else:
    choice = _choose(
      step, st, traced, planned, converted, cands, fallback, entry_key, args, kwargs, notes, first
    )
    if st.select == "measure" and agreement is not None:
      notes.append(
        "select='measure': nothing timed in a multi-process job (every process would have "
        "to compile and run each timed variant together); the cost model's choice is shared"
      )
    elif st.select == "measure":
      choice = _measured(step, traced, planned, converted, choice, args, kwargs, notes)
    if entry_key and choice.how in ("cost_model", "measured"):
      variants.remember(entry_key, choice)
  shared_choice.settle(agreement, choice, notes)
  return choice


def _choose(
  step: StepFunction,
  st: Settings,
  traced: TracedStep,
  planned: PlannedProgram,
  converted: PlannedProgram | None,
  cands: list[Candidate],
  fallback: VariantConfig | None,
  entry_key: str | None,
  args,
  kwargs,
  notes: list[str],
  first: first_compile.FirstCompile | None = None,
) -> Choice:
  """The choice remembered on disk under ``entry_key`` (None: not looked up), or the cost
  model's among the compiled variants (``first``: the GSPMD step's first compile)."""
  if entry_key:
    remembered = variants.recall(st, entry_key, cands, fallback)
    if remembered is not None:  # no compile needed
      return remembered
  make = _maker(_programs(planned, converted), traced, step.statics)
  known: dict[int, Any] = {}
  # The variants' deviceless compiles share the kernels they have in common (unless the
  # user's options name a kernel cache of their own).
  with contextlib.ExitStack() as stack:
    if first is not None:
      kernels = first.kernels
    else:
      kernels = stack.enter_context(kernel_cache.Shared.for_selection(st))
    running = None
    if fallback is not None and first is not None:
      # A GSPMD step compiling already: its shard_map form's programs compile beside it,
      # and its option variants come from its report.
      def more(report):
        return variants.gspmd_candidates(
          st, planned.config, make, args, kwargs, notes, {}, kernels, report=report
        )[1:]

      running = search.Running(first.running(), more)
    elif fallback is not None:  # a GSPMD step: its option variants come from compiling it
      converted_ones = [c for c in cands if c.config.program == "shard_map"]
      cands = variants.gspmd_candidates(
        st, planned.config, make, args, kwargs, notes, known, kernels
      )
      cands += converted_ones
    choice, _ = search.select(st, cands, make, args, kwargs, known, kernels, running)
  return choice


def _measured(
  step: StepFunction,
  traced: TracedStep,
  planned: PlannedProgram,
  converted: PlannedProgram | None,
  choice: Choice,
  args,
  kwargs,
  notes: list[str],
) -> Choice:
  """``choice`` with the cost model's best variants timed on the devices (:mod:`.measure`)."""
  programs = _programs(planned, converted)

  def runner(c: Candidate):  # timed on the caller's arguments: no donation
    return _jitted(_rewritten(programs, c.config, traced, step.statics), c, traced, donate=False)

  return measure.measured_choice(choice, runner, args, kwargs, notes)


def build(
  step: StepFunction,
  st: Settings,
  traced: TracedStep,
  planned: PlannedProgram,
  converted: PlannedProgram | None,
  choice: Choice,
  notes: list[str],
) -> Built:
  """Step 7: the chosen variant jitted with its options, and its explanation."""
  chosen = choice.candidate
  cfg, actions = planned.config, list(planned.actions)
  if chosen.config.program == "shard_map" and converted is not None:
    cfg, actions = converted.config, list(converted.actions)
  if chosen.config == cfg.as_written() and chosen.config != cfg:
    actions = [a for a in actions if a.kind in ("left_alone", "convert")]
    actions.append(
      Action("left_alone", "program", f"kept as written: {chosen.name} estimated faster")
    )
  for k, v in chosen.options.items():
    actions.append(Action("compiler_option", "compile", f"{k}={flags_lib.format_value(v)}"))
  notes = list(notes)
  if choice.how != "only_candidate":
    notes.extend(choice_notes(st.target, choice))
  explanation = Explanation(
    actions, dict(chosen.options), notes, list(choice.estimates), chosen.name, choice
  )
  python_fn = _rewritten(_programs(planned, converted), chosen.config, traced, step.statics)
  return Built(_jitted(python_fn, chosen, traced), explanation, python_fn, choice)


def _jitted(python_fn, candidate: Candidate, traced: TracedStep, *, donate: bool = True):
  """``python_fn`` (a variant's program) under ``jax.jit`` with the candidate's XLA options
  and the step's jit keywords (without its donation where ``donate`` is False)."""
  jit_kwargs = dict(traced.jit_kwargs)
  if not donate:
    jit_kwargs.pop("donate_argnums", None)
    jit_kwargs.pop("donate_argnames", None)
  return jax.jit(
    python_fn,
    compiler_options=flags_lib.per_compile.spelled(candidate.options) or None,
    **jit_kwargs,
  )


def _programs(planned: PlannedProgram, converted: PlannedProgram | None) -> dict[str, Any]:
  """The programs the variants evaluate, by ``VariantConfig.program``."""
  out = {"traced": planned.program}
  if converted is not None:
    out["shard_map"] = converted.program
  return out


def _rewritten(programs: Mapping[str, Any], cfg: VariantConfig, traced: TracedStep, statics):
  """The step evaluated as variant ``cfg`` says, with the step's signature."""

  def rewritten(*a, **kw):
    leaves = jax.tree.leaves(statics.dynamic(a, kw))
    out = evaluate_program(programs[cfg.program], leaves, cfg)
    return jax.tree.unflatten(traced.out_tree, out)

  return rewritten


def choice_notes(target: targets_lib.Topology | None, choice: Choice) -> list[str]:
  """What ``explain()`` says of a choice among variants made for ``target``."""
  chosen = choice.name
  where = target.name if target is not None else "the devices"

  measured = dict(choice.measured)

  def row(e: Estimate) -> str:
    text = f"{e.name} {e.step_time_s * 1e3:.3f} ms"
    if e.name in measured:
      text += f" (measured {measured[e.name] * 1e3:.3f} ms)"
    return text + (" (chosen)" if e.name == chosen else "")

  table = "; ".join(row(e) for e in choice.estimates)
  by = "measured on the devices" if choice.how == "measured" else "chosen by the cost model"
  notes = [f"{by} on {where}: " + table]
  if choice.how == "remembered":
    notes.append(
      "choice remembered from an earlier run with the same program, arguments "
      "and settings (jax_overlap cache directory; cache=False chooses again)"
    )
  notes.extend(f"variant not compiled: {f}" for f in choice.failed)
  notes.extend(choice.judged)
  return notes
