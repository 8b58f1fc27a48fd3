"""Variants sharing XLA's kernel cache: the kernels XLA takes from it are the ones it would
have compiled (every report number the same as without the cache), launches are found
through XLA's thunk metadata, and kernel names that are not the step's own are left
unknown."""

import glob
import os
import shutil

import pytest

from jax_overlap._src.analysis import analyze as analysis
from jax_overlap._src.analysis import schedule
from jax_overlap._src.compile import compiler as compile_lib
from jax_overlap._src.compile import kernel_cache
from jax_overlap.examples import fsdp_transformer


def _kernel_facts(report):
  return [
    (k.name, k.kind, k.grid_blocks, k.threads_per_block, k.smem_bytes, k.flops, k.time_s)
    for k in report.kernels
  ]


def _ptx_files(step):
  return len(glob.glob(os.path.join(step.dump_dir, "*.ptx")))


@pytest.fixture(scope="module")
def small_step():
  return fsdp_transformer.build("h100x8", layers=2, hidden=256, mlp=512, heads=4, seq=128)


# Options the selection's variants differ by: a scheduling one, one that changes the
# GEMMs' code (cuBLAS instead of Triton) and one that changes the HLO (no dot merger).
VARIANTS = [
  {"xla_gpu_enable_latency_hiding_scheduler": False},
  {"xla_gpu_enable_triton_gemm": False},
  {"xla_gpu_dot_merger_threshold_mb": 0},
]


def test_variants_from_a_shared_cache_report_what_their_own_compiles_report(small_step):
  fn, args = small_step
  with kernel_cache.Shared() as kernels:
    seed = compile_lib.compile_for_target(
      fn, *args, target="h100x8", xla_options=kernels.seed({}), keep_dump=True
    )
    assert kernels.seeded()
    for options in VARIANTS:
      alone = compile_lib.compile_for_target(
        fn, *args, target="h100x8", xla_options=options, keep_dump=True
      )
      shared = compile_lib.compile_for_target(
        fn, *args, target="h100x8", xla_options=kernels.copy(options), keep_dump=True
      )
      assert shared.reused_kernels and not alone.reused_kernels
      # XLA generated code only for the kernels the seed did not have.
      assert _ptx_files(shared) < _ptx_files(alone)
      a, s = analysis.analyze_compiled(alone), analysis.analyze_compiled(shared)
      assert _kernel_facts(s) == _kernel_facts(a), options
      assert [(c.name, c.kind, c.bytes, c.time_s) for c in s.collectives] == [
        (c.name, c.kind, c.bytes, c.time_s) for c in a.collectives
      ]
      assert s.step_time_s == a.step_time_s
      # Launch names of the compile alone are the driver's; the shared one's are unknown.
      assert any(k.launch_name for k in a.kernels)
      assert not any(k.launch_name for k in s.kernels)
      for step in (alone, shared):
        shutil.rmtree(step.dump_dir, ignore_errors=True)
  shutil.rmtree(seed.dump_dir, ignore_errors=True)


