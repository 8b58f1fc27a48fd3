"""``@jax_overlap.overlap``: rewrite a sharded step so collectives interleave with compute.

The decorator traces the step to a jaxpr once per input signature and
re-evaluates it with these changes. All but the collective matmuls keep the
arithmetic exactly as written (operations are reordered and annotated, never
changed); a collective matmul computes the same products in row blocks, equal
up to the order of floating-point accumulation:

1. *Prefetch.* Inside each ``shard_map`` body, parameter all-gathers (gathers
   whose input depends only on the body's inputs) are grouped into layers —
   consecutive gathers in program order that no matmul separates — and each
   group is issued ``prefetch`` layers ahead of its first use, so that the
   gather of layer i+1 is in flight while layer i computes.
2. *Per-layer reduce-scatter.* Each ``psum_scatter`` is issued right after
   the operation that produces its input, so gradient reduce-scatters run
   during the rest of the backward pass instead of piling up at its end.
3. *Separate collectives.* The compile gets XLA combine thresholds no larger
   than one layer's collective, so the combiner cannot merge the gathers of
   several layers into one that nothing can hide.
4. *Collective matmuls.* An activation all-gather feeding a matmul, or a
   matmul feeding a reduce-scatter (tensor and sequence parallelism), becomes
   a ppermute ring interleaved with partial matmuls where the cost model says
   it wins (``jax_overlap.collective_matmul``).
5. *Annotations.* Every collective gets frontend attributes naming the layer
   group it belongs to (``_jax_overlap_pair``), its priority class
   (``_jax_overlap_priority``) and occupancy class (``_jax_overlap_occupancy``);
   the matmuls it should hide under carry the same pair id. They reach the
   compiled HLO (combiners join them with commas), where the analysis and the
   runtime controls read them.
6. *Compiler options.* The target's recommended options (``jax_overlap._src.flags``).

Programs without explicit collectives (GSPMD inserts them during
partitioning) get 3 and 5 only; ``explain()`` says so. Stacked layers under
``lax.scan`` are pipelined by :func:`jax_overlap.fsdp.scan_layers`.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata

from jax_overlap._src import errors, gspmd, latency_profile, scan_pipeline, selection_cache
from jax_overlap._src import flags as flags_lib
from jax_overlap._src import targets as targets_lib
from jax_overlap._src.fsdp import _after

__all__ = ["overlap", "Overlapped", "Explanation", "Action", "priority"]

_GATHER = "all_gather"
_SCATTER = "reduce_scatter"
_COLLECTIVES = {"all_gather", "reduce_scatter", "psum", "psum_invariant", "ppermute", "all_to_all", "pmax", "pmin"}
SCHEDULING_GROUPS = False
_OPAQUE = ("scan", "while", "cond", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call")
_MATMUL = {"dot_general", "conv_general_dilated", "ragged_dot_general"}
_LOOP_PIPELINER = (
    "xla_gpu_enable_pipelined_all_gather",
    "xla_gpu_enable_pipelined_reduce_scatter",
    "xla_gpu_enable_pipelined_all_reduce",
)
_DOT_MERGER = ("xla_gpu_dot_merger_threshold_mb",)
# Latency-profiled recompiles tried per step (the fastest variants by estimate).
_PROFILED_VARIANTS = 3
_PROFILED_SUFFIX = ", scheduled by the cost model's estimates"


@dataclasses.dataclass(frozen=True)
class Action:
  """One thing the transform did (or left alone, with the reason)."""

  kind: str  # "classify", "prefetch", "reduce_scatter", "collective_matmul", "annotate", "compiler_option", "left_alone"
  where: str
  detail: str


@dataclasses.dataclass
class Explanation:
  """What ``overlap`` rewrote and why."""

  actions: list[Action]
  xla_options: dict[str, Any]
  notes: list[str]
  candidates: list[tuple[str, float]] = dataclasses.field(default_factory=list)
  chosen: str = ""

  def of_kind(self, kind: str) -> list[Action]:
    return [a for a in self.actions if a.kind == kind]

  def __str__(self) -> str:
    lines = ["jax_overlap.overlap:"]
    for kind in ("classify", "prefetch", "reduce_scatter", "collective_matmul", "annotate", "compiler_option", "left_alone"):
      acts = self.of_kind(kind)
      if acts:
        lines.append(f"  {kind} ({len(acts)}):")
        lines.extend(f"    [{a.where}] {a.detail}" for a in acts)
    lines.extend(f"  note: {n}" for n in self.notes)
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Manual annotation.
# ---------------------------------------------------------------------------


class priority:  # noqa: N801 - used as a context manager, like jax's own
  """Marks the collectives (and ops) traced inside as a priority class.

  ``with jax_overlap.priority("high"): y = jax.lax.all_gather(...)`` attaches
  the frontend attribute ``_jax_overlap_priority="high"`` to the enclosed ops;
  it reaches the compiled HLO, where the analysis and the runtime plan read it.
  Also usable as a decorator.
  """

  _CLASSES = ("high", "normal", "low")

  def __init__(self, level: str = "high"):
    if level not in self._CLASSES:
      raise ValueError(f"priority: level must be one of {', '.join(self._CLASSES)}, got {level!r}")
    self.level = level
    self._cm = None

  def __enter__(self):
    self._cm = set_xla_metadata(_jax_overlap_priority=self.level)
    return self._cm.__enter__()

  def __exit__(self, *exc):
    cm, self._cm = self._cm, None
    return cm.__exit__(*exc)

  def __call__(self, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      with priority(self.level):
        return fn(*args, **kwargs)

    return wrapped


# ---------------------------------------------------------------------------
# The jaxpr pass.
# ---------------------------------------------------------------------------


def _pure(eqn) -> bool:
  """No effects other than naming a mesh axis (which every collective has)."""
  return all(type(eff).__name__ == "NamedAxisEffect" for eff in eqn.effects)


def _is_var(x) -> bool:
  return not hasattr(x, "val")


def _nbytes(aval) -> int:
  try:
    return int(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)
  except (TypeError, AttributeError):
    return 0


# Operations after which a value counts as computed in the step (an activation).
_COMPUTE = _MATMUL | set(_OPAQUE)
_HEAVY = _COMPUTE | _COLLECTIVES


def parameter_inputs(jaxpr, param_invars) -> dict[int, frozenset]:
  """Which inputs of each shard_map body (by position) carry parameters, program-wide.

  ``param_invars`` are the program's inputs that are parameters (the leaves of the step's
  ``params_argnums`` arguments). A value carries a parameter when it is computed from
  parameters by cheap operations alone (casts, reshapes, slices, elementwise: no matmul,
  collective or loop); a shard_map body's input carries one when the value passed to it
  does. Keyed by ``id`` of the body jaxpr.
  """
  out: dict[int, frozenset] = {}

  def walk(jx, flags: dict) -> list[bool]:
    def is_param(v):
      return _is_var(v) and flags.get(v, False)

    for e in jx.eqns:
      name = e.primitive.name
      if name == "shard_map":
        body = e.params["jaxpr"]
        out[id(body)] = frozenset(k for k, v in enumerate(e.invars) if is_param(v))
        res = [False] * len(e.outvars)
      elif name in ("pjit", "jit") and "jaxpr" in e.params:
        inner = e.params["jaxpr"].jaxpr
        res = walk(inner, {iv: is_param(v) for iv, v in zip(inner.invars, e.invars)})
      elif name in _HEAVY or any(True for _ in _subjaxprs(e)):
        res = [False] * len(e.outvars)
      else:
        vs = [v for v in e.invars if _is_var(v)]
        res = [bool(vs) and all(is_param(v) for v in vs)] * len(e.outvars)
      for v, r in zip(e.outvars, res):
        flags[v] = r
    return [is_param(v) for v in jx.outvars]

  walk(jaxpr, {v: True for v in param_invars})
  return out


def parameter_avals(jaxpr, param_inputs: dict) -> frozenset:
  """(shape, dtype) of the parameter-carrying inputs of every shard_map body (per device)."""
  out: set = set()
  for e in jaxpr.eqns:
    if e.primitive.name == "shard_map":
      body = e.params["jaxpr"]
      for k in param_inputs.get(id(body), ()):
        v = body.invars[k]
        out.add((tuple(getattr(v.aval, "shape", ())), str(getattr(v.aval, "dtype", ""))))
    for sub in _subjaxprs(e):
      out |= parameter_avals(sub, param_inputs)
  return frozenset(out)


def classify_collectives(
    jaxpr, param_inputs: frozenset | None = None, param_avals: frozenset | None = None
) -> dict[int, str]:
  """Each all-gather and reduce-scatter of a shard_map body, by what it moves.

  All-gathers:

  * ``"parameter"``: the input depends only on parameters, without a matmul or a loop on
    the way (other collectives may be: a gathered parameter that feeds another's
    gather). ``param_inputs`` are the positions of the body's inputs that carry
    parameters (:func:`parameter_inputs`); None (not known): every input counts as one;
  * ``"input"``: computed from the body's inputs by cheap operations, but from an input
    that is not a parameter (the batch, gathered along the sequence for sequence
    parallelism);
  * ``"activation"``: the input is computed in the step (a matmul or a loop on its way):
    it sits on the critical path of the layer that produces it.

  Reduce-scatters are ``"gradient"`` when their results leave the body through cheap
  operations only and (given ``param_avals``, :func:`parameter_avals`) have a
  parameter's per-device shape and dtype, else ``"activation"`` (a row-parallel layer's
  partial sums, or an activation's cotangent).
  """
  eqns = list(jaxpr.eqns)
  producer: dict[Any, int] = {}
  for i, e in enumerate(eqns):
    for v in e.outvars:
      producer[v] = i
  invars = [v for v in jaxpr.invars if _is_var(v)]
  index = {v: k for k, v in enumerate(invars)}
  all_in = list(jaxpr.invars)
  if param_inputs is None:
    params = set(invars)
  else:
    params = {all_in[k] for k in param_inputs if k < len(all_in) and _is_var(all_in[k])}
  # Per equation: the body inputs it reads through cheap operations, or None once a heavy
  # operation (matmul, collective, loop) is on the way.
  reads: list[frozenset | None] = []
  for e in eqns:
    acc: set | None = set()
    for v in e.invars:
      if not _is_var(v):
        continue
      if v in producer:
        d = producer[v]
        src = None if eqns[d].primitive.name in _COMPUTE else reads[d]
        if src is None:
          acc = None
          break
        acc |= src
      elif v in index:
        acc.add(v)
    reads.append(None if acc is None else frozenset(acc))
  # Which equations reach an output through cheap operations only.
  users: dict[Any, list[int]] = {}
  for i, e in enumerate(eqns):
    for v in e.invars:
      if _is_var(v):
        users.setdefault(v, []).append(i)
  outs = {v for v in jaxpr.outvars if _is_var(v)}
  to_output = [False] * len(eqns)
  for i in range(len(eqns) - 1, -1, -1):
    for v in eqns[i].outvars:
      if v in outs or any(
        to_output[u] and eqns[u].primitive.name not in _HEAVY for u in users.get(v, ())
      ):
        to_output[i] = True
  out: dict[int, str] = {}
  for i, e in enumerate(eqns):
    if e.primitive.name == _GATHER:
      src = reads[i]
      if src is None:
        out[i] = "activation"
      else:
        out[i] = "parameter" if src and src <= params else "input"
    elif e.primitive.name == _SCATTER:
      shaped = param_avals is None or (
        tuple(e.outvars[0].aval.shape), str(e.outvars[0].aval.dtype)
      ) in param_avals
      out[i] = "gradient" if to_output[i] and shaped else "activation"
  return out


@dataclasses.dataclass
class _BodyPlan:
  order: list[int]
  metadata: dict[int, dict[str, str]]
  actions: list[Action]
  gather_groups: int
  max_group_gather_bytes: int
  max_scatter_bytes: int
  max_gather_bytes: int = 0
  max_scatter_out_bytes: int = 0
  axis_size: int = 1
  chain_prev: dict = dataclasses.field(default_factory=dict)
  # Collective matmuls: eqn index to evaluate -> (kind, gather/dot index skipped, params).
  fused: dict = dataclasses.field(default_factory=dict)
  skipped: frozenset = frozenset()
  # N-D gather -> dot_general rings: gather index -> (input, gather eqn, dots, collect), and
  # each user of the gathered value -> its gather index.
  rings: dict = dataclasses.field(default_factory=dict)
  ring_of: dict = dataclasses.field(default_factory=dict)
  loops: int = 0  # loops over layers whose collectives are left as written
  # lax.scan equations whose collectives are pipelined: eqn index -> scan_pipeline.ScanPlan.
  scans: dict = dataclasses.field(default_factory=dict)


def _plan_body(
    jaxpr, where: str, prefetch: int, reduce_scatter: str, annotate: bool, chain: bool = False,
    collective_matmul: str = "off", target: str | None = None, param_inputs: frozenset | None = None,
    param_avals: frozenset | None = None,
) -> _BodyPlan:
  eqns = list(jaxpr.eqns)
  n = len(eqns)
  producer: dict[Any, int] = {}
  for i, e in enumerate(eqns):
    for v in e.outvars:
      producer[v] = i
  deps = [[producer[v] for v in e.invars if _is_var(v) and v in producer] for e in eqns]
  # Operations that depend only on the body's inputs and have no effects can move freely.
  input_only = [False] * n
  for i, e in enumerate(eqns):
    input_only[i] = _pure(e) and all(input_only[d] for d in deps[i])
  actions: list[Action] = []
  key = [float(i) for i in range(n)]
  metadata: dict[int, dict[str, str]] = {}

  # Collectives in nested loops and custom derivatives stay as written; say so.
  # Their sizes still set the combine thresholds (one loop iteration's gathers
  # are one layer's).
  nested = _NestedStats()
  scans: dict[int, scan_pipeline.ScanPlan] = {}
  kept_loops = 0
  for i, e in enumerate(eqns):
    if e.primitive.name in _OPAQUE and _has_collectives(e):
      _nested_stats(e, nested)
      if e.primitive.name in ("scan", "while"):
        # A loop over layers: pipeline its collectives across iterations where it can.
        sp = scan_pipeline.plan(e, gathers=prefetch > 0, scatters=reduce_scatter == "per_layer")
        loop = f"{where + ', ' if where else ''}lax.scan at equation {i} ({e.params.get('length', '?')} iterations)"
        if sp:
          scans[i] = sp
          if sp.gathers:
            actions.append(Action(
                "prefetch", loop, f"{len(sp.gathers)} all-gather(s) of each iteration's layer "
                "issued one iteration early (the first before the loop), one gathered layer "
                "carried"))
          if sp.scatters:
            actions.append(Action(
                "reduce_scatter", loop, f"{len(sp.scatters)} gradient reduce-scatter(s) issued "
                "one iteration late (the last after the loop), one unscattered gradient "
                "carried"))
        else:
          kept_loops += 1
          why = sp.reason if (prefetch > 0 or reduce_scatter == "per_layer") else (
              "prefetch=0 and reduce_scatter='as_written' keep collectives where written")
          actions.append(Action("left_alone", loop, f"collectives kept as written: {why}"))
        continue
      actions.append(
          Action("left_alone", where, f"collectives inside {e.primitive.name} are left as written "
                 "(for stacked layers under lax.scan use jax_overlap.fsdp.scan_layers)")
      )
  if kept_loops:
    actions.append(
        Action("left_alone", where, f"{kept_loops} loop(s) over layers keep their collectives "
               "as written; their per-iteration sizes set the combine thresholds")
    )

  # 3. Collective matmuls: an activation all-gather feeding a matmul, or a matmul
  # feeding a reduce-scatter, become ppermute rings of partial matmuls where the
  # cost model says they win.
  fused, skipped, rings, ring_of = _plan_collective_matmuls(
      eqns, set(v for v in jaxpr.outvars if _is_var(v)), collective_matmul, target, where, actions
  )

  # 1. Group parameter gathers into layers; activation collectives are on the critical
  # path of the layer that produces them and are not prefetched.
  kinds = classify_collectives(jaxpr, param_inputs, param_avals)
  n_kind = {k: sum(1 for i, v in kinds.items() if v == k and eqns[i].primitive.name == p)
            for k, p in (("parameter", _GATHER), ("input", _GATHER), ("activation", _GATHER))}
  n_rs = {k: sum(1 for v in kinds.values() if v == k) for k in ("gradient",)}
  n_act_rs = sum(1 for i, v in kinds.items() if v == "activation" and eqns[i].primitive.name == _SCATTER)
  if kinds:
    actions.append(
        Action(
            "classify",
            where,
            f"{n_kind['parameter']} parameter all-gather(s) (inputs only parameters: prefetched "
            f"ahead of their layer), {n_kind['input']} all-gather(s) of other inputs (the batch), "
            f"{n_kind['activation']} activation all-gather(s) and "
            f"{n_act_rs} activation reduce-scatter(s) (computed in the step: on the critical path, "
            f"candidates for collective matmuls), {n_rs['gradient']} gradient reduce-scatter(s)",
        )
    )
  groups: list[list[int]] = []
  current: list[int] = []
  for i, e in enumerate(eqns):
    name = e.primitive.name
    if name == _GATHER and kinds.get(i) == "parameter" and input_only[i] and i not in skipped:
      current.append(i)
    elif name in _MATMUL and current:
      groups.append(current)
      current = []
  if current:
    groups.append(current)
  group_bytes = [sum(_nbytes(eqns[i].outvars[0].aval) for i in g) for g in groups]

  def closure(i: int) -> list[int]:
    out, stack = set(), [i]
    while stack:
      j = stack.pop()
      for d in deps[j]:
        if d not in out:
          out.add(d)
          stack.append(d)
    return sorted(out)

  if prefetch > 0 and groups:
    for k, g in enumerate(groups):
      anchor = groups[k - prefetch][-1] if k >= prefetch else -1
      first = min(g)
      if anchor >= first - 1:
        continue  # already issued there
      for r, i in enumerate(g):
        new_key = anchor + 0.5 + r * 1e-6
        for d in closure(i):
          key[d] = min(key[d], new_key - 0.25 + d * 1e-9)
        key[i] = new_key
      label = f"layer {k}" + (f" before layer {k - prefetch}'s compute" if k >= prefetch else " at the start")
      actions.append(
          Action(
              "prefetch",
              where,
              f"{len(g)} all-gather(s) of {label} ({group_bytes[k] / 2**20:.1f} MiB gathered), "
              f"issued {prefetch} layer(s) ahead of first use",
          )
      )

  # 2. Reduce-scatters right after the op producing their input.
  max_scatter = 0
  if reduce_scatter == "per_layer":
    for i, e in enumerate(eqns):
      if e.primitive.name != _SCATTER:
        continue
      max_scatter = max(max_scatter, sum(_nbytes(v.aval) for v in e.invars if _is_var(v)))
      ready = max([key[d] for d in deps[i]], default=-1.0)
      if ready < key[i] - 1.5:
        key[i] = ready + 1e-3
        actions.append(
            Action("reduce_scatter", where, f"reduce-scatter #{i} moved up to just after its producer")
        )

  order = sorted(range(n), key=lambda i: (key[i], i))
  # The order must stay topological; keys were only ever lowered along dependencies.
  pos = {i: p for p, i in enumerate(order)}
  if any(pos[d] > pos[i] for i in range(n) for d in deps[i]):
    order = list(range(n))
    actions = [Action("left_alone", where, "reordering would break a dependency; order kept")]

  # 4. Annotations.
  if annotate:
    group_of = {i: k for k, g in enumerate(groups) for i in g}
    for i, e in enumerate(eqns):
      name = e.primitive.name
      if name in _COLLECTIVES:
        k = group_of.get(i)
        pair = f"g{k}" if k is not None else f"op{i}"
        metadata[i] = {
            "_jax_overlap_pair": pair,
            "_jax_overlap_priority": "high",
            "_jax_overlap_occupancy": "communication",
        }
        if SCHEDULING_GROUPS and k is not None and k >= prefetch > 0:
          metadata[i]["_scheduling_group_id"] = str(k)
    # Matmuls between a prefetched group's issue point and its first use hide it.
    if prefetch > 0:
      for k in range(len(groups)):
        if k < prefetch:
          continue
        lo, hi = groups[k - prefetch][-1], min(groups[k])
        for i in range(lo + 1, hi):
          if eqns[i].primitive.name in _MATMUL:
            metadata[i] = {"_jax_overlap_pair": f"g{k}", "_jax_overlap_occupancy": "shaped"}
            if SCHEDULING_GROUPS:
              metadata[i]["_scheduling_group_id"] = str(k)
    if metadata:
      n_coll = sum(1 for m in metadata.values() if m.get("_jax_overlap_priority"))
      actions.append(
          Action(
              "annotate",
              where,
              f"{n_coll} collective(s) tagged with pair id, priority 'high' and occupancy "
              f"class; {len(metadata) - n_coll} matmul(s) tagged as the compute they hide under",
          )
      )
  # Fine-grained issue: the first layer's gathers, and the reduce-scatters, one
  # after another (an optimization barrier ties each one's input to the previous
  # one's result), so XLA cannot merge them and compute starts on the first
  # tensors while the rest are in flight.
  chain_prev: dict[int, int] = {}
  if chain:
    pos = {i: p for p, i in enumerate(order)}
    if groups:
      # In order of first use: the first matmul each gathered tensor reaches.
      first_use = [float("inf")] * n
      for i in range(n - 1, -1, -1):
        if eqns[i].primitive.name in _MATMUL:
          first_use[i] = i
        for d in deps[i]:
          first_use[d] = min(first_use[d], first_use[i])
      first = sorted(groups[0], key=lambda i: (first_use[i], pos[i]))
      for a_, b_ in zip(first, first[1:]):
        chain_prev[b_] = a_
    if reduce_scatter == "per_layer":
      rs = sorted((i for i, e in enumerate(eqns) if e.primitive.name == _SCATTER), key=lambda i: pos[i])
      for a_, b_ in zip(rs, rs[1:]):
        chain_prev[b_] = a_
    if any(pos[a_] > pos[b_] for b_, a_ in chain_prev.items()):
      reordered = _topological(order, deps, chain_prev)
      if reordered is not None:
        order = reordered
      else:  # a gathered tensor feeds another's gather: keep the links the order allows
        chain_prev = {b_: a_ for b_, a_ in chain_prev.items() if pos[a_] < pos[b_]}
    if chain_prev:
      actions.append(
          Action(
              "reduce_scatter" if not groups else "prefetch",
              where,
              f"{len(chain_prev)} collective(s) issued one by one (first layer's gathers, "
              "reduce-scatters) so that none is merged with the next",
          )
      )
  single_gather = max((_nbytes(eqns[i].outvars[0].aval) for g in groups for i in g), default=0)
  scatter_out = max(
      (_nbytes(e.outvars[0].aval) for e in eqns if e.primitive.name == _SCATTER), default=0
  )
  axis_size = max(
      (int(e.params.get("axis_size", 1)) for e in eqns if e.primitive.name in (_GATHER, _SCATTER)),
      default=1,
  )
  return _BodyPlan(
      order, metadata, actions, len(groups),
      # A loop iteration's gathers are one layer's; top-level groups next to a
      # loop (its prologue) can span several.
      nested.group_gather_bytes if nested.loops else max(group_bytes, default=0),
      max(max_scatter, nested.scatter_bytes),
      max(single_gather, nested.gather_bytes), max(scatter_out, nested.scatter_out_bytes),
      max(axis_size, nested.axis_size), chain_prev, fused, frozenset(skipped),
      rings=rings, ring_of=ring_of, loops=nested.loops, scans=scans,
  )


def _pipeliner_off(options: dict[str, Any]) -> dict[str, Any]:
  """Options that turn off the loop pipeliner ``options`` turn on, in either spelling."""
  off: dict[str, Any] = {}
  for k in _LOOP_PIPELINER:
    if options.get(k) is True:
      off[k] = False
    new = flags_lib.REGISTRY[k].replacement
    if new and options.get(new) not in (None, False, "off"):
      off[new] = "off"
  return off


def _topological(order: list[int], deps: list[list[int]], extra: dict[int, int]) -> list[int] | None:
  """``order`` changed as little as possible so that also ``extra[b]`` comes before ``b``.

  Returns None if the extra links close a cycle with the dependencies.
  """
  rank = {i: p for p, i in enumerate(order)}
  preds = [set(d) for d in deps]
  for b, a in extra.items():
    preds[b].add(a)
  succs: list[list[int]] = [[] for _ in deps]
  for i, ps in enumerate(preds):
    for d in ps:
      succs[d].append(i)
  waiting = [len(ps) for ps in preds]
  ready = [(rank[i], i) for i in range(len(deps)) if not waiting[i]]
  heapq.heapify(ready)
  out = []
  while ready:
    _, i = heapq.heappop(ready)
    out.append(i)
    for j in succs[i]:
      waiting[j] -= 1
      if not waiting[j]:
        heapq.heappush(ready, (rank[j], j))
  return out if len(out) == len(deps) else None


@dataclasses.dataclass
class _NestedStats:
  """Collective sizes inside loops and custom derivatives of a shard_map body."""

  loops: int = 0  # loops whose body has collectives
  group_gather_bytes: int = 0  # largest group of gathers no matmul separates, in one iteration
  gather_bytes: int = 0
  scatter_bytes: int = 0
  scatter_out_bytes: int = 0
  axis_size: int = 1


def _subjaxprs(eqn):
  from jax._src import core

  for p in eqn.params.values():
    for q in p if isinstance(p, (tuple, list)) else (p,):
      sub = q.jaxpr if isinstance(q, core.ClosedJaxpr) else q
      if isinstance(sub, core.Jaxpr):
        yield sub


def _nested_stats(eqn, out: _NestedStats) -> None:
  """Adds the collective sizes found under ``eqn`` (recursively) to ``out``."""
  is_loop = eqn.primitive.name in ("scan", "while")
  for sub in _subjaxprs(eqn):
    group, found = 0, False
    for e in sub.eqns:
      name = e.primitive.name
      if name in (_GATHER, _SCATTER):
        found = True
        out.axis_size = max(out.axis_size, int(e.params.get("axis_size", 1)))
      if name == _GATHER:
        b = _nbytes(e.outvars[0].aval)
        out.gather_bytes = max(out.gather_bytes, b)
        group += b
        out.group_gather_bytes = max(out.group_gather_bytes, group)
      elif name in _MATMUL:
        group = 0
      elif name == _SCATTER:
        out.scatter_bytes = max(out.scatter_bytes, sum(_nbytes(v.aval) for v in e.invars if _is_var(v)))
        out.scatter_out_bytes = max(out.scatter_out_bytes, _nbytes(e.outvars[0].aval))
      _nested_stats(e, out)  # nested loops and calls (nothing found: nothing added)
    if found and is_loop:
      out.loops += 1


def _plan_collective_matmuls(
    eqns, outvars: set, mode: str, target: str | None, where: str, actions: list
):
  """Finds all_gather -> dot and dot -> reduce_scatter pairs worth decomposing."""
  if mode not in ("auto", "on"):
    return {}, set(), {}, {}
  from jax_overlap._src import collective_matmul as cm_lib

  users: dict[Any, list[int]] = {}
  for i, e in enumerate(eqns):
    for v in e.invars:
      if _is_var(v):
        users.setdefault(v, []).append(i)
  fused: dict[int, tuple] = {}
  skipped: set[int] = set()
  rings: dict[int, tuple] = {}
  ring_of: dict[int, int] = {}

  def plain_dot(d):
    dn = d.params.get("dimension_numbers")
    return (
        d.primitive.name == "dot_general"
        and dn == (((1,), (0,)), ((), ()))
        and all(getattr(v.aval, "ndim", 0) == 2 for v in d.invars)
    )

  def worth(m, n, k, p, dtype, kind, bidirectional):
    # The estimate is for the ring that runs: both link directions only when the block
    # splits in two.
    est = cm_lib.estimate_gain(
        m, n, k, p, dtype, target or "h100x8", kind=kind, bidirectional=bidirectional
    )
    if mode == "on" and not est.worthwhile:
      est = dataclasses.replace(est, worthwhile=True)
    return est

  for i, e in enumerate(eqns):
    name = e.primitive.name
    axes = e.params.get("axis_name")
    axis = axes[0] if isinstance(axes, tuple) and len(axes) == 1 else axes
    if not isinstance(axis, str) or e.params.get("axis_index_groups") is not None:
      continue
    kw_extra = {}
    if name == _GATHER and e.params.get("tiled") and not _simple_ag_dot(e, users, outvars, eqns, plain_dot):
      ring = _plan_ring(i, e, eqns, users, outvars)
      if ring is None:
        continue
      dots, collect = ring
      m, n, k = _ring_mnk(e, eqns, dots)
      bidi = e.invars[0].aval.shape[e.params["all_gather_dimension"]] % 2 == 0
      est = worth(m, n, k, int(e.params.get("axis_size", 1)), e.outvars[0].aval.dtype,
                  "all_gather", bidi)
      if not est.worthwhile:
        continue
      rings[i] = (e.invars[0], e, dots, collect, bidi)
      for u in users.get(e.outvars[0], []):
        ring_of[u] = i
      skipped.add(i)
      actions.append(Action(
          "collective_matmul", where,
          f"all-gather of {tuple(e.invars[0].aval.shape)} along dim {e.params['all_gather_dimension']} "
          f"feeding {len(dots)} matmul(s){' (the gathered value is also kept)' if collect else ''} "
          f"decomposed into a {'bidirectional' if bidi else 'unidirectional'} ppermute ring; estimated {est.speedup:.2f}x"))
      continue
    if name == _GATHER and e.params.get("tiled") and e.params.get("all_gather_dimension") == 0:
      out = e.outvars[0]
      us = users.get(out, [])
      if len(us) != 1 or out in outvars:
        continue  # the gathered value is needed elsewhere (e.g. saved for the backward pass)
      d = eqns[us[0]]
      if not plain_dot(d) or d.invars[0] is not out or d.invars[1] is out:
        continue
      (m, k), n = out.aval.shape, d.invars[1].aval.shape[1]
      bidi = e.invars[0].aval.shape[0] % 2 == 0
      est = worth(m, n, k, int(e.params.get("axis_size", 1)), out.aval.dtype, "all_gather", bidi)
      if not est.worthwhile:
        continue
      kw_extra = {"axis": axis, "precision": d.params.get("precision"),
                  "preferred_element_type": d.params.get("preferred_element_type"),
                  "bidirectional": bidi}
      fused[us[0]] = ("all_gather", e.invars[0], d.invars[1], kw_extra)
      skipped.add(i)
      actions.append(Action("collective_matmul", where, f"all-gather -> matmul ({m}x{k} @ {k}x{n}) "
                            f"decomposed into a {'bidirectional' if bidi else 'unidirectional'} ppermute ring; estimated {est.speedup:.2f}x"))
    elif (name == _SCATTER and e.params.get("tiled") and len(e.invars) == 1
          and _is_var(e.invars[0])):
      src = e.invars[0]
      prod = next((j for j in range(i) if src in eqns[j].outvars), None)
      if prod is None or len(users.get(src, [])) != 1 or src in outvars:
        continue
      d = eqns[prod]
      if d.primitive.name != "dot_general":
        continue
      sd = e.params.get("scatter_dimension")
      if not (plain_dot(d) and sd == 0):
        nd = _plan_rs_nd(d, sd, int(e.params.get("axis_size", 1)))
        if nd is None:
          continue
        m, n, k = nd
        bidi = e.outvars[0].aval.shape[sd] % 2 == 0
        est = worth(m, n, k, int(e.params.get("axis_size", 1)), d.invars[0].aval.dtype,
                    "reduce_scatter", bidi)
        if not est.worthwhile:
          continue
        fused[i] = ("reduce_scatter_nd", d.invars[0], d.invars[1], {
            "axis": axis, "scatter_dim": sd, "dimension_numbers": d.params["dimension_numbers"],
            "precision": d.params.get("precision"),
            "preferred_element_type": d.params.get("preferred_element_type"),
            "out_dtype": d.outvars[0].aval.dtype, "bidirectional": bidi})
        skipped.add(prod)
        actions.append(Action("collective_matmul", where, f"matmul {tuple(d.invars[0].aval.shape)} x "
                              f"{tuple(d.invars[1].aval.shape)} -> reduce-scatter along dim {sd} "
                              f"decomposed into a {'bidirectional' if bidi else 'unidirectional'} ppermute ring; estimated {est.speedup:.2f}x"))
        continue
      d = eqns[prod]
      (m, k), n = d.invars[0].aval.shape, d.invars[1].aval.shape[1]
      p = int(e.params.get("axis_size", 1))
      if m % p:
        continue
      bidi = (m // p) % 2 == 0
      est = worth(m, n, k * p, p, d.invars[0].aval.dtype, "reduce_scatter", bidi)
      if not est.worthwhile:
        continue
      kw_extra = {"axis": axis, "precision": d.params.get("precision"),
                  "preferred_element_type": d.params.get("preferred_element_type"),
                  "bidirectional": bidi}
      fused[i] = ("reduce_scatter", d.invars[0], d.invars[1], kw_extra)
      skipped.add(prod)
      actions.append(Action("collective_matmul", where, f"matmul ({m}x{k} @ {k}x{n}) -> "
                            f"reduce-scatter decomposed into a {'bidirectional' if bidi else 'unidirectional'} ppermute ring; estimated {est.speedup:.2f}x"))
  return fused, skipped, rings, ring_of


def _plan_rs_nd(d, sd, p) -> tuple[int, int, int] | None:
  """GEMM-equivalent (m, n, k) of an N-D dot whose output is reduce-scattered along ``sd``,
  or None when ``sd`` is a batch dimension or not divisible by ``p``."""
  (lc, rc), (lb, rb) = d.params["dimension_numbers"]
  if sd is None or sd < len(lb):
    return None
  out = d.outvars[0].aval.shape
  if out[sd] % max(p, 1):
    return None
  lhs, rhs = d.invars[0].aval.shape, d.invars[1].aval.shape
  k = int(math.prod(lhs[a] for a in lc))
  n = int(math.prod(rhs[a] for a in range(len(rhs)) if a not in rc and a not in rb))
  m = int(math.prod(out)) // max(n, 1)
  return m, n, k * p


def _simple_ag_dot(e, users, outvars, eqns, plain_dot) -> bool:
  """The 2-D case ``all_gather_matmul`` (with its custom VJP) handles."""
  if e.params.get("all_gather_dimension") != 0:
    return False
  out = e.outvars[0]
  us = users.get(out, [])
  if len(us) != 1 or out in outvars:
    return False
  d = eqns[us[0]]
  return plain_dot(d) and d.invars[0] is out and d.invars[1] is not out


def _plan_ring(i, e, eqns, users, outvars):
  """The dots an N-D gather feeds along a free dimension: (dots, collect) or None."""
  out = e.outvars[0]
  gd = e.params.get("all_gather_dimension")
  dots, other = [], False
  for u in users.get(out, []):
    d = eqns[u]
    if d.primitive.name != "dot_general" or (d.invars[0] is out) == (d.invars[1] is out):
      other = True
      continue
    lhs = d.invars[0] is out
    (lc, rc), (lb, rb) = d.params["dimension_numbers"]
    xc, xb = (lc, lb) if lhs else (rc, rb)
    if gd in xc or gd in xb:
      other = True  # gathered along a contracted or batch dimension: not a ring of slices
      continue
    dots.append(u)
  if not dots:
    return None
  return tuple(dots), other or out in outvars


def _ring_mnk(e, eqns, dots) -> tuple[int, int, int]:
  """GEMM-equivalent (m, n, k) of the dots a ring replaces, for the cost model."""
  out = e.outvars[0]
  shape = out.aval.shape
  n_total, m, k = 0, 1, 1
  for u in dots:
    d = eqns[u]
    lhs = d.invars[0] is out
    (lc, rc), (lb, rb) = d.params["dimension_numbers"]
    xc = lc if lhs else rc
    w = d.invars[1] if lhs else d.invars[0]
    wc, wb = (rc, rb) if lhs else (lc, lb)
    k = int(math.prod(shape[a] for a in xc))
    m = int(math.prod(shape)) // max(k, 1)
    n_total += int(math.prod(w.aval.shape[a] for a in range(w.aval.ndim) if a not in wc and a not in wb))
  return m, n_total, k


def _eval_eqn(eqn, invals, metadata: dict[str, str] | None):
  """Binds one equation as ``jax.core.eval_jaxpr`` does, optionally under XLA metadata."""
  from jax._src import source_info_util

  bound = eqn.primitive.get_bind_params(eqn.params)
  # jax < 0.7 returns (subfuns, params); newer versions return params.
  if isinstance(bound, tuple) and len(bound) == 2 and isinstance(bound[0], list):
    subfuns, params = bound
  else:
    subfuns, params = [], bound
  ctx = getattr(eqn, "ctx", None)
  manager = getattr(ctx, "manager", None)
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
    with manager if manager is not None else _null():
      if metadata:
        with set_xla_metadata(**metadata):
          out = eqn.primitive.bind(*subfuns, *invals, **params)
      else:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
  return out if eqn.primitive.multiple_results else [out]


class _null:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


def _environment(jaxpr, consts, args):
  """The variable environment of an evaluation, and its reader (literals read as values)."""
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return v.val if not _is_var(v) else env[v]

  return env, read


def _run_ring(ring, env, read) -> bool:
  """Runs an N-D gather -> dots ring; False (and the plain gather) if a weight is not ready."""
  from jax_overlap._src import collective_matmul as cm_lib

  x, gather, dots, collect, bidi = ring
  eqns_w = []
  for d in dots:
    lhs = d.invars[0] is gather.outvars[0]
    w = d.invars[1] if lhs else d.invars[0]
    if _is_var(w) and w not in env:
      env[gather.outvars[0]] = _eval_eqn(gather, [read(x)], None)[0]
      return False
    aval = d.outvars[0].aval
    eqns_w.append((read(w), lhs, d.params["dimension_numbers"], d.params.get("precision"),
                   d.params.get("preferred_element_type"), tuple(aval.shape), aval.dtype))
  axis = gather.params["axis_name"]
  axis = axis[0] if isinstance(axis, tuple) else axis
  outs, full = cm_lib.all_gather_dot_generals(
      read(x), eqns_w, axis=axis, gather_dim=gather.params["all_gather_dimension"], collect=collect,
      bidirectional=bidi,
  )
  for d, o in zip(dots, outs):
    env[d.outvars[0]] = o
  if collect:
    env[gather.outvars[0]] = full
  return True


def _run(jaxpr, consts, args, plan: _BodyPlan | None):
  env, read = _environment(jaxpr, consts, args)
  order = plan.order if plan is not None else range(len(jaxpr.eqns))
  ring_done: dict[int, bool] = {}
  for i in order:
    eqn = jaxpr.eqns[i]
    if plan is not None and i in plan.ring_of:
      g = plan.ring_of[i]
      if g not in ring_done:
        ring, = [plan.rings[g]]
        ring_done[g] = _run_ring((ring[0], ring[1], [jaxpr.eqns[u] for u in ring[2]], ring[3], ring[4]),
                                 env, read)
      if ring_done[g] and i in plan.rings[g][2]:
        continue  # this dot's output came from the ring
    if plan is not None and i in plan.skipped:
      continue  # computed by the collective matmul that replaces it
    if plan is not None and i in plan.fused:
      kind, lhs, rhs, kw = plan.fused[i]
      from jax_overlap._src import collective_matmul as cm_lib

      fn = {"all_gather": cm_lib.all_gather_matmul, "reduce_scatter": cm_lib.matmul_reduce_scatter,
            "reduce_scatter_nd": cm_lib.dot_general_reduce_scatter}[kind]
      env[eqn.outvars[0]] = fn(read(lhs), read(rhs), **kw)
      continue
    if plan is not None and i in plan.scans:
      outs = scan_pipeline.run(eqn, [read(v) for v in eqn.invars], plan.scans[i], _eval_eqn)
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
      continue
    md = plan.metadata.get(i) if plan is not None else None
    invals = [read(v) for v in eqn.invars]
    prev = plan.chain_prev.get(i) if plan is not None else None
    if prev is not None and invals:
      invals[0] = _after(invals[0], read(jaxpr.eqns[prev].outvars[0]))
    outs = _eval_eqn(eqn, invals, md)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass
class _Config:
  prefetch: int
  reduce_scatter: str
  annotate: bool
  collective_matmul: str = "off"
  target: str | None = None
  chain: bool = False  # issue the first layer's gathers and every reduce-scatter one by one
  # id(shard_map body) -> positions of its inputs that carry parameters (parameter_inputs)
  param_inputs: dict | None = None
  param_avals: frozenset | None = None  # parameter_avals


def _evaluate(closed, args, cfg: _Config):
  """Evaluates a top-level jaxpr, rewriting the bodies of its shard_maps."""
  jaxpr = closed.jaxpr
  env, read = _environment(jaxpr, closed.consts, args)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name == "shard_map":
      outs = _run_shard_map(eqn, invals, cfg)
    elif name in ("pjit", "jit") and "jaxpr" in eqn.params:
      outs = _evaluate(eqn.params["jaxpr"], invals, cfg)
      outs = _constrain(outs, eqn.params.get("out_shardings"))
    else:
      outs = _eval_eqn(eqn, invals, None)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _constrain(outs, shardings):
  if not shardings:
    return outs
  res = []
  for o, s in zip(outs, shardings):
    if isinstance(s, jax.sharding.NamedSharding):
      o = jax.lax.with_sharding_constraint(o, s)
    res.append(o)
  return res


def _has_collectives(eqn) -> bool:
  """Whether a sub-jaxpr of ``eqn`` (recursively) holds a collective or a shard_map."""
  return any(
      e.primitive.name in _COLLECTIVES or e.primitive.name == "shard_map" or _has_collectives(e)
      for sub in _subjaxprs(eqn)
      for e in sub.eqns
  )


def _collect(jaxpr, cfg: _Config, actions, stats, counter) -> None:
  """Plans every shard_map body the evaluator will rewrite, in the same order."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "shard_map":
      counter[0] += 1
      _record(_plan_body(eqn.params["jaxpr"], f"shard_map #{counter[0]}", cfg.prefetch,
                         cfg.reduce_scatter, cfg.annotate, cfg.chain, cfg.collective_matmul, cfg.target,
                         _params_of(cfg, eqn), cfg.param_avals), actions, stats)
    elif name in ("pjit", "jit") and "jaxpr" in eqn.params:
      _collect(eqn.params["jaxpr"].jaxpr, cfg, actions, stats, counter)
    elif name in _OPAQUE and _has_collectives(eqn):
      actions.append(
          Action("left_alone", name, "collectives inside a custom derivative or loop are left as "
                 "written (use jax_overlap.fsdp.scan_layers for scanned layers)")
      )


