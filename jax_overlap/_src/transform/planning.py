"""Reading the jaxpr: which collectives are which, and the plan for each ``shard_map`` body
(prefetch groups, reduce-scatter placement, collective matmul rings, pipelined loops, loop
bodies planned on their own).

(Over 500 lines: ``plan_body`` is one walk over a body's equations that decides every
collective of it in order, each decision reading the ones before it.)"""

from __future__ import annotations

import dataclasses
import heapq

from jax_overlap._src.transform import (
  batch_parts,
  embedding,
  first_pieces,
  matmul_sites,
  scan_pipeline,
  weight_gradients,
)
from jax_overlap._src.transform import prefetch as prefetch_lib
from jax_overlap._src.transform.explain import Action
from jax_overlap._src.transform.jaxprs import (
  COLLECTIVES,
  COMPUTE,
  GATHER,
  HEAVY,
  MATMUL,
  OPAQUE,
  SCATTER,
  ancestors_of,
  contains_collectives,
  is_pure,
  is_var,
  nbytes,
  producers,
  subjaxprs,
  var_users,
)
from jax_overlap._src.transform.matmul_sites import plan_collective_matmuls


def parameter_inputs(jaxpr, param_invars) -> dict[int, frozenset]:
  """Which inputs of each shard_map body and of each ``lax.scan`` body in one (by position)
  carry parameters, program-wide.

  ``param_invars`` are the program's inputs that are parameters (the leaves of the step's
  ``params_argnums`` arguments). A value carries a parameter when it is computed from
  parameters by cheap operations alone (casts, reshapes, slices, elementwise: no matmul,
  collective or loop); a shard_map body's input carries one when the value passed to it
  does (for a scan: the stacked value its slice comes from). Keyed by ``id`` of the body
  jaxpr (a scan's: of its open jaxpr).
  """
  out: dict[int, frozenset] = {}

  def walk(jx, flags: dict) -> list[bool]:
    def is_param(v):
      return is_var(v) and flags.get(v, False)

    for e in jx.eqns:
      name = e.primitive.name
      if name == "shard_map":
        body = e.params["jaxpr"]
        out[id(body)] = frozenset(k for k, v in enumerate(e.invars) if is_param(v))
        (inner,) = subjaxprs(e)
        walk(inner, {iv: k in out[id(body)] for k, iv in enumerate(inner.invars)})
        res = [False] * len(e.outvars)
      elif name == "scan":  # a loop over layers: its body's slices of stacked parameters
        body = e.params["jaxpr"].jaxpr
        out[id(body)] = frozenset(k for k, v in enumerate(e.invars) if is_param(v))
        walk(body, {iv: k in out[id(body)] for k, iv in enumerate(body.invars)})
        res = [False] * len(e.outvars)
      elif name in ("pjit", "jit") and "jaxpr" in e.params:
        inner = e.params["jaxpr"].jaxpr
        res = walk(inner, {iv: is_param(v) for iv, v in zip(inner.invars, e.invars)})
      elif name in HEAVY or any(True for _ in subjaxprs(e)):
        res = [False] * len(e.outvars)
      else:
        vs = [v for v in e.invars if is_var(v)]
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
    for sub in subjaxprs(e):
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
  producer = producers(eqns)
  invars = [v for v in jaxpr.invars if is_var(v)]
  index = {v: k for k, v in enumerate(invars)}
  all_in = list(jaxpr.invars)
  if param_inputs is None:
    params = set(invars)
  else:
    params = {all_in[k] for k in param_inputs if k < len(all_in) and is_var(all_in[k])}
  # Per equation: the body inputs it reads through cheap operations, or None once a heavy
  # operation (matmul, collective, loop) is on the way.
  reads: list[frozenset | None] = []
  for e in eqns:
    acc: set | None = set()
    for v in e.invars:
      if not is_var(v):
        continue
      if v in producer:
        d = producer[v]
        src = None if eqns[d].primitive.name in COMPUTE else reads[d]
        if src is None:
          acc = None
          break
        acc |= src
      elif v in index:
        acc.add(v)
    reads.append(None if acc is None else frozenset(acc))
  # Which equations reach an output through cheap operations only.
  users = var_users(eqns)
  outs = {v for v in jaxpr.outvars if is_var(v)}
  to_output = [False] * len(eqns)
  for i in range(len(eqns) - 1, -1, -1):
    for v in eqns[i].outvars:
      if v in outs or any(
        to_output[u] and eqns[u].primitive.name not in HEAVY for u in users.get(v, ())
      ):
        to_output[i] = True
  out: dict[int, str] = {}
  for i, e in enumerate(eqns):
    if e.primitive.name == GATHER:
      src = reads[i]
      if src is None:
        out[i] = "activation"
      else:
        out[i] = "parameter" if src and src <= params else "input"
    elif e.primitive.name == SCATTER:
      shaped = (
        param_avals is None
        or (tuple(e.outvars[0].aval.shape), str(e.outvars[0].aval.dtype)) in param_avals
      )
      out[i] = "gradient" if to_output[i] and shaped else "activation"
  return out


