"""One choice of variant per job: process 0 publishes, the others take it (an in-memory
key-value store stands in for jax.distributed's; tests/test_multiprocess.py runs the
real one across two processes)."""

import collections
import dataclasses
import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.analysis import analyze as analysis
from jax_overlap._src.analysis import latency_profile
from jax_overlap._src.transform import compiles, selection_cache, shared_choice, variants
from jax_overlap._src.transform.evaluate import VariantConfig
from jax_overlap._src.transform.records import Candidate, Choice, Estimate


class FakeClient:
  """The part of jax.distributed's client the agreement uses, in memory; a missing key is
  a timeout at once."""

  def __init__(self):
    self.store: dict[str, str] = {}
    self.barriers: list[str] = []

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.store and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.store[key] = value

  def blocking_key_value_get(self, key, timeout_in_ms):
    if key not in self.store:
      raise RuntimeError(f"DEADLINE_EXCEEDED: {key} not set within {timeout_in_ms} ms")
    return self.store[key]

  def wait_at_barrier(self, barrier_id, timeout_in_ms, process_ids=None):
    self.barriers.append(barrier_id)

  def key_value_dir_get(self, key):
    return sorted((k, v) for k, v in self.store.items() if k.startswith(key))


@pytest.fixture
def job(monkeypatch, tmp_path):
  """Two processes sharing one store; ``job.become(i)`` makes this process process i (with
  a fresh count of builds, as another process has)."""
  client = FakeClient()
  monkeypatch.setattr(shared_choice, "_client", lambda: client)
  monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(tmp_path / "process0"))

  def become(i):
    monkeypatch.setattr(shared_choice, "_process", lambda: (i, 2))
    monkeypatch.setattr(shared_choice, "_builds", collections.Counter())
    monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(tmp_path / f"process{i}"))

  client.become = become
  become(0)
  return client


_SETTINGS = {"target": "h100x8"}


_CFG = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False)
CFG = {name: dataclasses.replace(_CFG, prefetch=i) for i, name in enumerate(["r", "w", "sm", "x"])}


def _candidates(**cfg):
  return [
    Candidate("rewritten", cfg.get("rewritten", CFG["r"]), {"a": 1}),
    Candidate("as written", cfg.get("as written", CFG["w"]), {"a": 2}),
  ]


def _choice(candidates, index, estimates=(), failed=(), judged=()):
  return Choice(
    tuple(candidates),
    index,
    tuple(Estimate(n, t) for n, t in estimates),
    failed=tuple(failed),
    judged=tuple(judged),
  )


def test_a_single_process_agrees_with_no_one(monkeypatch):
  monkeypatch.setattr(shared_choice, "_process", lambda: (0, 1))
  assert shared_choice.begin("program", ("sig",), _SETTINGS) is None
  assert not shared_choice.follows(None)
  notes = []
  shared_choice.settle(None, _choice(_candidates(), 0), notes)
  assert notes == []


def test_each_build_has_its_own_key(job):
  first = shared_choice.begin("program", ("sig",), _SETTINGS)
  again = shared_choice.begin("program", ("sig",), _SETTINGS)
  other = shared_choice.begin("another program", ("sig",), _SETTINGS)
  fingerprint = selection_cache.key("program", ("sig",), _SETTINGS)
  assert first.key == f"jax_overlap/choice/{fingerprint}/0"
  assert again.key == f"jax_overlap/choice/{fingerprint}/1"
  assert other.key.rsplit("/", 2)[1] != fingerprint
  assert first.leader and not shared_choice.follows(first)


