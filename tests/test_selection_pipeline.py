"""@overlap's selection as a pipeline of typed steps: the records between them, one target per
decoration (the devices' own on GPUs), measured selection, and mistakes answered where they
are made."""

import dataclasses
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlap
from jax_overlap import targets
from jax_overlap._src.deprecations import JaxOverlapDeprecationWarning
from jax_overlap._src.transform import measure, pipeline, records
from jax_overlap._src.transform.evaluate import VariantConfig
from jax_overlap.examples import shard_map_fsdp as S

# The settings test_selection_cache.py chooses with, on the quickstart notebook's step (the
# session's compile store shares XLA's results between them).
QUICK = dict(schedule_from_estimates=False)


@pytest.fixture(scope="module")
def program():
  return S.build("h100x8", layers=2, hidden=1024, mlp=2816, heads=8, seq=512)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(tmp_path))
  return tmp_path


@pytest.mark.slow
def test_the_choice_is_a_typed_record_explain_reads(cache_dir, program):
  fn, args = program
  ov = jax_overlap.overlap(fn, target="h100x8", **QUICK)
  built = ov.build(*args)
  assert isinstance(built, records.Built)
  choice = built.choice
  assert isinstance(choice, records.Choice) and choice.how == "cost_model"
  assert choice.origin == "this process"
  assert all(isinstance(c, records.Candidate) for c in choice.candidates)
  assert all(isinstance(c.config, VariantConfig) for c in choice.candidates)
  # One estimate per candidate, in order; the chosen one is the fastest.
  assert [e.name for e in choice.estimates] == [c.name for c in choice.candidates]
  assert all(isinstance(e, records.Estimate) for e in choice.estimates)
  best = min(choice.estimates, key=lambda e: e.step_time_s)
  assert choice.name == best.name and choice.candidate.name == best.name
  e = ov.explain(*args)
  assert e is built.explanation and e.choice is choice
  assert e.chosen == choice.name and list(e.candidates) == list(choice.estimates)
  assert e.xla_options == choice.candidate.options
  # Frozen all the way down: nothing downstream edits a step's record.
  for record, field in [(choice, "index"), (choice.candidate, "name"), (e, "chosen")]:
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(record, field, None)
  with pytest.raises(dataclasses.FrozenInstanceError):
    choice.candidate.config.prefetch = 3
  # A second decoration remembers the choice: a record of its own kind, saying so.
  again = jax_overlap.overlap(fn, target="h100x8", **QUICK).build(*args).choice
  assert again.how == "remembered" and again.origin == "the selection cache"
  assert again.name == choice.name


@pytest.mark.slow
def test_target_none_on_gpu_devices_selects_as_for_their_topology(cache_dir, program):
  # The arguments live on the h100x8 compile-only mesh: GPU devices of a known kind.
  fn, args = program
  named = jax_overlap.overlap(fn, target="h100x8", **QUICK).build(*args)
  plain = jax_overlap.overlap(fn, **QUICK)
  built = plain.build(*args)
  assert plain.settings.target is None  # the decoration keeps None; the build resolves it
  assert built.choice.how in ("cost_model", "remembered")
  assert built.choice.name == named.choice.name
  notes = "\n".join(built.explanation.notes)
  assert "target: h100x8 (1 host(s) x 8 h100), the devices the step runs on" in notes
  assert "chosen by the cost model on h100x8" in notes
  assert dict(built.explanation.candidates) == pytest.approx(dict(named.choice.estimates))


def _device(kind, process=0, platform="gpu"):
  return types.SimpleNamespace(device_kind=kind, process_index=process, platform=platform)


