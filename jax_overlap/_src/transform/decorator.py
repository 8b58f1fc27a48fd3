"""``jax_overlap.overlap``: the decorator, what it builds per input signature (trace, plan,
convert a GSPMD step, choose a variant with :mod:`.variants`) and how it is called.
Its keywords are checked in :mod:`.settings` and its arguments read in :mod:`.arguments`;
the variants, their selection and the plan live in their own modules."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_overlap._src import errors
from jax_overlap._src import flags as flags_lib
from jax_overlap._src.compile import kernel_cache
from jax_overlap._src.flags.registry import Workload
from jax_overlap._src.transform import (
  arguments,
  out_layouts,
  selection_cache,
  shared_choice,
  to_shard_map,
  variants,
)
from jax_overlap._src.transform.evaluate import _collect, _Config, _evaluate
from jax_overlap._src.transform.explain import Action, Explanation
from jax_overlap._src.transform.planning import parameter_avals, parameter_inputs
from jax_overlap._src.transform.settings import (
  Annotate,
  CollectiveMatmul,
  Gspmd,
  ReduceScatter,
  Select,
  Settings,
  WeightGradients,
)
from jax_overlap._src.transform.variants import (
  _CONVERTED_PREFIX,
  _PROFILED_VARIANTS,  # noqa: F401 - re-exported for jax_overlap._src.transform
  _judged,
  _pipeliner_off,  # noqa: F401 - re-exported for jax_overlap._src.transform
  _windowed_notes,
  _worth_profiling,  # noqa: F401 - re-exported for tests
)

# ---------------------------------------------------------------------------
# The decorator.
# ---------------------------------------------------------------------------


class Overlapped:
  """A step function rewritten for overlap; call it like the original.

  Attributes:
    fn: the original function.
    settings: ``overlap``'s keywords, checked (a frozen ``Settings``).
  """

  def __init__(self, fn, settings: Settings):
    self.fn = fn
    self.settings = settings
    self._cache: dict = {}
    functools.update_wrapper(self, fn)

  def _param_inputs(self, closed, args, kwargs, statics: arguments.Statics) -> dict | None:
    """Positions of parameter inputs per shard_map body, from ``params_argnums``."""
    dyn_args, dyn_kwargs = statics.dynamic(args, kwargs)
    n_all = len(jax.tree.leaves((dyn_args, dyn_kwargs)))
    invars = closed.jaxpr.invars
    if n_all != len(invars):
      return None  # the jaxpr does not take the arguments leaf for leaf: no evidence
    params = [invars[j] for j in self._param_leaves(args, statics)]
    return parameter_inputs(closed.jaxpr, params) if params else None

  def _param_leaves(self, args, statics: arguments.Statics) -> list[int]:
    """Positions, among the flattened dynamic arguments, of the leaves of
    ``params_argnums`` (positions among all the arguments, static ones included)."""
    static = statics.positions(len(args))
    counts = [0 if i in static else len(jax.tree.leaves(a)) for i, a in enumerate(args)]
    starts = np.cumsum([0, *counts])
    return [
      j
      for i in self.settings.params_argnums
      if i < len(args)
      for j in range(starts[i], starts[i + 1])
    ]

  @functools.cached_property
  def _base(self):
    """The step as ``jax.jit`` traces it, with its static arguments (made once: every
    call of the step asks)."""
    if hasattr(self.fn, "trace"):
      return self.fn
    keep = ("static_argnums", "static_argnames")
    return jax.jit(self.fn, **{k: v for k, v in self.settings.jit_kwargs.items() if k in keep})

  @functools.cached_property
  def _statics(self) -> arguments.Statics:
    return arguments.Statics.of(self._base)

  @shared_choice.reports_failures  # multi-process: a failed build stops the other processes
  def _build(self, args, kwargs):
    st = self.settings
    base, statics = self._base, self._statics
    arguments.check_args(*statics.dynamic(args, kwargs), st.mesh)
    key = arguments.signature(args, kwargs)
    hit = self._cache.get(key) or self._traced_hit(key, args, kwargs)
    if hit is not None:
      return hit
    traced = errors.trace_user_fn(
      "overlap", self.fn, args, kwargs, lambda: base.trace(*args, **kwargs)
    )
    closed, out_info = traced.jaxpr, traced.out_info
    out_tree = jax.tree.structure(out_info)
    annotate = st.annotate
    if annotate == "auto":
      annotate = st.target is not None or arguments.platform(args, kwargs, st.mesh) != "cpu"
    param_inputs = self._param_inputs(closed, args, kwargs, statics)
    cfg = _Config(
      st.prefetch,
      st.reduce_scatter,
      annotate,
      st.collective_matmul,
      st.target,
      param_inputs=param_inputs,
      param_avals=None if param_inputs is None else parameter_avals(closed.jaxpr, param_inputs),
      defer_weight_gradients=st.weight_gradients == "defer",
    )
    actions: list[Action] = []
    # Plan the rewrite from the jaxpr alone (no extra tracing).
    counter = [0]  # shard_map bodies seen
    stats = _collect(closed.jaxpr, cfg, actions, counter)
    groups = stats.gather_groups
    if groups and st.prefetch > groups:
      raise ValueError(
        f"overlap: prefetch must be between 0 and the number of layers ({groups}), got {st.prefetch}"
      )
    notes = []
    programs = {"traced": closed}
    converted = None
    if counter[0] == 0:
      notes.append(
        "no shard_map in this program: its collectives are inserted by the SPMD partitioner, so "
        "only compiler options apply; the full rewrite (prefetch, per-layer reduce-scatter, "
        "annotations) needs shard_map or jax_overlap.fsdp.scan_layers"
      )
      if st.converts():
        converted = self._convert(traced, closed, args, kwargs, cfg, notes, statics)
    if converted is not None:
      programs["shard_map"], cfg_sm, actions_sm, stats_sm = converted

    # The user's jit settings that the variants keep: donation (of a jitted step, unless
    # given to overlap itself).
    jit_kwargs = {**st.jit_kwargs, **statics.jit_kwargs()}
    donated = tuple(getattr(traced, "donate_argnums", ()) or ())
    if donated and not {"donate_argnums", "donate_argnames"} & set(jit_kwargs):
      jit_kwargs["donate_argnums"] = donated
    # And its output shardings (unless given to overlap): every variant returns them.
    jit_kwargs.update(out_layouts.jit_kwargs(traced, out_tree, jit_kwargs))

    def evaluate(cfg_: _Config):
      def rewritten(*a, **kw):
        leaves = jax.tree.leaves(statics.dynamic(a, kw))
        out = _evaluate(programs[cfg_.program], leaves, cfg_)
        return jax.tree.unflatten(out_tree, out)

      return rewritten

    def make(cfg_: _Config, options_: dict[str, Any]):
      return jax.jit(evaluate(cfg_), **jit_kwargs)

    known: dict[int, Any] = {}
    # The variants' deviceless compiles share the kernels they have in common (unless the
    # user's options name a kernel cache of their own).
    kernels = kernel_cache.Shared(
      enabled=st.target is not None and kernel_cache.OPTION not in st.xla_options
    )
    entry_key = None
    if st.cache:
      entry_key = selection_cache.key(str(closed), key, st.key(annotate, jit_kwargs))
    # Multi-process: process 0 chooses, the others take its choice (not their own cache's).
    agreement = shared_choice.begin(str(closed), key, st.key(annotate, jit_kwargs))
    if shared_choice.follows(agreement):
      entry_key = None
    remembered = None
    converted_candidates = []
    if converted is not None:
      converted_candidates = [
        (_CONVERTED_PREFIX + n, c, o) for n, c, o in variants.candidates(st, cfg_sm, stats_sm)
      ]
    if counter[0] == 0 and st.target is not None and st.select == "cost_model":
      # A remembered choice needs no compile: every compiler-option variant evaluates
      # the step as written.
      candidates = [("as written, recommended flags", cfg.as_written(), variants.recommended(st))]
      candidates += converted_candidates
      if entry_key:
        remembered = self._recall(entry_key, candidates, fallback=cfg.as_written())
      if shared_choice.follows(agreement):  # process 0's choice: no compiles here
        remembered = shared_choice.receive(agreement, candidates, fallback=cfg.as_written())
      if remembered is None:
        candidates = variants.gspmd_candidates(st, cfg, make, args, kwargs, notes, known, kernels)
        candidates += converted_candidates
    elif converted is not None:
      candidates = converted_candidates
    else:
      candidates = variants.candidates(st, cfg, stats)
    if shared_choice.follows(agreement) and remembered is None:  # process 0's choice
      remembered = shared_choice.receive(agreement, candidates)
    chosen = 0
    estimates: list[tuple[str, float]] = []
    failed: list[str] = []
    judged: list[str] = []
    if len(candidates) > 1 or remembered is not None:
      if remembered is None and entry_key:
        remembered = self._recall(entry_key, candidates)
      if remembered is not None:
        chosen, estimates, failed, judged = remembered
      else:
        chosen, estimates, failed, reports = variants.select(
          st, candidates, make, args, kwargs, known, kernels
        )
        judged = _judged(candidates, chosen, reports)
        judged += _windowed_notes(candidates, reports)
        if entry_key:
          self._remember(entry_key, candidates, chosen, estimates, failed, judged)
      table = [
        f"{n} {t * 1e3:.3f} ms" + (" (chosen)" if n == candidates[chosen][0] else "")
        for n, t in estimates
      ]
      notes.append(f"chosen by the cost model on {st.target}: " + "; ".join(table))
      if remembered is not None and not shared_choice.follows(agreement):
        notes.append(
          "choice remembered from an earlier run with the same program, arguments "
          "and settings (jax_overlap cache directory; cache=False chooses again)"
        )
      notes.extend(f"variant not compiled: {f}" for f in failed)
      notes.extend(judged)
    # Multi-process: process 0 publishes its choice, every process confirms it.
    shared_choice.settle(agreement, candidates, chosen, estimates, failed, judged, notes)
    kernels.close()
    name, cfg_c, options = candidates[chosen]
    if cfg_c.program == "shard_map":
      cfg, actions = cfg_sm, actions_sm
    if cfg_c == cfg.as_written() and cfg_c != cfg:
      actions = [a for a in actions if a.kind in ("left_alone", "convert")]
      actions.append(Action("left_alone", "program", f"kept as written: {name} estimated faster"))
    for k, v in options.items():
      actions.append(Action("compiler_option", "compile", f"{k}={flags_lib.format_value(v)}"))
    explanation = Explanation(actions, options, notes, estimates, name)
    python_fn = evaluate(cfg_c)
    jitted = jax.jit(
      python_fn, compiler_options=flags_lib.per_compile.spelled(options) or None, **jit_kwargs
    )
    entry = (jitted, explanation, python_fn)
    self._cache[key] = entry
    return entry

  def _traced_hit(self, key, args, kwargs):
    """Under an outer trace (``analyze``, an enclosing ``jax.jit``), the arguments are
    tracers whose shardings are unknown: the step built for concrete arguments of the
    same shapes and dtypes, the latest one, if any."""
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
      return None
    tree, sig = key
    shapes = [s[:2] for s in sig]
    for (tree_, sig_), entry in reversed(self._cache.items()):
      if tree_ == tree and [s[:2] for s in sig_] == shapes:
        return entry
    return None

  def _convert(self, traced, closed, args, kwargs, cfg, notes, statics: arguments.Statics):
    """The step's shard_map form planned like a shard_map program: (its jaxpr, config,
    actions, stats), or None with a note saying why it was not converted."""
    leaves = jax.tree.leaves(statics.dynamic(args, kwargs))
    if len(leaves) != len(closed.jaxpr.invars):
      notes.append("not converted to shard_map: the traced program does not take the "
                   "arguments leaf for leaf")  # fmt: skip
      return None
    params = self._param_leaves(args, statics)
    jit_params = getattr(traced, "_params", {})
    avals = arguments.abstract_leaves(leaves, closed.jaxpr.invars, jit_params.get("in_shardings"))
    # The layouts jax.jit(step) returns (asked for, or the partitioner's), for its outputs.
    out_shardings = out_layouts.partitioner_choice(traced)
    try:
      conv = to_shard_map.convert(closed, avals, out_shardings, params_leaves=params)
      smap = jax.make_jaxpr(conv.fn)(*avals)
    except to_shard_map.Refused as e:
      notes.append(f"not converted to shard_map: {e}")
      return None
    param_inputs = self._param_inputs(smap, args, kwargs, statics)
    cfg_sm = dataclasses.replace(
      cfg,
      program="shard_map",
      param_inputs=param_inputs,
      param_avals=None if param_inputs is None else parameter_avals(smap.jaxpr, param_inputs),
    )
    actions: list[Action] = [
      Action("convert", "program", f"GSPMD step in its shard_map form: {conv.summary()}")
    ]
    stats = _collect(smap.jaxpr, cfg_sm, actions, [0])
    notes.append(
      "converted to shard_map (the variants named 'shard_map form'): each equation's layout "
      f"followed as the partitioner would, {conv.summary()}"
    )
    return smap, cfg_sm, actions, stats

  def _recall(self, entry_key: str, candidates, fallback=None):
    return variants.recall(self.settings, entry_key, candidates, fallback)

  def _remember(self, entry_key: str, candidates, chosen: int, estimates, failed, judged=()):
    return variants.remember(
      self.settings, entry_key, candidates, chosen, estimates, failed, judged
    )

  def __call__(self, *args, **kwargs):
    fn, _, python_fn = self._build(args, kwargs)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
      # Called inside another transformation (jit, grad, vmap): inline the rewrite;
      # compiler options can only be set by the outermost jit.
      return python_fn(*args, **kwargs)
    return fn(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """Lowers the rewritten step like ``jax.jit(...).lower``."""
    fn = self._build(args, kwargs)[0]
    return fn.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    """Traces the rewritten step like ``jax.jit(...).trace``."""
    fn = self._build(args, kwargs)[0]
    return fn.trace(*args, **kwargs)

  def explain(self, *args, **kwargs) -> Explanation:
    """What was rewritten and why, for these arguments."""
    return self._build(args, kwargs)[1]

  def compiler_options(self, *args, **kwargs) -> dict[str, Any]:
    return dict(self.explain(*args, **kwargs).xla_options)


def overlap(
  fn: Callable | None = None,
  *,
  mesh=None,
  target: str | None = None,
  prefetch: int = 1,
  reduce_scatter: ReduceScatter = "per_layer",
  collective_matmul: CollectiveMatmul = "auto",
  weight_gradients: WeightGradients = "defer",
  annotate: Annotate = "auto",
  xla_options: dict[str, Any] | None = None,
  workload: Workload = "fsdp",
  select: Select = "cost_model",
  schedule_from_estimates: bool = True,
  cache: bool = True,
  params_argnums: int | tuple[int, ...] = 0,
  gspmd: Gspmd = "auto",
  **jit_kwargs,
):
  """Rewrites a sharded step so its collectives overlap compute.

  Usable as ``@overlap`` or ``@overlap(target="h100x8", prefetch=2)``.

  Args:
    fn: the step function (plain, jitted, or containing ``shard_map``).
    mesh: the mesh the step runs on (checked against the arguments' shardings).
    target: GPU topology whose recommended XLA options are applied ("h100x8"...).
    prefetch: how many layers ahead parameter all-gathers are issued (>= 0).
    reduce_scatter: "per_layer" (issue each gradient reduce-scatter as soon as
      its input exists, and keep them separate) or "as_written".
    collective_matmul: "auto" decomposes an activation all-gather feeding a
      matmul (and a matmul feeding a reduce-scatter) into partial matmuls
      (``jax_overlap.collective_matmul``) where the cost model for ``target``
      (default h100x8) predicts a gain, as the better of a ppermute ring (NCCL
      send/recv) and the collective issued in pieces (chained all-gathers or
      reduce-scatters, each on all of NCCL's channels); "on" wherever the
      pattern matches (the better of the two); "ring" or "pieces" wherever it
      matches, that way only; "off" never. Loops over layers (``lax.scan``) are
      planned body by body the same way (each iteration's activation collectives);
      with ``select="cost_model"`` the variants include their bodies as written and
      only the forward loops' bodies rewritten.
    weight_gradients: "defer" runs each backward weight gradient of a gathered
      activation (``x_gathered^T dy``) while the next activation all-gather travels:
      it waits for that all-gather's input, and the all-gather's users wait for it
      (XLA's scheduler otherwise leaves every weight gradient to the end of the
      step, with no compute beside the tensor-parallel all-gathers of the backward
      pass); with ``select="cost_model"`` the step with them where XLA puts them is
      one of the variants. "as_written" leaves them to XLA.
    annotate: attach frontend attributes for the runtime controls and the
      analysis (True/False); "auto" attaches them when the step compiles for
      a GPU (a ``target`` is given or the arguments live on GPU devices) and
      not on CPU, where nothing reads them and they slow XLA's compile.
    xla_options: extra per-compile XLA options (win over the others).
    workload: workload for the recommended options.
    select: with a ``target``, "cost_model" compiles the rewritten step and the
      step as written (with the recommended options) deviceless for the target
      and keeps the one the analysis estimates faster, so the transform is never
      slower than the flags alone by that estimate; "rewrite" always rewrites.
    schedule_from_estimates: with ``select="cost_model"``, also compile three
      variants (the fastest, then those with the least compute; none whose
      compute alone takes longer than the best step so far) with a latency
      profile written from their analysis
      (``jax_overlap.latency_profile``), so XLA's latency-hiding scheduler
      places collectives by the cost model's kernel and collective times
      instead of its own estimates, and keep whichever is estimated faster.
      The profile file lives in the jax_overlap cache directory. Skipped when
      ``xla_options`` already names a profile (e.g. one measured on GPUs).
    cache: remember the cost model's choice on disk (``selection/`` in the
      jax_overlap cache directory, ``$JAX_OVERLAP_CACHE_DIR`` or
      ``~/.cache/jax_overlap``), keyed by the traced program, the arguments'
      shapes, dtypes and shardings, the target, these settings, jax/jaxlib and
      jax_overlap's code, so a restarted job skips the deviceless compiles.
      Every variant computes the same values; only the choice is reused.
    params_argnums: the positional argument(s) holding the parameters (the train
      state), 0 by default as in ``step(params, batch)``. All-gathers whose input
      depends only on parameters are prefetched; those of other inputs (a
      sequence-parallel batch) and of values computed in the step (activations) are
      not, and ``explain()`` says which is which.
    gspmd: for a step without ``shard_map`` (GSPMD), "auto" also tries its shard_map
      form when a ``target`` is given and ``select="cost_model"``: the step converted
      equation by equation (``jax_overlap._src.transform.to_shard_map``: parameters
      gathered at use, gradients reduce-scattered where autodiff makes them) and then
      rewritten like a shard_map step, beside the compiler-option variants of the step
      as written; "convert" always uses the shard_map form (and says in ``explain()``
      why not where it cannot be converted); "as_written" never converts.
    **jit_kwargs: passed to ``jax.jit`` (e.g. ``donate_argnums``). A jitted ``fn`` keeps its
      own donation unless ``donate_argnums``/``donate_argnames`` is given here, and its
      static arguments; ``static_argnums``/``static_argnames`` given here mark those of a
      plain ``fn``. Static arguments choose the program (one build per value), they are
      not its inputs.

  Returns:
    An :class:`Overlapped` callable with the same signature and outputs.

  Raises:
    ValueError: for a negative prefetch, an unknown mode or target.

  Example:
    >>> @overlap(target="h100x8")  # doctest: +SKIP
    ... def train_step(params, batch): ...
  """
  settings = Settings(
    mesh=mesh,
    target=target,
    prefetch=prefetch,
    reduce_scatter=reduce_scatter,
    collective_matmul=collective_matmul,
    weight_gradients=weight_gradients,
    annotate=annotate,
    xla_options=xla_options,
    workload=workload,
    select=select,
    schedule_from_estimates=schedule_from_estimates,
    cache=cache,
    params_argnums=params_argnums,
    gspmd=gspmd,
    jit_kwargs=jit_kwargs,
  )

  def wrap(f):
    if not callable(f):
      raise TypeError(f"overlap: expected a function, got {type(f).__name__}")
    return Overlapped(f, settings)

  return wrap if fn is None else wrap(fn)
