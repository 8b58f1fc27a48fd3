"""The dump settings jax_overlap's own compiles set, whatever XLA_FLAGS holds.

XLA reads XLA_FLAGS once, when the backend starts: each case runs in a child process
started with the XLA_FLAGS under test (MaxText sets these when XLA_FLAGS is unset)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jax_overlap._src.compile import dumps

_HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
needs_plugin = pytest.mark.skipif(
  not _HAS_CUDA_PLUGIN, reason="needs jax-cuda13-plugin for deviceless compiles"
)

MAXTEXT_XLA_FLAGS = (
  "--xla_dump_to={dump}/ --xla_dump_large_constants --xla_dump_hlo_module_re=jit_train_step"
)

# The child: analyze a small FSDP step (its jit is not named train_step) and the same step
# decorated by jax_overlap.overlap (choosing among its variants, without the recompiles
# with latency profiles: the same compile path, a third of the time); prints what the
# reports and the choice are.
_CHILD = r"""
import json, sys
import jax_overlap
from jax_overlap._src.compile import dumps
from jax_overlap.examples import shard_map_fsdp as S

if sys.argv[1] == "without_settings":  # a jaxlib that takes none of them per compile
  dumps.dump_settings = lambda: {}
fn, args = S.build("h100x8", layers=2, hidden=128, mlp=256, heads=2, seq=64)

def summary(report):
  return {
    "step_time_s": report.step_time_s,
    "comm_time_s": report.comm_time_s,
    "exposed_comm_s": report.exposed_comm_s,
    "kernels": sorted(k.name for k in report.kernels),
    "collectives": sorted(c.name for c in report.collectives),
  }

try:
  out = {"plain": summary(jax_overlap.analyze(fn, *args, target="h100x8"))}
except ValueError as e:
  print("JAX_OVERLAP_CHILD" + json.dumps({"error": str(e)}))
  sys.exit(0)
if sys.argv[1] == "analyze":
  print("JAX_OVERLAP_CHILD" + json.dumps(out))
  sys.exit(0)
ov = jax_overlap.overlap(fn, target="h100x8", schedule_from_estimates=False)
explained = ov.explain(*args)
out["overlap"] = summary(jax_overlap.analyze(ov, *args, target="h100x8"))
out["chosen"] = explained.chosen
out["candidates"] = [name for name, _ in explained.candidates]
print("JAX_OVERLAP_CHILD" + json.dumps(out))
"""


def _child(tmp_path, xla_flags: str | None, mode: str = "") -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  # Compiled anew in each child: neither the compile store nor a selection made under other
  # XLA_FLAGS answers for it.
  env.update(
    JAX_PLATFORMS="cpu",
    JAX_OVERLAP_COMPILE_CACHE="0",
    JAX_OVERLAP_CACHE_DIR=str(tmp_path / f"cache{len(list(tmp_path.iterdir()))}"),
    PYTHONPATH=os.pathsep.join(p for p in [_root(), env.get("PYTHONPATH", "")] if p),
  )
  p = subprocess.run(
    [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, env=env, timeout=900
  )
  line = next((ln for ln in p.stdout.splitlines() if ln.startswith("JAX_OVERLAP_CHILD")), None)
  assert line is not None, p.stderr[-3000:]
  return json.loads(line[len("JAX_OVERLAP_CHILD") :])


def _root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dump_settings_are_options_this_jaxlib_takes():
  settings = dumps.dump_settings()
  # The ones the analysis cannot do without are per-compile options on every jaxlib tested.
  for name in ("xla_dump_hlo_module_re", "xla_dump_hlo_as_text", "xla_dump_max_hlo_modules"):
    assert settings[name] == dumps.DUMP_SETTINGS[name]
  assert set(settings) <= set(dumps.DUMP_SETTINGS)


def test_settings_win_over_the_callers_but_for_the_ptx_emitter():
  opts = dumps.with_dump_settings(
    {"xla_dump_to": "/d", "xla_dump_hlo_module_re": "x", "xla_dump_emitter_re": "^ptx$"}
  )
  assert opts["xla_dump_hlo_module_re"] == ".*"
  assert opts["xla_dump_emitter_re"] == "^ptx$"
  assert dumps.with_dump_settings({"a": 1}) == {"a": 1}  # no dump, nothing set


@needs_plugin
@pytest.mark.slow
def test_maxtext_xla_flags_give_the_same_reports(tmp_path):
  dump = tmp_path / "xla_dump"
  plain = _child(tmp_path, None)
  assert _child(tmp_path, MAXTEXT_XLA_FLAGS.format(dump=dump)) == plain
  # XLA_FLAGS's own dump folder got no module of these steps.
  assert not dump.exists() or not any(dump.iterdir())
  # The other settings that hide the files read (a format alone, a module count) or bury
  # them (per-pass dumps).
  flags = "--xla_dump_hlo_as_proto --xla_dump_max_hlo_modules=1 --xla_dump_hlo_pass_re=.*"
  assert _child(tmp_path, flags, "analyze") == {"plain": plain["plain"]}


@needs_plugin
def test_a_hidden_dump_names_the_setting(tmp_path):
  out = _child(tmp_path, "--xla_dump_hlo_module_re=jit_train_step", "without_settings")
  assert out["error"] == (
    "analyze: XLA wrote no optimised HLO (*after_optimizations.txt) for this compile; "
    "XLA_FLAGS sets xla_dump_hlo_module_re=jit_train_step, which can keep XLA from writing it"
  )


def test_missing_dump_without_a_setting_blames_nothing_in_xla_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
  e = dumps.missing_dump("analyze", "optimised HLO")
  assert str(e) == (
    "analyze: XLA wrote no optimised HLO for this compile; check that the function has any "
    "computation"
  )