def test_from_devices_reads_the_gpu_hosts_and_devices_per_host():
  h100 = [_device("NVIDIA H100 80GB HBM3", p) for p in (0, 0, 0, 0, 1, 1, 1, 1)]
  topo = targets.from_devices(h100)
  assert (topo.gpu.name, topo.num_hosts, topo.gpus_per_host, topo.name) == ("h100", 2, 4, "h100x8")
  for kind, gpu in [
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40"),
    ("NVIDIA A40", "a40"),
    ("AMD Instinct MI250X", "mi250x"),
  ]:
    assert targets.from_devices([_device(kind)]).gpu.name == gpu
  assert targets.from_devices([_device("NVIDIA H200")] * 8) == targets.get("h200x8")
  with pytest.raises(ValueError, match=r"device kind 'NVIDIA T4' is not in the GPU catalogue"):
    targets.from_devices([_device("NVIDIA T4")])
  with pytest.raises(ValueError, match="the devices are cpu, not GPUs; pass target="):
    targets.from_devices([_device("cpu", platform="cpu")])
  with pytest.raises(ValueError, match=r"mixed GPU kinds \['a100', 'h100'\]"):
    targets.from_devices([_device("NVIDIA H100"), _device("NVIDIA A100-SXM4-80GB")])
  with pytest.raises(ValueError, match=r"hosts hold different numbers of devices \(\[1, 2\]\)"):
    targets.from_devices([_device("NVIDIA H100", p) for p in (0, 0, 1)])
  with pytest.raises(ValueError, match="no devices"):
    targets.from_devices([])


def test_compile_only_devices_of_a_topology_read_back_as_it():
  for name in ("h100x8", "h200x16", "a100x4"):
    assert targets.from_devices(targets.compile_only_devices(name)) == targets.get(name)


def test_target_is_one_topology_from_the_decoration_on():
  def step(x):
    return x

  topo = targets.get("h100x8")
  assert jax_overlap.overlap(step, target=" H100x8").settings.target == topo
  assert jax_overlap.overlap(step, target=topo).settings.target is topo
  assert jax_overlap.overlap(step).settings.target is None
  key = jax_overlap.overlap(step, target=topo).settings.key(True, {})
  assert key["target"] == "h100x8"
  with pytest.raises(ValueError, match="unknown target 'q100x8'"):
    jax_overlap.overlap(step, target="q100x8")


def test_unknown_keywords_are_refused_at_decoration_naming_the_closest():
  def step(x):
    return x

  with pytest.raises(
    TypeError, match=r"unexpected keyword argument 'targets'; did you mean 'target'"
  ):
    jax_overlap.overlap(targets="h100x8")
  with pytest.raises(TypeError, match=r"'static_argnum'; did you mean 'static_argnums'"):
    jax_overlap.overlap(step, static_argnum=0)
  with pytest.raises(TypeError, match=r"'zzz_option'.*overlap takes its own keywords and jax\.jit"):
    jax_overlap.overlap(step, zzz_option=1)
  # jax.jit's own keywords pass.
  jax_overlap.overlap(step, donate_argnums=0, static_argnames=())


def test_a_misspelled_compile_option_gets_the_closest_name_in_every_entry_point():
  wrong = {"xla_gpu_enable_latency_hidding_scheduler": True}
  expected = (
    r"xla_options names 'xla_gpu_enable_latency_hidding_scheduler', which is not an option "
    r"of jaxlib .*: per compile, XLA refuses the compile \(\"No such compile option\"\); did "
    r"you mean xla_gpu_enable_latency_hiding_scheduler\?"
  )
  x = jax.ShapeDtypeStruct((8,), jnp.float32)
  with pytest.raises(ValueError, match="analyze: " + expected):
    jax_overlap.analyze(lambda v: v * 2, x, xla_options=wrong)
  with pytest.raises(ValueError, match="analyze: " + expected):
    jax_overlap.analyze(lambda v: v * 2, x, xla_options=wrong, target=None)
  with pytest.warns(jax_overlap.NothingToOverlapWarning):
    with pytest.raises(ValueError, match="overlap: " + expected):
      jax_overlap.overlap(lambda v: v + 1, xla_options=wrong)(jnp.ones(8))
  # flags.validate words it for where the options go: one compile, or XLA_FLAGS.
  (per_compile,) = jax_overlap.flags.validate({"xla_gpu_frobnicate": 1}, probe=False) or [None]
  if per_compile is not None:  # the registry alone does not know every name
    assert "per compile, XLA refuses the compile" in per_compile.message
  (problem,) = jax_overlap.flags.validate({"xla_gpu_enable_latency_hidding_scheduler": True})
  assert "per compile, XLA refuses the compile with an error" in problem.message
  assert problem.suggestion == "xla_gpu_enable_latency_hiding_scheduler"
  assert "aborts the process at backend start" not in problem.message.split("(")[0]
  (problem,) = jax_overlap.flags.validate("--xla_gpu_enable_latency_hidding_scheduler=true")
  assert "in XLA_FLAGS it aborts the process at backend start" in problem.message


