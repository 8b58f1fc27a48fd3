"""Data budgets: per-example learning-dynamics scores and selection of the best examples.

Scores are computed from the logits the training step already has, so they
cost a few elementwise operations per example and stay sharded like the batch:

* ``loss``: the per-example loss;
* ``el2n``: the norm of d loss / d logits (for softmax cross-entropy,
  ``||softmax(z) - onehot(y)||_2``), the "error L2 norm" of Paul et al. (2021),
  a proxy for the per-example gradient norm: the gradient with respect to the
  last layer's weights is this vector times the (fixed) features;
* ``excess_loss``: loss minus a reference model's loss on the same example
  (RHO-loss, Mindermann et al. 2022): high for examples that are learnable
  (the reference fits them) and not yet learnt; low for noise the reference
  cannot fit either, and for examples already learnt.

:func:`select` keeps the ``keep_fraction`` highest-scoring examples of a
(possibly sharded) batch, inside ``jit``; ``keep_fraction`` can come from a
FLOP budget through :func:`jax_overlap.budget.compute.keep_fraction_for_budget`.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Selection", "combine", "per_example_scores", "select", "selected_count"]

ScoreKind = Literal["classification", "regression"]
ScoreName = Literal["auto", "loss", "el2n", "excess_loss"]


def _reduce_to_batch(x: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Mean over every axis but the first (token axes of sequence models)."""
  if x.ndim == 1:
    return x
  axes = tuple(range(1, x.ndim))
  if mask is None:
    return jnp.mean(x, axis=axes)
  m = mask.astype(x.dtype)
  return jnp.sum(x * m, axis=axes) / jnp.maximum(jnp.sum(m, axis=axes), 1)


def _check_labels(labels, classes: int) -> None:
  """Integer labels in ``[0, classes)`` (checked where their values are known: not
  under ``jit``, where ``one_hot`` would give an out-of-range label a zero loss)."""
  if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
    raise ValueError(
      f"per_example_scores: classification labels must be integers, got {jnp.result_type(labels)}"
    )
  if isinstance(labels, jax.core.Tracer):
    return
  lo, hi = int(jnp.min(labels)), int(jnp.max(labels))
  if lo < 0 or hi >= classes:
    raise ValueError(
      f"per_example_scores: classification labels must be in [0, {classes}) (the logits' "
      f"{classes} classes), got values from {lo} to {hi}"
    )


