"""Steps jitted by a framework's own ``jit`` under ``jax_overlap.overlap`` and ``analyze``:
Flax NNX's ``nnx.jit`` and Equinox's ``eqx.filter_jit``.

Each wraps a ``jax.jit`` of a pure function and does its own work around a call:
``nnx.jit`` splits the Module arguments into states, runs its ``jax.jit`` (``jitted_fn``)
on them and merges the states it returns back into the caller's Modules (parameters,
optimizer state, RNG counts, batch statistics); ``filter_jit`` splits its arguments into
arrays and everything else (static), runs its ``jax.jit`` (``_cached``) and puts the
outputs back together. ``overlap`` rewrites that ``jax.jit``, as it rewrites any jitted
step, and leaves the framework the rest: a call runs the framework's wrapper with the
rewritten ``jax.jit`` in its place, so arguments and Modules are handled exactly as without
the decorator. ``analyze`` compiles the ``jax.jit`` on the arguments the wrapper gives it,
so that what a step updates in place (NNX) is among the program's outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from typing import Any

# One swap at a time: an nnx.jit function called from two threads runs one rewritten step.
_SWAP = threading.RLock()


@dataclasses.dataclass(frozen=True)
class Kind:
  """How one framework's ``jit`` wrapper is read.

  Attributes:
    name: the framework's ``jit``, for messages.
    modules: the module prefix its wrapper's class lives under.
    attribute: the wrapper's attribute holding its ``jax.jit``.
    stage: the wrapper's method that only traces or lowers, calling the ``jax.jit``'s
      method of the same name with the arguments a call would pass it.
    in_place: whether the wrapper is changed for the length of a call (NNX's ties its
      ``jax.jit`` to the wrapper) rather than copied with another ``jax.jit``.
  """

  name: str
  modules: str
  attribute: str
  stage: str
  in_place: bool


NNX = Kind("nnx.jit", "flax.nnx", "jitted_fn", "trace", in_place=True)
EQUINOX = Kind("eqx.filter_jit", "equinox", "_cached", "lower", in_place=False)


def kind_of(fn) -> Kind | None:
  """The framework whose ``jit`` made ``fn``, or None for other functions.

  Raises:
    TypeError: a wrapper of a known framework whose ``jax.jit`` this version keeps
      elsewhere.
  """
  module = type(fn).__module__ or ""
  kind = next((k for k in (NNX, EQUINOX) if module.startswith(k.modules)), None)
  if kind is None or not hasattr(fn, kind.stage):
    return None  # another object of the framework (a Module, a Partial)
  inner = getattr(fn, kind.attribute, None)
  if inner is None or not hasattr(inner, kind.stage):
    raise TypeError(
      f"overlap: {module}.{type(fn).__name__} is a {kind.name} function whose jax.jit this "
      f"version keeps elsewhere than {kind.attribute!r}; decorate a functional step "
      "instead: jax.jit of a function of arrays (for Flax NNX, the state of "
      "nnx.split(model), merged in the step with nnx.merge)"
    )
  return kind


@contextlib.contextmanager
def _running(kind: Kind, wrapper, jitted):
  """For the block: the wrapper to call, with ``jitted`` as its ``jax.jit``."""
  if not kind.in_place:
    yield dataclasses.replace(wrapper, **{kind.attribute: jitted})
    return
  with _SWAP:
    saved = getattr(wrapper, kind.attribute)
    setattr(wrapper, kind.attribute, jitted)
    try:
      yield wrapper
    finally:
      setattr(wrapper, kind.attribute, saved)


def is_wrapped_step(fn) -> bool:
  """Whether ``fn`` is a framework's ``jit`` function or one rewritten by ``overlap``."""
  return isinstance(fn, WrappedOverlapped) or kind_of(fn) is not None


def on_arguments(fn, args, kwargs, method):
  """``method(jitted, a, kw)`` for the framework's ``jit`` function ``fn`` (or one rewritten
  by ``overlap``, whose rewritten step is ``jitted`` then): ``jitted`` is the ``jax.jit``
  the wrapper runs, ``a`` and ``kw`` the arguments it passes it for these (Modules split
  into states, static parts apart). Called where the framework calls its ``jax.jit``, so
  that tracing ``jitted`` works as in a call; nothing runs and no Module changes."""
  if isinstance(fn, WrappedOverlapped):
    kind, wrapper, jitted = fn.kind, fn.fn, fn.step
  else:
    kind, wrapper = kind_of(fn), fn
    jitted = getattr(fn, kind.attribute)
  got = []

  class Probe:
    pass

  def stage(*a, **kw):
    got.append(method(jitted, a, kw))

  setattr(Probe, kind.stage, staticmethod(stage))
  with _running(kind, wrapper, Probe) as probing:
    getattr(probing, kind.stage)(*args, **kwargs)
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


class WrappedOverlapped:
  """A framework's ``jit`` step (``nnx.jit``, ``eqx.filter_jit``) rewritten for overlap;
  call it like the original.

  Attributes:
    fn: the framework's ``jit`` function.
    kind: its framework (:class:`Kind`).
    step: the rewritten ``jax.jit`` (an ``Overlapped``): its ``settings``, and its
      ``explain``/``lower`` take the arguments the wrapper passes its ``jax.jit``.
  """

  def __init__(self, fn, kind: Kind, step):
    self.fn = fn
    self.kind = kind
    self.step = step
    self.settings = step.settings
    functools.update_wrapper(self, fn, updated=())

  def _on_arguments(self, method, args, kwargs):
    return on_arguments(self, args, kwargs, lambda _, a, kw: method(*a, **kw))

  def __call__(self, *args, **kwargs):
    with _running(self.kind, self.fn, self.step) as wrapper:
      return wrapper(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """Lowers the rewritten step like the framework's ``jit(...).lower``."""
    with _running(self.kind, self.fn, self.step) as wrapper:
      return wrapper.lower(*args, **kwargs)

  def build(self, *args, **kwargs):
    """What a call with these arguments runs (see ``Overlapped.build``)."""
    return self._on_arguments(self.step.build, args, kwargs)

  def explain(self, *args, **kwargs):
    """What was rewritten and why, for these arguments."""
    return self._on_arguments(self.step.explain, args, kwargs)

  def compiler_options(self, *args, **kwargs) -> dict[str, Any]:
    return dict(self.explain(*args, **kwargs).xla_options)