def test_a_step_with_nothing_to_move_warns_once():
  calls = []

  def step(w, x):
    calls.append(1)
    return jnp.tanh(x @ w)

  ov = jax_overlap.overlap(step)
  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  with pytest.warns(
    jax_overlap.NothingToOverlapWarning, match=r"found nothing to move in step"
  ) as said:
    out = ov(w, x)
  assert said[0].filename == __file__  # the caller's line
  np.testing.assert_array_equal(out, step(w, x))
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_overlap.NothingToOverlapWarning)
    ov(w, x)  # the same step again: no second warning
    ov(w, jnp.ones((3, 4)))  # nor for other shapes
  assert ov.build(w, x).choice.how == "only_candidate"


def test_a_step_with_collectives_to_move_does_not_warn():
  mesh = jax.make_mesh((8,), ("fsdp",))
  fn, args = S.build(None, layers=2, hidden=64, mlp=128, heads=4, seq=16, mesh=mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_overlap.NothingToOverlapWarning)
    jax_overlap.overlap(fn).build(*args)


@pytest.mark.slow
def test_measure_on_abstract_arguments_says_so_and_keeps_the_cost_models_choice(cache_dir, program):
  fn, args = program
  by_model = jax_overlap.overlap(fn, target="h100x8", **QUICK).build(*args).choice
  built = jax_overlap.overlap(fn, target="h100x8", select="measure", **QUICK).build(*args)
  assert built.choice.how == "cost_model" and built.choice.measured == ()
  assert built.choice.name == by_model.name
  assert any(
    "select='measure': nothing timed (the arguments are abstract" in n
    for n in built.explanation.notes
  )


def _choice(names, estimates):
  cfg = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False)
  cands = tuple(records.Candidate(n, cfg, {}) for n in names)
  return records.Choice(
    cands,
    int(np.argmin(estimates)),
    tuple(records.Estimate(n, t) for n, t in zip(names, estimates)),
  )


def _slow(x):
  def body(_, y):
    return jnp.tanh(y @ y)

  return jax.lax.fori_loop(0, 60, body, x)


def test_measured_selection_times_the_models_best_and_keeps_the_fastest_measured():
  # The cost model prefers "slow" (estimated fastest); timing says otherwise.
  names = ["slow", "fast", "twin of fast", "worst"]
  choice = _choice(names, [1e-3, 2e-3, 2e-3, 9e-3])
  assert choice.name == "slow"
  x = jnp.ones((256, 256))
  fns = {"slow": jax.jit(_slow), "fast": jax.jit(lambda v: v + 1), "worst": jax.jit(_slow)}
  timed = []

  def runner(c):
    timed.append(c.name)
    return fns[c.name]

  notes = []
  got = measure.measured_choice(choice, runner, (x,), {}, notes, platforms=("cpu",), steps=3)
  assert got.how == "measured" and got.name == "fast"
  # The best three distinct estimates are timed: the twin of an equal estimate is not.
  assert timed == ["slow", "fast", "worst"]
  measured = dict(got.measured)
  assert set(measured) == {"slow", "fast", "worst"} and measured["fast"] < measured["slow"]
  assert got.estimates == choice.estimates and notes == []
  text = "\n".join(pipeline.choice_notes(targets.get("h100x8"), got))
  assert text.startswith("measured on the devices on h100x8: slow 1.000 ms (measured ")
  assert "fast 2.000 ms (measured " in text and "(chosen)" in text.split("fast 2.000")[1]
  # Meant for GPUs: on CPU devices nothing is timed and the model's choice stays.
  notes = []
  same = measure.measured_choice(choice, runner, (x,), {}, notes)
  assert same is choice
  assert notes == [
    "select='measure': nothing timed (the step runs on cpu devices, not on gpu/cuda/rocm); "
    "the cost model's choice is kept"
  ]