def _params_of(cfg: _Config, eqn) -> frozenset | None:
  if cfg.param_inputs is None:
    return None
  return cfg.param_inputs.get(id(eqn.params["jaxpr"]), frozenset())


def _record(plan: _BodyPlan, actions, stats) -> None:
  actions.extend(plan.actions)
  stats["gather_groups"] = max(stats.get("gather_groups", 0), plan.gather_groups)
  stats["max_group_gather_bytes"] = max(stats.get("max_group_gather_bytes", 0), plan.max_group_gather_bytes)
  stats["max_scatter_bytes"] = max(stats.get("max_scatter_bytes", 0), plan.max_scatter_bytes)
  stats["max_gather_bytes"] = max(stats.get("max_gather_bytes", 0), plan.max_gather_bytes)
  stats["max_scatter_out_bytes"] = max(stats.get("max_scatter_out_bytes", 0), plan.max_scatter_out_bytes)
  stats["axis_size"] = max(stats.get("axis_size", 1), plan.axis_size)
  stats["loops"] = stats.get("loops", 0) + plan.loops


def _run_shard_map(eqn, invals, cfg: _Config):
  params = eqn.params
  body = params["jaxpr"]
  plan = _plan_body(body, "", cfg.prefetch, cfg.reduce_scatter, cfg.annotate, cfg.chain,
                    cfg.collective_matmul, cfg.target, _params_of(cfg, eqn), cfg.param_avals)
  consts = getattr(body, "consts", ())
  inner = body.jaxpr if hasattr(body, "jaxpr") and not hasattr(body, "eqns") else body

  def new_body(*args):
    return tuple(_run(inner, consts, args, plan))

  kwargs = dict(mesh=params["mesh"], in_specs=tuple(params["in_specs"]), out_specs=tuple(params["out_specs"]))
  if "check_vma" in params:
    kwargs["check_vma"] = params["check_vma"]
  manual = params.get("newly_manual_axes", params.get("manual_axes"))
  mesh_axes = set(params["mesh"].axis_names)
  if manual is not None and set(manual) != mesh_axes:
    kwargs["axis_names"] = set(manual)
  out = jax.shard_map(new_body, **kwargs)(*invals)
  return list(out) if isinstance(out, (tuple, list)) else [out]