def test_a_finished_variants_kernels_serve_the_variants_after_it(small_step):
  # The seed is the step as written; a variant with XLA's dot merger off has GEMM fusions
  # the seed has not, and one with cuBLAS GEMMs has GEMM calls of its own: compiled side
  # by side from the seed, each compiles its own. Once both are done (their two files
  # merged), a later variant of either takes them from the cache instead of compiling
  # them again.
  fn, args = small_step
  unmerged = {"xla_gpu_dot_merger_threshold_mb": 0}
  cublas = {"xla_gpu_enable_triton_gemm": False}
  low_priority = {"xla_gpu_enable_highest_priority_async_stream": False}
  steps = []
  with kernel_cache.Shared() as kernels:

    def compiled(options):
      steps.append(
        compile_lib.compile_for_target(
          fn, *args, target="h100x8", xla_options=options, keep_dump=True
        )
      )
      return steps[-1]

    seed = kernels.seed({})
    compiled(seed)
    kernels.done(seed)
    first = kernels.copy(unmerged)
    sibling = kernels.copy(cublas)  # copied beside the first, before it is done
    new_in_first = _ptx_files(compiled(first))
    new_in_sibling = _ptx_files(compiled(sibling))
    assert new_in_first > 0 and new_in_sibling > 0
    # A copy of the seed alone compiles the first's kernels again (give or take one: XLA
    # compiles kernels in parallel, and two identical fusions compiled at the same time
    # may or may not become one).
    again = _ptx_files(compiled(kernels.copy({**unmerged, **low_priority})))
    assert abs(again - new_in_first) <= 1, (again, new_in_first)
    kernels.done(first)
    kernels.done(sibling)  # copied before the first was done: the two files merged
    assert os.path.basename(kernels.copy({})[kernel_cache.OPTION]) != "seed.bin"
    later = _ptx_files(compiled(kernels.copy({**unmerged, **low_priority})))
    later_sibling = _ptx_files(compiled(kernels.copy({**cublas, **low_priority})))
    assert later < new_in_first - 1, (later, new_in_first)
    assert later_sibling < new_in_sibling - 1, (later_sibling, new_in_sibling)
  for step in steps:
    shutil.rmtree(step.dump_dir, ignore_errors=True)


def _entry(name: bytes, value: bytes) -> bytes:
  """A kernel cache map entry as XLA writes it: field 1 (length-delimited) holding the
  kernel's name (field 1) and its kernel (field 2: a message whose field 1 is the
  fingerprint of the fusion, here ``value`` itself, followed by a binary)."""
  kernel = b"\x0a" + bytes([len(value)]) + value + b"\x1a\x03bin"
  inner = b"\x0a" + bytes([len(name)]) + name + b"\x12" + bytes([len(kernel)]) + kernel
  return b"\x0a" + bytes([len(inner)]) + inner


def test_files_of_compiles_side_by_side_are_merged(tmp_path):
  # Two compiles copied from one file: the first to finish becomes the newest; the
  # second's kernels are merged into it (where both named a kernel alike, the second's is
  # kept). A file that is not a kernel cache is not merged.
  with kernel_cache.Shared() as kernels:
    seed = kernels.seed({})
    # XLA's file ends with a field of its own (a number), kept as it is.
    open(seed[kernel_cache.OPTION], "wb").write(_entry(b"k0", b"seed") + b"\x10\x02")
    kernels.done(seed)
    a = kernels.copy({})
    b = kernels.copy({})
    open(a[kernel_cache.OPTION], "ab").write(_entry(b"ka", b"A") + _entry(b"k1", b"a1"))
    open(b[kernel_cache.OPTION], "ab").write(_entry(b"kb", b"B") + _entry(b"k1", b"b1"))
    kernels.done(a)
    assert (
      open(kernels.copy({})[kernel_cache.OPTION], "rb").read()
      == open(a[kernel_cache.OPTION], "rb").read()
    )
    kernels.done(b)
    merged = open(kernels.copy({})[kernel_cache.OPTION], "rb").read()
    assert kernel_cache._entries(merged) == {
      b"k0": _entry(b"k0", b"seed"),
      b"ka": _entry(b"ka", b"A"),
      b"k1": _entry(b"k1", b"b1"),
      b"kb": _entry(b"kb", b"B"),
    }
    assert kernel_cache._fields(merged)[1] == {2: b"\x10\x02"}
    # The same fusion compiled by two siblings under two names: XLA takes one kernel per
    # fingerprint, so the later one's is kept alone.
    e = kernels.copy({})
    f = kernels.copy({})
    open(e[kernel_cache.OPTION], "ab").write(_entry(b"ke", b"F"))
    open(f[kernel_cache.OPTION], "ab").write(_entry(b"kf", b"F"))
    kernels.done(e)
    kernels.done(f)
    merged = open(kernels.copy({})[kernel_cache.OPTION], "rb").read()
    got = kernel_cache._entries(merged)
    assert b"kf" in got and b"ke" not in got and b"k0" in got
    c = kernels.copy({})
    d = kernels.copy({})
    open(d[kernel_cache.OPTION], "wb").write(b"not a kernel cache")
    kernels.done(c)
    kernels.done(d)  # unreadable: the newest stays as it was
    assert open(kernels.copy({})[kernel_cache.OPTION], "rb").read() == merged
    kernels.done({})  # options without a file of this cache: nothing changes
    kernels.done({kernel_cache.OPTION: str(tmp_path / "other.bin")})
    assert open(kernels.copy({})[kernel_cache.OPTION], "rb").read() == merged