def test_timing_needs_a_timed_step():
  with pytest.raises(ValueError, match="need at least one timed step and no negative warm-up"):
    measure.time_variants([jnp.sin], (jnp.ones(2),), {}, steps=0)
  (t,) = measure.time_variants([jax.jit(jnp.sin)], (jnp.ones(2),), {}, warmup=1, steps=2)
  assert 0 < t < 10


def test_memory_plan_is_named_apart_from_the_runtime_plan():
  from jax_overlap._src.budget.memory.planner import MemoryPlan

  assert jax_overlap.budget.memory.MemoryPlan is MemoryPlan
  with pytest.warns(JaxOverlapDeprecationWarning, match=r"budget.memory.Plan: is now .*MemoryPlan"):
    old = jax_overlap.budget.memory.Plan
  assert old is MemoryPlan
  with pytest.raises(AttributeError, match="has no attribute 'Planned'"):
    jax_overlap.budget.memory.Planned  # noqa: B018


def _faked_analysis(monkeypatch, times: dict) -> list:
  """``analysis.analyze`` answering from ``times`` (name: (step ms, compute ms)); the list
  the names it was asked for are appended to, in order."""
  from jax_overlap._src.analysis import analyze as analysis

  compiled = []

  def fake_analyze(fn, *args, name, xla_options, **kwargs):
    compiled.append(name)
    step, compute = times[name]
    return types.SimpleNamespace(
      step_time_s=step * 1e-3, compute_time_s=compute * 1e-3, xla_options={}, notes=[]
    )

  monkeypatch.setattr(analysis, "analyze", fake_analyze)
  return compiled


def test_a_program_that_cannot_win_after_its_first_variant_is_not_compiled_further(
  monkeypatch,
):
  # A cheap first pass: one variant of each program, then only programs that can still win.
  from jax_overlap._src.transform import search

  written = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False).as_written()
  rewritten = dataclasses.replace(written, prefetch=1, reduce_scatter="per_layer", loops="all")
  forward = dataclasses.replace(rewritten, loops="forward")
  converted = dataclasses.replace(rewritten, program="shard_map")
  # name: (step ms, compute ms)
  times = {
    "w0": (10.0, 6.0),
    "w1": (9.0, 6.0),
    "r0": (10.3, 5.0),  # 3% behind the best step, its compute could still win: siblings compile
    "r1": (8.0, 5.0),
    "f0": (12.0, 5.0),  # 20% behind the best step (10 ms): siblings skipped
    "f1": (1.0, 1.0),
    "s0": (16.0, 11.0),  # its compute alone is over the best step (10 ms): siblings skipped
    "s1": (1.0, 1.0),
    "c0": (20.0, 15.0),  # the same program on cuBLAS GEMMs: a program of its own
    "b0": (10.1, 5.0),  # its loop bodies in batch parts: other GEMMs, a program of its own
  }
  compiled = _faked_analysis(monkeypatch, times)
  # Variants of one program differ in their options.
  cands = [records.Candidate(n, written, {"o": n}) for n in ("w0", "w1")]
  cands += [records.Candidate(n, rewritten, {"o": n}) for n in ("r0", "r1")]
  cands += [records.Candidate(n, forward, {"o": n}) for n in ("f0", "f1")]
  cands += [records.Candidate(n, converted, {"o": n}) for n in ("s0", "s1")]
  cands += [records.Candidate("c0", rewritten, {"xla_gpu_enable_triton_gemm": False})]
  cands += [records.Candidate("b0", dataclasses.replace(rewritten, batch_parts=2), {"o": "r0"})]
  # One that compiles w0's program with w0's options: compiled once.
  cands += [records.Candidate("w0 again", written, {"o": "w0"})]
  settings = types.SimpleNamespace(
    target=targets.get("h100x8"), schedule_from_estimates=False, xla_options={}
  )
  choice, reports = search.select(settings, cands, lambda cfg, options: None, (), {})
  assert sorted(compiled[:6]) == ["b0", "c0", "f0", "r0", "s0", "w0"]
  assert sorted(compiled[6:]) == ["r1", "w1"]
  assert choice.name == "r1"
  assert [c.name for c in choice.candidates] == ["w0", "w1", "r0", "r1", "f0", "s0", "c0", "b0"]
  assert len(reports) == len(choice.candidates) == len(choice.estimates)
  assert choice.failed == (
    "w0 again: the same program and options as 'w0'",
    "1 variant(s) of the program of 'f0' skipped: its step takes 12.000 ms, 20% behind the "
    "best step so far (10.000 ms), more than the other variants of one program (options and "
    "orderings) gain over its first (15% allowed)",
    "1 variant(s) of the program of 's0' skipped: its compute alone takes 11.000 ms, more "
    "than the best step so far (10.000 ms)",
  )
  # Where the compute could still win and the first variant is close, every variant compiles.
  times["s0"] = (11.0, 9.0)
  times["f0"] = (11.0, 5.0)
  compiled.clear()
  choice, _ = search.select(settings, cands, lambda cfg, options: None, (), {})
  assert sorted(compiled) == sorted(times) and choice.name == "f1"


