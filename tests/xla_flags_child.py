"""The child of tests/test_flags_corpus.py: starts jax's CPU backend under XLA_FLAGS.

A module of its own, importing nothing, so that each child forked from the server that
preloaded jax unpickles its target without importing the test module."""

import os


def start(text: str) -> None:
  """jax's CPU backend under ``XLA_FLAGS=text`` (XLA aborts the process on a bad flag)."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)  # XLA prints its whole flag list before aborting
  os.environ["XLA_FLAGS"] = text
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.devices()
