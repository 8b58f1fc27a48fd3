"""Latency profiles written from the analysis and read back by XLA's scheduler."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import jax_overlap
from jax_overlap.examples import shard_map_fsdp as S


@pytest.fixture(scope="module")
def analysed():
  """One compile of a small scan_layers step, shared by the tests."""
  fn, args = S.build("h100x8", layers=2, hidden=256, mlp=512, heads=4, seq=64, form="scan_layers")
  opts = jax_overlap.flags.as_compiler_options(target="h100x8", workload="fsdp")
  return fn, args, opts, jax_overlap.analyze(fn, *args, target="h100x8", xla_options=opts)


def test_profile_names_every_instruction_once_with_the_analysis_costs(tmp_path, analysed):
  fn, args, opts, report = analysed
  text = jax_overlap.latency_profile.profile_text(report)
  entries = re.findall(r'costs \{ name: "([^"]+)" cost_us: ([0-9.]+) \}', text)
  names = [n for n, _ in entries]
  assert len(names) == len(set(names)) == len(re.findall("^costs ", text, re.M))
  # Loop iterations (name@i) collapse to the instruction's name.
  assert not any("@" in n for n in names)
  expected = {k.name.split("@")[0]: k.time_s for k in [*report.kernels, *report.collectives]}
  # Async fusions' starts and dones are named too (costing nothing; their kernel is named).
  from jax_overlap._src.analysis.latency_profile import _async_pairs

  for start, _, ends in _async_pairs(report.hlo_text):
    expected.update(dict.fromkeys((start, *ends), 0.0))
  assert set(names) == set(expected)
  for n, us in entries:
    assert abs(float(us) - expected[n] * 1e6) <= 1e-3
  path = jax_overlap.latency_profile.write_profile(report, str(tmp_path))
  assert os.path.dirname(path) == str(tmp_path)
  assert open(path).read() == text
  # Named by content: the same report gives the same file.
  assert jax_overlap.latency_profile.write_profile(report, str(tmp_path)) == path


def test_xla_recompiles_with_the_profile_and_keeps_the_names(tmp_path, analysed):
  fn, args, opts, report = analysed
  path = jax_overlap.latency_profile.write_profile(report, str(tmp_path))
  again = jax_overlap.analyze(
    fn, *args, target="h100x8", xla_options={**opts, jax_overlap.latency_profile.OPTION: path}
  )
  assert again.xla_options[jax_overlap.latency_profile.OPTION] == path
  names = {k.name.split("@")[0] for k in [*again.kernels, *again.collectives]}
  from jax_overlap._src.analysis.latency_profile import _async_pairs

  profiled = set(re.findall(r'costs \{ name: "([^"]+)"', open(path).read())) - {
    n for start, _, ends in _async_pairs(report.hlo_text) for n in (start, *ends)
  }
  # The recompile has the instructions the profile names, so XLA uses every cost.
  assert names == profiled


@pytest.mark.slow
def test_xla_schedules_by_the_profiles_costs(tmp_path, analysed):
  # Two profiles with the same names and different costs: if XLA's scheduler reads the
  # costs, the two schedules differ; the same profile twice gives the same schedule.
  fn, args, opts, report = analysed
  entries = re.findall(
    r'costs \{ name: "([^"]+)" cost_us: ([0-9.]+) \}',
    jax_overlap.latency_profile.profile_text(report),
  )
  collectives = {c.name.split("@")[0] for c in report.collectives}

  def schedule(scale_collectives: float, name: str):
    path = tmp_path / name
    path.write_text(
      "".join(
        f'costs {{ name: "{n}" cost_us: {float(us) * (scale_collectives if n in collectives else 1.0):.3f} }}\n'
        for n, us in entries
      )
    )
    r = jax_overlap.analyze(
      fn,
      *args,
      target="h100x8",
      xla_options={**opts, jax_overlap.latency_profile.OPTION: str(path)},
    )
    return [(c.name, c.start_index, c.done_index) for c in r.collectives]

  cheap = schedule(1e-3, "cheap.pbtxt")
  costly = schedule(1e3, "costly.pbtxt")
  assert cheap == schedule(1e-3, "cheap_again.pbtxt")
  assert cheap != costly


def test_a_conditional_costs_its_counted_branch_and_xla_misses_nothing_it_costs(tmp_path, capfd):
  # Gradient clipping under lax.cond: the conditional is one node of XLA's schedule. The
  # profile gives it the cost of the branch the analysis counted, names every instruction
  # as XLA's scheduler knows it (XLA 0.11 renames a collective it makes synchronous after
  # scheduling), and the branch the analysis does not count is costed too (outside the
  # step): XLA, reading the profile back, finds a cost for every instruction it schedules.
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax_overlap.targets.compile_only_mesh("h100x8", ("fsdp",))
  w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

  @jax.jit
  def step(w, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    norm = jnp.sqrt(jnp.sum(g * g))
    g = jax.lax.cond(norm > 1.0, lambda g: jnp.tanh(g @ g.T) @ g / norm, lambda g: g * 0.5, g)
    return w - 0.1 * g

  opts = jax_overlap.flags.as_compiler_options(target="h100x8")
  report = jax_overlap.analyze(step, w, x, target="h100x8", xla_options=opts)
  from jax_overlap._src.analysis import hlo

  module = hlo.parse_module(report.hlo_text)
  (cond,) = [i for c in module.computations.values() for i in c.instructions
             if i.opcode == "conditional"]  # fmt: skip
  text = jax_overlap.latency_profile.profile_text(report)
  costs = {n: float(us) for n, us in re.findall(r'name: "([^"]+)" cost_us: ([0-9.]+)', text)}
  items = {k.name.split("@")[0]: k.time_s * 1e6 for k in [*report.kernels, *report.collectives]}
  branches = {
    b: sum(items.get(i.name, 0.0) for i in module.computations[b].instructions) for b in cond.called
  }
  counted = max(branches, key=branches.get)
  assert branches[counted] > 0
  assert costs[cond.name] == pytest.approx(branches[counted], abs=2e-3)
  uncounted = {
    i.name for b in cond.called if b != counted for i in module.computations[b].instructions
  }

  def missed(profile: str) -> set[str]:
    """The instructions XLA's scheduler found no cost for in ``profile`` (as the report
    gives them; XLA's own lines about them are kept off stderr)."""
    path = tmp_path / f"{len(profile)}.pbtxt"
    path.write_text(profile)
    capfd.readouterr()
    opts_p = {**opts, jax_overlap.latency_profile.OPTION: str(path)}
    again = jax_overlap.analyze(step, w, x, target="h100x8", xla_options=opts_p)
    assert "profile_guided_latency_estimator" not in capfd.readouterr().err
    assert again.profile_missing is not None
    return set(again.profile_missing)

  assert report.uncounted_costs and set(report.uncounted_costs) <= uncounted
  assert all(
    costs[n] == pytest.approx(t * 1e6, abs=2e-3) for n, t in report.uncounted_costs.items()
  )
  assert not set(report.uncounted_costs) & set(items)  # not in the step
  assert missed(text) == set()
  # Without the conditional's entry XLA says so (what the check above would see).
  without = "".join(line + "\n" for line in text.splitlines() if cond.name not in line)
  assert cond.name in missed(without)