def test_the_others_take_process_0s_choice(job):
  leader = shared_choice.begin("program", ("sig",), _SETTINGS)
  notes = []
  estimates = [("rewritten", 2e-3), ("as written", 1e-3)]
  shared_choice.settle(
    leader, _choice(_candidates(), 1, estimates, ["x: failed"], ["judged"]), notes
  )
  assert "process 0 chose it" in notes[-1]
  job.become(1)
  follower = shared_choice.begin("program", ("sig",), _SETTINGS)
  assert follower.key == leader.key and shared_choice.follows(follower)
  # This process's own list names the variants alike, with its own configurations.
  mine = [Candidate("rewritten", CFG["x"], {"a": 0}), Candidate("as written", CFG["sm"], {})]
  got = shared_choice.receive(follower, mine)
  assert got.candidate == Candidate("as written", CFG["sm"], {"a": 2})
  assert (got.how, got.origin) == ("shared", "process 0")
  assert list(got.estimates) == estimates and got.failed == ("x: failed",)
  assert got.judged == ("judged",)
  notes = []
  shared_choice.settle(follower, got, notes)
  assert notes[-1].startswith("variant 'as written' shared by process 0 with all 2 processes")
  assert "this process, 1, compiled no variant and read no selection cache" in notes[-1]
  assert job.barriers == [f"{leader.key}/confirmed"] * 2


def test_a_profiled_choice_brings_its_latency_profile(job, tmp_path):
  profile = tmp_path / "process0" / "latency_profiles" / "0123456789abcdef.pbtxt"
  profile.parent.mkdir(parents=True)
  profile.write_text("costs { name: 'fusion' cost: 1.0 }\n")
  name = "rewritten" + variants.PROFILED_SUFFIX
  leader = shared_choice.begin("program", ("sig",), _SETTINGS)
  candidates = [
    *_candidates(),
    Candidate(name, CFG["r"], {latency_profile.OPTION: str(profile)}),
  ]
  shared_choice.settle(leader, _choice(candidates, 2, [(name, 1e-3)]), [])
  job.become(1)
  follower = shared_choice.begin("program", ("sig",), _SETTINGS)
  got = shared_choice.receive(follower, _candidates())
  assert (got.name, got.candidate.config) == (name, CFG["r"])
  path = got.candidate.options[latency_profile.OPTION]
  assert path == str(tmp_path / "process1" / "latency_profiles" / profile.name)
  assert open(path).read() == profile.read_text()


def test_a_process_waits_for_process_0_within_the_timeout(job, monkeypatch):
  monkeypatch.setenv(shared_choice.TIMEOUT_ENV, "2")
  job.become(1)
  follower = shared_choice.begin("program", ("sig",), _SETTINGS)
  with pytest.raises(
    RuntimeError,
    match=r"process 1 of 2 waited 2 s for process 0's choice of variant \(key "
    r"jax_overlap/choice/[0-9a-f]+/0\) and gave up: DEADLINE_EXCEEDED.*it has published no "
    r"choice yet",
  ):
    shared_choice.receive(follower, _candidates())


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf"])
def test_the_timeout_must_be_a_positive_number(monkeypatch, value):
  monkeypatch.setenv(shared_choice.TIMEOUT_ENV, value)
  with pytest.raises(ValueError, match="JAX_OVERLAP_CHOICE_TIMEOUT_S must be a positive number"):
    shared_choice.timeout_s()


def test_several_processes_need_a_distributed_client(monkeypatch):
  monkeypatch.setattr(shared_choice, "_process", lambda: (0, 4))
  monkeypatch.setattr(shared_choice, "_client", lambda: None)
  with pytest.raises(RuntimeError, match="4 processes but no jax.distributed client"):
    shared_choice.begin("program", ("sig",), _SETTINGS)


def _build(candidates, chosen=0, fail_with=None, fallback=None):
  """A build as the decorator runs one, on this process."""

  @shared_choice.reports_failures
  def build():
    agreement = shared_choice.begin("program", ("sig",), _SETTINGS)
    if fail_with is not None:
      raise fail_with
    choice = _choice(candidates, chosen, [("x", 1.0)])
    if shared_choice.follows(agreement):
      choice = shared_choice.receive(agreement, candidates, fallback)
    notes = []
    shared_choice.settle(agreement, choice, notes)
    return choice.name, notes

  return build()