@dataclasses.dataclass
class BodyPlan:
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
  # each user of a gathered value -> the gather indices it reads (a dot may read two).
  rings: dict = dataclasses.field(default_factory=dict)
  ring_of: dict = dataclasses.field(default_factory=dict)
  loops: int = 0  # loops over layers whose collectives are left as written
  # lax.scan equations whose collectives are pipelined: eqn index -> scan_pipeline.ScanPlan.
  scans: dict = dataclasses.field(default_factory=dict)
  # Activation all-gather index -> the weight-gradient dots its users wait for.
  wgrad_before: dict = dataclasses.field(default_factory=dict)
  # Reduce-scatter in pieces -> the rings whose kept gathered value is put in order while
  # its last reduce-scatter travels (kept_assembly_sites).
  assemble_beside: dict = dataclasses.field(default_factory=dict)
  # lax.scan equations whose body runs with a plan of its own: eqn index -> BodyPlan.
  loop_bodies: dict = dataclasses.field(default_factory=dict)
  # A loop with collectives -> the gradient reduce-scatters computed before it that finish
  # before it starts (tied to its inputs) instead of waiting for it.
  scatters_before_loop: dict = dataclasses.field(default_factory=dict)
  # Parameter gather -> the equation it is issued after (prefetch by time); a pipelined loop
  # -> the equation its first gathers are issued after.
  issue_after: dict = dataclasses.field(default_factory=dict)
  prologue_after: dict = dataclasses.field(default_factory=dict)
  # The equations gathers are tied after are read through the tie's barrier by their later
  # readers (ties.tied_through), so that XLA keeps every tie: under a memory cap.
  ties_read_through: bool = False
  # lax.scan equations whose body runs in parts of its batch: eqn index -> (each body
  # input's split dimension (batch_parts.split_dims), the parts); and for every loop that
  # can, the most parts (2 or 4) its batch divides into.
  batch_parts: dict = dataclasses.field(default_factory=dict)
  splittable: dict = dataclasses.field(default_factory=dict)
  # Row lookups and their gradients' scatter-adds run without the table's collectives:
  # call eqn -> embedding.Lookup / embedding.RowScatter.
  lookups: dict = dataclasses.field(default_factory=dict)
  row_scatters: dict = dataclasses.field(default_factory=dict)
  # The step's first gathers in pieces (first_pieces.py): gather -> first_pieces.Pieces, and
  # the matmul first reading each -> that gather.
  first_pieces: dict = dataclasses.field(default_factory=dict)
  piece_dots: dict = dataclasses.field(default_factory=dict)
  # The other gathers issued at the start -> the first gather whose last piece they follow.
  after_pieces: dict = dataclasses.field(default_factory=dict)
  reverse: bool = False  # this is a loop body, of a reversed scan (a backward pass's)


