"""Weight gradients run beside the activation all-gathers of the backward pass.

In tensor- and sequence-parallel backward passes the weight gradient of a layer
(``x_gathered^T dy``, a dot that contracts the gathered sequence) needs nothing the next
layer's activation all-gather produces, and that all-gather needs nothing the weight
gradient produces. XLA's latency-hiding scheduler, working from the end of the step,
places every weight gradient at the end (they feed only the step's outputs), so the
backward's all-gathers have no compute beside them. Two optimization barriers fix the
order: the weight gradient waits for the all-gather's input, and the all-gather's users
wait for the weight gradient, so it runs while the all-gather travels: what Megatron-LM
and Transformer Engine call delayed weight-gradient compute, here decided on the traced
program. Gathers of parameters are not activations: their contracting dots are the
layers themselves.
"""

from __future__ import annotations

from jax_overlap._src.transform.jaxprs import (
  GATHER,
  ancestors_of,
  gathered_dim_role,
  is_var,
  producers,
  var_users,
)

# classify_collectives' kinds of all-gathers that move activations, not parameters.
_GATHERED_ACTIVATIONS = ("activation", "input")


def weight_gradient_dots(eqns, users: dict, kinds: dict[int, str]) -> dict[int, int]:
  """Dots that contract the gathered dimension of an all-gather of activations (computed
  in the step, or the sequence-parallel batch and cotangents the body receives): the
  weight gradients of the layers the gather feeds. Dot index -> gather index."""
  found: dict[int, int] = {}
  for g, e in enumerate(eqns):
    if (
      e.primitive.name != GATHER
      or not e.params.get("tiled")
      or kinds.get(g) not in _GATHERED_ACTIVATIONS
    ):
      continue
    out, gd = e.outvars[0], e.params.get("all_gather_dimension")
    for u in users.get(out, []):
      if gathered_dim_role(eqns[u], out, gd) == "contracting":
        found[u] = g
  return found


def plan(
  eqns,
  deps: list[list[int]],
  kinds: dict[int, str],
  order: list[int],
  skip: set[int] = frozenset(),
  pinned: set[int] = frozenset(),
) -> dict[int, tuple[int, int]]:
  """Weight-gradient dot -> (the equation producing the input of the first all-gather of
  activations after it in ``order`` that does not depend on it, that all-gather). Gathers
  in ``skip`` (replaced by a fused collective matmul) take none; dots in ``pinned``
  (already ordered after something) and dots with no such all-gather after them are left
  where they are."""
  users = var_users(eqns)
  producer = producers(eqns)
  pos = {i: p for p, i in enumerate(order)}
  gathers = sorted(
    (
      i
      for i, e in enumerate(eqns)
      if e.primitive.name == GATHER
      and kinds.get(i) in _GATHERED_ACTIVATIONS
      and i not in skip
      and is_var(e.invars[0])
    ),
    key=lambda i: pos[i],
  )
  ancestors: dict[int, set[int]] = {}

  def above(i: int) -> set[int]:
    if i not in ancestors:
      ancestors[i] = ancestors_of(deps, i)
    return ancestors[i]

  deferred: dict[int, tuple[int, int]] = {}
  for w in sorted(weight_gradient_dots(eqns, users, kinds), key=lambda i: pos[i]):
    if w in pinned:
      continue
    for g in gathers:
      if pos[g] < pos[w]:
        continue
      p = producer.get(eqns[g].invars[0])
      if p is None or w in above(p) or w == p:
        continue  # the gather waits for this weight gradient (or reads a body input)
      deferred[w] = (p, g)
      break
  return deferred
