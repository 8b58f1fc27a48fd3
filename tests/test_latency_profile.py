"""Latency profiles written from the analysis and read back by XLA's scheduler."""

import os
import re

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
  assert len(names) == len(set(names)) == len(text.strip().splitlines())
  # Loop iterations (name@i) collapse to the instruction's name.
  assert not any("@" in n for n in names)
  expected = {k.name.split("@")[0]: k.time_s for k in [*report.kernels, *report.collectives]}
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
  profiled = set(re.findall(r'name: "([^"]+)"', open(path).read()))
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
    """The instructions XLA's scheduler found no cost for in ``profile``."""
    path = tmp_path / f"{len(profile)}.pbtxt"
    path.write_text(profile)
    capfd.readouterr()
    opts_p = {**opts, jax_overlap.latency_profile.OPTION: str(path)}
    jax_overlap.analyze(step, w, x, target="h100x8", xla_options=opts_p)
    err = capfd.readouterr().err
    return set(re.findall(r"profile_guided_latency_estimator\.cc:\d+\]   (\S+)", err))

  assert report.uncounted_costs and set(report.uncounted_costs) <= uncounted
  assert all(
    costs[n] == pytest.approx(t * 1e6, abs=2e-3) for n, t in report.uncounted_costs.items()
  )
  assert not set(report.uncounted_costs) & set(items)  # not in the step
  assert missed(text) == set()
  # Without the conditional's entry XLA says so (what the check above would see).
  without = "".join(line + "\n" for line in text.splitlines() if cond.name not in line)
  assert cond.name in missed(without)
