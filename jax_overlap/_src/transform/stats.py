"""What the planned rewrite found in a step's shard_map bodies (:class:`RewriteStats`), from
their plans (:class:`~.planning.BodyPlan`): the variants' XLA options and which variants to
try are sized from it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RewriteStats:
  """What the planned rewrite found in a step's shard_map bodies; the variants' XLA
  options (combine thresholds, which switches to try) are sized from it."""

  gather_groups: int = 0  # layers of parameter gathers in the body with the most
  max_group_gather_bytes: int = 0  # the bytes one such layer gathers, at most
  max_gather_bytes: int = 0  # one all-gather's output bytes, at most
  max_scatter_out_bytes: int = 0  # one reduce-scatter's output bytes, at most
  axis_size: int = 1  # devices the collectives run over, at most
  loops: int = 0  # loops over layers whose collectives are pipelined or kept
  rings: int = 0  # collective matmuls planned
  weight_gradients: int = 0  # backward weight gradients deferred to a later all-gather
  loop_bodies: int = 0  # lax.scan bodies with plans of their own
  reversed_loop_bodies: int = 0  # of those, reversed scans (a backward pass's)
  # lax.scan bodies that can run in parts of their batch (batch_parts.py): in 2, and in 4.
  split_loops: int = 0
  split4_loops: int = 0

  def including(self, plan) -> RewriteStats:
    """These statistics and one more body's plan (and the plans of the loops in it)."""
    stats = self
    for inner in plan.loop_bodies.values():
      stats = stats.including(inner)
    return stats._plus(plan)

  def _plus(self, plan) -> RewriteStats:
    return RewriteStats(
      gather_groups=max(self.gather_groups, plan.gather_groups),
      max_group_gather_bytes=max(self.max_group_gather_bytes, plan.max_group_gather_bytes),
      max_gather_bytes=max(self.max_gather_bytes, plan.max_gather_bytes),
      max_scatter_out_bytes=max(self.max_scatter_out_bytes, plan.max_scatter_out_bytes),
      axis_size=max(self.axis_size, plan.axis_size),
      loops=self.loops + plan.loops,
      rings=self.rings + len(plan.rings) + len(plan.fused),
      weight_gradients=self.weight_gradients + sum(len(w) for w in plan.wgrad_before.values()),
      loop_bodies=self.loop_bodies + len(plan.loop_bodies),
      reversed_loop_bodies=self.reversed_loop_bodies
      + sum(b.reverse for b in plan.loop_bodies.values()),
      split_loops=self.split_loops + sum(n >= 2 for n in plan.splittable.values()),
      split4_loops=self.split4_loops + sum(n >= 4 for n in plan.splittable.values()),
    )

  @property
  def has_collectives(self) -> bool:
    """Whether the rewrite found collectives whose grouping the variants can change."""
    return bool(self.gather_groups or self.max_scatter_out_bytes or self.loops)
