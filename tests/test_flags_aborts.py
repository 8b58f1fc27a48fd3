"""Options with which XLA aborts the process compiling some programs: what the registry
records is what the installed XLA does (asked in a helper process), recommendations leave
such options out, validation warns, and a compile they would abort raises instead."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

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


WINDOWED = "xla_gpu_threshold_for_windowed_einsum_mib"

# A helper process: grad of a scan over layers of 2048 x 2048 bf16 weights (8 MiB) split over
# 8 devices, compiled deviceless for h100x8 once per (threshold in MiB, how, form) of the JSON
# list argv[1], printing one word per compile: "guarded" compiles through jax_overlap's guard
# (REFUSED where it raises), "xla" straight through XLA; form "gspmd" (jit over sharded
# arrays) or "shard_map" (the same layers, tensor-parallel, in a shard_map: the user's
# per-device dots, which XLA's partitioner leaves alone).
_WINDOWED_HELPER = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_overlap import ConfigError
from jax_overlap._src.compile.compiler import compile_for_target
from jax_overlap._src.targets import compile_only_mesh
mesh = compile_only_mesh("h100x8", {"x": 8})
size = 2048
c = jax.ShapeDtypeStruct((512, size), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
def gspmd_layer(c, w):
  return c + jnp.tanh(c @ w[0]) @ w[1], None
def tp_layer(c, w):
  g = jax.lax.all_gather(c, "x", axis=0, tiled=True)
  h = jnp.tanh(g @ w[0]) @ w[1]
  return c + jax.lax.psum_scatter(h, "x", scatter_dimension=0, tiled=True), None
specs = (P(None, None, "x"), P(None, "x", None))
body = jax.shard_map(lambda w, c: jax.lax.scan(tp_layer, c, w)[0], mesh=mesh, in_specs=(specs, P("x")), out_specs=P("x"))
programs = {
  "gspmd": (
    lambda w, c: jnp.sum(jax.lax.scan(gspmd_layer, c, w)[0].astype(jnp.float32) ** 2),
    jax.ShapeDtypeStruct((2, 2, size, size), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, None, "x"))),
  ),
  "shard_map": (
    lambda w, c: jnp.sum(body(w, c).astype(jnp.float32) ** 2),
    tuple(jax.ShapeDtypeStruct((2, size, size), jnp.bfloat16, sharding=NamedSharding(mesh, s)) for s in specs),
  ),
}
for threshold, how, form in json.loads(sys.argv[1]):
  loss, w = programs[form]
  options = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_threshold_for_windowed_einsum_mib": threshold}
  word = "COMPILED"
  if how == "guarded":
    try:
      compile_for_target(jax.jit(jax.grad(loss)), w, c, target="h100x8", xla_options=options)
    except ConfigError:
      word = "REFUSED"
  else:
    jax.jit(jax.grad(loss)).lower(w, c).compile(options)
  print("RESULT", word, flush=True)
"""