def test_the_first_pass_profiles_its_fastest_variant_at_once(monkeypatch):
  # The fastest first variant is recompiled with a latency profile before the rest: the
  # step it reaches is the one the other programs must come near.
  from jax_overlap._src.analysis import latency_profile
  from jax_overlap._src.transform import search

  written = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False).as_written()
  rewritten = dataclasses.replace(written, prefetch=1, reduce_scatter="per_layer", loops="all")
  suffix = search.PROFILED_SUFFIX
  # name: (step ms, compute ms); the profiled step as written is 9 ms: r0 (10.5 ms) is then
  # more than 10% behind it and r1 is not compiled.
  times = {"w0": (10.0, 8.5), "w0" + suffix: (9.0, 8.5), "r0": (10.5, 8.0), "r1": (8.0, 8.0)}
  # Its compute could still win, but its step is more than search.FAR_BEHIND behind the
  # best: not profiled at the end either.
  times["r0" + suffix] = (9.5, 8.0)
  compiled = _faked_analysis(monkeypatch, times)
  monkeypatch.setattr(latency_profile, "write_profile", lambda report: "/profile.pbtxt")
  cands = [records.Candidate("w0", written)]
  cands += [records.Candidate(n, rewritten, {"o": i}) for i, n in enumerate(("r0", "r1"))]
  settings = types.SimpleNamespace(
    target=targets.get("h100x8"), schedule_from_estimates=True, xla_options={}
  )
  monkeypatch.setenv("JAX_OVERLAP_SELECT_WORKERS", "1")  # one variant compiles at a time
  choice, _ = search.select(settings, cands, lambda cfg, options: None, (), {})
  assert sorted(compiled[:2]) == ["r0", "w0"] and compiled[2:] == ["w0" + suffix]
  assert choice.name == "w0" + suffix
  assert any(n.startswith("1 variant(s) of the program of 'r0' skipped") for n in choice.failed)
  # The fastest program's other variants (never skipped) compile beside its profiled one,
  # so that no thread idles meanwhile.
  from jax_overlap._src.transform import compiles

  batches = []
  analyze_all = compiles.analyze_all

  def recorded(settings, jobs, *a, **k):
    batches.append([j.name for j in jobs])
    return analyze_all(settings, jobs, *a, **k)

  monkeypatch.setattr(compiles, "analyze_all", recorded)
  # Two compile at a time: a thread that would idle beside the profiled fastest (its
  # program has no other variant) profiles the next first variant worth it (r0, 5 %
  # behind w0): r0's program then comes within reach of the best step and r1 compiles.
  monkeypatch.setenv("JAX_OVERLAP_SELECT_WORKERS", "2")
  choice, _ = search.select(settings, cands, lambda cfg, options: None, (), {})
  assert batches == [["w0", "r0"], ["w0" + suffix, "r0" + suffix], ["r1"], []]
  assert choice.name == "r1"
  batches.clear()
  times["w1"] = (10.2, 8.5)
  times["w1" + suffix] = (9.2, 8.5)
  cands.insert(1, records.Candidate("w1", written, {"o": "w1"}))
  choice, _ = search.select(settings, cands, lambda cfg, options: None, (), {})
  # At the end, the fastest variant not profiled yet (w1); r0 is still too far behind.
  assert batches == [["w0", "r0"], ["w0" + suffix, "w1"], [], ["w1" + suffix]]
  assert choice.name == "w0" + suffix


