"""The step's first parameter gather in pieces, so that the first matmul starts on part of
its weight.

Nothing runs before the step's first gathers (:mod:`.prefetch` issues them at the start, in
order of first use, the compute waiting for them), so the first matmul waits for its whole
weight. Only the first gather the compute waits for is split: the ones after it share the
link with it and wait for it anyway. Gathered in ``k`` pieces along a dimension that matmul
keeps (one of the weight's free dimensions: a dense layer's output columns), the matmul
runs on each piece while the next one travels, and the outputs are put together along the
output dimension it becomes; the other readers of the weight (the backward pass) get the
pieces put together. Each piece is the same collective over the whole mesh, on a block of
the shard's columns, and each is issued after the one before has arrived, so XLA neither
merges them nor reorders them; the other gathers issued at the start go after the last
piece (XLA's combiner would otherwise join a piece with them).

How many pieces is the cost model's choice (:func:`plan`): ``k`` gathers of a ``k``-th of
the bytes (alpha-beta, each with its own latency) and ``k`` matmuls of a ``k``-th of the
roofline time, pipelined, against the whole gather then the whole matmul; none where nothing
is gained, and none where the matmul's other operand itself comes from a collective (an
embedding's rows, reduce-scattered at the step's start): the link then carries both before
the first matmul, the step's start is the link's, and pieces only add their latencies. Each
output element is the same dot product as in the matmul as written, so results are
bit-identical on CPU devices.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jax_overlap._src.transform.explain import Action
from jax_overlap._src.transform.jaxprs import COLLECTIVES, is_var, nbytes, producers

_CHOICES = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Pieces:
  """All-gather ``gather`` in ``k`` pieces along dimension ``dim`` of its result, which
  matmul ``dot`` (its first reader) keeps as its output dimension ``out_dim``."""

  gather: int
  dot: int
  dim: int
  out_dim: int
  k: int
  whole: bool = True  # something else reads the gathered value: the pieces put together
  # The other gathers issued at the start, after this one: each waits for the last piece.
  then: tuple = ()


def _free_dim(dot, w) -> tuple[int, int] | None:
  """The largest free dimension of ``w`` in ``dot`` (a ``dot_general`` reading ``w`` as
  exactly one operand) and the output dimension it becomes; None if it has none."""
  if dot.primitive.name != "dot_general" or (dot.invars[0] is w) == (dot.invars[1] is w):
    return None
  (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
  lhs_free = [d for d in range(dot.invars[0].aval.ndim) if d not in lc and d not in lb]
  rhs_free = [d for d in range(dot.invars[1].aval.ndim) if d not in rc and d not in rb]
  free = lhs_free if dot.invars[0] is w else rhs_free
  if not free:
    return None
  dim = max(free, key=lambda d: (w.aval.shape[d], -d))
  base = len(lb) + (0 if dot.invars[0] is w else len(lhs_free))
  return dim, base + free.index(dim)


def _waits_for_a_collective(eqns, producer: dict, v) -> bool:
  """``v`` is computed from a collective's result (through any equations of ``eqns``)."""
  seen, todo = set(), [v]
  while todo:
    x = todo.pop()
    i = producer.get(x) if is_var(x) else None
    if i is None or i in seen:
      continue
    seen.add(i)
    if eqns[i].primitive.name in COLLECTIVES:
      return True
    todo.extend(eqns[i].invars)
  return False


def pipelined(t_gather: float, t_dot: float, k: int, t_piece: float) -> float:
  """``k`` gathers of ``t_piece`` each and ``k`` matmuls of ``t_dot / k``, each matmul after
  its piece and each piece after the one before: the time until the last matmul ends."""
  if k == 1:
    return t_gather + t_dot
  return t_piece + (k - 1) * max(t_piece, t_dot / k) + t_dot / k


