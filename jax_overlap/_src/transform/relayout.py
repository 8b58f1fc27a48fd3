"""How a value laid out one way over a mesh is laid out another: the collectives and
slices, in order (the GSPMD step's conversion to shard_map runs them, and counts them).

A layout (``layouts.Layout``) names, per dimension, the mesh axes splitting it (major
first) and the axes over which a device holds an addend. An unreduced sum is
reduce-scattered along the dimensions its new layout splits over the summed axes
(:func:`scatter_dims`); splits then move between dimensions, are gathered, and are sliced
(:func:`steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jax_overlap._src.transform.layouts import Axes, Layout

__all__ = ["scatter_dims", "steps"]


def _scatter_dim(src: Layout, dst: Layout, red: set) -> int | None:
  """The dimension an unreduced sum over ``red`` is reduce-scattered along on its way to
  ``dst``: one ``dst`` splits over some of those axes (all of them, if one does) and ``src``
  does not split; None if none does."""
  best = None
  for d, ax in enumerate(dst.dims):
    if ax and set(ax) <= red and not src.dims[d]:
      if best is None or len(ax) > len(dst.dims[best]):
        best = d
  return best


def scatter_dims(src: Layout, dst: Layout, red: set) -> tuple[list[int], set]:
  """The dimensions an unreduced sum over ``red`` is reduce-scattered along, one after the
  other (:func:`_scatter_dim` over the axes left), and the axes it is then all-reduced
  over. A weight gradient summed over both axes of a 2-D mesh and split along two
  dimensions, one per axis, is reduce-scattered twice, never all-reduced whole."""
  dims, red = [], set(red)
  while red and (d := _scatter_dim(src, dst, red)) is not None:
    dims.append(d)
    red -= set(dst.dims[d])
  return dims, red


def steps(
  dims: Sequence[Axes],
  want: Sequence[Axes],
  moves: Callable[[Axes], bool] = lambda axes: True,
) -> list[tuple]:
  """The collectives and slices that take a value whose dimensions are split over ``dims``
  to ``want`` (no unreduced sum left), in order: ``("all-to-all", axes, old, new)``,
  ``("all-gather", axes, d)``, ``("slice", axes, d)``.

  A split moved from one dimension to another (tokens split by batch going to the
  experts split over the same axes, a sequence split going to heads) is an all-to-all,
  each device sending the others their pieces, as the partitioner reshards, instead of
  the whole value gathered for each device to keep a piece of it: ``axes`` are last
  (minor) axes splitting ``old`` that ``want[old]`` does not, and the next axes
  ``want[new]`` adds after ``new``'s own, so that a device's piece along both is its
  place in the whole; ``moves(axes)`` says whether it pays (the cost model's all-to-all
  against the gather it replaces). A dimension that keeps the first of its axes gathers
  only the others; one that adds axes after its own slices only by them. Every gather
  comes before any slice: a split moved over other axes (a transposed value constrained
  as it was before the transpose) must be whole along the old dimension before a device
  keeps its piece along the new one."""
  dims = list(dims)
  ordered: list[tuple] = []
  for new, axes in enumerate(want):
    # The axes it adds after its own, from the dimensions whose last axes they are, a
    # run of them at a time, in their order.
    while axes[: len(dims[new])] == dims[new] and len(axes) > len(dims[new]):
      rest = axes[len(dims[new]) :]
      found = None
      for old, split in enumerate(dims):
        for k in range(len(rest), 0, -1):
          moved = rest[:k]
          if (
            old != new
            and split[len(split) - k :] == moved
            and not set(moved) & set(want[old])
            and moves(moved)
          ):
            found = old, moved
            break
        if found:
          break
      if found is None:
        break
      old, moved = found
      ordered.append(("all-to-all", moved, old, new))
      dims[old], dims[new] = dims[old][: len(dims[old]) - len(moved)], dims[new] + moved
  slices = []
  for d, (have, axes) in enumerate(zip(dims, want)):
    if have == axes:
      continue
    if have[: len(axes)] == axes:  # the first axes kept: only the others gathered
      ordered.append(("all-gather", have[len(axes) :], d))
    elif axes[: len(have)] == have:  # axes added after its own: only they slice
      slices.append(("slice", axes[len(have) :], d))
    else:
      if have:
        ordered.append(("all-gather", have, d))
      if axes:
        slices.append(("slice", axes, d))
  return ordered + slices