def test_the_first_pass_compiles_the_other_programs_beside_a_first_compile_running(monkeypatch):
  # A GSPMD step's first compile (the step as written) starts while the step is converted;
  # the selection compiles its shard_map form's first variants beside it, then adds the
  # option variants that compile's report gives, right after it.
  import concurrent.futures
  import threading

  from jax_overlap._src.analysis import analyze as analysis
  from jax_overlap._src.transform import search

  written = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False).as_written()
  converted = dataclasses.replace(
    written, program="shard_map", prefetch=1, reduce_scatter="per_layer", loops="all"
  )
  times = {"w0": (10.0, 8.0), "w1": (9.0, 8.0), "s0": (9.5, 8.5), "s1": (9.4, 8.5)}
  started = threading.Event()
  compiled = []
  first_done_when = {}

  def fake_analyze(fn, *args, name, xla_options, **kwargs):
    compiled.append(name)
    first_done_when[name] = running.done()
    started.set()
    step, compute = times[name]
    return types.SimpleNamespace(
      step_time_s=step * 1e-3, compute_time_s=compute * 1e-3, xla_options={}, notes=[]
    )

  def first_compile():  # the step as written, compiling until a shard_map variant started
    ok = started.wait(60)
    return types.SimpleNamespace(
      step_time_s=10e-3, compute_time_s=8e-3, xla_options={}, notes=[], waited=ok
    )

  monkeypatch.setattr(analysis, "analyze", fake_analyze)
  monkeypatch.setenv("JAX_OVERLAP_SELECT_WORKERS", "2")
  given = []

  def more(report):
    given.append(report)
    return [records.Candidate("w1", written, {"o": "w1"})]

  pool = concurrent.futures.ThreadPoolExecutor(1)
  running = pool.submit(first_compile)
  cands = [records.Candidate("w0", written)]
  cands += [records.Candidate(n, converted, {"o": n}) for n in ("s0", "s1")]
  settings = types.SimpleNamespace(
    target=targets.get("h100x8"), schedule_from_estimates=False, xla_options={}
  )
  choice, reports = search.select(
    settings, cands, lambda cfg, options: None, (), {}, running=search.Running(running, more)
  )
  pool.shutdown()
  assert given and given[0].waited, "no shard_map variant compiled beside the first compile"
  assert compiled[0] == "s0" and first_done_when["s0"] is False
  assert [c.name for c in choice.candidates] == ["w0", "w1", "s0", "s1"]
  assert reports[0] is given[0] and choice.name == "w1"


def test_a_first_compile_that_fails_fails_the_selection(monkeypatch):
  import concurrent.futures

  from jax_overlap._src.analysis import analyze as analysis
  from jax_overlap._src.transform import search

  written = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False).as_written()
  converted = dataclasses.replace(written, program="shard_map")
  monkeypatch.setattr(
    analysis,
    "analyze",
    lambda fn, *a, name, xla_options, **k: types.SimpleNamespace(
      step_time_s=1e-3, compute_time_s=1e-3, xla_options={}, notes=[]
    ),
  )
  failed: concurrent.futures.Future = concurrent.futures.Future()
  failed.set_exception(RuntimeError("XLA could not compile the function"))
  cands = [records.Candidate("w0", written), records.Candidate("s0", converted)]
  settings = types.SimpleNamespace(
    target=targets.get("h100x8"), schedule_from_estimates=False, xla_options={}
  )
  with pytest.raises(RuntimeError, match="could not compile"):
    search.select(
      settings,
      cands,
      lambda cfg, options: None,
      (),
      {},
      running=search.Running(failed, lambda report: []),
    )


