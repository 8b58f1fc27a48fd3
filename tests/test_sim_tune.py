"""Tests of the tuner: plan format, agreement with exhaustive search, progress display."""

import dataclasses
import json

import pytest

from jax_overlap import runtime, sim
from jax_overlap._src.sim import tune as tune_mod


def _small(gpu_tokens=2048, n=3):
  att = sim.attention("a", gpu_tokens, 2048, 1024)
  return sim.tp_chain(n, 4096, 2048, lag=2, kernel=lambda i: att, name="small")


@pytest.mark.parametrize("target", ["a100", "h100", "a40"])
def test_coordinate_search_within_one_percent_of_exhaustive(target):
  wl = _small()
  ex = sim.tune(
    wl, target=target, groups="kernel", method="exhaustive", max_evals=10**6, progress=False
  )
  co = sim.tune(wl, target=target, groups="kernel", method="coordinate", progress=False)
  assert ex.method == "exhaustive" and co.method == "coordinate"
  assert co.makespan_s <= ex.makespan_s * 1.01


def test_exhaustive_search_finds_the_brute_force_optimum():
  # Enumerate every cap each kernel can be shaped to (a cap below its residency that the
  # padding reaches, from the runtime arithmetic, independently of the tuner's search
  # space) and both priorities, simulate each, take the best; the tuner's exhaustive
  # search (caps with or without room) must have found that optimum.
  import itertools

  wl = _small()
  kernels = [it for it in wl.items if isinstance(it, sim.Kernel)]
  options = []
  for k in kernels:
    nat = runtime.blocks_per_sm("h100", k.threads, k.regs, k.smem)
    caps = [
      r
      for r in range(1, nat)
      if runtime.blocks_per_sm(
        "h100",
        k.threads,
        k.regs,
        k.smem + runtime.shaped_dynamic_smem("h100", k.threads, k.regs, k.smem, 0, r),
      )
      == r
    ]
    options.append([None, *caps])
  assert sum(len(o) for o in options) > len(options)  # some kernel can be shaped
  best = min(
    sim.simulate(
      wl,
      target="h100",
      policy=sim.Policy("x", priority=p, shaping={k.name: c for k, c in zip(kernels, caps) if c}),
      baseline=False,
    ).makespan_s
    for p in (False, True)
    for caps in itertools.product(*options)
  )
  ex = sim.tune(
    wl,
    target="h100",
    groups="kernel",
    method="exhaustive",
    max_evals=10**6,
    progress=False,
    make_room=False,
  )
  assert min(r.makespan_s for r in ex.table) == pytest.approx(best, rel=1e-12)


def test_tuned_plan_reproduces_its_makespan_and_format():
  wl = _small()
  res = sim.tune(wl, target="h100", progress=False)
  plan = res.plan
  assert isinstance(plan, runtime.Plan)
  assert plan.version == 1 and plan.target == "h100"
  assert plan.streams.priority == ("highest" if res.policy.priority else "default")
  names = {it.name for it in wl.items}
  assert {k.match for k in plan.kernels} <= names
  assert {k.match: k.blocks_per_sm for k in plan.kernels} == dict(res.policy.shaping or {})
  again = sim.simulate(wl, target="h100", policy=res.policy, baseline=False).makespan_s
  assert again == pytest.approx(res.makespan_s, rel=1e-12)
  assert res.gain == pytest.approx(1 - res.makespan_s / res.baseline_s)
  assert "makespan (ms)" in res.format_table()
  # Its JSON form is what sim.plan_dict writes for the same choice (plus the empty
  # regions section), and the runtime library's rules text follows from it.
  written = json.loads(plan.to_json())
  assert written.pop("regions") == {}
  shaping, priority = res.policy.shaping, res.policy.priority
  assert written == {
    **sim.plan_dict("h100", shaping, priority, wl),
    "comm_block": written["comm_block"],
  }
  assert runtime.Plan.from_json(plan.to_json()) == plan
  assert plan.to_rules().startswith("version\t1")
  # Every simulation of the search is a typed row; the best one is the result's.
  assert len(res.table) == res.evaluations
  assert all(isinstance(r, sim.Evaluation) for r in res.table)
  assert min(r.makespan_s for r in res.table) <= res.makespan_s * (1 + 1e-12)
  with pytest.raises(dataclasses.FrozenInstanceError):
    res.plan = None


