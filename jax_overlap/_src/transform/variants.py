"""The variants ``@overlap`` chooses among, and the choice: each variant compiled for the
target and analysed, a few again with a latency profile written from their analysis, the
fastest by estimate kept and remembered on disk.

A variant is a :class:`Candidate`: its name, the program it evaluates (a
:class:`~.evaluate.VariantConfig`: the step as traced or its shard_map form, rewritten or as
written) and the XLA options it compiles with. The choice among them is a :class:`Choice`:
every estimate, what failed to compile, the second opinions, and how it was made. The
functions take the decoration's checked keywords (``settings``: a
:class:`~.settings.Settings`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jax_overlap._src import flags as flags_lib
from jax_overlap._src.analysis import latency_profile
from jax_overlap._src.transform import compiles, gspmd, selection_cache
from jax_overlap._src.transform.evaluate import VariantConfig
from jax_overlap._src.transform.records import Candidate, Choice, Estimate
from jax_overlap._src.transform.search import PROFILED_SUFFIX
from jax_overlap._src.transform.stats import RewriteStats

_LOOP_PIPELINER = (
  "xla_gpu_enable_pipelined_all_gather",
  "xla_gpu_enable_pipelined_reduce_scatter",
  "xla_gpu_enable_pipelined_all_reduce",
)
_DOT_MERGER = ("xla_gpu_dot_merger_threshold_mb",)
# Names of the variants of a GSPMD step's shard_map form begin with this.
CONVERTED_PREFIX = "shard_map form, "


def pipeliner_off(options: dict[str, Any]) -> dict[str, Any]:
  """Options that turn off the loop pipeliner ``options`` turn on, in either spelling."""
  off: dict[str, Any] = {}
  for k in _LOOP_PIPELINER:
    if options.get(k) is True:
      off[k] = False
    new = flags_lib.REGISTRY[k].replacement
    if new and options.get(new) not in (None, False, "off"):
      off[new] = "off"
  return off


def candidates(settings, cfg: VariantConfig, stats: RewriteStats) -> list[Candidate]:
  """The variants of a rewritten program (``cfg``), sized from what its plan found."""
  return [Candidate(*c) for c in _candidate_tuples(settings, cfg, stats)]


def _candidate_tuples(settings, cfg: VariantConfig, stats: RewriteStats) -> list[tuple]:
  base: dict[str, Any] = {}
  if settings.target is not None:
    base.update(flags_lib.as_compiler_options(target=settings.target, workload=settings.workload))
  p, ag = max(stats.axis_size, 1), "xla_gpu_all_gather_combine_threshold_bytes"
  per_layer = dict(base)
  if stats.max_group_gather_bytes:
    # Large enough for one layer's gathers, too small to merge two layers (or over a cap).
    per_layer[ag] = settings.gather_merge_bytes(stats.max_group_gather_bytes)
    if settings.reduce_scatter == "per_layer":
      per_layer["xla_gpu_reduce_scatter_combine_threshold_bytes"] = int(
        stats.max_group_gather_bytes // p
      )
  per_op = dict(base)
  if stats.max_gather_bytes:
    per_op[ag] = settings.gather_merge_bytes(stats.max_gather_bytes)
  if stats.max_scatter_out_bytes and settings.reduce_scatter == "per_layer":
    per_op["xla_gpu_reduce_scatter_combine_threshold_bytes"] = int(stats.max_scatter_out_bytes)
  out = [("rewritten, one layer per collective", cfg, {**per_layer, **settings.xla_options})]
  if settings.target is not None and settings.select != "rewrite" and stats.has_collectives:
    out.append(("rewritten, one tensor per collective", cfg, {**per_op, **settings.xla_options}))
    out.append(
      (
        "rewritten, one layer per collective, two collectives in flight",
        cfg,
        {
          **per_layer,
          "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
          **settings.xla_options,
        },
      )
    )
    # Gathers tied where the cost model issues them, the first ones and the reduce-scatters
    # one by one; XLA's dot merger off, so the first matmul starts on the first tensor.
    unmerged = {k: 0 for k in _DOT_MERGER if flags_lib.accepted_by_jaxlib(k, 0)}
    out.append(
      (
        "rewritten, gathers tied where the cost model issues them, first ones and reduce-scatters one by one"
        + (", XLA's dot merger off" if unmerged else ""),
        dataclasses.replace(cfg, chain=True),
        {**per_layer, **unmerged, **settings.xla_options},
      )
    )
    if stats.weight_gradients:
      # The weight gradients where XLA's scheduler puts them (at the end of the step).
      out.append(
        (
          "rewritten, one layer per collective, weight gradients where XLA puts them",
          dataclasses.replace(cfg, defer_weight_gradients=False),
          {**per_layer, **settings.xla_options},
        )
      )
    if stats.rings and flags_lib.accepted_by_jaxlib("xla_gpu_enable_triton_gemm", False):
      # The collective matmuls' partial GEMMs through cuBLAS: the running sum of a
      # reduce-scatter ring is added in the GEMM's epilogue, and no partial GEMM is split
      # along K.
      out.append(
        (
          "rewritten, one layer per collective, cuBLAS GEMMs (XLA's Triton GEMMs off)",
          cfg,
          {**per_layer, "xla_gpu_enable_triton_gemm": False, **settings.xla_options},
        )
      )
    if stats.loop_bodies:
      # The loops' bodies as written, or only the forward ones planned: XLA schedules a
      # loop body on its own, and a backward body that recomputes its layer
      # (jax.checkpoint) has two chains of pieces for one link.
      out.append(
        (
          "rewritten, one layer per collective, loop bodies as written",
          dataclasses.replace(cfg, loops="none"),
          {**per_layer, **settings.xla_options},
        )
      )
      if 0 < stats.reversed_loop_bodies < stats.loop_bodies:
        out.append(
          (
            "rewritten, one layer per collective, only forward loop bodies rewritten",
            dataclasses.replace(cfg, loops="forward"),
            {**per_layer, **settings.xla_options},
          )
        )
    pipeliner = pipeliner_off(base)
    if stats.loops and pipeliner:
      # Loops that pipeline their own collectives (scan_layers) gain nothing from
      # XLA's pipeliner, which moves the first gather and the last reduce-scatter
      # out of the loop where nothing hides them.
      out.append(
        (
          "rewritten, one layer per collective, XLA's loop pipeliner off",
          cfg,
          {**per_layer, **pipeliner, **settings.xla_options},
        )
      )
      out.append(
        (
          "rewritten, one tensor per collective, XLA's loop pipeliner off",
          cfg,
          {**per_op, **pipeliner, **settings.xla_options},
        )
      )
      out.append(
        (
          "rewritten, one layer per collective, XLA's loop pipeliner off, two collectives "
          "in flight",
          cfg,
          {
            **per_layer,
            **pipeliner,
            "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
            **settings.xla_options,
          },
        )
      )
    # Loop bodies in parts of their batch (batch_parts.py): 2, and 4 where every such
    # loop's batch divides into 4; XLA's dot merger off (else it joins the parts' matmuls
    # back into one) and its loop pipeliner off: to issue an iteration's all-gathers one
    # iteration early it recomputes the work that feeds them (MaxText's tensor-parallel
    # step: 9 % more matmul FLOPs, the step 3-5 % slower with 2 parts).
    for parts, loops in ((2, stats.split_loops), (4, stats.split4_loops)):
      if loops and loops == stats.split_loops:
        out.append(
          (
            f"rewritten, loop bodies in {parts} batch parts, XLA's dot merger off"
            + (", XLA's loop pipeliner off" if pipeliner else ""),
            dataclasses.replace(cfg, batch_parts=parts),
            {**per_layer, **unmerged, **pipeliner, **settings.xla_options},
          )
        )
    as_written = cfg.as_written()
    if stats.loops and unmerged:
      # Loops left to XLA's own pipeliner, with its dot merger off (the loop's first
      # matmul starts on its first weight).
      out.append(
        (
          "as written, recommended flags, XLA's dot merger off",
          as_written,
          {**base, **unmerged, **settings.xla_options},
        )
      )
    out.append(("as written, recommended flags", as_written, {**base, **settings.xla_options}))
  return out


def recall(
  settings, entry_key: str, candidates: list[Candidate], fallback: VariantConfig | None = None
) -> Choice | None:
  """The remembered choice among ``candidates`` (a remembered variant not among them
  appended); None if there is none to use.

  ``fallback``: the configuration of a remembered variant not among ``candidates``
  (a GSPMD step's compiler-option variants, all the step as written), except those of
  its shard_map form.
  """
  entry = selection_cache.load(entry_key)
  if entry is None:
    return None
  names = [c.name for c in candidates]
  base = entry["base"]
  if base not in names and (fallback is None or base.startswith(CONVERTED_PREFIX)):
    return None
  options = entry["options"]
  profile = options.get(latency_profile.OPTION)
  if profile is not None and not os.path.exists(str(profile)):
    return None  # the profile file it was scheduled with is gone
  cfg = candidates[names.index(base)].config if base in names else fallback
  remembered = Candidate(entry["chosen"], cfg, options)
  candidates = list(candidates)
  if entry["chosen"] in names:
    chosen = names.index(entry["chosen"])
    candidates[chosen] = remembered
  else:
    candidates.append(remembered)
    chosen = len(candidates) - 1
  try:
    estimates = tuple(Estimate(str(n), float(t)) for n, t in entry["estimates"])
  except (TypeError, ValueError):
    return None
  return Choice(
    tuple(candidates),
    chosen,
    estimates,
    failed=tuple(str(f) for f in entry["failed"]),
    judged=tuple(str(j) for j in entry.get("judged", [])),
    how="remembered",
    origin="the selection cache",
  )


def remember(entry_key: str, choice: Choice) -> None:
  """Stores ``choice`` under ``entry_key`` (:mod:`.selection_cache`)."""
  c = choice.candidate
  base = c.name[: -len(PROFILED_SUFFIX)] if c.name.endswith(PROFILED_SUFFIX) else c.name
  selection_cache.store(
    entry_key,
    {
      "chosen": c.name,
      "base": base,
      "options": dict(c.options),
      "estimates": [[e.name, e.step_time_s] for e in choice.estimates],
      "failed": list(choice.failed),
      "judged": list(choice.judged),
    },
  )


def recommended(settings) -> dict[str, Any]:
  """The target's recommended options for the workload, with the user's on top."""
  return {
    **flags_lib.as_compiler_options(target=settings.target, workload=settings.workload),
    **settings.xla_options,
  }


AS_WRITTEN = "as written, recommended flags"


def compile_as_written(settings, cfg, make, args, kwargs, kernels=None):
  """(report, XLA's executable or None where the compile was read back from the store):
  the GSPMD step as written compiled for the target with the recommended flags, the
  first compile of its selection (seeding ``kernels``, the selection's shared kernel
  cache, when given)."""
  from jax_overlap._src.analysis import analyze as analysis
  from jax_overlap._src.compile import compiler as compile_lib
  from jax_overlap._src.compile import dumps

  as_written = cfg.as_written()
  base = recommended(settings)
  options = compiles.for_selection(settings, base)
  if kernels is not None:
    options = kernels.seed(options, compiles.program(as_written))
  step = compile_lib.compile_for_target(
    make(as_written, base),
    *args,
    target=settings.target,
    xla_options=options,
    api_name="analyze",
    **kwargs,
  )
  if not step.hlo_text.strip():
    raise dumps.missing_dump("analyze", "optimised HLO (*after_optimizations.txt)")
  if kernels is not None:
    kernels.done(options)
  return analysis.analyze_compiled(step, name=AS_WRITTEN, xla_options=options), step.compiled


def gspmd_candidates(settings, cfg, make, args, kwargs, notes, known, kernels=None, report=None):
  """Option variants for a program without shard_map, built for the collectives the
  partitioner inserted (read from ``report``, the step as written compiled for the target
  by :func:`compile_as_written`, compiled here when not given)."""
  as_written = cfg.as_written()
  base = recommended(settings)
  if report is None:
    report, _ = compile_as_written(settings, cfg, make, args, kwargs, kernels)
  found = gspmd.found(report)
  i = next(i for i, n in enumerate(notes) if n.startswith("no shard_map in this program"))
  converted = any(n.startswith("converted to shard_map") for n in notes)
  notes[i] = (
    f"no shard_map in this program: the SPMD partitioner inserts its collectives; compiled "
    f"for {settings.target.name} they are {found.summary()}. The variants named 'as written' are "
    "compiler options for those collectives"
    + (
      "; those named 'shard_map form' are the full rewrite (prefetch, per-layer "
      "reduce-scatter, collective matmuls, annotations) of the step converted to shard_map"
      if converted
      else "; the full rewrite (prefetch, per-layer reduce-scatter, collective matmuls, "
      "annotations) needs "
      "shard_map, jax_overlap.fsdp.scan_layers or a step the conversion to shard_map accepts"
    )
  )
  notes.extend(gspmd.left_out(found))
  known[0] = report
  return [
    Candidate(n, as_written, {**opts, **settings.xla_options})
    for n, opts in gspmd.variants(found, base)
  ]
