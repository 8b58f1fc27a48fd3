"""A memory cap on prefetch by time (``overlap(prefetch_memory=)``, transform/prefetch.py): the
bytes of parameters gathered ahead of their first use stay under the cap in the plan, in
``explain()`` and in XLA's buffer assignment of the built step, the cap costs the exposed time
it says, and the numbers are those of the step as written."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src import targets
from jax_overlap._src.transform import prefetch, variants
from jax_overlap._src.transform.evaluate import (
  RewriteStats,
  VariantConfig,
  collect_stats,
  evaluate_program,
)
from jax_overlap._src.transform.settings import Settings, byte_count
from jax_overlap.examples import llama_fsdp as L

MiB = 2**20
TOPO = targets.get("h100x8")


# -- issue_by_time on a program of its own -------------------------------------------------


def _program(layers: list[tuple[int, int]], tokens: int):
  """Equations of ``x = tanh(x @ (w * 2))`` per layer (hidden sizes ``(k, n)``): each
  ``w * 2`` stands for a parameter gather first read by the matmul after it, each ``tanh`` is
  an equation without compute time between two matmuls."""

  def f(x, *ws):
    for w in ws:
      x = jnp.tanh(x @ (w * 2.0))
    return x

  x = jax.ShapeDtypeStruct((tokens, layers[0][0]), jnp.bfloat16)
  ws = [jax.ShapeDtypeStruct(kn, jnp.bfloat16) for kn in layers]
  return list(jax.make_jaxpr(f)(x, *ws).eqns)


def _wanted(eqns, sizes: list[int]) -> dict[int, tuple[int, int, int]]:
  gathers = [i for i, e in enumerate(eqns) if e.primitive.name == "mul"]
  return {g: (g + 1, size, 8) for g, size in zip(gathers, sizes)}


def _peak(issues) -> int:
  """The most bytes issued and not yet first used between two equations (a gather held from
  right after the equation it is issued after to its first use; at one equation, uses first)."""
  events = sorted(
    [(-1 if it.after is None else it.after, it.nbytes) for it in issues]
    + [(it.first_use, -it.nbytes) for it in issues]
  )
  held = peak = 0
  for _, b in events:
    held += b
    peak = max(peak, held)
  return peak


def _after(it) -> int:
  return -1 if it.after is None else it.after


_widths = st.lists(st.sampled_from([512, 1024, 4096]), min_size=3, max_size=11)


@settings(max_examples=40, deadline=None)
@given(
  widths=_widths,
  tokens=st.sampled_from([256, 2048, 8192]),
  mib=st.lists(st.integers(1, 96), min_size=10, max_size=10),
  fractions=st.lists(st.floats(0.0, 1.5), min_size=1, max_size=5),
)
def test_a_cap_bounds_the_bytes_held_and_only_delays_issue_points(widths, tokens, mib, fractions):
  eqns = _program(list(zip(widths, widths[1:])), tokens)
  order = list(range(len(eqns)))
  wanted = _wanted(eqns, [m * MiB for m in mib])
  free = prefetch.issue_by_time(eqns, order, wanted, TOPO)
  largest = max(it.nbytes for it in free)
  caps = sorted({int(f * _peak(free)) for f in fractions} | {0, _peak(free)}, reverse=True)
  exposed = []
  for cap in caps:
    capped = prefetch.issue_by_time(eqns, order, wanted, TOPO, prefetch_memory=cap)
    assert [it.eqn for it in capped] == [it.eqn for it in free]
    assert _peak(capped) <= max(cap, largest)
    for a, b in zip(free, capped):
      assert _after(b) >= _after(a)  # issue points only move later
      assert _after(b) < b.first_use  # and stay ahead of the use
      assert b.capped == (_after(b) > _after(a))
      assert b.exposed_uncapped_s is not None and b.exposed_s >= 0.0 and b.hidden_s >= 0.0
    issued = [_after(it) for it in capped]
    assert issued == sorted(issued)  # the link still takes them in order of first use
    total = sum(it.exposed_s for it in capped)
    assert total >= sum(it.exposed_uncapped_s for it in capped) - 1e-12
    if not any(it.capped for it in capped):  # the cap costs nothing: the same placement
      assert [(it.after, it.exposed_s) for it in capped] == [
        (it.after, it.exposed_s) for it in free
      ]
    else:
      exposed.append(total)
  # A tighter cap never exposes less (the placements it delays, on one timeline).
  assert all(a <= b + 1e-12 for a, b in zip(exposed, exposed[1:]))


def test_a_gather_larger_than_the_cap_goes_just_in_time_and_alone():
  eqns = _program([(4096, 4096)] * 4, 4096)
  order = list(range(len(eqns)))
  # Layer 2's gather is larger than the cap; the others fit two at a time.
  wanted = _wanted(eqns, [16 * MiB, 16 * MiB, 64 * MiB, 16 * MiB])
  free = prefetch.issue_by_time(eqns, order, wanted, TOPO)
  capped = prefetch.issue_by_time(eqns, order, wanted, TOPO, prefetch_memory=32 * MiB)
  big = capped[2]
  # Issued right after layer 1's matmul, which uses the gather before it: the last compute
  # before its own use, with nothing else held.
  assert big.after == capped[1].first_use and eqns[big.after].primitive.name == "dot_general"
  assert capped[3].after >= big.first_use  # the next waits for its use
  assert _peak(capped) == 64 * MiB and _peak(free) > 64 * MiB
  assert sum(it.exposed_s for it in capped) > sum(it.exposed_s for it in free)


def test_the_timeline_waits_for_the_link_and_for_each_gather():
  # Two gathers of 2 s on one link, both issued at the start, used after 1 s and 3 s of
  # compute: the first waits 1 s, the second finishes at 4 s and waits 0 (the first's wait
  # moved the compute on: 1 + 1 + 2 = 4).
  (e1, h1), (e2, h2) = prefetch.timeline([1.0, 2.0, 1.0], [(0, 1, 2.0), (0, 2, 2.0)])
  assert (e1, e2) == (1.0, 0.0)
  assert (h1, h2) == (1.0, 2.0)  # the second travels from 2 s to 4 s, under compute
  assert prefetch.timeline([1.0], []) == []


# -- overlap(prefetch_memory=) on a whole model ---------------------------------------------

_SUMMARY = re.compile(r"at most ([\d.]+) MiB gathered ahead of first use")
_COST = re.compile(
  r"prefetch_memory=([\d.]+) MiB: (\d+) issued later than their time to keep within it, "
  r"([\d.]+) ms expected exposed with the cap against ([\d.]+) ms without it"
)
_AFTER = re.compile(
  r"all-gather #(\d+) .*? (?:issued|placed) (?:at the start|after equation (\d+))"
)


def _llama(**kw):
  return L.build(
    "h100x8", layers=3, hidden=1024, mlp=2816, heads=8, kv_heads=2, vocab=4096, seq=1024, **kw
  )


def _issued_after(explanation) -> dict[int, int]:
  out = {}
  for a in explanation.of_kind("gather_timing"):
    m = _AFTER.search(a.detail)
    if m:
      out[int(m[1])] = -1 if m[2] is None else int(m[2])
  return out


def test_explain_states_the_cap_what_it_delayed_and_what_it_costs():
  fn, args = _llama()

  def explain(cap):
    ov = jax_overlap.overlap(
      fn, target="h100x8", select="rewrite", cache=False, prefetch_memory=cap
    )
    return ov.explain(*args)

  free = explain(None)
  (summary,) = free.of_kind("prefetch")
  assert float(_SUMMARY.search(summary.detail)[1]) > 16  # more than the caps below
  issued_free = _issued_after(free)
  costs = []
  for cap, mib in (("16MiB", 16), (8 * MiB, 8), (0, 0)):
    e = explain(cap)
    (summary,) = e.of_kind("prefetch")
    ahead = float(_SUMMARY.search(summary.detail)[1])
    assert ahead <= max(mib, 8.0), summary.detail  # 8 MiB: the largest gather (the head)
    assert "(tied there)" in summary.detail
    m = _COST.search(summary.detail)
    assert m and float(m[1]) == mib, summary.detail
    delayed, with_cap, without = int(m[2]), float(m[3]), float(m[4])
    later = [a for a in e.of_kind("gather_timing") if "later than its time" in a.detail]
    assert delayed == len(later) > 0
    assert with_cap >= without
    costs.append(with_cap)
    issued = _issued_after(e)
    assert issued.keys() == issued_free.keys()
    assert all(issued[g] >= issued_free[g] for g in issued)
    assert sum(issued[g] > issued_free[g] for g in issued) == delayed
  assert costs == sorted(costs) and costs[-1] > costs[0]
  assert "larger than the cap issued just in time" in summary.detail


@pytest.mark.slow
def test_xla_holds_no_more_gathered_weights_than_the_cap_allows():
  """XLA's own buffer assignment (budget.memory.breakdown, deviceless h100x8): the gathered
  weights live at the step's fullest moment. The training step keeps its forward's gathered
  weights for the backward pass, so there the cap lowers little but never adds; a forward pass
  (an evaluation step) holds only what is gathered ahead, and there a tight cap shows."""
  fn, args = _llama()
  cfg = L.Config(layers=3, hidden=1024, mlp=2816, heads=8, kv_heads=2, vocab=4096, seq=1024)
  forward = jax.jit(L.make_loss(cfg, args[0]["embed"].sharding.mesh))

  def gathered(step, cap):
    ov = jax_overlap.overlap(
      step, target="h100x8", select="rewrite", cache=False, prefetch_memory=cap
    )
    return jax_overlap.budget.memory.breakdown(ov, *args, target="h100x8")["gathered_weights"]

  train = {cap: gathered(fn, cap) for cap in (None, 8 * MiB)}
  if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11):
    assert train[8 * MiB] <= train[None]
  else:
    # XLA 0.11 and later keep the tied training step's gathered weights longer: capped, it
    # holds more at its fullest moment (51.0 -> 70.0 MiB on jax 0.12.0.1; docs/transform.md).
    assert train[8 * MiB] <= 1.5 * train[None]
  evaluation = {cap: gathered(forward, cap) for cap in (None, 16 * MiB, 8 * MiB, 0)}
  assert evaluation[16 * MiB] <= 16 * MiB < evaluation[None]
  assert evaluation[8 * MiB] <= 8 * MiB
  assert evaluation[0] <= 8 * MiB  # one gather at a time (the largest is 8 MiB)
  assert evaluation[0] <= evaluation[8 * MiB] <= evaluation[16 * MiB]
  # Against the variant that ties every gather where the cost model issues it, uncapped.
  closed = forward.trace(*args).jaxpr
  st_ = Settings(target="h100x8")
  cfg_ = VariantConfig.from_settings(st_, False, None, None)
  stats = collect_stats(closed.jaxpr, cfg_, [], [0])
  (tied,) = [c for c in variants.candidates(st_, cfg_, stats) if c.config.chain]
  step = jax.jit(lambda *a: evaluate_program(closed, jax.tree.leaves(a), tied.config))
  b = jax_overlap.budget.memory.breakdown(step, *args, target="h100x8", xla_options=tied.options)
  assert evaluation[8 * MiB] < b["gathered_weights"]


@pytest.mark.slow
@pytest.mark.xla_default_cpu_emitters  # bit for bit under XLA's own code generation
@pytest.mark.parametrize("form", L.FORMS)
def test_the_same_losses_and_parameters_as_the_step_as_written(form):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  cfg = L.Config(
    form=form,
    layers=2,
    hidden=128,
    mlp=256,
    heads=4,
    kv_heads=2,
    vocab=1024,
    seq=8,
    dtype="float32",
    learning_rate=0.1,
  )
  params = L.init_params(cfg, mesh, jax.random.key(0))
  sh = NamedSharding(mesh, P("fsdp"))
  tokens = jax.device_put(jax.random.randint(jax.random.key(1), (8, cfg.seq), 0, cfg.vocab), sh)
  labels = jax.device_put(jax.random.randint(jax.random.key(2), (8, cfg.seq), 0, cfg.vocab), sh)
  step = L.make_step(cfg, mesh)
  cap = "160KiB"  # room for one MLP weight (128 KiB) at a time
  ov = jax_overlap.overlap(
    step, target="h100x8", select="rewrite", cache=False, prefetch_memory=cap
  )
  e = ov.explain(params, tokens, labels)
  assert any("later than its time" in a.detail for a in e.of_kind("gather_timing")), str(e)
  p1, p2 = params, params
  for _ in range(3):
    p1, l1 = jax.jit(step)(p1, tokens, labels)
    p2, l2 = ov(p2, tokens, labels)
    assert float(l1) == float(l2)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The variant that also chains the first gathers and the reduce-scatters, under the cap.
  closed = jax.jit(step).trace(params, tokens, labels).jaxpr
  tied = VariantConfig(
    1, "per_layer", False, "off", "h100x8", chain=True, prefetch_memory=byte_count(cap, "test")
  )
  fn = jax.jit(lambda *a: evaluate_program(closed, jax.tree.leaves(a), tied))
  for a, b in zip(
    jax.tree.leaves(jax.jit(step)(params, tokens, labels)), fn(params, tokens, labels)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- the keyword ------------------------------------------------------------------------------


def _step(x):
  return x


@pytest.mark.parametrize(
  "given, expected",
  [
    (None, None),
    (0, 0),
    (3 * MiB, 3 * MiB),
    (2e9, 2_000_000_000),
    ("2GiB", 2 * 2**30),
    ("512 MiB", 512 * MiB),
    ("1.5GB", 1_500_000_000),
    ("64kib", 64 * 1024),
    (" 1000 ", 1000),
  ],
)
def test_prefetch_memory_takes_bytes_or_a_size(given, expected):
  ov = jax_overlap.overlap(_step, prefetch_memory=given)
  assert ov.settings.prefetch_memory == expected
  assert ov.settings.key(True, {})["prefetch_memory"] == expected


def test_the_cap_is_part_of_the_selection_key():
  keys = [
    jax_overlap.overlap(_step, target="h100x8", prefetch_memory=c).settings.key(True, {})
    for c in (None, "1GiB", 2**30, "2GiB")
  ]
  assert keys[1] == keys[2] and len({repr(k) for k in keys}) == 3


@pytest.mark.parametrize(
  "given, error, match",
  [
    (-1, ValueError, r"overlap: prefetch_memory must be a number of bytes >= 0.*got -1"),
    (1.5, ValueError, r"overlap: prefetch_memory .*a whole number.*got 1\.5"),
    (float("inf"), ValueError, r"overlap: prefetch_memory .*got inf"),
    ("2 GiBs", ValueError, r"overlap: prefetch_memory .*units: B, kB.*got '2 GiBs'"),
    ("lots", ValueError, r"overlap: prefetch_memory .*got 'lots'"),
    ("-1MiB", ValueError, r"overlap: prefetch_memory .*got '-1MiB'"),
    (True, TypeError, r"overlap: prefetch_memory must be .*got True \(bool\)"),
    ([2**30], TypeError, r"overlap: prefetch_memory must be .*got \[1073741824\] \(list\)"),
  ],
)
def test_a_bad_cap_is_refused_naming_the_keyword(given, error, match):
  with pytest.raises(error, match=match):
    jax_overlap.overlap(_step, prefetch_memory=given)


def test_no_variant_merges_more_all_gather_bytes_than_the_cap():
  stats = RewriteStats(gather_groups=4, max_group_gather_bytes=8 * MiB, max_gather_bytes=4 * MiB)
  cfg = VariantConfig(1, "per_layer", False)

  def thresholds(cap):
    st_ = Settings(target="h100x8", prefetch_memory=cap)
    return {
      c.options.get("xla_gpu_all_gather_combine_threshold_bytes")
      for c in variants.candidates(st_, cfg, stats)
      if c.name.startswith("rewritten")
    }

  assert thresholds(None) == {8 * MiB, 4 * MiB}
  assert thresholds("6MiB") == {6 * MiB, 4 * MiB}
  assert thresholds(0) == {0}


def test_a_cap_without_prefetch_is_refused():
  with pytest.raises(ValueError, match=r"prefetch_memory='1GiB' caps .* use prefetch >= 1"):
    jax_overlap.overlap(_step, prefetch=0, prefetch_memory="1GiB")