def test_tuner_plans_no_cap_that_cannot_make_room():
  # Attention blocks beside an NCCL channel: no cap leaves room (registers), so the
  # tuner caps nothing and says why; the runtime library would leave them alone too.
  wl = sim.tp_chain(4, 8192, 4096, lag=2, kernel=lambda i: sim.attention("a", 4096, 4096, 2048))
  res = sim.tune(wl, target="h100", progress=False)
  assert res.plan.kernels == () and not res.policy.shaping
  assert set(res.no_room) == {f"a.{i}" for i in (1, 2, 3)}  # a.0 overlaps no collective
  assert all("registers" in why for why in res.no_room.values())
  assert res.plan.comm_block.to_dict() == {
    "threads": 544,
    "regs_per_thread": 96,
    "smem_bytes": 82240,
  }
  # Caps that cannot make room are searched too, and none pays: dispatch is in order, so
  # under XLA's priority a waiting channel already holds back the next attention blocks
  # until an SM drains, which a cap of 1 would only do sooner at the attention's cost.
  # The plan turns the library's room rule off so that caps would apply as written.
  drain = sim.tune(wl, target="h100", progress=False, make_room=False)
  assert any(row.shaping for row in drain.table)
  assert drain.policy.priority and not drain.policy.shaping
  assert drain.makespan_s == pytest.approx(res.makespan_s)
  assert drain.plan.comm_block is None
  assert json.loads(drain.plan.to_json())["comm_block"] is None


def test_plan_dict_json_round_trip():
  d = sim.plan_dict("h100x8", {"k": 1}, True)
  assert d == {
    "version": 1,
    "target": "h100",
    "kernels": [{"match": "k", "blocks_per_sm": 1}],
    "streams": {"priority": "highest"},
    "comm_block": "auto",
  }
  assert json.loads(json.dumps(d)) == d
  from jax_overlap._src.runtime import plan as plan_mod

  p = plan_mod.Plan.from_json(d)
  assert p.kernels[0].blocks_per_sm == 1 and p.streams.priority == "highest"
  # AMD targets get the dict unvalidated (the runtime library shapes CUDA launches only).
  assert sim.plan_dict("mi250x", {}, False)["target"] == "mi250x"


def test_tune_on_an_amd_target_has_a_policy_and_no_runtime_plan():
  res = sim.tune(_small(), target="mi250x", progress=False)
  assert res.plan is None  # the runtime library shapes CUDA launches only
  again = sim.simulate(_small(), target="mi250x", policy=res.policy, baseline=False)
  assert again.makespan_s == pytest.approx(res.makespan_s, rel=1e-12)


def test_tune_results_read_as_dicts_warn_for_one_release():
  from jax_overlap._src.deprecations import JaxOverlapDeprecationWarning

  res = sim.tune(_small(), target="h100", progress=False)
  with pytest.warns(JaxOverlapDeprecationWarning, match=r"plan\['streams'\].*plan.streams"):
    assert res.plan["streams"] == {"priority": res.plan.streams.priority}
  with pytest.warns(JaxOverlapDeprecationWarning, match="use TuneResult.plan"):
    assert res.runtime_plan is res.plan
  with pytest.raises(KeyError, match="no key 'blocks'; it has version, target, kernels"):
    res.plan["blocks"]
  with pytest.raises(TypeError, match="not iterable"):
    iter(res.plan)


def test_plan_rejected_by_runtime_raises():
  with pytest.raises(ValueError, match=r"'blocks_per_sm' must be at most 32"):
    sim.plan_dict("h100", {"k": 64}, False)


def test_shaping_matches_runtime_arithmetic():
  from jax_overlap._src import targets
  from jax_overlap._src.runtime import residency

  for gpu in ("a40", "a100", "h100"):
    g = targets.get_gpu(gpu)
    for threads, regs, smem in [(256, 32, 0), (128, 200, 64 * 1024), (384, 168, 8192)]:
      for n in (1, 2, 3):
        ours = sim.shaped_smem(g, smem, n)
        theirs = residency.shaped_dynamic_smem(g, threads, regs, smem, 0, n)
        if residency.blocks_per_sm(g, threads, regs, smem) > n:
          assert ours == smem + theirs
        assert sim.residency(g, threads, regs, smem) == residency.blocks_per_sm(
          g, threads, regs, smem
        )