# ---------------------------------------------------------------------------
# The decorator.
# ---------------------------------------------------------------------------


def _check_args(args, kwargs, mesh) -> None:
  flat = [("args" + jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tuple(args))[0]]
  flat += [("kwargs" + jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(dict(kwargs))[0]]
  for where, leaf in flat:
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, int, float, bool, complex)):
      pass
    elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      pass
    else:
      raise TypeError(
          f"overlap: argument {where} is a {type(leaf).__name__}, not an array; pass arrays "
          "(or jax.ShapeDtypeStruct) and close over other values"
      )
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      m = sharding.mesh
      for dim, entry in enumerate(sharding.spec):
        if entry is None:
          continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        for a in axes:
          if a not in m.axis_names:
            raise ValueError(
                f"overlap: argument {where} is sharded over mesh axis {a!r}, which the mesh "
                f"{dict(m.shape)} does not have"
            )
        size = math.prod(m.shape[a] for a in axes)
        if leaf.shape[dim] % size:
          raise ValueError(
              f"overlap: argument {where} has dimension {dim} of size {leaf.shape[dim]}, not "
              f"divisible by the mesh axes {axes} ({size} devices)"
          )
  if mesh is not None:
    for where, leaf in flat:
      sharding = getattr(leaf, "sharding", None)
      if isinstance(sharding, jax.sharding.NamedSharding):
        missing = [a for a in sharding.mesh.axis_names if a not in mesh.axis_names]
        if missing:
          raise ValueError(
              f"overlap: argument {where} uses mesh axes {missing} that "
              f"mesh= {dict(mesh.shape)} does not have"
          )