def plan_body(
  jaxpr,
  where: str,
  prefetch: int,
  reduce_scatter: str,
  annotate: bool,
  chain: bool = False,
  collective_matmul: str = "off",
  target: str | None = None,
  param_inputs: frozenset | None = None,
  param_avals: frozenset | None = None,
  defer_weight_gradients: bool = True,
  nested_params: dict | None = None,
  exclude: frozenset = frozenset(),
  loops: str = "all",
  in_loop: bool = False,
  lookups: bool = False,
  prefetch_memory: int | None = None,
  batch_split: int = 1,
) -> BodyPlan:
  """The plan of one body (a shard_map's, or a loop's inside one). ``nested_params``:
  :func:`parameter_inputs` for the loops inside it; ``exclude``: collectives another plan
  moves out of this body (a pipelined loop's), left alone here; ``loops``: which loops
  inside get plans of their own (:func:`_loop_body_plan`); ``in_loop``: this is one;
  ``lookups``: row lookups of a table sharded by rows may run without gathering it
  (embedding.py); ``prefetch_memory``: the most bytes of parameters gathered ahead of their
  first use (prefetch.py), None: no cap; ``batch_split``: loops whose activation collectives
  run along a dimension other than the batch run in this many parts of it (batch_parts.py)
  in place of plans of their own, where it divides the batch (1: none)."""
  eqns = list(jaxpr.eqns)
  n = len(eqns)
  producer = producers(eqns)
  deps = [[producer[v] for v in e.invars if is_var(v) and v in producer] for e in eqns]
  # Operations that depend only on the body's inputs and have no effects can move freely.
  input_only = [False] * n
  for i, e in enumerate(eqns):
    input_only[i] = is_pure(e) and all(input_only[d] for d in deps[i])
  actions: list[Action] = []
  key = [float(i) for i in range(n)]
  metadata: dict[int, dict[str, str]] = {}

  # Collectives in nested loops and custom derivatives stay as written; say so.
  # Their sizes still set the combine thresholds (one loop iteration's gathers
  # are one layer's).
  nested = _NestedStats()
  scans: dict[int, scan_pipeline.ScanPlan] = {}
  loop_bodies: dict[int, BodyPlan] = {}
  split: dict[int, tuple] = {}  # batch_parts.py
  splittable: dict[int, int] = {}
  kept_loops = 0
  for i, e in enumerate(eqns):
    if e.primitive.name in OPAQUE and contains_collectives(e):
      _nested_stats(e, nested)
      if e.primitive.name in ("scan", "while"):
        # A loop over layers: pipeline its collectives across iterations where it can.
        loop = f"{where + ', ' if where else ''}lax.scan at equation {i} ({e.params.get('length', '?')} iterations)"
        sp = scan_pipeline.plan(e, gathers=prefetch > 0, scatters=reduce_scatter == "per_layer")
        fits = {} if sp else {n: batch_parts.split_dims(e, n) for n in (2, 4)}
        fits = {n: dims for n, dims in fits.items() if dims is not None}
        if fits:
          splittable[i] = max(fits)
        if batch_split in fits:
          split[i] = (fits[batch_split], batch_split)
          actions.append(
            Action(
              "batch_parts",
              loop,
              f"each iteration in {batch_split} parts of its batch "
              f"({sum(d is not None for d in fits[batch_split])} of its inputs split): one "
              "part's activation collectives beside another part's compute, each collective "
              "issued after the one of its kind before it",
            )
          )
          continue
        # What one iteration can do on its own, around what the pipeline moves.
        inner = _loop_body_plan(
          e,
          sp,
          loop,
          loops,
          annotate,
          collective_matmul,
          target,
          param_avals,
          defer_weight_gradients,
          nested_params,
        )
        if inner is not None:
          loop_bodies[i] = inner
          actions.extend(inner.actions)
        if sp:
          length = int(e.params.get("length", 1))
          depth = max(1, min(prefetch, length - 1))
          sp = dataclasses.replace(sp, depth=depth, peel=length - 2 > depth)
          scans[i] = sp
          layers = "layer" if depth == 1 else f"{depth} layers"
          if sp.peel:  # scan_pipeline.run: the first and last iterations outside the loop
            early = (
              f"{'one iteration' if depth == 1 else f'{depth} iterations'} early; the first "
              "iteration runs before the loop with its gathers where it uses them, the next "
              f"{layers} gathered beside it"
            )
            late = (
              "one iteration late; the last iteration runs after the loop with its "
              "reduce-scatters where it computes them, the one before scattered beside it"
            )
          else:
            early = (
              f"{'one iteration' if depth == 1 else f'{depth} iterations'} early (the first "
              f"{layers} before the loop)"
            )
            late = "one iteration late (the last after the loop)"
          if sp.gathers:
            actions.append(
              Action(
                "prefetch",
                loop,
                f"{len(sp.gathers)} all-gather(s) of each iteration's layer issued {early}, "
                f"{'one gathered layer' if depth == 1 else f'{depth} gathered layers'} carried",
              )
            )
          if sp.scatters:
            actions.append(
              Action(
                "reduce_scatter",
                loop,
                f"{len(sp.scatters)} gradient reduce-scatter(s) issued {late}, one "
                "unscattered gradient carried",
              )
            )
        elif inner is None:
          kept_loops += 1
          why = (
            sp.reason
            if (prefetch > 0 or reduce_scatter == "per_layer")
            else ("prefetch=0 and reduce_scatter='as_written' keep collectives where written")
          )
          actions.append(Action("left_alone", loop, f"collectives kept as written: {why}"))
        continue
      actions.append(
        Action(
          "left_alone",
          where,
          f"collectives inside {e.primitive.name} are left as written "
          "(for stacked layers under lax.scan use jax_overlap.fsdp.scan_layers)",
        )
      )
  if kept_loops:
    actions.append(
      Action(
        "left_alone",
        where,
        f"{kept_loops} lax.scan loop(s) keep their collectives "
        "as written; their per-iteration sizes set the combine thresholds",
      )
    )

  # 3. Collective matmuls: an activation all-gather feeding a matmul, or a matmul
  # feeding a reduce-scatter, become ppermute rings of partial matmuls where the
  # cost model says they win.
  body_outputs = set(v for v in jaxpr.outvars if is_var(v))
  fused, skipped, rings, ring_of = plan_collective_matmuls(
    eqns,
    body_outputs,
    collective_matmul,
    target,
    where,
    actions,
    exclude,
  )

  # 1. Group parameter gathers into layers; activation collectives are on the critical
  # path of the layer that produces them and are not prefetched.
  kinds = classify_collectives(jaxpr, param_inputs, param_avals)
  n_kind = {
    k: sum(1 for i, v in kinds.items() if v == k and eqns[i].primitive.name == p)
    for k, p in (("parameter", GATHER), ("input", GATHER), ("activation", GATHER))
  }
  n_rs = {k: sum(1 for v in kinds.values() if v == k) for k in ("gradient",)}
  n_act_rs = sum(
    1 for i, v in kinds.items() if v == "activation" and eqns[i].primitive.name == SCATTER
  )
  if kinds:
    actions.append(
      Action(
        "classify",
        where,
        f"{n_kind['parameter']} parameter all-gather(s) (inputs only parameters: issued "
        f"ahead of their first use), {n_kind['input']} all-gather(s) of other inputs "
        f"({'a loop carries or saves' if in_loop else 'the batch'}), "
        f"{n_kind['activation']} activation all-gather(s) and "
        f"{n_act_rs} activation reduce-scatter(s) (computed in the step: on the critical path, "
        f"candidates for collective matmuls), {n_rs['gradient']} gradient reduce-scatter(s)",
      )
    )
  users = var_users(eqns)
  # Row lookups of a table sharded by rows, without gathering the table (embedding.py).
  lookups, row_scatters, emb_actions = (
    embedding.plan(eqns, users, kinds, target, where) if lookups else ({}, {}, [])
  )
  actions.extend(emb_actions)
  skipped = set(skipped) | {lk.table for lk in lookups.values()}
  skipped |= {rs.scatter for rs in row_scatters.values()}
  groups: list[list[int]] = []
  current: list[int] = []
  for i, e in enumerate(eqns):
    name = e.primitive.name
    if name == GATHER and kinds.get(i) == "parameter" and input_only[i] and i not in skipped:
      current.append(i)
    elif name in MATMUL and current:
      groups.append(current)
      current = []
  if current:
    groups.append(current)
  group_bytes = [sum(nbytes(eqns[i].outvars[0].aval) for i in g) for g in groups]

  def closure(i: int) -> list[int]:
    return sorted(ancestors_of(deps, i))

  # Each parameter gather (and each pipelined loop's first gathers) issued by the cost
  # model's time, so that it arrives when first used (prefetch.py).
  issues = _issues(eqns, users, groups, scans, target, prefetch_memory) if prefetch > 0 else []
  issue_after: dict[int, int] = {}
  prologue_after: dict[int, int] = {}
  # Each is placed there in the program; ``chain`` also ties it there (its input after that
  # equation's output), so that XLA cannot issue it earlier, and so does a memory cap in
  # every variant (XLA's scheduler issues untied gathers early and would hold more).
  tie = chain or prefetch_memory is not None
  for it in issues:
    if it.eqn in scans:
      if it.after is not None and tie:
        prologue_after[it.eqn] = it.after
    else:
      new_key = (it.after if it.after is not None else -1) + 0.5 + it.eqn * 1e-6
      # Later than written only where tied there (the memory cap may delay it).
      if new_key < key[it.eqn] or (tie and it.after is not None):
        for d in closure(it.eqn):
          key[d] = min(key[d], new_key - 0.25 + d * 1e-9)
        key[it.eqn] = new_key
      if it.after is not None and tie:
        issue_after[it.eqn] = it.after
  if issues:
    actions.extend(_issue_actions(issues, scans, where, tie, prefetch_memory))
  # The first gathers in pieces, where the first matmul can start on part of its weight.
  pieces: dict = {}
  if issues:
    from jax_overlap._src import targets as targets_lib

    pieces, piece_actions = first_pieces.plan(
      eqns,
      users,
      [it for it in issues if it.eqn not in scans],
      targets_lib.get(target or "h100x8"),
      where,
      jaxpr.outvars,
      frozenset(ring_of) | frozenset(fused),
    )
    for g in pieces:  # evaluated first of the gathers at the start: the others follow it
      for d in closure(g):
        key[d] = min(key[d], -0.95 + d * 1e-9)
      key[g] = min(key[g], -0.9)
    actions.extend(piece_actions)

  # 2. Reduce-scatters right after the op producing their input.
  max_scatter = 0
  if reduce_scatter == "per_layer":
    for i, e in enumerate(eqns):
      if e.primitive.name != SCATTER:
        continue
      max_scatter = max(max_scatter, sum(nbytes(v.aval) for v in e.invars if is_var(v)))
      ready = max([key[d] for d in deps[i]], default=-1.0)
      if ready < key[i] - 1.5:
        key[i] = ready + 1e-3
        actions.append(
          Action(
            "reduce_scatter", where, f"reduce-scatter #{i} moved up to just after its producer"
          )
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
      if name in COLLECTIVES:
        k = group_of.get(i)
        pair = f"g{k}" if k is not None else f"op{i}"
        metadata[i] = {
          "_jax_overlap_pair": pair,
          "_jax_overlap_priority": "high",
          "_jax_overlap_occupancy": "communication",
        }
    # Matmuls between a prefetched group's issue point and its first use hide it.
    if prefetch > 0:
      for k in range(len(groups)):
        if k < prefetch:
          continue
        lo, hi = groups[k - prefetch][-1], min(groups[k])
        for i in range(lo + 1, hi):
          if eqns[i].primitive.name in MATMUL:
            metadata[i] = {"_jax_overlap_pair": f"g{k}", "_jax_overlap_occupancy": "shaped"}
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
  # Fine-grained issue: the gathers issued at the start, and the reduce-scatters, one
  # after another (an optimization barrier ties each one's input to the previous
  # one's result), so XLA cannot merge them and compute starts on the first
  # tensors while the rest are in flight.
  chain_prev: dict[int, int] = {}
  if chain:
    pos = {i: p for p, i in enumerate(order)}
    # The gathers issued at the start (nothing to hide them), in order of first use: the
    # first matmul starts when its own weight arrives. Without prefetch: the first group.
    at_start = [it.eqn for it in issues if it.after is None and it.eqn not in scans]
    if not issues and groups:
      at_start = sorted(groups[0], key=lambda i: pos[i])
    if at_start:
      # In order of first use: the first matmul each gathered tensor reaches.
      first_use = [float("inf")] * n
      for i in range(n - 1, -1, -1):
        if eqns[i].primitive.name in MATMUL:
          first_use[i] = i
        for d in deps[i]:
          first_use[d] = min(first_use[d], first_use[i])
      first = sorted(at_start, key=lambda i: (first_use[i], pos[i]))
      for a_, b_ in zip(first, first[1:]):
        chain_prev[b_] = a_
    if reduce_scatter == "per_layer":
      rs = sorted(
        (i for i, e in enumerate(eqns) if e.primitive.name == SCATTER), key=lambda i: pos[i]
      )
      for a_, b_ in zip(rs, rs[1:]):
        chain_prev[b_] = a_
    if any(pos[a_] > pos[b_] for b_, a_ in chain_prev.items()):
      reordered = topological(order, deps, chain_prev)
      if reordered is not None:
        order = reordered
      else:  # a gathered tensor feeds another's gather: keep the links the order allows
        chain_prev = {b_: a_ for b_, a_ in chain_prev.items() if pos[a_] < pos[b_]}
    if chain_prev:
      actions.append(
        Action(
          "reduce_scatter" if not groups else "prefetch",
          where,
          f"{len(chain_prev)} collective(s) issued one by one (the gathers issued at the "
          "start, reduce-scatters) so that none is merged with the next",
        )
      )
  # 5. Weight gradients of the backward pass wait for the next activation all-gather's
  # input, and its users wait for them: they run while it travels.
  deferred = (
    weight_gradients.plan(
      eqns, deps, kinds, order, skip=(skipped - set(rings)) | exclude, pinned=set(chain_prev)
    )
    if defer_weight_gradients
    else {}
  )
  if deferred:
    readers = users
    extra: dict[int, set[int]] = {}
    for w, (p, g) in deferred.items():
      extra.setdefault(w, set()).add(p)
      for u in readers.get(eqns[g].outvars[0], []):
        extra.setdefault(u, set()).add(w)
    for b, a in chain_prev.items():
      extra.setdefault(b, set()).add(a)
    reordered = topological(order, deps, extra)
    if reordered is None:
      deferred = {}
    else:
      order = reordered
      chain_prev = {**chain_prev, **{w: p for w, (p, _) in deferred.items()}}
  wgrad_before: dict[int, tuple[int, ...]] = {}
  for w, (_, g) in sorted(deferred.items()):
    wgrad_before[g] = (*wgrad_before.get(g, ()), w)
  if deferred:
    actions.append(
      Action(
        "weight_gradient",
        where,
        f"{len(deferred)} weight gradient(s) (dots contracting a gathered sequence) run "
        f"while {len(wgrad_before)} later activation all-gather(s) travel: each waits for "
        "the all-gather's input, and the all-gather's users wait for it",
      )
    )
  # 6. Gradients that exist before a loop with collectives (the output projection's, computed
  # before the scanned backward) are reduce-scattered before it, not after it: XLA keeps an
  # asynchronous collective from spanning a loop that runs collectives of its own.
  before_loop = (
    scatters_before_loops(eqns, deps, kinds, order) if reduce_scatter == "per_layer" else {}
  )
  for loop_i, rs in before_loop.items():
    actions.append(
      Action(
        "reduce_scatter",
        where,
        f"{len(rs)} gradient reduce-scatter(s) computed before the loop at equation {loop_i} "
        "finish before it starts (issued when their gradient exists, not after the loop)",
      )
    )
  # 7. Gathered values kept for the backward pass are put in order beside the next
  # reduce-scatter whose last piece has nothing else to hide it.
  beside, copies_s, room_s = matmul_sites.kept_assembly_sites(
    eqns, order, rings, ring_of, fused, body_outputs, target
  )
  if beside:
    actions.append(
      Action(
        "kept_gather",
        where,
        f"{sum(map(len, beside.values()))} gathered value(s) kept for the backward pass put "
        f"in order (copies, {copies_s * 1e3:.2f} ms by the cost model) while the last piece "
        f"of {len(beside)} later reduce-scatter(s) travels ({room_s * 1e3:.2f} ms), each "
        "beside the one with the most time left, instead of where the backward pass reads "
        "them",
      )
    )
  single_gather = max((nbytes(eqns[i].outvars[0].aval) for g in groups for i in g), default=0)
  scatter_out = max(
    (nbytes(e.outvars[0].aval) for e in eqns if e.primitive.name == SCATTER), default=0
  )
  axis_size = max(
    (int(e.params.get("axis_size", 1)) for e in eqns if e.primitive.name in (GATHER, SCATTER)),
    default=1,
  )
  return BodyPlan(
    order,
    metadata,
    actions,
    len(groups),
    # A loop iteration's gathers are one layer's; top-level groups next to a
    # loop (its prologue) can span several.
    nested.group_gather_bytes if nested.loops else max(group_bytes, default=0),
    max(max_scatter, nested.scatter_bytes),
    max(single_gather, nested.gather_bytes),
    max(scatter_out, nested.scatter_out_bytes),
    max(axis_size, nested.axis_size),
    chain_prev,
    fused,
    frozenset(skipped),
    rings=rings,
    ring_of=ring_of,
    loops=nested.loops,
    scans=scans,
    wgrad_before=wgrad_before,
    assemble_beside=beside,
    loop_bodies=loop_bodies,
    scatters_before_loop=before_loop,
    issue_after=issue_after,
    prologue_after=prologue_after,
    ties_read_through=prefetch_memory is not None,
    lookups=lookups,
    row_scatters=row_scatters,
    first_pieces=pieces,
    piece_dots={p.dot: g for g, p in pieces.items()},
    after_pieces={o: g for g, p in pieces.items() for o in p.then},
    batch_parts=split,
    splittable=splittable,
  )


def _issues(
  eqns, users: dict, groups: list[list[int]], scans: dict, target, prefetch_memory: int | None
) -> list:
  """:func:`prefetch.issue_by_time` for the body's parameter gathers (``groups``) and its
  pipelined loops' first gathers (``scans``), within ``prefetch_memory`` bytes held ahead of
  first use."""
  from jax_overlap._src import targets as targets_lib

  wanted: dict[int, tuple[int, int, int]] = {}
  for g in (i for grp in groups for i in grp):
    readers = users.get(eqns[g].outvars[0], [])
    if readers:
      e = eqns[g]
      wanted[g] = (min(readers), nbytes(e.outvars[0].aval), int(e.params.get("axis_size", 1)))
  for li, sp in scans.items():
    if sp.gathers:
      inner = scan_pipeline.loop_body(eqns[li])[0].eqns
      size = sum(nbytes(inner[g].outvars[0].aval) for g in sp.gathers) * sp.depth
      devices = max(int(inner[g].params.get("axis_size", 1)) for g in sp.gathers)
      wanted[li] = (li, size, devices)
  if not wanted:
    return []
  topo = targets_lib.get(target or "h100x8")
  return prefetch_lib.issue_by_time(eqns, list(range(len(eqns))), wanted, topo, prefetch_memory)


def _issue_actions(
  issues: list, scans: dict, where: str, tied: bool, cap: int | None
) -> list[Action]:
  """A summary (``prefetch``) and one ``gather_timing`` action per gather placed by time:
  where it is issued and the compute it hides under, by the cost model; ``tied``: tied
  there (else placed there in the program, XLA free to issue it earlier); ``cap``: the
  memory cap they were placed within (its cost in the summary)."""
  gathers = [it for it in issues if it.eqn not in scans]  # loops say theirs themselves
  at_start = sum(1 for it in gathers if it.after is None)
  out = []
  if gathers:
    out.append(
      Action(
        "prefetch",
        where,
        f"{len(gathers)} parameter all-gather(s) issued by the cost model's time to arrive "
        f"when first used: {len(gathers) - at_start} after the compute that hides them "
        + ("(tied there)" if tied else "(placed there; XLA may issue them earlier)")
        + f", {at_start} at the start (too little compute before their use); "
        f"{sum(it.exposed_s for it in gathers) * 1e3:.3f} ms expected exposed; at most "
        f"{_ahead_bytes(issues) / 2**20:.1f} MiB gathered ahead of first use"
        + (" (a loop's first gathers included)" if len(gathers) < len(issues) else "")
        + ("" if cap is None else _cap_note(issues, cap)),
      )
    )
  for it in issues:
    what = (
      f"the first gathers of the loop at equation {it.eqn}"
      if it.eqn in scans
      else f"all-gather #{it.eqn}"
    )
    when = "at the start" if it.after is None else f"after equation {it.after}"
    verb = "issued" if tied or it.after is None else "placed"
    use = "" if it.eqn in scans else f", first used at equation {it.first_use}"
    out.append(
      Action(
        "gather_timing",
        where,
        f"{what} ({it.nbytes / 2**20:.1f} MiB, {it.time_s * 1e3:.3f} ms) {verb} {when}{use}: "
        f"hides under {it.hidden_s * 1e3:.3f} ms of compute ({it.matmuls} matmul(s))"
        + (f", {it.exposed_s * 1e3:.3f} ms exposed" if it.exposed_s > 0 else "")
        + ("; later than its time, to keep within prefetch_memory" if it.capped else ""),
      )
    )
  return out


def _cap_note(issues: list, cap: int) -> str:
  """What the memory cap did to ``issues``: how many it delayed and what that costs."""
  mib = f"{cap / 2**20:.1f} MiB"
  delayed = sum(1 for it in issues if it.capped)
  if not delayed:
    return f"; prefetch_memory={mib} delays none"
  with_cap = sum(it.exposed_s for it in issues) * 1e3
  without = sum(it.exposed_uncapped_s or 0.0 for it in issues) * 1e3
  large = sum(1 for it in issues if it.nbytes > cap)
  over = _ahead_bytes(issues) > cap
  return (
    f"; prefetch_memory={mib}: {delayed} issued later than their time to keep within it, "
    f"{with_cap:.3f} ms expected exposed with the cap against {without:.3f} ms without it "
    "(both placements on one timeline, the link taking one gather at a time)"
    + (
      f"; {large} gather(s) larger than the cap issued just in time for their use, alone"
      if large
      else ""
    )
    + (
      "; above the cap where one gather is larger than it or one equation first reads several"
      if over
      else ""
    )
  )


def _ahead_bytes(issues: list) -> int:
  """The most bytes gathered and not yet used at any point of the body (each gather held
  from its issue to its first use)."""
  events = sorted(
    [(-1 if it.after is None else it.after, it.nbytes) for it in issues]
    + [(it.first_use, -it.nbytes) for it in issues],
    key=lambda e: (e[0], e[1]),  # at one equation, uses before issues
  )
  held = peak = 0
  for _, b in events:
    held += b
    peak = max(peak, held)
  return peak


def scatters_before_loops(eqns, deps, kinds: dict, order: list[int]) -> dict[int, tuple]:
  """Each loop with collectives (``lax.scan``/``while``) -> the gradient reduce-scatters that
  ``order`` runs before it and that it does not already wait for, by equation index."""
  pos = {i: p for p, i in enumerate(order)}
  loops = sorted(
    (
      i
      for i, e in enumerate(eqns)
      if e.primitive.name in ("scan", "while") and contains_collectives(e)
    ),
    key=pos.__getitem__,
  )
  out: dict[int, tuple] = {}
  taken: set[int] = set()
  for loop in loops:
    waits = ancestors_of(deps, loop)
    rs = tuple(
      sorted(
        (
          i
          for i, k in kinds.items()
          if k == "gradient"
          and eqns[i].primitive.name == SCATTER
          and pos[i] < pos[loop]
          and i not in waits
          and i not in taken
        ),
        key=pos.__getitem__,
      )
    )
    if rs:
      out[loop] = rs
      taken.update(rs)
  return out


def _loop_body_plan(
  e,
  sp,
  loop: str,
  which: str,
  annotate: bool,
  collective_matmul: str,
  target,
  param_avals,
  defer_weight_gradients: bool,
  nested_params: dict | None,
) -> BodyPlan | None:
  """The plan of scan ``e``'s body for what one iteration can do on its own: collective
  matmuls of its activation collectives and its weight gradients deferred (tensor- and
  sequence-parallel layers under ``lax.scan``); None when there is nothing to do. The
  collectives the loop's pipeline ``sp`` moves across iterations are left to it. ``which``
  loops are planned: ``"all"``, ``"forward"`` (not the reversed scans autodiff's transpose
  runs) or ``"none"``."""
  if e.primitive.name != "scan" or (collective_matmul == "off" and not defer_weight_gradients):
    return None
  if which == "none" or (which == "forward" and e.params.get("reverse")):
    return None

  body, _ = scan_pipeline.loop_body(e)  # rematerialized layers inlined, as the pipeline reads it
  key = id(e.params["jaxpr"].jaxpr)  # the same inputs, keyed by the scan's own body
  inner = plan_body(
    body,
    loop,
    0,
    "as_written",
    annotate,
    False,
    collective_matmul,
    target,
    None if nested_params is None else nested_params.get(key, frozenset()),
    param_avals,
    defer_weight_gradients,
    nested_params,
    sp.moved if sp else frozenset(),
    which,
    in_loop=True,
  )
  if not (inner.fused or inner.rings or inner.wgrad_before or inner.loop_bodies):
    return None
  keep = ("collective_matmul", "kept_gather", "weight_gradient", "classify", "left_alone")
  inner.actions[:] = [a for a in inner.actions if a.kind in keep]
  inner.reverse = bool(e.params.get("reverse"))
  return inner


def topological(order: list[int], deps: list[list[int]], extra: dict) -> list[int] | None:
  """``order`` changed as little as possible so that also ``extra[b]`` (an equation, or a
  set of them) comes before ``b``.

  Returns None if the extra links close a cycle with the dependencies.
  """
  rank = {i: p for p, i in enumerate(order)}
  preds = [set(d) for d in deps]
  for b, a in extra.items():
    preds[b].update(a if isinstance(a, set) else {a})
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


def _nested_stats(eqn, out: _NestedStats) -> None:
  """Adds the collective sizes found under ``eqn`` (recursively) to ``out``."""
  is_loop = eqn.primitive.name in ("scan", "while")
  for sub in subjaxprs(eqn):
    group, found = 0, False
    for e in sub.eqns:
      name = e.primitive.name
      if name in (GATHER, SCATTER):
        found = True
        out.axis_size = max(out.axis_size, int(e.params.get("axis_size", 1)))
      if name == GATHER:
        b = nbytes(e.outvars[0].aval)
        out.gather_bytes = max(out.gather_bytes, b)
        group += b
        out.group_gather_bytes = max(out.group_gather_bytes, group)
      elif name in MATMUL:
        group = 0
      elif name == SCATTER:
        out.scatter_bytes = max(
          out.scatter_bytes, sum(nbytes(v.aval) for v in e.invars if is_var(v))
        )
        out.scatter_out_bytes = max(out.scatter_out_bytes, nbytes(e.outvars[0].aval))
      _nested_stats(e, out)  # nested loops and calls (nothing found: nothing added)
    if found and is_loop:
      out.loops += 1
