"""Exceptions raised by jax_overlap."""

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
  "ConfigError",
  "NothingToOverlapWarning",
  "caller_stacklevel",
  "user_call_error",
  "trace_user_fn",
]

T = TypeVar("T")


class ConfigError(RuntimeError):
  """Configuration that cannot take effect: bad flags, or flags set too late."""


class NothingToOverlapWarning(UserWarning):
  """``@overlap`` found nothing to move in a step: it runs as written (warned once per
  decorated step)."""


# Modules whose frames a warning skips to reach the user's line: this package, and the
# frameworks whose jit wrappers call the decorated step (and the standard library between).
_NOT_THE_CALLER = ("jax_overlap", "jax", "jaxlib", "flax", "equinox", "contextlib", "functools")


def caller_stacklevel() -> int:
  """``stacklevel`` for a ``warnings.warn`` made by the caller of this function, such that
  the warning names the first line outside jax_overlap and the frameworks that call it
  (a decorated step called directly, or through ``nnx.jit``'s or ``filter_jit``'s wrapper)."""
  import sys

  level, frame = 1, sys._getframe(1)
  while frame is not None:
    name = frame.f_globals.get("__name__", "")
    if not any(name == p or name.startswith(p + ".") for p in _NOT_THE_CALLER):
      return level
    level, frame = level + 1, frame.f_back
  return 1


def _fn_name(fn: Any) -> str:
  fn = getattr(fn, "__wrapped__", fn)
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _describe(x: Any) -> str:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    import numpy as np

    return f"{np.dtype(x.dtype).name}{list(x.shape)}"
  import jax

  leaves = jax.tree.leaves(x)
  if len(leaves) > 1 or (leaves and leaves[0] is not x):  # identity: arrays' == is elementwise
    return f"{type(x).__name__} of {len(leaves)} {'leaves' if len(leaves) > 1 else 'leaf'}"
  return type(x).__name__


def user_call_error(
  api: str, fn: Any, args: tuple, kwargs: dict, error: BaseException
) -> Exception:
  """The error to raise when tracing the user's ``fn`` on their arguments fails.

  It names the API, the function and the arguments it was called with, and
  keeps the kind of the original error (the nearest built-in exception class,
  so ``except TypeError`` still catches a shape mismatch). The original is
  chained as the cause.
  """
  kind = next(
    (c for c in type(error).__mro__ if c.__module__ == "builtins" and issubclass(c, Exception)),
    RuntimeError,
  )
  if kind is Exception:
    kind = RuntimeError
  shown = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
  first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return kind(
    f"{api}: {_fn_name(fn)}({', '.join(shown)}) fails when traced on these arguments, before "
    f"any compilation: {type(error).__name__}: {first}"
  )


def trace_user_fn(api: str, fn: Any, args: tuple, kwargs: dict, trace: Callable[[], T]) -> T:
  """Runs ``trace()`` (a trace of the user's ``fn``); its errors become the user's own.

  Raises:
    The kind of error the trace raised, with :func:`user_call_error`'s message.
  """
  try:
    return trace()
  except Exception as e:  # noqa: BLE001 - re-raised with the caller's context
    raise user_call_error(api, fn, args, kwargs, e) from e