def test_a_thread_the_rest_leave_idle_recompiles_a_variant_with_a_latency_profile(monkeypatch):
  # One variant left to compile after the first pass and two threads: beside it, the
  # variant most worth a latency profile by what is known then (one of the profiles tried
  # at the end, tried now), so that the last batch holds one profile fewer.
  from jax_overlap._src.analysis import latency_profile
  from jax_overlap._src.transform import compiles, search

  written = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False).as_written()
  rewritten = dataclasses.replace(written, prefetch=1, reduce_scatter="per_layer", loops="all")
  sfx = search.PROFILED_SUFFIX
  times = {
    "w0": (10.0, 8.0),
    "w0" + sfx: (9.6, 8.0),
    "w1": (10.1, 7.9),
    "w1" + sfx: (9.4, 7.9),
    "r0": (10.4, 8.1),
    "r1": (10.3, 7.5),
    "r1" + sfx: (9.7, 7.5),
  }
  batches = []

  analyze_all = compiles.analyze_all

  def recorded(settings, jobs, *a, **k):
    batches.append([j.name for j in jobs])
    return analyze_all(settings, jobs, *a, **k)

  _faked_analysis(monkeypatch, times)
  monkeypatch.setattr(compiles, "analyze_all", recorded)
  monkeypatch.setattr(latency_profile, "write_profile", lambda report: "/profile.pbtxt")
  monkeypatch.setenv("JAX_OVERLAP_SELECT_WORKERS", "2")
  cands = [records.Candidate(n, written, {"o": n}) for n in ("w0", "w1")]
  cands += [records.Candidate(n, rewritten, {"o": n}) for n in ("r0", "r1")]
  settings = types.SimpleNamespace(
    target=targets.get("h100x8"), schedule_from_estimates=True, xla_options={}
  )
  choice, _ = search.select(settings, cands, lambda cfg, options: None, (), {})
  # First pass, the fastest profiled beside its program's other variant, then the rest (r1)
  # with w1's profile beside it (w1: the fastest not profiled yet), and r1's at the end.
  assert batches == [["w0", "r0"], ["w0" + sfx, "w1"], ["r1", "w1" + sfx], ["r1" + sfx]]
  assert choice.name == "w1" + sfx
  assert sum(c.name.endswith(sfx) for c in choice.candidates) == search.PROFILED_VARIANTS


@pytest.mark.parametrize("both_help", [False, True])
def test_a_combination_of_options_compiles_only_where_each_beat_the_first(monkeypatch, both_help):
  # w12 sets both options w1 and w2 set one each: compiled after them, and only where each
  # of them beat the program's first variant (w0).
  from jax_overlap._src.transform import search

  written = VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False).as_written()
  times = {
    "w0": (10.0, 8.0),
    "w1": (9.5, 8.0),
    "w2": (9.8 if both_help else 10.2, 8.0),
    "w12": (9.0, 8.0),
  }
  compiled = _faked_analysis(monkeypatch, times)
  monkeypatch.setenv("JAX_OVERLAP_SELECT_WORKERS", "1")
  base = {"a": 1}
  cands = [
    records.Candidate("w0", written, base),
    records.Candidate("w12", written, {**base, "o1": 1, "o2": 2}),
    records.Candidate("w1", written, {**base, "o1": 1}),
    records.Candidate("w2", written, {**base, "o2": 2}),
  ]
  settings = types.SimpleNamespace(
    target=targets.get("h100x8"), schedule_from_estimates=False, xla_options={}
  )
  choice, _ = search.select(settings, cands, lambda cfg, options: None, (), {})
  assert compiled[:3] == ["w0", "w1", "w2"]
  if both_help:
    assert compiled[3:] == ["w12"] and choice.name == "w12"
  else:
    assert compiled[3:] == [] and choice.name == "w1"
    assert [n for n in choice.failed if n.startswith("w12: not compiled")] == [
      "w12: not compiled: it combines the options of 'w1' and 'w2', and 'w2' (10.200 ms) "
      "did not beat the program's first variant (10.000 ms)"
    ]
