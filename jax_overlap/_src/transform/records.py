"""The records ``@overlap``'s pipeline passes from step to step (:mod:`.decorator`): each
frozen, each holding what the next step reads.

trace -> :class:`TracedStep`; plan (and convert) -> :class:`PlannedProgram`; candidates ->
:class:`Candidate`; select -> :class:`Choice` (with :class:`Estimate` rows); build ->
:class:`Built`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from jax_overlap._src.transform.evaluate import VariantConfig
from jax_overlap._src.transform.explain import Action, Explanation
from jax_overlap._src.transform.stats import RewriteStats

__all__ = [
  "Built",
  "Candidate",
  "Choice",
  "Estimate",
  "Judged",
  "PlannedProgram",
  "TracedStep",
]

# How a choice was made: the only variant there was, the cost model's estimates, a choice
# remembered on disk, timings on the devices, or the choice of another process of the job.
Judged = Literal["only_candidate", "cost_model", "remembered", "measured", "shared"]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One variant: its name, the program it evaluates and the XLA options it compiles with."""

  name: str
  config: VariantConfig
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

  def __post_init__(self):
    object.__setattr__(self, "options", dict(self.options))

  def renamed(self, name: str, options: Mapping[str, Any] | None = None) -> Candidate:
    """The same program under another name (and options)."""
    return Candidate(name, self.config, self.options if options is None else options)


class Estimate(NamedTuple):
  """A variant's step time: by the cost model in ``Choice.estimates``, on the devices in
  ``Choice.measured``."""

  name: str
  step_time_s: float


@dataclasses.dataclass(frozen=True)
class Choice:
  """The variant chosen among ``candidates`` and how.

  Attributes:
    candidates: every variant considered (latency-profiled recompiles appended).
    index: the chosen one's position in ``candidates``.
    estimates: each compiled variant's estimate by the cost model.
    measured: the variants timed on the devices (``select="measure"``), their median step.
    failed: "name: reason" for each variant that did not compile.
    judged: second opinions on the chosen variant (the simulator's; "self-judged").
    how: how the choice was made (:data:`Judged`).
    origin: who made it: "this process", "process 0" or "the selection cache".
  """

  candidates: tuple[Candidate, ...]
  index: int
  estimates: tuple[Estimate, ...] = ()
  measured: tuple[Estimate, ...] = ()
  failed: tuple[str, ...] = ()
  judged: tuple[str, ...] = ()
  how: Judged = "cost_model"
  origin: str = "this process"

  @property
  def candidate(self) -> Candidate:
    return self.candidates[self.index]

  @property
  def name(self) -> str:
    return self.candidate.name


@dataclasses.dataclass(frozen=True)
class TracedStep:
  """The step as ``jax.jit`` traced it for one input signature.

  Attributes:
    traced: the ``jax.stages.Traced``.
    closed: its closed jaxpr.
    out_tree: the structure of its outputs.
    signature: the arguments' signature the build is kept under.
    jit_kwargs: the ``jax.jit`` keywords every variant compiles with (static arguments,
      donation: the user's, or those of a jitted step).
  """

  traced: Any
  closed: Any
  out_tree: Any
  signature: Any
  jit_kwargs: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class PlannedProgram:
  """A program with its rewrite planned: the step as traced, or its shard_map form.

  Attributes:
    program: the closed jaxpr the variants evaluate.
    config: the rewrite as the settings ask for it (:class:`~.evaluate.VariantConfig`).
    actions: what the plan does, for ``explain()``.
    stats: what the plan found (:class:`~.evaluate.RewriteStats`).
    shard_maps: how many ``shard_map`` bodies it has.
  """

  program: Any
  config: VariantConfig
  actions: tuple[Action, ...]
  stats: RewriteStats
  shard_maps: int

  @property
  def moves_anything(self) -> bool:
    """Whether the rewrite has any collective to move, split or annotate."""
    return self.shard_maps > 0 and (self.stats.has_collectives or self.stats.rings > 0)


@dataclasses.dataclass(frozen=True)
class Built:
  """What a call of the step runs for one input signature.

  Attributes:
    jitted: the chosen variant under ``jax.jit`` with its XLA options.
    explanation: what was done and why (:class:`~.explain.Explanation`).
    python_fn: the chosen variant unjitted (inlined under an outer transformation).
    choice: the choice it came from.
  """

  jitted: Any
  explanation: Explanation
  python_fn: Callable
  choice: Choice