# A child process: a scanned FSDP step compiled with a profile written from its analysis
# (scanned layers: XLA from jaxlib 0.11 runs their slice copies as async fusion-start /
# fusion-done pairs), and once more with a profile of the analysis' kernels and collectives
# alone. Prints what each recompile's report says XLA's scheduler missed in the profile.
_PROFILED_CHILD = r"""
import json, os, re, sys
import jax_overlap
from jax_overlap._src.analysis import latency_profile
from jax_overlap.examples import shard_map_fsdp as S

fn, args = S.build("h100x8", layers=4, hidden=1024, mlp=2048, heads=8, seq=64, form="scan_layers")
opts = {"xla_gpu_enable_latency_hiding_scheduler": True}
report = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=opts)
full = latency_profile.profile_text(report)
named = {k.name.split("@")[0] for k in [*report.kernels, *report.collectives]}
bare = "".join(
  ln + "\n" for ln in full.splitlines()
  if ln.startswith("costs") and re.search(r'name: "([^"]+)"', ln).group(1) in named
)
out = {"async_starts": len(latency_profile._async_pairs(report.hlo_text))}
for key, text in (("full", full), ("bare", bare)):
  path = os.path.join(sys.argv[1], key + ".pbtxt")
  open(path, "w").write(text)
  again = jax_overlap.analyze(
    fn, *args, target="h100x8", xla_options={**opts, latency_profile.OPTION: path}
  )
  out[key] = {"missing": list(again.profile_missing), "notes": again.notes}
print("JAX_OVERLAP_CHILD" + json.dumps(out))
"""


@pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
  reason="needs jax-cuda13-plugin for deviceless compiles",
)
def test_a_compile_with_a_written_profile_prints_no_pgle_warning(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(
    JAX_PLATFORMS="cpu",
    JAX_OVERLAP_COMPILE_CACHE="0",
    JAX_OVERLAP_CACHE_DIR=str(tmp_path / "cache"),
    PYTHONPATH=os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p),
  )
  p = subprocess.run(
    [sys.executable, "-c", _PROFILED_CHILD, str(tmp_path)],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  line = next((ln for ln in p.stdout.splitlines() if ln.startswith("JAX_OVERLAP_CHILD")), None)
  assert line is not None, p.stderr[-3000:]
  out = json.loads(line[len("JAX_OVERLAP_CHILD") :])
  # Every instruction the profile's compile named is in it; XLA 0.12.1 numbers a scan's
  # dynamic-slice and dynamic-update-slice fusions anew in the next compile (from .9 in
  # one, from 0 in the other), and only those can be missed: XLA's lines about them are kept off stderr and counted
  # in the report's notes.
  renumbered = [n for n in out["full"]["missing"] if not n.startswith("loop_dynamic_")]
  assert renumbered == [], out["full"]
  if out["full"]["missing"]:
    assert any("kept off stderr" in n for n in out["full"]["notes"]), out["full"]
  # XLA's lines about the profile never reach stderr, not even the bare profile's.
  assert "profile_guided_latency_estimator" not in p.stderr
  # Where XLA runs async fusions, a profile without their starts and dones misses them,
  # and the report says so once.
  if out["async_starts"]:
    # (XLA 0.12.0 asks for them; 0.12.1 for the renumbered fusions above only.)
    missed = out["bare"]["missing"]
    assert missed and all(n.startswith(("fusion-", "loop_dynamic_")) for n in missed), out["bare"]
    (said,) = [n for n in out["bare"]["notes"] if "does not name" in n]
    assert missed[0] in said


def test_async_fusions_are_named_with_the_latency_of_their_kernel():
  # XLA asks the start and the done their cost by name, and their latency by the start's
  # name (or the wrapped instruction's); the scheduling name is the one XLA knows.
  from jax_overlap._src.analysis.analyze import analyze_hlo

  hlo_text = """HloModule m, is_scheduled=true

%fused (q0: f32[4096,1024], q1: s32[]) -> f32[1,1024] {
  %q0 = f32[4096,1024]{1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%q0, %q1, %z), dynamic_slice_sizes={1,1024}
}

%wrapped (p0: f32[4096,1024], p1: s32[]) -> f32[1,1024] {
  %p0 = f32[4096,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %copy_fusion.2 = f32[1,1024]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused
}

ENTRY %main (a: f32[4096,1024], i: s32[]) -> f32[1,1024] {
  %a = f32[4096,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %fusion-start.1 = ((f32[4096,1024]{1,0}, s32[]), f32[1,1024]{1,0}, u32[]) async-start(%a, %i), calls=%wrapped, metadata={scheduling_name="fusion-start"}
  ROOT %fusion-done.1 = f32[1,1024]{1,0} async-done(%fusion-start.1), metadata={scheduling_name="fusion-done"}
}
"""
  report = analyze_hlo(hlo_text, target="h100x8")
  (kernel,) = report.kernels
  assert kernel.name == "copy_fusion.2" and kernel.time_s > 0
  lines = jax_overlap.latency_profile.profile_text(report).splitlines()
  assert lines == [
    f'costs {{ name: "copy_fusion.2" cost_us: {kernel.time_s * 1e6:.3f} }}',
    'costs { name: "fusion-start" cost_us: 0.000 }',
    'costs { name: "fusion-done" cost_us: 0.000 }',
    f'latencies {{ source: "fusion-start" target: "fusion-done" latency_us: '
    f"{kernel.time_s * 1e6:.3f} }}",
  ]