def plan(
  eqns, users: dict, issues: list, topo, where: str, outvars=(), taken=frozenset()
) -> tuple[dict, list]:
  """The first gather the compute waits for (issued at the start and exposed, by ``issues``
  of :func:`.prefetch.issue_by_time`), in pieces where the cost model says it pays:
  ({gather: Pieces}, actions). ``outvars``: the body's outputs; ``taken``: matmuls a
  collective matmul computes (their gathers stay whole)."""
  from jax_overlap._src.analysis import cost_model as cost
  from jax_overlap._src.transform.prefetch import eqn_time

  found: dict[int, Pieces] = {}
  actions: list[Action] = []
  producer = producers(eqns)
  # The first gather the compute waits for, in order of first use: the ones after it share
  # the link with it and wait for it anyway, and their pieces would only add latencies.
  waited = [it for it in issues if it.after is None and it.exposed_s > 0]
  for it in sorted(waited, key=lambda it: it.first_use)[:1]:
    g = it.eqn
    e = eqns[g]
    if e.primitive.name != "all_gather":
      continue
    out = e.outvars[0]
    readers = users.get(out, [])
    if not readers:
      continue
    d = min(readers)
    if d in taken:
      continue
    dims = _free_dim(eqns[d], out)
    if dims is None or dims[0] == e.params.get("all_gather_dimension"):
      continue
    dim, out_dim = dims
    other = next(v for v in eqns[d].invars if v is not out)
    if _waits_for_a_collective(eqns, producer, other):
      # The link carries that collective too before the first matmul can start (an
      # embedding's rows, reduce-scattered): the start is the link's, and pieces only add
      # their latencies to it.
      continue
    n = int(e.params.get("axis_size", 1))
    t_gather = cost.collective_time("all-gather", nbytes(out.aval), n, topo)
    t_dot = eqn_time(eqns[d], topo.gpu)
    best = (pipelined(t_gather, t_dot, 1, t_gather), 1)
    for k in _CHOICES:
      if out.aval.shape[dim] % k:
        continue
      piece = cost.collective_time("all-gather", nbytes(out.aval) / k, n, topo)
      best = min(best, (pipelined(t_gather, t_dot, k, piece), k))
    t, k = best
    if k == 1:
      continue
    whole = len(readers) > 1 or any(v is out for v in outvars)
    then = tuple(
      o.eqn for o in issues if o.after is None and o.eqn != g and o.first_use > it.first_use
    )
    found[g] = Pieces(g, d, dim, out_dim, k, whole, then)
    actions.append(
      Action(
        "prefetch",
        where,
        f"first all-gather #{g} ({nbytes(out.aval) / 2**20:.1f} MiB, nothing before it) in "
        f"{k} pieces along dimension {dim}: the matmul at equation {d} starts on the first "
        f"({(t_gather + t_dot) * 1e3:.3f} -> {t * 1e3:.3f} ms to its end by the cost model)",
      )
    )
  return found, actions


class Gathering:
  """All-gather ``eqn`` of ``shard`` in the pieces of ``p``, each issued after the one
  before has arrived. ``bind(eqn, invals)`` runs an equation.

  Every order is an optimization barrier whose outputs are what the rest reads, so XLA
  keeps it: a barrier output nothing reads is dropped with its dependency, and XLA's
  combiner then joins the pieces into one collective again."""

  def __init__(self, eqn, shard, p: Pieces, bind):
    self.eqn, self.p, self.bind = eqn, p, bind
    # Every block is cut before the first gather, so a gather waits for nothing on the
    # compute stream but the gather before it.
    blocks = list(lax.optimization_barrier(tuple(jnp.split(shard, p.k, axis=p.dim))))
    self.pieces = [bind(eqn, [blocks[0]])[0]]
    for block in blocks[1:]:
      block, self.pieces[-1] = lax.optimization_barrier((block, self.pieces[-1]))
      self.pieces.append(bind(eqn, [block])[0])

  def before(self, x):
    """``x`` (the input of a later gather) ordered after the last piece has arrived: the
    link takes the pieces first, and XLA's combiner cannot join that gather with one."""
    x, self.pieces[-1] = lax.optimization_barrier((x, self.pieces[-1]))
    return x

  def dot(self, eqn, invals: list, var, bind=None):
    """Matmul ``eqn`` (``invals``; ``var``, its operand this gathers, not among them; bound
    by ``bind``, by default the gather's) in pieces: one matmul per piece while the next piece travels (XLA's dot merger would join
    them; each waits for its piece after the matmul before), put together along the output
    dimension the weight's split dimension becomes."""
    k = next(k for k, v in enumerate(eqn.invars) if not (is_var(v) and v is var))
    other = invals[k]
    outs = []
    for j in range(self.p.k):
      if j >= 1:  # piece j is read after matmul j - 1: XLA waits for it there, not before
        self.pieces[j], outs[j - 1] = lax.optimization_barrier((self.pieces[j], outs[j - 1]))
      piece, other = lax.optimization_barrier((self.pieces[j], other))
      vals = list(invals)
      vals[k] = other
      vals[1 - k] = piece
      outs.append((bind or self.bind)(eqn, vals)[0])
    return jnp.concatenate(outs, axis=self.p.out_dim)

  def whole(self):
    """The gathered value: the pieces put together."""
    return jnp.concatenate(self.pieces, axis=self.p.dim)