def per_example_scores(
  logits: jax.Array,
  labels: jax.Array,
  *,
  kind: ScoreKind = "classification",
  reference_loss: jax.Array | None = None,
  reference_logits: jax.Array | None = None,
  mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
  """Per-example loss, error-norm (gradient-norm proxy) and excess loss.

  Args:
    logits: ``[batch, ..., classes]`` logits (classification) or
      ``[batch, ...]`` predictions (regression).
    labels: integer labels ``[batch, ...]`` (classification) or targets with
      the predictions' shape (regression).
    kind: ``"classification"`` (softmax cross-entropy) or ``"regression"``
      (half squared error, summed over the last axis).
    reference_loss: a reference model's per-example loss ``[batch]``, e.g.
      precomputed once for the data set; enables ``excess_loss``.
    reference_logits: a reference model's logits for this batch (alternative
      to ``reference_loss``).
    mask: ``[batch, ...]`` weights over token positions for sequence models.

  Returns:
    ``{"loss", "el2n"}`` and, with a reference, ``"excess_loss"``; each a
    ``[batch]`` float32 array sharded like ``logits``'s batch axis. ``loss``
    is differentiable (train on its mean and the scores come with the step);
    ``el2n`` and ``excess_loss`` are under ``stop_gradient``.

  Raises:
    ValueError: for an unknown ``kind``, mismatched shapes (labels, mask, reference),
      or classification labels that are not integers in ``[0, classes)`` (their range is
      checked where their values are known, outside ``jit``).

  Example:
    >>> import jax.numpy as jnp
    >>> s = per_example_scores(jnp.array([[2.0, 0.0], [0.0, 2.0]]), jnp.array([0, 0]))
    >>> bool(s["loss"][1] > s["loss"][0]), bool(s["el2n"][1] > s["el2n"][0])
    (True, True)
  """
  if kind not in ("classification", "regression"):
    raise ValueError(
      f"per_example_scores: kind must be 'classification' or 'regression', got {kind!r}"
    )
  if reference_loss is not None and reference_logits is not None:
    raise ValueError("per_example_scores: give reference_loss or reference_logits, not both")

  def token_terms(z):
    z = z.astype(jnp.float32)
    if kind == "classification":
      if labels.shape != z.shape[:-1]:
        raise ValueError(
          "per_example_scores: classification labels must have the logits' shape without the "
          f"class axis, expected {z.shape[:-1]}, got {labels.shape}"
        )
      _check_labels(labels, z.shape[-1])
      logp = jax.nn.log_softmax(z, axis=-1)
      onehot = jax.nn.one_hot(labels, z.shape[-1], dtype=z.dtype)
      loss = -jnp.sum(logp * onehot, axis=-1)
      err = jnp.exp(logp) - onehot
      return loss, jnp.sqrt(jnp.sum(err * err, axis=-1))
    if labels.shape != z.shape:
      raise ValueError(
        "per_example_scores: regression targets must have the predictions' shape, expected "
        f"{z.shape}, got {labels.shape}"
      )
    err = z - labels.astype(z.dtype)
    if z.ndim == 1:
      return 0.5 * err * err, jnp.abs(err)
    return 0.5 * jnp.sum(err * err, axis=-1), jnp.sqrt(jnp.sum(err * err, axis=-1))

  loss_t, err_t = token_terms(logits)
  if mask is not None and loss_t.ndim == 1:
    raise ValueError(
      "per_example_scores: mask weighs token positions, and these logits have no token "
      f"axis (one loss per example, {loss_t.shape}); weigh the examples' scores instead"
    )
  if mask is not None and tuple(jnp.shape(mask)) != loss_t.shape:
    raise ValueError(
      "per_example_scores: mask weighs token positions and must have the shape of the "
      f"per-token loss, {loss_t.shape} (the logits without the class axis), got "
      f"{tuple(jnp.shape(mask))}"
    )
  out = {"loss": _reduce_to_batch(loss_t, mask), "el2n": _reduce_to_batch(err_t, mask)}
  if reference_logits is not None:
    reference_loss = _reduce_to_batch(token_terms(jax.lax.stop_gradient(reference_logits))[0], mask)
  if reference_loss is not None:
    reference_loss = jnp.asarray(reference_loss, jnp.float32)
    if reference_loss.shape != out["loss"].shape:
      raise ValueError(
        f"per_example_scores: reference_loss must have shape {out['loss'].shape}, got "
        f"{reference_loss.shape}"
      )
    out["excess_loss"] = out["loss"] - reference_loss
  # The loss stays differentiable so the step can train on mean(scores["loss"]) and get the
  # scores for free; the selection scores carry no gradient.
  return {k: v if k == "loss" else jax.lax.stop_gradient(v) for k, v in out.items()}


def combine(scores: dict[str, jax.Array], method: ScoreName = "auto") -> jax.Array:
  """One ``[batch]`` score from :func:`per_example_scores`' dictionary.

  Args:
    scores: the dictionary.
    method: a key (``"loss"``, ``"el2n"``, ``"excess_loss"``) or ``"auto"``:
      ``excess_loss`` when present, else ``el2n``.

  Returns:
    The chosen score.

  Raises:
    ValueError: for a ``method`` that is no score's name nor ``"auto"``.
    KeyError: naming the missing score and the available ones.

  Example:
    >>> import jax.numpy as jnp
    >>> combine({"loss": jnp.ones(2), "el2n": jnp.zeros(2)}).tolist()
    [0.0, 0.0]
  """
  if method not in typing.get_args(ScoreName):
    choices = ", ".join(map(repr, typing.get_args(ScoreName)))
    raise ValueError(f"budget.data.combine: method must be one of {choices}, got {method!r}")
  key = method
  if method == "auto":
    key = "excess_loss" if "excess_loss" in scores else "el2n"
  if key not in scores:
    raise KeyError(
      f"budget.data.combine: score {key!r} is not available; have {sorted(scores)} "
      "(excess_loss needs reference_loss or reference_logits)"
    )
  return scores[key]


class Selection(NamedTuple):
  """Result of :func:`select`.

  Attributes:
    batch: the kept examples (``mode="top_k"``: ``k`` rows) or the whole batch
      (``mode="threshold"``).
    index: positions of the kept rows in the input batch (``top_k``), else None.
    mask: ``[batch]`` boolean, True for kept examples.
    threshold: the lowest kept score.
  """

  batch: Any
  index: jax.Array | None
  mask: jax.Array
  threshold: jax.Array


def selected_count(batch_size: int, keep_fraction: float, multiple_of: int = 1) -> int:
  """Rows :func:`select` keeps: ``keep_fraction * batch_size`` rounded to ``multiple_of``.

  Rounds to the nearest multiple of ``multiple_of`` (at least one multiple),
  so that the kept batch still divides evenly over the batch shards.

  Raises:
    ValueError: if ``keep_fraction`` is not in (0, 1] or ``multiple_of`` does
      not divide ``batch_size``.

  Example:
    >>> selected_count(64, 0.3, multiple_of=8)
    16
  """
  _check_fraction(keep_fraction)
  if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
    raise ValueError(
      f"budget.data.select: multiple_of must be an integer >= 1, got {multiple_of!r}"
    )
  if batch_size % multiple_of:
    raise ValueError(
      f"budget.data.select: multiple_of ({multiple_of}) must divide the batch size ({batch_size})"
    )
  units = batch_size // multiple_of
  return multiple_of * min(units, max(1, int(math.floor(keep_fraction * units + 0.5))))


def _is_tracer(x: Any) -> bool:
  tracer = getattr(jax.core, "Tracer", None)
  if tracer is not None:
    return isinstance(x, tracer)
  return isinstance(x, jax.Array) and not hasattr(x, "addressable_shards")


def _check_fraction(keep_fraction: Any) -> None:
  if _is_tracer(keep_fraction):
    raise TypeError(
      "budget.data.select: keep_fraction must be a static Python float (it sets the output "
      "shape); mark it static in jit"
    )
  try:
    value = float(keep_fraction)
  except (TypeError, ValueError):
    raise TypeError(
      f"budget.data.select: keep_fraction must be a float in (0, 1], got {keep_fraction!r}"
    ) from None
  if not (0.0 < value <= 1.0):
    raise ValueError(f"budget.data.select: keep_fraction must be in (0, 1], got {keep_fraction!r}")


def select(
  batch: Any,
  scores: jax.Array,
  keep_fraction: float,
  *,
  mode: Literal["top_k", "threshold"] = "top_k",
  multiple_of: int = 1,
  sharding: Any = None,
) -> Selection:
  """Keeps the highest-scoring ``keep_fraction`` of a batch; jittable, works on sharded batches.

  ``top_k`` ranks the global ``[batch]`` scores with ``jax.lax.top_k`` (XLA
  gathers the sharded scores, a few bytes per example) and takes the kept rows
  of every batch leaf; the kept batch is ``k`` rows, so the training step on it
  costs ``k / batch`` of the full one. ``threshold`` keeps the batch and its
  shardings untouched and returns a mask of the examples at or above the
  global ``1 - keep_fraction`` quantile, for weighting a loss.

  Args:
    batch: pytree of arrays whose leading axis is the batch.
    scores: ``[batch]`` scores; higher is kept.
    keep_fraction: static float in (0, 1].
    mode: ``"top_k"`` or ``"threshold"``.
    multiple_of: round the kept count to this multiple (e.g. the number of
      batch shards, so the kept batch divides evenly); see
      :func:`selected_count`.
    sharding: for ``top_k``, a ``jax.sharding.Sharding`` (or pytree of them
      matching ``batch``) to constrain the kept batch to; by default a leaf
      that is a concrete array keeps its own sharding when ``k`` divides evenly.

  Returns:
    A :class:`Selection`.

  Raises:
    ValueError: if ``keep_fraction`` is not in (0, 1], ``mode`` is unknown, or
      leaves do not share the scores' batch size.
    TypeError: if ``keep_fraction`` is traced.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> batch = {"x": jnp.arange(8.0)[:, None], "y": jnp.arange(8)}
    >>> sel = jax.jit(select, static_argnums=2)(batch, -jnp.arange(8.0), 0.25)
    >>> sel.batch["y"].tolist()
    [0, 1]
  """
  _check_fraction(keep_fraction)
  if mode not in ("top_k", "threshold"):
    raise ValueError(f"budget.data.select: mode must be 'top_k' or 'threshold', got {mode!r}")
  scores = jnp.asarray(scores)
  if scores.ndim != 1:
    raise ValueError(f"budget.data.select: scores must be [batch], got shape {scores.shape}")
  n = scores.shape[0]
  leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
  bad = [
    f"{jax.tree_util.keystr(p)}: {getattr(x, 'shape', None)}"
    for p, x in leaves
    if not getattr(x, "shape", ()) or x.shape[0] != n
  ]
  if bad:
    raise ValueError(
      f"budget.data.select: every batch leaf needs leading axis {n} (the scores' length); "
      f"found {', '.join(bad)}"
    )
  k = selected_count(n, float(keep_fraction), multiple_of)
  scores = scores.astype(jnp.float32)
  if mode == "threshold":
    # The k-th largest score: the global (1 - k/n) quantile of the scores.
    q = jnp.sort(_gathered(scores))[n - k]
    mask = scores >= q
    return Selection(batch, None, mask, q)
  top, index = jax.lax.top_k(_gathered(scores), k)
  mask = jnp.zeros((n,), bool).at[index].set(True)
  if sharding is None:
    shardings = [_own_sharding(x, k) for _, x in leaves]
  elif isinstance(sharding, jax.sharding.Sharding):
    shardings = [sharding] * len(leaves)
  else:
    shardings = treedef.flatten_up_to(sharding)
  kept = []
  for (_, x), s in zip(leaves, shardings):
    y, placed = _take_rows(x, index, s)
    if s is not None and not placed:
      y = jax.lax.with_sharding_constraint(y, s)
    kept.append(y)
  return Selection(jax.tree_util.tree_unflatten(treedef, kept), index, mask, top[-1])


def _take_rows(x: jax.Array, index: jax.Array, sharding: Any) -> tuple[jax.Array, bool]:
  """``x[index]`` and whether it is placed; explicit-sharding meshes need the output sharding."""
  aval_sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(aval_sharding, "spec", None)
  if spec is None or all(a is None for a in spec):
    return jnp.take(x, index, axis=0), False
  if sharding is None:
    n_shards = math.prod(
      aval_sharding.mesh.shape[a]
      for a in ((spec[0],) if isinstance(spec[0], str) else (spec[0] or ()))
    )
    keep_spec = index.shape[0] % n_shards == 0
    sharding = jax.sharding.NamedSharding(
      aval_sharding.mesh,
      jax.sharding.PartitionSpec(*(spec if keep_spec else (None, *tuple(spec)[1:]))),
    )
  return x.at[index].get(out_sharding=sharding), True


def _gathered(scores: jax.Array) -> jax.Array:
  """The scores replicated, for a global ranking (explicit-sharding meshes need it spelled out)."""
  aval_sharding = getattr(jax.typeof(scores), "sharding", None)
  spec = getattr(aval_sharding, "spec", None)
  if spec is not None and any(a is not None for a in spec):
    mesh = getattr(aval_sharding, "mesh", None)
    target = (
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      if mesh is not None and not getattr(mesh, "empty", False)
      else jax.sharding.PartitionSpec()
    )
    return jax.sharding.reshard(scores, target)
  return scores


def _own_sharding(x: Any, k: int) -> Any:
  """The sharding of a concrete array if its batch axis can be split the same way over k rows."""
  s = getattr(x, "sharding", None)
  if _is_tracer(x) or not isinstance(s, jax.sharding.NamedSharding):
    return None
  spec = tuple(s.spec) + (None,) * (x.ndim - len(s.spec))
  axes = spec[0]
  if axes is None:
    return s
  axes = axes if isinstance(axes, tuple) else (axes,)
  shards = math.prod(s.mesh.shape[a] for a in axes)
  return s if k % shards == 0 else None