def _windowed_compiles(*compiles: tuple[int, str, str]) -> list[str]:
  """One helper process's words for ``compiles``, in order; ENDED for the compile that
  ended the process."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
  env["JAX_PLATFORMS"] = "cpu"
  p = subprocess.run(
    [sys.executable, "-c", _WINDOWED_HELPER, json.dumps(compiles)],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  words = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
  if p.returncode < 0:
    return [*words, "ENDED"]
  assert p.returncode == 0, p.stderr[-2000:]
  return words


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_CUDA_PLUGIN, reason="needs jax-cuda13-plugin for deviceless compiles")
def test_a_nonzero_windowed_einsum_threshold_is_guarded_as_xla_acts_on_it():
  # Layers of 2048 x 2048 bf16 weights (8 MiB): XLA windows their dots at thresholds up to
  # 8 MiB. Where the installed XLA ends the process at 0 (asked by the registry's probe),
  # it does at 8 too (in a process of its own), and the guard refuses that compile; at 9
  # nothing is windowed, and XLA and the guard compile it. Where XLA compiles at 0, both
  # compile at 8. The same layers in a shard_map: nothing for XLA to window, compiled at 0
  # by both.
  ends = aborts.aborts(WINDOWED)[0]
  assert _windowed_compiles((8, "xla", "gspmd")) == ["ENDED" if ends else "COMPILED"]
  rest = [(8, "guarded", "gspmd"), (0, "xla", "shard_map"), (0, "guarded", "shard_map")]
  if ends:
    rest += [(9, "xla", "gspmd"), (9, "guarded", "gspmd")]
  want = ["REFUSED" if ends else "COMPILED"] + ["COMPILED"] * (len(rest) - 1)
  assert _windowed_compiles(*rest) == want


def test_a_threshold_aborts_up_to_the_programs_largest_dot():
  # The decision alone, with XLA's answer given: a threshold windows the dots at least that
  # large, so every value up to the largest dot operand of a program with a loop is refused.
  said = lambda name: (True, "segmentation fault")  # noqa: E731

  def layer(c, w):
    return jnp.tanh(c @ w), None

  def lowered(loop: bool, dtype=jnp.bfloat16):
    ws = jax.ShapeDtypeStruct((2, 2048, 2048), dtype)
    c = jax.ShapeDtypeStruct((512, 2048), dtype)
    if loop:
      return jax.jit(lambda ws, c: jax.lax.scan(layer, c, ws)[0]).lower(ws, c)
    return jax.jit(lambda ws, c: layer(layer(c, ws[0])[0], ws[1])[0]).lower(ws, c)

  assert aborts.largest_dot_operand_bytes(lowered(True)) == 8 << 20
  # Dots in functions the program calls, by plain or quoted name (``@"<lambda>"``).
  inner = jax.jit(lambda ws, c: jax.lax.scan(layer, c, ws)[0])
  called = jax.jit(lambda ws, c: inner(ws, c) * 2).lower(
    jax.ShapeDtypeStruct((2, 2048, 2048), jnp.bfloat16),
    jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16),
  )
  assert 'call @"' in called.as_text()
  assert aborts.largest_dot_operand_bytes(called) == 8 << 20
  assert aborts.largest_dot_operand_bytes(lowered(True, jnp.float32)) == 16 << 20
  for value in (0, 1, 8, "8"):
    with pytest.raises(
      ConfigError, match=rf"{WINDOWED}={value} .*at least that many MiB.*8\.0 MiB"
    ):
      aborts.check_program(lowered(True), {WINDOWED: value}, ask=said)
  aborts.check_program(lowered(True), {WINDOWED: 9}, ask=said)
  aborts.check_program(lowered(True, jnp.float32), {WINDOWED: 16 + 1}, ask=said)
  with pytest.raises(ConfigError, match="16.0 MiB"):
    aborts.check_program(lowered(True, jnp.float32), {WINDOWED: 16}, ask=said)
  aborts.check_program(lowered(False), {WINDOWED: 0}, ask=said)  # no loop
  aborts.check_program(lowered(True), {WINDOWED: -1}, ask=said)  # below 0: windows nothing
  # Dots inside a shard_map are the user's per-device ones, which the partitioner leaves
  # alone: not counted; a dot outside it on the map's output is.
  mesh = jax.make_mesh((8,), ("x",))
  body = jax.shard_map(
    lambda ws, c: jax.lax.scan(layer, c, ws)[0], mesh=mesh, in_specs=P(), out_specs=P()
  )
  ws, c = (
    jax.ShapeDtypeStruct((2, 2048, 2048), jnp.bfloat16),
    jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16),
  )
  mapped = jax.jit(body).lower(ws, c)
  assert aborts.largest_dot_operand_bytes(mapped) == 0
  aborts.check_program(mapped, {WINDOWED: 0}, ask=said)
  mixed = jax.jit(lambda ws, c: body(ws, c) @ ws[0]).lower(ws, c)
  assert aborts.largest_dot_operand_bytes(mixed) == 8 << 20
  with pytest.raises(ConfigError, match="outside shard_map"):
    aborts.check_program(mixed, {WINDOWED: 0}, ask=said)
  # Without a program (recommendations, validation): any threshold from 0 may abort.
  assert aborts.aborting({WINDOWED: 64}, ask=said) == {WINDOWED: "segmentation fault"}
  assert aborts.aborting({WINDOWED: -1}, ask=said) == {}
  assert aborts.aborting({WINDOWED: "many"}, ask=said) == {}


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
