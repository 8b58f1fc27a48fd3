"""Argument checks of the collective matmuls, with errors that name the API and the fix."""

from __future__ import annotations

import numpy as np
from jax import lax


def axis_size(api: str, axis) -> int:
  if isinstance(axis, (tuple, list)):
    if len(axis) != 1:
      raise ValueError(f"{api}: axis must be a single mesh axis name for the ring, got {axis!r}")
    axis = axis[0]
  if not isinstance(axis, str):
    raise TypeError(f"{api}: axis must be a mesh axis name (str), got {axis!r}")
  try:
    return int(lax.axis_size(axis))
  except NameError:
    raise ValueError(
      f"{api}: axis {axis!r} is not bound here; call it inside a shard_map body whose mesh "
      "has that axis"
    ) from None


def check_operands(api: str, x, w, x_desc: str) -> None:
  for name, v in (("x", x), ("w", w)):
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
      raise TypeError(f"{api}: {name} must be an array, got {type(v).__name__}")
  if np.ndim(x) != 2 or np.ndim(w) != 2:
    raise ValueError(
      f"{api}: x and w must both be rank 2 ({x_desc} and (k, n)), got x with shape "
      f"{tuple(x.shape)} and w with shape {tuple(w.shape)}"
    )
  if x.shape[1] != w.shape[0]:
    raise ValueError(
      f"{api}: the contracting dimensions must match: x.shape[1] ({x.shape[1]}) != "
      f"w.shape[0] ({w.shape[0]})"
    )


def directions(api: str, rows: int, what: str, bidirectional: bool, chunks) -> tuple[int, ...]:
  if chunks is None:
    chunks = 2 if bidirectional else 1
  if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
    raise ValueError(f"{api}: chunks must be a positive int, got {chunks!r}")
  if bidirectional and chunks % 2:
    raise ValueError(
      f"{api}: chunks must be even with bidirectional=True (half the pieces go each way), "
      f"got {chunks}"
    )
  if rows % chunks:
    raise ValueError(
      f"{api}: {what} ({rows}) must be divisible by the number of ring pieces chunks={chunks}"
    )
  if bidirectional:
    return (1,) * (chunks // 2) + (-1,) * (chunks // 2)
  return (1,) * int(chunks)


def piece_sizes(api: str, pieces, n: int, block: int) -> list[int]:
  """The sizes (along the gathered or scattered dimension of one device's block) of the
  pieces ``pieces`` asks for: a count (equal pieces; the largest count up to it that
  divides the block; default the axis size ``n``) or the sizes themselves."""

  def positive_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1

  bad = ValueError(
    f"{api}: pieces must be a positive int (a count of equal pieces) or a sequence of "
    f"positive ints (the pieces' sizes), got {pieces!r}"
  )
  if pieces is None or isinstance(pieces, (int, np.integer)):
    c = n if pieces is None else pieces
    if not positive_int(c):
      raise bad
    c = min(int(c), block)
    while block % c:  # the largest count up to the one asked for that divides the block
      c -= 1
    return [block // c] * c
  try:
    sizes = list(pieces)
  except TypeError:
    raise bad from None
  if not sizes or not all(positive_int(v) for v in sizes):
    raise bad
  sizes = [int(v) for v in sizes]
  if sum(sizes) != block:
    raise ValueError(
      f"{api}: the pieces' sizes {tuple(sizes)} add up to {sum(sizes)}, but this device's "
      f"block is {block} along the dimension they split"
    )
  return sizes