def test_a_seed_finishing_after_its_copies_is_merged_in():
  with kernel_cache.Shared() as kernels:
    seed = kernels.seed({})
    early = kernels.copy({})  # the seed has compiled nothing yet: an empty cache
    assert not kernel_cache.has_kernels(early[kernel_cache.OPTION])
    open(early[kernel_cache.OPTION], "wb").write(_entry(b"e", b"early"))
    kernels.done(early)
    open(seed[kernel_cache.OPTION], "wb").write(_entry(b"s", b"seed"))
    kernels.done(seed)
    got = kernel_cache._entries(open(kernels.copy({})[kernel_cache.OPTION], "rb").read())
    assert set(got) == {b"e", b"s"}


@pytest.mark.parametrize("threads", [2, 3])
def test_programs_first_variants_compile_side_by_side_and_the_rest_after_them(monkeypatch, threads):
  # A selection's variants of a program not compiled yet take their kernels from its first
  # variant: that one starts at once, beside the first variants of other programs (the seed
  # included); the program's other variants start only once it has finished.
  import dataclasses
  import threading
  import time
  import types

  from jax_overlap._src.transform import compiles, evaluate
  from jax_overlap._src.transform.records import Candidate

  monkeypatch.setenv("JAX_OVERLAP_SELECT_WORKERS", str(threads))
  monkeypatch.setattr(kernel_cache, "_UNSUPPORTED", [False])
  lock, running, started, ended = threading.Lock(), set(), {}, {}
  together = ("w0", "r0") if threads == 2 else ("w0", "r0", "s0")
  meet = threading.Barrier(len(together), timeout=30)

  def fake_analyze(fn, *args, name, xla_options, **kwargs):
    assert kernel_cache.OPTION in xla_options  # every variant compiles with the shared cache
    with lock:
      started[name] = time.monotonic()
      running.add(name)
    if name in together:
      meet.wait()  # fails unless these run at the same time
    time.sleep(0.02)
    with lock:
      running.discard(name)
      ended[name] = time.monotonic()
    return types.SimpleNamespace(xla_options={}, notes=[])

  monkeypatch.setattr(analysis, "analyze", fake_analyze)
  rewritten = evaluate.VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False)
  written = rewritten.as_written()
  converted = dataclasses.replace(written, program="shard_map")
  jobs = [Candidate(f"w{i}", written) for i in range(3)]
  jobs += [Candidate(f"r{i}", rewritten) for i in range(3)]
  jobs += [Candidate(f"s{i}", converted) for i in range(2)]
  settings = types.SimpleNamespace(target="h100x8")
  with kernel_cache.Shared() as kernels:
    out = compiles.analyze_all(
      settings, jobs, lambda cfg, options: None, (), {}, (ValueError,), kernels
    )
  assert len(out) == len(jobs) and not any(isinstance(r, Exception) for r in out)
  for first, rest in (("w0", ["w1", "w2"]), ("r0", ["r1", "r2"]), ("s0", ["s1"])):
    assert all(started[r] >= ended[first] for r in rest), first
  # The leaders did not wait for the programs before them.
  assert started["r0"] < ended["w0"]
  if threads == 3:
    assert started["s0"] < ended["r0"]


