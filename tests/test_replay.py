"""A real compiled step replayed through the runtime library and the fake driver.

The step (an FSDP transformer step, compiled deviceless for h100x8) is taken from XLA's own
dump: each kernel's launch name, block size and dynamic shared memory from the thunk listing,
its registers and static shared memory from ptxas on the dumped PTX. Its launch sequence is
replayed through the runtime library twice: op by op (cuLaunchKernel), and as XLA's command
buffers record it (one cuGraphAddKernelNode per kernel thunk). With a plan written for the same
step from the tuner's search space (its strongest setting: every group at its lowest cap, so
the plan names as many kernels as any tuned plan can), the set of kernels the library shapes
must be the set the plan selects, less those that already run at or below their cap and those beside which no cap
leaves room for the plan's communication block (residency and room from the published
occupancy rules with the real resources: ``runtime.room_cap``).
"""

import fnmatch
import re
import shutil

import pytest
from fake_cuda import harness

from jax_overlap import runtime, sim
from jax_overlap._src.compile import ptx
from jax_overlap._src.sim import tune as tune_mod

pytestmark = pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")


@pytest.fixture(scope="module")
def step(fsdp_h100_dump):
  report, dump_dir = fsdp_h100_dump
  return report, ptx.kernel_resources(dump_dir, (9, 0))


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
  return harness.build(tmp_path_factory.mktemp("fake_cuda_replay"))


def _launches(report, resources):
  """(name, threads, dynamic smem, registers, static smem) per kernel launch, in order."""
  out = []
  for k in report.kernels:
    if k.launch_name:
      r = resources[k.launch_name]
      out.append((k.launch_name, k.threads_per_block, k.smem_bytes, r.registers, r.static_smem))
  return out


def _plan(report):
  """The plan for the strongest setting of the tuner's search space: every group at its
  lowest cap. (``sim.tune`` on a real deviceless report is tested in test_sim_realize.py;
  on this step it finds nothing worth shaping and would write an empty plan.)"""
  wl = sim.workload_from_report(report)
  groups, settings, choices = tune_mod.search_space(wl, "h100x8")
  strongest = [s[1] if len(s) > 1 else None for s in settings]
  shaping = tune_mod._shaping_for(groups, strongest, choices)
  return sim.plan_dict("h100x8", shaping, True, wl)


def _selected(plan, name):
  for rule in plan["kernels"]:
    if fnmatch.fnmatchcase(name, rule["match"]):
      return rule["blocks_per_sm"]
  return None


@pytest.mark.slow
def test_replay_shapes_exactly_what_the_plan_selects(step, fake, tmp_path):
  report, resources = step
  launches = _launches(report, resources)
  assert len(launches) > 100
  plan = _plan(report)
  assert plan["kernels"]
  assert runtime.check_plan(plan, report).unmatched == ()
  cb = plan["comm_block"]
  comm = runtime.CommBlock(**cb) if isinstance(cb, dict) else runtime.CommBlock.nccl("h100")
  expected, no_room = set(), 0
  for name, threads, dyn, regs, static in launches:
    cap = _selected(plan, name)
    if cap is None:
      continue
    room, _ = runtime.room_cap("h100", comm, threads, regs, static, dyn, cap)
    if room == 0:
      no_room += 1
    elif runtime.blocks_per_sm("h100", threads, regs, static + dyn) > room:
      expected.add(name)
  assert expected, "no planned kernel runs above its cap"
  funcs = ";".join(
    f"{n}:static={s}:regs={r}" for n, (_, _, _, r, s) in {x[0]: x for x in launches}.items()
  )
  rules = runtime.Plan.from_json(plan).to_rules()
  original = {(n, t): d for n, t, d, _, _ in launches}
  for action in ("launch", "graph"):
    r = harness.run_app(
      fake,
      "dlopen",
      [f"{action}:{n}:{t}:{d}" for n, t, d, _, _ in launches],
      rules=rules,
      funcs=funcs,
      tmp=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.launches) == len(launches)
    failed = [x for x in r.launches if x["result"] != "0"]
    assert failed == [], failed[:3]
    shaped = {
      x["func"] for x in r.launches if int(x["dyn"]) > original[(x["func"], int(x["threads"]))]
    }
    assert shaped == expected, (action, shaped ^ expected)
    counter = "launches_shaped" if action == "launch" else "graph_nodes_shaped"
    n_expected = sum(1 for x in launches if x[0] in expected)
    assert r.counters[counter] == n_expected
    assert r.counters["launches_no_room"] == no_room


def test_replayed_kernels_are_xlas_own(step):
  report, resources = step
  # Every launch name of the report is a PTX entry ptxas assembled, and vice versa
  # every entry but XLA's collective helper kernels is launched.
  names = {k.launch_name for k in report.kernels if k.launch_name}
  assert names <= set(resources)
  assert all(re.fullmatch(r"\w+", n) for n in names)