def test_tune_errors():
  wl = _small()
  with pytest.raises(ValueError, match=r"sim.tune: groups must be 'window' or 'kernel', got 'x'"):
    sim.tune(wl, target="h100", groups="x", progress=False)
  with pytest.raises(ValueError, match=r"sim.tune: method must be"):
    sim.tune(wl, target="h100", method="annealing", progress=False)
  with pytest.raises(ValueError, match=r"unknown target"):
    sim.tune(wl, target="z900", progress=False)


def test_progress_prints_without_tqdm(monkeypatch, capsys):
  import builtins

  real_import = builtins.__import__

  def no_tqdm(name, *a, **k):
    if name.startswith("tqdm"):
      raise ImportError(name)
    return real_import(name, *a, **k)

  monkeypatch.setattr(builtins, "__import__", no_tqdm)
  bar = tune_mod._Progress(10, True, "tune test")
  bar.last = -1e9
  bar.update(0.001)
  bar.close()
  assert "tune test: 1/10 evaluations, best 1.0000 ms" in capsys.readouterr().err
  off = tune_mod._Progress(10, False, "quiet")
  off.update(0.001)
  assert capsys.readouterr().err == ""


def test_simulate_a_runtime_plan():
  wl = _small()
  res = sim.tune(wl, target="h100", progress=False)
  again = sim.simulate(wl, target="h100", policy=res.plan, baseline=False)
  assert again.makespan_s == pytest.approx(res.makespan_s, rel=1e-12)
  assert again.policy == "plan"
  glob = {
    "version": 1,
    "kernels": [{"match": "a.*", "blocks_per_sm": 1}],
    "streams": {"priority": "highest"},
  }
  pol = sim.policy_from_plan(glob, wl)
  assert pol.priority and set(pol.shaping) == {"a.0", "a.1", "a.2"}


def test_plan_naming_missing_kernels():
  wl = _small()
  bad = {"version": 1, "kernels": [{"match": "attention_*", "blocks_per_sm": 1}]}
  with pytest.raises(ValueError, match=r"plan kernels\[0\] \('attention_\*'\) names no kernel"):
    sim.simulate(wl, target="h100", policy=bad)
  with pytest.raises(ValueError, match=r"exactly one of 'match' (\(glob\) )?or 'regex'"):
    sim.policy_from_plan({"kernels": [{"blocks_per_sm": 1}]}, wl)
  # Read as the runtime reads a plan: a key it does not know is refused, not ignored.
  with pytest.raises(ValueError, match=r"unknown key 'priority'; valid keys: .*streams"):
    sim.simulate(wl, target="h100", policy={"priority": "highest"})
  with pytest.raises(TypeError, match=r"workload must be a sim.Workload, got dict"):
    sim.tune({"items": []}, target="h100")


def test_plan_rules_use_launch_names_and_one_setting_per_function():
  import dataclasses

  wl = sim.tp_chain(4, 8192, 4096, lag=2, kernel=lambda i: sim.attention("a", 4096, 4096, 2048))
  kernels = [it for it in wl.items if isinstance(it, sim.Kernel)]
  # Every attention kernel launches as one function (as XLA's deduplicated fusions and loop
  # iterations do); the last one is a library call whose kernel name is unknown.
  renamed = {k.name: "attention_fusion_3" for k in kernels[:-1]}
  renamed[kernels[-1].name] = ""
  items = tuple(
    dataclasses.replace(it, launch_name=renamed[it.name]) if it.name in renamed else it
    for it in wl.items
  )
  wl2 = sim.Workload(items, name="named")
  for mode in ("kernel", "window"):
    groups, _, _ = tune_mod.search_space(wl2, "h100", groups=mode)
    # One function, one setting: all instances in one group; the library call in none.
    assert [set(g) for g in groups] == [{k.name for k in kernels[:-1]}]
  res = sim.tune(wl2, target="h100", progress=False)
  assert res.unnamed == (kernels[-1].name,)
  assert kernels[-1].name not in res.policy.shaping
  assert {k.match for k in res.plan.kernels} <= {"attention_fusion_3"}
  # Instances of one function shaped differently get one rule with the smallest cap.
  d = sim.plan_dict("h100", {kernels[0].name: 3, kernels[1].name: 2}, True, wl2)
  assert d["kernels"] == [{"match": "attention_fusion_3", "blocks_per_sm": 2}]
  with pytest.raises(ValueError, match="has no launch name"):
    sim.plan_dict("h100", {kernels[-1].name: 1}, True, wl2)


