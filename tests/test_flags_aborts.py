"""Options with which XLA aborts the process compiling some programs: what the registry
records is what the installed XLA does (asked in a helper process), recommendations leave
such options out, validation warns, and a compile they would abort raises instead."""

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import pytest

from jax_overlap import ConfigError, flags
from jax_overlap._src.flags import aborts
from jax_overlap._src.flags import probe as probe_lib
from jax_overlap._src.flags.validation import version_tuple

ABORTING = sorted(n for n, f in flags.REGISTRY.items() if f.aborts)
ESTIMATOR = "xla_gpu_enable_analytical_latency_estimator"
_HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None


def test_the_options_seen_to_end_compiles_are_registered():
  assert ABORTING == [ESTIMATOR, "xla_gpu_threshold_for_windowed_einsum_mib"]
  entry = flags.REGISTRY[ESTIMATOR].aborts
  assert entry.value == "true" and entry.programs == "while_loop"


@pytest.mark.skipif(not _HAS_CUDA_PLUGIN, reason="needs jax-cuda13-plugin for deviceless compiles")
@pytest.mark.parametrize("name", ABORTING)
def test_registered_aborts_are_what_the_installed_xla_does(name):
  # XLA itself, in a helper process: a scanned step compiled deviceless with the option.
  entry = flags.REGISTRY[name].aborts
  version = version_tuple(probe_lib.jaxlib_version())
  aborted, message = aborts.probe(name)
  assert all(version_tuple(v) >= version_tuple(entry.since) for v in entry.seen_in)
  assert all(version_tuple(v) < version_tuple(entry.since) for v in entry.clean_in)
  if probe_lib.jaxlib_version() in entry.clean_in:
    assert aborted is False, message  # the registry says this release compiles it
  elif version < version_tuple(entry.since):
    assert aborted in (True, False), message  # a release not seen: whatever XLA answers
  elif probe_lib.jaxlib_version() in entry.seen_in:
    assert aborted is True, message
    assert message and not re.match(r"[FEWI]\d{4} ", message)  # glog's prefix cut
  else:
    assert aborted in (True, False), message  # a release not seen: whatever XLA answers


def _lowered(loop: bool):
  def layer(c, w):
    return jnp.tanh(c @ w), None

  def f(ws, c):
    if loop:
      return jax.lax.scan(layer, c, ws)[0]
    for i in range(ws.shape[0]):
      c = layer(c, ws[i])[0]
    return c

  return jax.jit(f).lower(jnp.ones((2, 8, 8)), jnp.ones((4, 8)))


def test_a_compile_the_options_would_abort_raises_a_config_error(monkeypatch):
  # The decision alone, with XLA's answer given (the installed XLA's own answer is the
  # test above): a program with a loop and the option set is refused, naming where the
  # option came from; without a loop, or with the option off, it compiles.
  said = lambda name: (True, "shape.h:847] Check failed: buffer != nullptr")  # noqa: E731
  with pytest.raises(ConfigError, match=f"{ESTIMATOR}=true \\(set per compile\\).*while loop"):
    aborts.check_program(_lowered(True), {ESTIMATOR: True}, ask=said)
  aborts.check_program(_lowered(False), {ESTIMATOR: True}, ask=said)
  aborts.check_program(_lowered(True), {ESTIMATOR: False}, ask=said)
  # Bare: true, as XLA reads a bool. (The session's own XLA_FLAGS stay: they set the CPU
  # device count, read when the backend starts.)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + f" --{ESTIMATOR}")
  with pytest.raises(ConfigError, match="set in XLA_FLAGS.*Check failed"):
    aborts.check_program(_lowered(True), {}, ask=said)
  # What XLA does not abort on passes whatever the program.
  aborts.check_program(_lowered(True), {ESTIMATOR: True}, ask=lambda name: (False, ""))
  assert aborts.program_kinds(_lowered(True)) == {"while_loop"}
  assert aborts.program_kinds(_lowered(False)) == frozenset()


@pytest.mark.skipif(not _HAS_CUDA_PLUGIN, reason="needs jax-cuda13-plugin for deviceless compiles")
def test_recommendations_and_validation_follow_what_the_installed_xla_does():
  aborted, _ = aborts.aborts(ESTIMATOR)
  # Ampere's recommendation sets the estimator, unless the installed XLA aborts with it.
  assert (ESTIMATOR in flags.recommended(target="a100x8")) is not aborted
  problems = [p for p in flags.validate({ESTIMATOR: True}) if p.kind == "aborts"]
  assert len(problems) == int(aborted)
  for p in problems:
    assert p.severity == "warning" and "while loop" in p.message and "leave it unset" in p.message
  assert not [p for p in flags.validate({ESTIMATOR: False}) if p.kind == "aborts"]
  # The tensor-parallel recommendation's windowed einsum threshold, likewise.
  windowed = "xla_gpu_threshold_for_windowed_einsum_mib"
  tp = flags.recommended(target="h100x8", workload="tensor_parallel")
  assert (windowed in tp) is not aborts.aborts(windowed)[0]


@pytest.mark.parametrize(
  "version, asked",
  [("0.10.2", False), ("0.10.1", True), ("0.11.1", True), ("0.13.0", True)],
)
def test_every_release_the_registry_has_not_seen_compile_is_asked(
  version, asked, monkeypatch, tmp_path
):
  # The registry saw 0.10.2 compile with the windowed-einsum threshold at 0: that release
  # is taken on trust; one before the first seen to crash, or after it, is asked.
  name = "xla_gpu_threshold_for_windowed_einsum_mib"
  assert "0.10.2" in flags.REGISTRY[name].aborts.clean_in
  monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(probe_lib, "jaxlib_version", lambda: version)
  monkeypatch.setattr(aborts, "_answers", probe_lib.Answers("aborts", 2))
  monkeypatch.setattr(aborts, "_unasked", {})
  calls = []
  monkeypatch.setattr(aborts, "probe", lambda n: calls.append(n) or (True, "XLA's words"))
  assert aborts.aborts(name) == ((True, "XLA's words") if asked else (False, ""))
  assert calls == ([name] if asked else [])
  # Where XLA cannot be asked, the registry's record: aborting from the first version seen.
  monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(tmp_path / "unasked"))
  monkeypatch.setattr(aborts, "_answers", probe_lib.Answers("aborts", 2))
  monkeypatch.setattr(aborts, "probe", lambda n: (None, "no CUDA plugin"))
  verdict, _ = aborts.aborts(name)
  assert verdict is (version_tuple(version) >= version_tuple(flags.REGISTRY[name].aborts.since))