def _platform(args, kwargs, mesh) -> str:
  """The platform the step compiles for, read from the arguments' shardings."""
  for x in jax.tree.leaves((args, kwargs)):
    if isinstance(x, jax.core.Tracer):
      # Traced under an outer jit: the abstract mesh still names the platform.
      mesh_ = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
      platform = getattr(getattr(mesh_, "abstract_device", None), "platform", None)
      if platform:
        return str(platform)
      continue
    devices = getattr(getattr(x, "sharding", None), "_device_assignment", None)
    if devices:
      return str(devices[0].platform)
  if mesh is not None and getattr(mesh, "devices", None) is not None and mesh.devices.size:
    return str(mesh.devices.flat[0].platform)
  return jax.default_backend()


def _signature(args, kwargs):
  leaves, tree = jax.tree.flatten((args, kwargs))
  sig = []
  for x in leaves:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      sig.append((tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))))
    else:
      sig.append(("static", repr(x)))
  return tree, tuple(sig)


def _windowed_notes(candidates, reports) -> list[str]:
  """What XLA's windowed einsum decomposed, for each variant that asked for it, against the
  same program compiled as written (the first candidate)."""
  out = []
  for (name, _, options), report in zip(candidates, reports):
    if (report is None or reports[0] is None or name.endswith(_PROFILED_SUFFIX)
        or "xla_gpu_threshold_for_windowed_einsum_mib" not in options):
      continue
    change = gspmd.decomposed(gspmd.found(reports[0]), gspmd.found(report))
    out.append(f"{name}: {change}")
  return out


