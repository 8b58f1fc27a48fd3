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