def test_plan_dict_escapes_glob_characters():
  wl = sim.Workload((sim.Kernel("k", grid=8, threads=128, launch_name="fusion[1]*"),))
  d = sim.plan_dict("h100", {"k": 2}, False, wl)
  (rule,) = d["kernels"]
  import fnmatch

  assert fnmatch.fnmatchcase("fusion[1]*", rule["match"])
  assert not fnmatch.fnmatchcase("fusion1_x", rule["match"])


def test_simulator_comm_block_is_the_runtime_librarys_nccl_channel():
  # One description of an NCCL channel: the simulator's constants, the plan's "auto" and
  # the runtime library (test_runtime checks the library against CommBlock.nccl).
  for gpu in ("a40", "a100", "h100", "h200"):
    c = sim.constants_for(gpu)
    assert runtime.CommBlock(c.comm_threads, c.comm_regs, c.comm_smem) == runtime.CommBlock.nccl(
      gpu, 544
    )


def _resident_gemm_before_a_needed_gather() -> sim.Workload:
  """A GEMM of one wave (3 blocks per SM) placed before an all-gather that the next GEMM
  needs becomes ready: no block of the first is left to hold back, so the gather waits for
  its blocks to finish unless a cap leaves room for a channel beside them."""

  def gemm(name, **kw):
    return sim.Kernel(
      name,
      grid=132 * 3,
      threads=256,
      regs=32,
      smem=64 * 1024,
      flops=132 * 3 * 4e9,
      kind="gemm",
      **kw,
    )

  return sim.Workload(
    (
      sim.Kernel("w", grid=132, threads=256, flops=1e6, stream=1),
      gemm("A"),
      sim.Collective("c", "all-gather", 1 << 28, stream=1, after=("w",)),
      gemm("B", after=("c",)),
    )
  )


def test_gain_is_against_xlas_own_priority_and_every_kept_rule_pays():
  wl = _resident_gemm_before_a_needed_gather()
  res = sim.tune(wl, target="h100", progress=False, make_room=False)
  # The baseline is what XLA already does: its collective streams at the highest priority.
  assert res.baseline == "priority"
  assert (
    res.baseline_s == sim.simulate(wl, target="h100", policy="priority", baseline=False).makespan_s
  )
  conc = sim.tune(wl, target="h100", progress=False, make_room=False, baseline="concurrent")
  assert (
    conc.baseline_s
    == sim.simulate(wl, target="h100", policy="concurrent", baseline=False).makespan_s
  )
  # Every rule left in the plan costs at least 0.5% when taken out, checked by simulating
  # the plan without it; rules that did not were dropped and are reported.
  shaping = dict(res.policy.shaping)
  assert shaping, res.table[:3]
  # The plan's rules are the policy's caps, for the runtime library.
  assert {k.match: k.blocks_per_sm for k in res.plan.kernels} == shaping
  t = sim.simulate(wl, target="h100", policy=res.policy, baseline=False).makespan_s
  assert t == pytest.approx(res.makespan_s)
  for cap in set(shaping.values()):
    rest = {k: v for k, v in shaping.items() if v != cap}
    t_without = sim.simulate(
      wl,
      target="h100",
      policy=sim.Policy("without", priority=res.policy.priority, shaping=rest),
      baseline=False,
    ).makespan_s
    assert t_without > t * 1.005
  assert not set(res.pruned) & set(shaping)
  with pytest.raises(ValueError, match="baseline must be 'priority' or 'concurrent'"):
    sim.tune(wl, target="h100", progress=False, baseline="xla")


def test_priority_is_spelled_as_in_a_runtime_plan():
  from jax_overlap._src.deprecations import JaxOverlapDeprecationWarning

  wl = _small()
  for spelled, old in (("highest", True), ("default", False)):
    res = sim.tune(wl, target="h100", progress=False, priority=spelled)
    assert {r.priority for r in res.table} == {old}  # only that priority was searched
    with pytest.warns(JaxOverlapDeprecationWarning, match=f"priority='{spelled}'"):
      again = sim.tune(wl, target="h100", progress=False, priority=old)
    assert again.plan == res.plan and again.makespan_s == res.makespan_s
  with pytest.raises(ValueError, match="'highest', 'default' or None"):
    sim.tune(wl, target="h100", progress=False, priority="high")