def test_thunk_metadata_finds_the_launches_the_kernel_names_find(fsdp_h100_dump):
  # XLA's own listings of one compile (an 8-layer step whose identical fusions share
  # kernels): every launch found by kernel name is found through the metadata with the
  # same configuration, and the same kernel where the kernel is named after the
  # instruction. (Where an instruction's kernel was guessed from its deduplication group,
  # the metadata names the kernel its thunk launches.)
  _, dump = fsdp_h100_dump
  (hlo,) = glob.glob(os.path.join(dump, "*gpu_after_optimizations.txt"))
  (thunks,) = glob.glob(os.path.join(dump, "*thunk_sequence.txt"))
  (meta,) = glob.glob(os.path.join(dump, "*thunk_metadata.txt"))
  texts = [open(f).read() for f in (hlo, thunks, meta)]
  # Every kernel thunk of the listing has its instruction in the metadata.
  launched = schedule.launches_by_instruction(texts[1], texts[2])
  names = {name for kernels in launched.values() for name, _ in kernels}
  assert names == set(schedule.parse_thunks(texts[1])[0])
  by_name = analysis.analyze_hlo(texts[0], texts[1], target="h100x8")
  by_meta = analysis.analyze_hlo(texts[0], texts[1], thunk_metadata=texts[2], target="h100x8")
  assert [k.name for k in by_meta.kernels] == [k.name for k in by_name.kernels]
  found = 0
  for old, new in zip(by_name.kernels, by_meta.kernels):
    if not old.launch_name:
      continue
    found += 1
    config = (old.grid_blocks, old.threads_per_block, old.smem_bytes)
    assert (new.grid_blocks, new.threads_per_block, new.smem_bytes) == config, old.name
    if old.launch_name == old.name.replace(".", "_").replace("-", "_"):
      assert new.launch_name == old.launch_name
    else:
      assert new.launch_name in texts[1]
  assert found > len(by_name.kernels) // 2
  assert sum(bool(k.launch_name) for k in by_meta.kernels) >= found
  assert by_meta.step_time_s == by_name.step_time_s


def test_shared_cache_hands_out_nothing_without_a_seed_or_when_disabled(tmp_path):
  with kernel_cache.Shared() as kernels:
    # Nothing seeded yet: a cache of its own, empty.
    empty = kernels.copy({"a": 1})[kernel_cache.OPTION]
    assert not kernel_cache.has_kernels(empty)
    seeded = kernels.seed({"a": 1})
    assert seeded[kernel_cache.OPTION].endswith("seed.bin")
    # A user's own cache file is left as it is.
    own = {kernel_cache.OPTION: str(tmp_path / "mine.bin")}
    assert kernels.seed(own)[kernel_cache.OPTION] == own[kernel_cache.OPTION]
  off = kernel_cache.Shared(enabled=False)
  assert off.seed({"a": 1}) == {"a": 1} and off.copy({}) == {}


