"""The output layouts a step rebuilt by ``@overlap`` keeps: those of ``jax.jit(step)``.

``@overlap`` re-jits the step it traced (as written or rewritten, or in its shard_map form).
Its outputs must come back laid out as the user's jitted step lays them out:

- where the user's ``jax.jit`` asks for output shardings (``out_shardings``), every
  variant's jit asks for the same (:func:`jit_kwargs`);
- where it does not, XLA's SPMD partitioner chooses. The step as written, re-jitted, gets
  the same choice; its shard_map form has its layouts fixed by the conversion, which is
  given the partitioner's choice to aim for, read from the step as written compiled: by
  the selection's first compile for its target (:func:`from_compiled`,
  :mod:`.first_compile`), else by a compile of its own without autotuning
  (:func:`partitioner_choice`; only for a step that is converted and leaves some output
  of rank one or more unspecified: a scalar has one layout, whole on every device, and
  needs no compile to know it, :func:`known`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

__all__ = ["from_compiled", "jit_kwargs", "known", "partitioner_choice", "requested"]


def _unspecified(sharding) -> bool:
  return sharding is None or type(sharding).__name__ in ("UnspecifiedValue", "AUTO")


def requested(traced) -> tuple | None:
  """The output shardings the traced step's ``jax.jit`` asks for, one per output leaf
  (None where it asks for none); None if it asks for none at all.

  Args:
    traced: the step traced by its ``jax.jit`` (a ``jax.stages.Traced``).
  """
  shardings = getattr(traced, "_params", {}).get("out_shardings")
  if not shardings:
    return None
  flat = tuple(None if _unspecified(s) else s for s in shardings)
  return flat if any(s is not None for s in flat) else None


def jit_kwargs(traced, out_tree, given: dict[str, Any]) -> dict[str, Any]:
  """``{"out_shardings": ...}`` for the jit of each variant: the output shardings the
  user's jitted step asks for (a pytree like its outputs, None where unspecified), unless
  ``out_shardings`` is ``given`` to ``overlap`` (which wins); else ``{}``.

  Example:
    >>> jit_kwargs.update(out_layouts.jit_kwargs(traced, out_tree, jit_kwargs))  # doctest: +SKIP
  """
  if "out_shardings" in given:
    return {}
  flat = requested(traced)
  if flat is None or len(flat) != out_tree.num_leaves:
    return {}
  return {"out_shardings": jax.tree.unflatten(out_tree, list(flat))}


def known(traced) -> tuple | None:
  """:func:`partitioner_choice` where no compile is needed to know it, else None: every
  output leaf's sharding is requested, or unspecified only for scalars (rank 0: one
  layout, whole on every device, whatever the partitioner does), given as None: the
  conversion to shard_map gives a scalar output that layout, reduced.

  Args:
    traced: the step traced by its ``jax.jit`` (a ``jax.stages.Traced``).
  """
  info = getattr(traced, "out_info", None)
  if info is None:
    return None
  asked = getattr(traced, "_params", {}).get("out_shardings")
  outs = jax.tree.leaves(info)
  if asked is None or len(asked) != len(outs):
    asked = (None,) * len(outs)
  flat = tuple(None if _unspecified(s) else s for s in asked)
  if any(s is None and len(o.shape) > 0 for s, o in zip(flat, outs)):
    return None
  return flat


def partitioner_choice(traced, compiler_options: dict[str, Any] | None = None) -> tuple | None:
  """Each output leaf's sharding as ``jax.jit(step)`` returns it: the requested one, or
  the one XLA's partitioner gives it, from the step as written compiled for its devices
  with ``compiler_options`` (only when some output is unspecified; the partitioner's
  choice does not depend on them: a selection passes those that make a compile cheaper,
  such as no autotuning). Entries the conversion to shard_map cannot read (not a
  NamedSharding) are None, as is the whole where the step cannot be compiled here (the
  conversion then keeps the layouts it arrives at).
  """
  without = known(traced)
  if without is not None:
    return without
  try:
    compiled = traced.lower().compile(compiler_options or None)
  except Exception:  # noqa: BLE001 - any failure means no layouts to aim for, not an error
    compiled = None
  return from_compiled(traced, compiled)


def from_compiled(traced, compiled) -> tuple | None:
  """:func:`partitioner_choice` read from ``compiled``, the step as written (re-jitted as
  ``@overlap`` re-jits it, for its devices or a target with the same mesh axes) compiled
  already; None where ``compiled`` is None (the requested shardings, if any)."""
  asked = getattr(traced, "_params", {}).get("out_shardings")
  if asked is not None and not any(_unspecified(s) for s in asked):
    return tuple(asked)
  try:
    got = jax.tree.leaves(compiled.output_shardings)
  except Exception:  # noqa: BLE001 - no executable (or none that says): nothing to aim for
    return None if asked is None else tuple(None if _unspecified(s) else s for s in asked)
  if asked is not None and len(asked) == len(got):
    got = [g if _unspecified(a) else a for a, g in zip(asked, got)]
  return tuple(
    s if isinstance(s, NamedSharding) or getattr(s, "is_fully_replicated", False) else None
    for s in got
  )