def test_process_0s_failure_stops_the_others(job):
  with pytest.raises(ValueError, match="no variant compiled"):
    _build(_candidates(), fail_with=ValueError("no variant compiled"))
  job.become(1)
  with pytest.raises(
    RuntimeError,
    match="process 0 could not choose a variant for this step, so process 1 stops too: "
    "ValueError: no variant compiled",
  ):
    _build(_candidates())


def test_a_choice_another_process_cannot_build_stops_every_process(job):
  converted = "shard_map form, rewritten"
  # Process 0 chose its step's shard_map form, and meets the others at the barrier.
  leader = shared_choice.begin("program", ("sig",), _SETTINGS)
  shared_choice.settle(
    leader, _choice([*_candidates(), Candidate(converted, CFG["sm"])], 2, [(converted, 1e-3)]), []
  )
  # Process 1 did not convert the step: it has no shard_map form to build.
  job.become(1)
  with pytest.raises(
    RuntimeError,
    match=r"process 0 chose the variant 'shard_map form, rewritten', which process 1 cannot "
    r"build: its variants are \['rewritten', 'as written'\]",
  ):
    _build(_candidates(), fallback=CFG["w"])
  assert f"{leader.key}/ack/1" in job.store
  # After the barrier process 0 reads the answers: it stops too, naming process 1's reason
  # and its own choice.
  with pytest.raises(
    RuntimeError,
    match=r"process 1 cannot run the variant this process \(0\) built \(process 0 chose "
    r"'shard_map form, rewritten'\), so no process runs the step: process 1: RuntimeError: "
    r"overlap: process 0 chose the variant",
  ):
    shared_choice.confirm(leader)


def _tiny_shard_map_step():
  mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))

  def body(w, x):
    wg = jax.lax.all_gather(w, "fsdp", tiled=True)
    y = jax.numpy.tanh(x @ wg) @ wg.T
    return jax.lax.psum((y * y).sum(), "fsdp")

  step = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
  shard = jax.sharding.NamedSharding(mesh, P("fsdp"))
  w = jax.device_put(np.ones((64, 64), np.float32) / 64, shard)
  x = jax.device_put(np.ones((16, 64), np.float32), shard)
  return step, (w, x)


def test_a_decorated_step_on_process_1_runs_process_0s_choice_without_compiling(
  job, monkeypatch, tmp_path
):
  step, args = _tiny_shard_map_step()

  def no_compiles(*a, **k):
    raise AssertionError("process 1 compiled a variant")

  monkeypatch.setattr(analysis, "analyze", no_compiles)
  monkeypatch.setattr(compiles, "analyze_all", no_compiles)
  chosen = "as written, recommended flags"
  job.become(1)
  # Process 1's own selection cache is not read (nor written).
  monkeypatch.setattr(
    selection_cache,
    "load",
    lambda k: (_ for _ in ()).throw(AssertionError("process 1 read its selection cache")),
  )
  monkeypatch.setattr(selection_cache, "store", no_compiles)
  original = job.blocking_key_value_get

  def published(key, timeout_in_ms):
    if "/ack/" not in key and key not in job.store:
      job.store[key] = json.dumps(
        {
          "chosen": chosen,
          "base": chosen,
          "options": {"xla_gpu_enable_latency_hiding_scheduler": True},
          "estimates": [["rewritten, one layer per collective", 2e-3], [chosen, 1e-3]],
          "failed": [],
          "judged": [],
          "profile": None,
        }
      )
    return original(key, timeout_in_ms)

  monkeypatch.setattr(job, "blocking_key_value_get", published)
  ov = jax_overlap.overlap(step, target="h100x8")
  explanation = ov.explain(*args)
  assert explanation.chosen == chosen
  assert explanation.xla_options == {"xla_gpu_enable_latency_hiding_scheduler": True}
  shared = [n for n in explanation.notes if "shared by process 0" in n]
  assert len(shared) == 1 and "this process, 1, compiled no variant" in shared[0]
  assert not any("remembered" in n for n in explanation.notes)
  assert any(
    n.startswith("chosen by the cost model on h100x8: ") and f"{chosen} 1.000 ms (chosen)" in n
    for n in explanation.notes
  )