def test_sharing_can_be_turned_off(monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_SHARED_KERNELS", "0")
  assert not kernel_cache.sharing_on()
  with kernel_cache.Shared() as kernels:
    assert kernels.seed({"a": 1}) == {"a": 1}
  monkeypatch.setenv("JAX_OVERLAP_SHARED_KERNELS", "1")
  with kernel_cache.Shared() as kernels:
    assert kernel_cache.OPTION in kernels.seed({})


@pytest.mark.slow
def test_selection_with_shared_kernels_estimates_every_variant_as_without(monkeypatch):
  # A shard_map FSDP step (its rewrites and compiler-option variants; the benchmark
  # transform_selection_time compares all 51 variants of four 32-layer forms): the
  # selection hands later variants the seed's kernels, and every estimate is the one the
  # variant gets compiled on its own.
  import jax_overlap
  from jax_overlap.examples import shard_map_fsdp

  # The step test_selection_cache.py chooses for (the session's compile store shares the
  # compiles with shared kernels between the two).
  fn, args = shard_map_fsdp.build("h100x8", layers=2, hidden=1024, mlp=2816, heads=8, seq=512)
  handed = []
  copy = kernel_cache.Shared.copy

  def counted(self, options):
    out = copy(self, options)
    handed.append(kernel_cache.OPTION in out)
    return out

  monkeypatch.setattr(kernel_cache.Shared, "copy", counted)

  def explain():
    ov = jax_overlap.overlap(fn, target="h100x8", cache=False, schedule_from_estimates=False)
    return ov.explain(*args)

  shared = explain()
  assert handed and all(handed)
  monkeypatch.setenv("JAX_OVERLAP_SHARED_KERNELS", "0")
  handed.clear()
  alone = explain()
  assert not any(handed)
  assert dict(shared.candidates) == dict(alone.candidates)
  assert shared.chosen == alone.chosen


def test_every_kernel_of_an_instruction_launching_several_is_listed():
  # The listing format of XLA's dump (two kernels of one reduction fusion: an
  # initialisation and the work), joined through the metadata.
  thunks = (
    "001: kCustomKernel [source | next=002 (1)] input_reduce_fusion_init grid: [4, 1, 1] "
    "threads: [128, 1, 1]  shared_memory: 0 bytes\n"
    "002: kCustomKernel [prev=001 (1) | sink] input_reduce_fusion_work grid: [512, 1, 1] "
    "threads: [256, 1, 1]  shared_memory: 4096 bytes\n"
  )
  meta = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "input_reduce_fusion"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "kCustomKernel"\n}}\n'
    for i in (1, 2)
  )
  (kernels,) = schedule.launches_by_instruction(thunks, meta).values()
  assert kernels == [
    ("input_reduce_fusion_init", (4, 128, 0)),
    ("input_reduce_fusion_work", (512, 256, 4096)),
  ]


def test_compiles_with_any_kernel_cache_are_remembered_alike_and_apart_from_others(tmp_path):
  # A selection whose seed was read back from the compile store hands out empty caches:
  # its variants must find the compiles an earlier selection made from a full one.
  import jax

  from jax_overlap._src import targets

  lowered = jax.jit(lambda x: x + 1).lower(1.0)
  topo = targets.get("h100x8")
  full = tmp_path / "full.bin"
  full.write_bytes(b"kernels")

  def key(**options):
    return compile_lib._memo_key(lowered, options, topo)

  a = key(xla_gpu_kernel_cache_file=str(full), xla_gpu_enable_triton_gemm=False)
  b = key(xla_gpu_kernel_cache_file=str(tmp_path / "empty.bin"), xla_gpu_enable_triton_gemm=False)
  assert a == b
  assert a != key(xla_gpu_enable_triton_gemm=False)


def test_a_kernel_cache_xla_refuses_is_dropped_for_the_rest_of_the_selection(monkeypatch):
  # XLA's loader refusing a shared file (a check of its own the file breaks) must not cost
  # the variant: it compiles again without the file, and so do the variants after it.
  import types

  from jax_overlap._src.transform import compiles, evaluate
  from jax_overlap._src.transform.records import Candidate

  monkeypatch.setenv("JAX_OVERLAP_SELECT_WORKERS", "1")
  monkeypatch.setattr(kernel_cache, "_UNSUPPORTED", [False])
  calls = []

  def fake_analyze(fn, *args, name, xla_options, **kwargs):
    calls.append((name, kernel_cache.OPTION in xla_options))
    if name == "b" and kernel_cache.OPTION in xla_options:
      raise RuntimeError("INTERNAL: RET_CHECK failure (xla/service/gpu/kernel_reuse_cache.cc:112)")
    return types.SimpleNamespace(xla_options={}, notes=[])

  monkeypatch.setattr(analysis, "analyze", fake_analyze)
  cfg = evaluate.VariantConfig(prefetch=1, reduce_scatter="per_layer", annotate=False)
  jobs = [Candidate(n, cfg) for n in "abc"]
  with kernel_cache.Shared() as kernels:
    out = compiles.analyze_all(
      types.SimpleNamespace(target="h100x8"), jobs, lambda c, o: None, (), {},
      (RuntimeError,), kernels,
    )  # fmt: skip
  assert not any(isinstance(r, Exception) for r in out)
  assert calls == [("a", True), ("b", True), ("b", False), ("c", False)]
  assert kernel_cache.supported()  # other selections still share
