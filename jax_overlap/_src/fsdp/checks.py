"""Argument checks of :func:`scan_layers` and its validated settings (``_Config``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_API = "scan_layers"

AxisName = str | tuple[str, ...]
PyTree = Any


def _keystr(path) -> str:
  s = jax.tree_util.keystr(path)
  return s if s else "<root>"


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or hasattr(x, "aval")


def _axis_tuple(axis: AxisName) -> tuple[str, ...]:
  if isinstance(axis, str):
    return (axis,)
  if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) for a in axis):
    return tuple(axis)
  raise TypeError(f"{_API}: axis must be a mesh axis name or a tuple of names, got {axis!r}")


def _bound_axis_size(axes: tuple[str, ...]) -> int | None:
  """Product of the sizes of ``axes`` if all are bound here, else None."""
  size = 1
  for a in axes:
    try:
      size *= int(lax.axis_size(a))
    except NameError:
      return None
  return size


def _check_leaves(name: str, tree, *, need_layer_dim: bool) -> tuple[list, Any]:
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if not path_leaves:
    raise ValueError(f"{_API}: {name} must contain at least one array, got {tree!r}")
  bad = [f"{name}{_keystr(p)} ({type(v).__name__})" for p, v in path_leaves if not _is_array(v)]
  if bad:
    raise TypeError(
      f"{_API}: every leaf of {name} must be an array, got non-arrays at {', '.join(bad)}"
    )
  bad = [
    f"{name}{_keystr(p)} ({jnp.dtype(v.dtype).name})"
    for p, v in path_leaves
    if not jnp.issubdtype(v.dtype, jnp.inexact)
  ]
  if bad:
    raise TypeError(
      f"{_API}: every leaf of {name} must have a floating dtype (it is differentiated), "
      f"got {', '.join(bad)}"
    )
  if need_layer_dim:
    bad = [f"{name}{_keystr(p)}" for p, v in path_leaves if np.ndim(v) == 0]
    if bad:
      raise ValueError(
        f"{_API}: every leaf of {name} needs a leading layer dimension, got scalars at "
        f"{', '.join(bad)}"
      )
  return path_leaves, treedef


def _normalize_gather_dims(gather_dim, path_leaves, treedef) -> list[int | None]:
  """One gather dimension (of the per-layer leaf, or None) per stacked leaf."""
  if gather_dim is None or isinstance(gather_dim, (int, np.integer)):
    dims = [gather_dim] * len(path_leaves)
  else:
    try:
      dims = treedef.flatten_up_to(gather_dim)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"{_API}: gather_dim must be an int, None, or a pytree with the structure of "
        f"stacked_params ({treedef}), got {gather_dim!r}"
      ) from e
  out = []
  for (path, leaf), d in zip(path_leaves, dims):
    if d is None:
      out.append(None)
      continue
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
      raise TypeError(
        f"{_API}: gather_dim for stacked_params{_keystr(path)} must be an int or None, got {d!r}"
      )
    rank = np.ndim(leaf) - 1  # the per-layer rank
    if not -rank <= d < rank:
      raise ValueError(
        f"{_API}: gather_dim for stacked_params{_keystr(path)} must index a dimension of "
        f"the per-layer shape {tuple(np.shape(leaf)[1:])} (between {-rank} and {rank - 1}), "
        f"got {d}"
      )
    out.append(int(d) % rank)
  return out


@dataclasses.dataclass(frozen=True)
class _Config:
  """Validated settings of one scan_layers call."""

  axes: tuple[str, ...]
  prefetch: int
  dims: tuple[int | None, ...]
  unroll: int | bool
  remat_policy: Callable[..., bool] | None

  @property
  def axis(self) -> AxisName:
    return self.axes[0] if len(self.axes) == 1 else self.axes