def _judged(name: str, report) -> list[str]:
  """Notes that judge the chosen variant a second time: the simulator's contention-aware
  estimate beside the analysis's, and a mark where the analysis judged a schedule it
  wrote."""
  if report is None:
    return []
  from jax_overlap._src.sim import realize as realize_lib

  out = []
  try:
    sim_s = realize_lib.realize(report, realize_lib.XLA_POLICY).results[realize_lib.XLA_POLICY]
    out.append(
        f"chosen variant judged twice: the analysis {report.step_time_s * 1e3:.3f} ms, "
        f"sim.realize (SM contention, XLA's stream priority) {sim_s.makespan_s * 1e3:.3f} ms"
    )
  except (ValueError, TypeError, RuntimeError) as e:
    out.append(f"chosen variant not simulated: {str(e).splitlines()[0][:200]}")
  if name.endswith(_PROFILED_SUFFIX):
    out.append(
        "self-judged: the chosen schedule came from a latency profile written by the same cost "
        "model that estimated it"
    )
  return out


class Overlapped:
  """A step function rewritten for overlap; call it like the original.

  Attributes:
    fn: the original function.
  """

  def __init__(self, fn, *, mesh, target, prefetch, reduce_scatter, collective_matmul, annotate,
               xla_options, workload, select, jit_kwargs, schedule_from_estimates=True, cache=True,
               params_argnums=(0,)):
    self.params_argnums = params_argnums
    self.select = select
    self.cache = cache
    self.schedule_from_estimates = schedule_from_estimates
    self.fn = fn
    self.mesh = mesh
    self.target = target
    self.prefetch = prefetch
    self.reduce_scatter = reduce_scatter
    self.collective_matmul = collective_matmul
    self.annotate = annotate
    self.extra_options = dict(xla_options or {})
    self.workload = workload
    self.jit_kwargs = dict(jit_kwargs)
    self._cache: dict = {}
    functools.update_wrapper(self, fn)

  def _param_inputs(self, closed, args, kwargs) -> dict | None:
    """Positions of parameter inputs per shard_map body, from ``params_argnums``."""
    leaves = [len(jax.tree.leaves(a)) for a in args]
    n_all = sum(leaves) + len(jax.tree.leaves(kwargs))
    invars = closed.jaxpr.invars
    if n_all != len(invars):
      return None  # the jaxpr does not take the arguments leaf for leaf: no evidence
    starts = np.cumsum([0, *leaves])
    params = [
      v for i in self.params_argnums if i < len(args) for v in invars[starts[i] : starts[i + 1]]
    ]
    return parameter_inputs(closed.jaxpr, params) if params else None

  def _build(self, args, kwargs):
    _check_args(args, kwargs, self.mesh)
    key = _signature(args, kwargs)
    hit = self._cache.get(key)
    if hit is not None:
      return hit
    base = self.fn if hasattr(self.fn, "trace") else jax.jit(self.fn)
    traced = errors.trace_user_fn(
        "overlap", self.fn, args, kwargs, lambda: base.trace(*args, **kwargs)
    )
    closed, out_info = traced.jaxpr, traced.out_info
    out_tree = jax.tree.structure(out_info)
    annotate = self.annotate
    if annotate == "auto":
      annotate = self.target is not None or _platform(args, kwargs, self.mesh) != "cpu"
    param_inputs = self._param_inputs(closed, args, kwargs)
    cfg = _Config(self.prefetch, self.reduce_scatter, annotate, self.collective_matmul, self.target,
                  param_inputs=param_inputs,
                  param_avals=None if param_inputs is None else parameter_avals(closed.jaxpr, param_inputs))
    actions: list[Action] = []
    stats: dict = {}
    counter = [0]
    # Plan the rewrite from the jaxpr alone (no extra tracing).
    _collect(closed.jaxpr, cfg, actions, stats, counter)
    groups = stats.get("gather_groups", 0)
    if groups and self.prefetch > groups:
      raise ValueError(
          f"overlap: prefetch must be between 0 and the number of layers ({groups}), got {self.prefetch}"
      )
    notes = []
    if counter[0] == 0:
      notes.append(
          "no shard_map in this program: its collectives are inserted by the SPMD partitioner, so "
          "only compiler options apply; the full rewrite (prefetch, per-layer reduce-scatter, "
          "annotations) needs shard_map or jax_overlap.fsdp.scan_layers"
      )
    def make(cfg_: _Config, options_: dict[str, Any]):
      def rewritten(*a, **kw):
        out = _evaluate(closed, jax.tree.leaves((a, kw)), cfg_)
        return jax.tree.unflatten(out_tree, out)

      return rewritten

    known: dict[int, Any] = {}
    if counter[0] == 0 and self.target is not None and self.select == "cost_model":
      candidates = self._gspmd_candidates(cfg, make, args, kwargs, notes, known)
    else:
      candidates = self._candidates(cfg, stats)
    chosen = 0
    estimates: list[tuple[str, float]] = []
    if len(candidates) > 1:
      entry_key = None
      if self.cache:
        entry_key = selection_cache.key(str(closed), key, self._settings(annotate))
      remembered = self._recall(entry_key, candidates) if entry_key else None
      if remembered is not None:
        chosen, estimates, failed, judged = remembered
      else:
        chosen, estimates, failed, reports = self._select(candidates, make, args, kwargs, known)
        judged = _judged(candidates[chosen][0], reports[chosen])
        judged += _windowed_notes(candidates, reports)
        if entry_key:
          self._remember(entry_key, candidates, chosen, estimates, failed, judged)
      table = [
          f"{n} {t * 1e3:.3f} ms" + (" (chosen)" if n == candidates[chosen][0] else "")
          for n, t in estimates
      ]
      notes.append(f"chosen by the cost model on {self.target}: " + "; ".join(table))
      if remembered is not None:
        notes.append("choice remembered from an earlier run with the same program, arguments "
                     "and settings (jax_overlap cache directory; cache=False chooses again)")
      notes.extend(f"variant not compiled: {f}" for f in failed)
      notes.extend(judged)
    name, cfg_c, options = candidates[chosen]
    if cfg_c != cfg:
      actions = [a for a in actions if a.kind == "left_alone"]
      actions.append(Action("left_alone", "program", f"kept as written: {name} estimated faster"))
    for k, v in options.items():
      actions.append(Action("compiler_option", "compile", f"{k}={flags_lib.format_value(v)}"))
    explanation = Explanation(actions, options, notes, estimates, name)
    python_fn = make(cfg_c, options)
    jitted = jax.jit(python_fn, compiler_options=options or None, **self.jit_kwargs)
    entry = (jitted, explanation, python_fn)
    self._cache[key] = entry
    return entry

  def _candidates(self, cfg: _Config, stats: dict) -> list[tuple[str, _Config, dict[str, Any]]]:
    base: dict[str, Any] = {}
    if self.target is not None:
      base.update(flags_lib.as_compiler_options(self.target, self.workload))
    p = max(stats.get("axis_size", 1), 1)
    per_layer = dict(base)
    if stats.get("max_group_gather_bytes"):
      # Large enough for one layer's gathers, too small to merge two layers.
      per_layer["xla_gpu_all_gather_combine_threshold_bytes"] = int(stats["max_group_gather_bytes"])
      if self.reduce_scatter == "per_layer":
        per_layer["xla_gpu_reduce_scatter_combine_threshold_bytes"] = int(
            stats["max_group_gather_bytes"] // p
        )
    per_op = dict(base)
    if stats.get("max_gather_bytes"):
      per_op["xla_gpu_all_gather_combine_threshold_bytes"] = int(stats["max_gather_bytes"])
    if stats.get("max_scatter_out_bytes") and self.reduce_scatter == "per_layer":
      per_op["xla_gpu_reduce_scatter_combine_threshold_bytes"] = int(stats["max_scatter_out_bytes"])
    out = [("rewritten, one layer per collective", cfg, {**per_layer, **self.extra_options})]
    has_collectives = (stats.get("gather_groups", 0) or stats.get("max_scatter_out_bytes", 0)
                       or stats.get("loops", 0))
    if self.target is not None and self.select == "cost_model" and has_collectives:
      out.append(("rewritten, one tensor per collective", cfg, {**per_op, **self.extra_options}))
      out.append(
          ("rewritten, one layer per collective, two collectives in flight", cfg,
           {**per_layer, "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
            **self.extra_options})
      )
      # Merged dots wait for all of their weights: with the first layer's gathers
      # issued one by one, its first matmul should start on the first tensor.
      unmerged = {k: 0 for k in _DOT_MERGER if flags_lib.accepted_by_jaxlib(k, 0)}
      out.append(
          ("rewritten, first layer and reduce-scatters issued one by one"
           + (", XLA's dot merger off" if unmerged else ""),
           dataclasses.replace(cfg, chain=True), {**per_layer, **unmerged, **self.extra_options})
      )
      pipeliner = _pipeliner_off(base)
      if stats.get("loops") and pipeliner:
        # Loops that pipeline their own collectives (scan_layers) gain nothing from
        # XLA's pipeliner, which moves the first gather and the last reduce-scatter
        # out of the loop where nothing hides them.
        out.append(
            ("rewritten, one layer per collective, XLA's loop pipeliner off", cfg,
             {**per_layer, **pipeliner, **self.extra_options})
        )
        out.append(
            ("rewritten, one tensor per collective, XLA's loop pipeliner off", cfg,
             {**per_op, **pipeliner, **self.extra_options})
        )
        out.append(
            ("rewritten, one layer per collective, XLA's loop pipeliner off, two collectives "
             "in flight", cfg,
             {**per_layer, **pipeliner, "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
              **self.extra_options})
        )
      out.append(
          ("as written, recommended flags", _Config(0, "as_written", cfg.annotate, "off", cfg.target, param_inputs=cfg.param_inputs, param_avals=cfg.param_avals),
           {**base, **self.extra_options})
      )
    return out

  def _settings(self, annotate: bool) -> dict[str, Any]:
    return {
        "target": self.target, "workload": self.workload, "prefetch": self.prefetch,
        "params_argnums": list(self.params_argnums),
        "reduce_scatter": self.reduce_scatter, "collective_matmul": self.collective_matmul,
        "annotate": annotate, "select": self.select,
        "schedule_from_estimates": self.schedule_from_estimates,
        "xla_options": self.extra_options, "jit_kwargs": sorted(self.jit_kwargs),
    }

  def _recall(self, entry_key: str, candidates) -> tuple[int, list[tuple[str, float]], list[str]] | None:
    """The remembered choice, added to ``candidates``; None if there is none to use."""
    entry = selection_cache.load(entry_key)
    if entry is None:
      return None
    names = [c[0] for c in candidates]
    if entry["base"] not in names:
      return None
    options = entry["options"]
    profile = options.get(latency_profile.OPTION)
    if profile is not None and not os.path.exists(str(profile)):
      return None  # the profile file it was scheduled with is gone
    cfg = candidates[names.index(entry["base"])][1]
    if entry["chosen"] in names:
      chosen = names.index(entry["chosen"])
      candidates[chosen] = (entry["chosen"], cfg, options)
    else:
      candidates.append((entry["chosen"], cfg, options))
      chosen = len(candidates) - 1
    try:
      estimates = [(str(n), float(t)) for n, t in entry["estimates"]]
    except (TypeError, ValueError):
      return None
    judged = [str(j) for j in entry.get("judged", [])]
    return chosen, estimates, [str(f) for f in entry["failed"]], judged

  def _remember(self, entry_key: str, candidates, chosen: int, estimates, failed, judged=()) -> None:
    name, _, options = candidates[chosen]
    base = name[: -len(_PROFILED_SUFFIX)] if name.endswith(_PROFILED_SUFFIX) else name
    selection_cache.store(entry_key, {
        "chosen": name, "base": base, "options": options,
        "estimates": [[n, t] for n, t in estimates], "failed": failed, "judged": list(judged),
    })

  def _select(self, candidates, make, args, kwargs, known=None):
    """Index of the fastest candidate (profiled ones appended), all estimates, failures and
    the reports (None where a variant did not compile); ``known``: reports already made,
    by candidate index."""
    from jax_overlap._src import analysis

    times, reports, failed = [], [], []
    for i, (name, cfg_c, options) in enumerate(candidates):
      if known and i in known:
        times.append(known[i].step_time_s)
        reports.append(known[i])
        continue
      try:
        report = analysis.analyze(
            make(cfg_c, options), *args, target=self.target, name=name, xla_options=options, **kwargs
        )
        times.append(report.step_time_s)
        reports.append(report)
      except (ValueError, RuntimeError, TypeError) as e:
        if name == candidates[-1][0] and all(t == float("inf") for t in times):
          raise
        failed.append(f"{name}: {str(e).splitlines()[0][:200]}")
        times.append(float("inf"))
        reports.append(None)
    # The fastest few again, scheduled by XLA from the analysis' own costs (a
    # latency profile) instead of XLA's estimates, unless the user gave a profile.
    # A schedule can at best hide all of a variant's exposed communication, so one
    # whose compute alone takes longer than the best step so far is not tried.
    finite = [i for i in range(len(times)) if times[i] < float("inf")]
    if self.schedule_from_estimates and latency_profile.OPTION not in self.extra_options:
      for i in sorted(finite, key=lambda i: (times[i], i))[:_PROFILED_VARIANTS]:
        if reports[i].compute_time_s >= min(times):
          continue
        name, cfg_c, options = candidates[i]
        label = name + _PROFILED_SUFFIX
        try:
          profiled = {**options, latency_profile.OPTION: latency_profile.write_profile(reports[i])}
          report = analysis.analyze(
              make(cfg_c, profiled), *args, target=self.target, name=label, xla_options=profiled,
              **kwargs,
          )
        except (ValueError, RuntimeError, TypeError, OSError) as e:
          failed.append(f"{label}: {str(e).splitlines()[0][:200]}")
          continue
        candidates.append((label, cfg_c, profiled))
        times.append(report.step_time_s)
        reports.append(report)
    best = min(range(len(times)), key=lambda i: (times[i], i))
    return best, [(c[0], t) for c, t in zip(candidates, times)], failed, reports

  def _gspmd_candidates(self, cfg, make, args, kwargs, notes, known):
    """Option variants for a program without shard_map, built for the collectives the
    partitioner inserted (read from the step compiled as written for the target)."""
    from jax_overlap._src import analysis

    as_written = _Config(0, "as_written", cfg.annotate, "off", cfg.target,
                         param_inputs=cfg.param_inputs, param_avals=cfg.param_avals)
    base = {**flags_lib.as_compiler_options(self.target, self.workload), **self.extra_options}
    name = "as written, recommended flags"
    report = analysis.analyze(make(as_written, base), *args, target=self.target, name=name,
                              xla_options=base, **kwargs)
    found = gspmd.found(report)
    notes[-1] = (
        f"no shard_map in this program: the SPMD partitioner inserts its collectives; compiled "
        f"for {self.target} they are {found.summary()}. The variants below are compiler options "
        "for those collectives; the full rewrite (prefetch, per-layer reduce-scatter, "
        "annotations) needs shard_map or jax_overlap.fsdp.scan_layers"
    )
    known[0] = report
    return [(n, as_written, {**opts, **self.extra_options})
            for n, opts in gspmd.variants(found, base)]

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
    reduce_scatter: str = "per_layer",
    collective_matmul: str = "auto",
    annotate: bool | str = "auto",
    xla_options: dict[str, Any] | None = None,
    workload: str = "fsdp",
    select: str = "cost_model",
    schedule_from_estimates: bool = True,
    cache: bool = True,
    params_argnums: int | tuple[int, ...] = 0,
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
      matmul (and a matmul feeding a reduce-scatter) into a ppermute ring of
      partial matmuls (``jax_overlap.collective_matmul``) where the cost model
      for ``target`` (default h100x8) predicts a gain; "on" wherever the
      pattern matches; "off" never.
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
    schedule_from_estimates: with ``select="cost_model"``, also compile the three
      fastest variants (those whose compute alone is shorter than the best step
      so far) with a latency profile written from their analysis
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
    **jit_kwargs: passed to ``jax.jit`` (e.g. ``donate_argnums``).

  Returns:
    An :class:`Overlapped` callable with the same signature and outputs.

  Raises:
    ValueError: for a negative prefetch, an unknown mode or target.

  Example:
    >>> @overlap(target="h100x8")  # doctest: +SKIP
    ... def train_step(params, batch): ...
  """
  if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
    raise ValueError(f"overlap: prefetch must be a non-negative integer, got {prefetch!r}")
  if reduce_scatter not in ("per_layer", "as_written"):
    raise ValueError(f"overlap: reduce_scatter must be 'per_layer' or 'as_written', got {reduce_scatter!r}")
  if select not in ("cost_model", "rewrite"):
    raise ValueError(f"overlap: select must be 'cost_model' or 'rewrite', got {select!r}")
  if collective_matmul not in ("auto", "on", "off"):
    raise ValueError(
        f"overlap: collective_matmul must be 'auto', 'on' or 'off', got {collective_matmul!r}"
    )
  if target is not None:
    targets_lib.get(target)
  flags_lib.check_workload(workload)
  if "compiler_options" in jit_kwargs:
    raise ValueError("overlap: pass XLA options as xla_options=, not compiler_options=")
  if not isinstance(cache, bool):
    raise TypeError(f"overlap: cache must be True or False, got {cache!r}")
  if not isinstance(schedule_from_estimates, bool):
    raise TypeError(
        f"overlap: schedule_from_estimates must be True or False, got {schedule_from_estimates!r}"
    )
  if annotate not in (True, False, "auto"):
    raise ValueError(f"overlap: annotate must be True, False or 'auto', got {annotate!r}")
  argnums = (params_argnums,) if isinstance(params_argnums, int) else params_argnums
  if (
    not isinstance(argnums, tuple)
    or not argnums
    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in argnums)
  ):
    raise ValueError(
        "overlap: params_argnums must be a non-negative int or a non-empty tuple of them, got "
        f"{params_argnums!r}"
    )

  def wrap(f):
    if not callable(f):
      raise TypeError(f"overlap: expected a function, got {type(f).__name__}")
    return Overlapped(
        f, mesh=mesh, target=target, prefetch=prefetch, reduce_scatter=reduce_scatter,
        collective_matmul=collective_matmul, annotate=annotate, xla_options=xla_options,
        workload=workload, select=select, jit_kwargs=jit_kwargs,
        schedule_from_estimates=schedule_from_estimates, cache=cache, params_argnums=argnums,
    )

  return wrap if fn is None else wrap(fn)
