"""``jax_overlap.overlap``: the decorator and the step it returns (:class:`Overlapped`).

A call builds the step once per input signature through the pipeline in :mod:`.pipeline`
(resolve -> trace -> plan -> convert -> candidates -> select -> build, typed records from
:mod:`.records` between the steps) and runs what it built. Its keywords are checked in
:mod:`.settings`, its arguments read in :mod:`.arguments`; the variants and the choice among
them live in :mod:`.variants`."""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jax_overlap._src import errors, framework_jits
from jax_overlap._src import flags as flags_lib
from jax_overlap._src import targets as targets_lib
from jax_overlap._src.compile import xla_log
from jax_overlap._src.flags.registry import Workload
from jax_overlap._src.transform import arguments, pipeline
from jax_overlap._src.transform.explain import Explanation
from jax_overlap._src.transform.records import Built
from jax_overlap._src.transform.settings import (
  Annotate,
  CollectiveMatmul,
  Gspmd,
  ReduceScatter,
  Select,
  Settings,
  WeightGradients,
)


class Overlapped:
  """A step function rewritten for overlap; call it like the original.

  Attributes:
    fn: the original function.
    settings: ``overlap``'s keywords, checked (a frozen ``Settings``).
  """

  def __init__(self, fn, settings: Settings, *, under_framework: bool = False):
    self.fn = fn
    self.settings = settings
    self._under_framework = under_framework  # the jax.jit in nnx.jit: its arguments may be Modules
    self._built: dict[Any, Built] = {}
    self._compiled: list[Built] = []  # built steps whose first call compiled them
    self._warned_nothing = False
    functools.update_wrapper(self, fn)

  # -- the pipeline ----------------------------------------------------------

  def build(self, *args, **kwargs) -> Built:
    """Runs the pipeline for these arguments (once per input signature) and returns what a
    call runs: the chosen variant, jitted, with its explanation and choice."""
    # A plain function over NNX objects: overlap would jax.jit it, losing what it updates
    # in place (a jitted one keeps its jax.jit's meaning, whatever it is).
    plain = not self._under_framework and not hasattr(self.fn, "trace")
    if plain and (nodes := framework_jits.graph_nodes(args, kwargs)):
      name = getattr(self.fn, "__name__", "the step")
      raise TypeError(
        f"overlap: {name} takes Flax NNX objects ({', '.join(nodes)}), whose in-place "
        "updates a jax.jit of it would lose; decorate its nnx.jit instead "
        "(@jax_overlap.overlap above @nnx.jit), which updates them as nnx.jit does, or "
        "overlap(jax.jit(step)) if it returns all it changes"
      )
    arguments.check_args(*self._step.statics.dynamic(args, kwargs), self.settings.mesh)
    signature = arguments.signature(args, kwargs)
    hit = self._built.get(signature) or self._traced_hit(signature, args, kwargs)
    if hit is not None:
      return hit
    built = pipeline.run(self._step, args, kwargs, signature)
    self._built[signature] = built
    self._warn_if_nothing_moves(built)
    return built

  def _warn_if_nothing_moves(self, built: Built) -> None:
    """One warning per decorated step when the rewrite found nothing to move and no
    variant was compared (the step runs as written)."""
    idle = ("left_alone", "classify", "compiler_option")
    moved = [a for a in built.explanation.actions if a.kind not in idle]
    if self._warned_nothing or built.choice.how != "only_candidate" or moved:
      return
    self._warned_nothing = True
    name = getattr(self.fn, "__name__", "the step")
    warnings.warn(
      f"overlap: found nothing to move in {name}: no collective in a shard_map body (or "
      "none the rewrite can reorder) and no target to compare compiler options for; it "
      "runs as written. Give a target (e.g. target='h100x8') for a GSPMD step, or see "
      f"{name}.explain(*args)",
      errors.NothingToOverlapWarning,
      stacklevel=errors.caller_stacklevel(),
    )

  @functools.cached_property
  def _step(self) -> pipeline.StepFunction:
    """The step as the pipeline reads it, with ``jax.jit``'s view of it and its static
    arguments (made once: every call of the step asks)."""
    base = self.fn
    if not hasattr(base, "trace"):
      keep = ("static_argnums", "static_argnames")
      base = jax.jit(self.fn, **{k: v for k, v in self.settings.jit_kwargs.items() if k in keep})
    return pipeline.StepFunction(self.fn, self.settings, base, arguments.Statics.of(base))

  def _traced_hit(self, signature, args, kwargs) -> Built | None:
    """Under an outer trace (``analyze``, an enclosing ``jax.jit``), the arguments are
    tracers whose shardings are unknown: the step built for concrete arguments of the
    same shapes and dtypes, the latest one, if any."""
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
      return None
    tree, sig = signature
    shapes = [s[:2] for s in sig]
    for (tree_, sig_), entry in reversed(self._built.items()):
      if tree_ == tree and [s[:2] for s in sig_] == shapes:
        return entry
    return None

  # -- calling ---------------------------------------------------------------

  def __call__(self, *args, **kwargs):
    built = self.build(*args, **kwargs)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
      # Called inside another transformation (jit, grad, vmap): inline the rewrite;
      # compiler options can only be set by the outermost jit.
      return built.python_fn(*args, **kwargs)
    try:
      if not any(b is built for b in self._compiled):
        self._compile_quietly(built, args, kwargs)
      return built.jitted(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - XLA raises JaxRuntimeError and others
      unknown = flags_lib.per_compile.unknown_option_error("overlap", e)
      if unknown is not None:
        raise unknown from None
      raise

  def _compile_quietly(self, built: Built, args, kwargs) -> None:
    """The first call's compile of a variant scheduled from a latency profile, made here
    (jax reuses it for the call) so that XLA's lines about the profile are kept off stderr
    and said once in ``explain()`` (:mod:`~jax_overlap._src.compile.xla_log`)."""
    self._compiled.append(built)
    if not built.explanation.xla_options.get(xla_log.PROFILE_OPTION):
      return
    with xla_log.quiet() as lookups:
      built.jitted.lower(*args, **kwargs).compile()
    if (said := xla_log.summary(lookups)) is not None:
      built.explanation.notes.append(f"compiled for the devices: {said}")

  def lower(self, *args, **kwargs):
    """Lowers the rewritten step like ``jax.jit(...).lower``."""
    return self.build(*args, **kwargs).jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    """Traces the rewritten step like ``jax.jit(...).trace``."""
    return self.build(*args, **kwargs).jitted.trace(*args, **kwargs)

  def explain(self, *args, **kwargs) -> Explanation:
    """What was rewritten and why, for these arguments."""
    return self.build(*args, **kwargs).explanation

  def compiler_options(self, *args, **kwargs) -> dict[str, Any]:
    return dict(self.explain(*args, **kwargs).xla_options)


def _check_jit_kwargs(jit_kwargs: Mapping[str, Any]) -> None:
  """Refuses keywords that are neither ``overlap``'s nor ``jax.jit``'s, at decoration,
  naming the closest parameter."""
  jit_params = set(inspect.signature(jax.jit).parameters) - {"fun"}
  own = set(inspect.signature(overlap).parameters) - {"fn", "jit_kwargs"}
  for name in jit_kwargs:
    if name in jit_params:
      continue
    close = difflib.get_close_matches(name, sorted(own | jit_params), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TypeError(
      f"overlap() got an unexpected keyword argument {name!r}{hint} (overlap takes its own "
      "keywords and jax.jit's)"
    )


def overlap(
  fn: Callable | None = None,
  *,
  mesh=None,
  target: str | targets_lib.Topology | None = None,
  prefetch: int = 1,
  prefetch_memory: int | float | str | None = None,
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
    fn: the step function (plain, jitted, or containing ``shard_map``; or a Flax
      ``nnx.jit`` or Equinox ``eqx.filter_jit`` function, whose ``jax.jit`` is rewritten).
    mesh: the mesh the step runs on (checked against the arguments' shardings).
    target: the GPU topology the step is compiled and chosen for ("h100x8", a
      ``targets.Topology``); None: the devices the step runs on (on GPUs, their topology
      from ``targets.from_devices``, and the selection runs as for a named target; on
      CPU, no variant is compiled for a GPU).
    prefetch: 0 leaves parameter all-gathers where written; >= 1 issues each one by the
      cost model's time, to arrive when first used, and gathers that many iterations ahead
      in a ``lax.scan`` it pipelines.
    prefetch_memory: the most bytes of parameters gathered ahead of their first use at any
      point of a ``shard_map`` body (per device; an int, or a string such as ``"2GiB"`` or
      ``"512 MiB"``); None: no cap. A gather holds its bytes from its issue (in flight or
      arrived) to its first use, a pipelined loop's first gathers included; where the cap
      is short, gathers are issued later than their time, each as little as the cap
      allows, and ``explain()`` gives the cap, how many it delayed, the expected exposed
      time with and without it, and the most bytes held (at most the cap, unless one
      gather is larger: that one is issued just in time, alone). Under a cap every variant
      ties each gather after the equation it is issued after, so that XLA's scheduler,
      which issues a free all-gather as early as it can, holds no more (not in a GSPMD
      step's shard_map form, whose values carry no mesh axes to tie by), and XLA merges no
      more than the cap into one all-gather. Needs ``prefetch >= 1``; the layers a
      pipelined loop carries inside it are set by ``prefetch``.
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
    select: with a target (given, or the GPUs the step runs on), "cost_model" compiles
      the rewritten step and the step as written (with the recommended options)
      deviceless for the target and keeps the one the analysis estimates faster, so
      the transform is never slower than the flags alone by that estimate; "measure"
      does the same, then times the cost model's best few variants on the devices the
      step runs on (after warm-up, a few steps each, the slowest process's time in a
      multi-process job) and keeps the fastest measured, ``explain()`` showing measured
      beside estimated (on CPU or compile-only devices it says so and keeps the cost
      model's choice); "rewrite" always rewrites.
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
    An :class:`Overlapped` callable with the same signature and outputs (for an
    ``nnx.jit`` or ``eqx.filter_jit`` function, a callable that runs the framework's
    wrapper around the rewritten ``jax.jit``: NNX updates the caller's Modules as
    ``nnx.jit`` does).

  Raises:
    ValueError: for a negative prefetch, a negative or unreadable prefetch_memory (or one
      given with prefetch=0), an unknown mode or target.
    TypeError: for a prefetch_memory that is not a number or a string; for a keyword that is neither ``overlap``'s nor ``jax.jit``'s (naming the
      closest one).

  Example:
    >>> @overlap(target="h100x8")  # doctest: +SKIP
    ... def train_step(params, batch): ...
  """
  _check_jit_kwargs(jit_kwargs)
  settings = Settings(
    mesh=mesh,
    target=target,
    prefetch=prefetch,
    prefetch_memory=prefetch_memory,
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
    if (kind := framework_jits.kind_of(f)) is not None:  # nnx.jit, eqx.filter_jit
      inner = Overlapped(getattr(f, kind.attribute), settings, under_framework=True)
      return framework_jits.WrappedOverlapped(f, kind, inner)
    return Overlapped(f, settings)

  return wrap if fn is None else wrap(fn)
