"""Steps jitted by Flax NNX (``nnx.jit``) under ``jax_overlap.overlap``.

``nnx.jit`` wraps a ``jax.jit`` of a pure function: each call splits the Module arguments
into states, runs that ``jax.jit`` on them, and merges the states it returns back into the
caller's Modules (parameters, optimizer state, RNG counts, batch statistics). ``overlap``
rewrites the pure function, as it rewrites any jitted step, and leaves NNX to do the rest:
for the length of a call the wrapper's ``jax.jit`` (its ``jitted_fn``) is the rewritten
step, so the caller's Modules are updated exactly as ``nnx.jit`` updates them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any

# One swap at a time: a wrapper called from two threads runs one rewritten step.
_SWAP = threading.RLock()


def wrapper_of(fn) -> Any | None:
  """``fn`` if it is an ``nnx.jit`` function (its ``jax.jit`` reachable), else None.

  Raises:
    TypeError: an NNX-transformed function whose ``jax.jit`` this Flax keeps elsewhere.
  """
  module = type(fn).__module__ or ""
  if not module.startswith("flax.nnx"):
    return None
  inner = getattr(fn, "jitted_fn", None)
  if inner is None or not hasattr(inner, "trace"):
    raise TypeError(
      f"overlap: {type(fn).__module__}.{type(fn).__name__} is a Flax NNX transform "
      "whose jax.jit this version of Flax does not expose as 'jitted_fn'; decorate the "
      "function nnx.jit wraps with overlap inside a functional step instead "
      "(graphdef, state = nnx.split(model); overlap(jax.jit(step))(state, batch) with "
      "nnx.merge(graphdef, state) in step)"
    )
  return fn


def is_nnx_step(fn) -> bool:
  """Whether ``fn`` is an ``nnx.jit`` function or one rewritten by ``overlap``."""
  return isinstance(fn, NnxOverlapped) or wrapper_of(fn) is not None


def on_states(fn, args, kwargs, method):
  """``method(jitted, states, kwargs)`` for the ``nnx.jit`` function ``fn`` (or one
  rewritten by ``overlap``, whose rewritten ``jax.jit`` is ``jitted`` then): ``jitted`` is
  the ``jax.jit`` the wrapper runs, ``states`` the arguments it passes it for these (the
  Modules split into states). Called where NNX traces its ``jax.jit``, so that tracing
  ``jitted`` works as in a call; nothing runs and no Module changes. A compile of
  ``jitted`` returns what the step updates beside its outputs: nothing the step computes
  for the Modules is left out of the program."""
  wrapper, jitted = (fn.fn, fn.step) if isinstance(fn, NnxOverlapped) else (fn, fn.jitted_fn)
  got = []

  class Probe:
    @staticmethod
    def trace(*a, **kw):
      got.append(method(jitted, a, kw))

  with _SWAP:
    saved = wrapper.jitted_fn
    wrapper.jitted_fn = Probe
    try:
      wrapper.trace(*args, **kwargs)
    finally:
      wrapper.jitted_fn = saved
  return got[0]


def graph_nodes(args, kwargs) -> list[str]:
  """Types of the arguments that are Flax NNX graph nodes (Modules, Optimizers, Variables)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return []
  is_node = getattr(getattr(nnx, "graph", None), "is_graph_node", None)
  if is_node is None:
    return []
  return [type(a).__name__ for a in (*args, *kwargs.values()) if is_node(a)]


class NnxOverlapped:
  """An ``nnx.jit`` step rewritten for overlap; call it like the original.

  Attributes:
    fn: the ``nnx.jit`` function.
    step: the rewritten pure step (an ``Overlapped``): its ``settings``, and its
      ``explain``/``lower`` take the states NNX passes to ``jax.jit``.
  """

  def __init__(self, fn, step):
    self.fn = fn
    self.step = step
    self.settings = step.settings
    functools.update_wrapper(self, fn, updated=())

  @contextlib.contextmanager
  def _inside(self, jitted):
    """For the block: ``jitted`` is the wrapper's ``jax.jit``."""
    with _SWAP:
      saved = self.fn.jitted_fn
      self.fn.jitted_fn = jitted
      try:
        yield
      finally:
        self.fn.jitted_fn = saved

  def _on_states(self, method, args, kwargs):
    """``method`` of the rewritten step on the states NNX makes of these arguments."""
    return on_states(self, args, kwargs, lambda _, a, kw: method(*a, **kw))

  def __call__(self, *args, **kwargs):
    with self._inside(self.step):
      return self.fn(*args, **kwargs)

  def trace(self, *args, **kwargs):
    """Traces the rewritten step like ``nnx.jit(...).trace``."""
    with self._inside(self.step):
      return self.fn.trace(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """Lowers the rewritten step like ``nnx.jit(...).lower``."""
    with self._inside(self.step):
      return self.fn.lower(*args, **kwargs)

  def build(self, *args, **kwargs):
    """What a call with these arguments runs (see ``Overlapped.build``)."""
    return self._on_states(self.step.build, args, kwargs)

  def explain(self, *args, **kwargs):
    """What was rewritten and why, for these arguments."""
    return self._on_states(self.step.explain, args, kwargs)

  def compiler_options(self, *args, **kwargs) -> dict[str, Any]:
    return dict(self.explain(*args, **kwargs).xla_options)
