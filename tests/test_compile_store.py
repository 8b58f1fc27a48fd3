"""Deviceless compiles kept on disk: read back in place of XLA, keyed by program, options,
target and compiler versions; unreadable entries compiled again; bounded; off by flag."""

import gzip
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.analysis import analyze as analysis
from jax_overlap._src.compile import compiler as compile_lib
from jax_overlap._src.compile import store as compile_store


@pytest.fixture
def store(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_COMPILE_CACHE_DIR", str(tmp_path / "compiles"))
  monkeypatch.delenv("JAX_OVERLAP_COMPILE_CACHE", raising=False)
  compile_lib.clear_memo()
  yield tmp_path / "compiles"
  compile_lib.clear_memo()


def _step():
  mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  return (lambda x, w: jnp.tanh(x @ w).sum()), (x, w)


def _entries(folder):
  return sorted(p for p in os.listdir(folder) if p.endswith(".json.gz")) if folder.exists() else []


def test_a_second_process_reads_xlas_artefacts_instead_of_compiling(store):
  fn, args = _step()
  first = compile_lib.compile_for_target(fn, *args, target="h100x8")
  assert first.compiled is not None and len(_entries(store)) == 1
  compile_lib.clear_memo()  # what another process starts with
  again = compile_lib.compile_for_target(fn, *args, target="h100x8")
  assert again.compiled is None  # read back, not compiled
  assert again.hlo_text == first.hlo_text and again.thunk_text == first.thunk_text
  assert again.debug_options == first.debug_options and again.memory == first.memory
  xla = first.compiled.memory_analysis()
  assert again.memory == jax_overlap.analysis.MemoryStats(
    arguments=xla.argument_size_in_bytes,
    outputs=xla.output_size_in_bytes,
    temporaries=xla.temp_size_in_bytes,
    aliased=xla.alias_size_in_bytes,
  )
  assert again.memory.arguments > 0
  assert again.target == first.target and again.platform == "cuda"
  # The analysis of the stored step is the analysis of the compiled one.
  compile_lib.clear_memo()
  a = jax_overlap.analyze(fn, *args, target="h100x8")
  b = analysis.analyze_compiled(first)
  assert a.step_time_s == b.step_time_s and a.memory == b.memory
  assert [k.name for k in a.kernels] == [k.name for k in b.kernels]


def test_other_options_targets_and_compilers_are_other_entries(store, monkeypatch):
  fn, args = _step()
  compile_lib.compile_for_target(fn, *args, target="h100x8")
  compile_lib.compile_for_target(
    fn, *args, target="h100x8", xla_options={"xla_gpu_enable_triton_gemm": False}
  )
  compile_lib.compile_for_target(fn, *args, target="a100x8")
  assert len(_entries(store)) == 3
  compile_lib.clear_memo()
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_hlo_as_text")
  step = compile_lib.compile_for_target(fn, *args, target="h100x8")
  assert step.compiled is not None and len(_entries(store)) == 4
  compile_lib.clear_memo()
  monkeypatch.setattr(compile_store, "key_suffix", lambda: "another jaxlib")
  step = compile_lib.compile_for_target(fn, *args, target="h100x8")
  assert step.compiled is not None and len(_entries(store)) == 5


def test_an_unreadable_entry_is_compiled_again_and_rewritten(store):
  fn, args = _step()
  compile_lib.compile_for_target(fn, *args, target="h100x8")
  (entry,) = _entries(store)
  (store / entry).write_bytes(b"not gzip")
  compile_lib.clear_memo()
  step = compile_lib.compile_for_target(fn, *args, target="h100x8")
  assert step.compiled is not None and step.hlo_text
  with gzip.open(store / entry, "rt") as f:
    assert "hlo_text" in f.read()
  # An entry of another layout is a miss as well.
  with gzip.open(store / entry, "wt") as f:
    f.write('{"hlo_text": 1}')
  compile_lib.clear_memo()
  assert compile_lib.compile_for_target(fn, *args, target="h100x8").compiled is not None


def test_turned_off_nothing_is_kept_and_local_compiles_never_are(store, monkeypatch):
  fn, args = _step()
  compile_lib.compile_for_target(fn, *args, target=None)
  assert _entries(store) == []
  monkeypatch.setenv("JAX_OVERLAP_COMPILE_CACHE", "0")
  compile_lib.compile_for_target(fn, *args, target="h100x8")
  assert _entries(store) == []


def test_only_the_most_recently_used_entries_are_kept(store, monkeypatch):
  monkeypatch.setattr(compile_store, "MAX_ENTRIES", 2)
  for i in range(3):
    compile_store.save(f"key {i}", {"i": i})
    os.utime(compile_store._path(f"key {i}"), (i, i))  # distinct ages
  compile_store.save("key 3", {"i": 3})
  assert [compile_store.load(f"key {i}") for i in (2, 3)] == [{"i": 2}, {"i": 3}]
  assert compile_store.load("key 0") is None and compile_store.load("key 1") is None


def test_the_folder_keeps_at_most_max_bytes(store, monkeypatch):
  big = {"text": "".join(chr(33 + (i * 7919) % 90) for i in range(20000))}  # ~ incompressible
  compile_store.save("a", big)
  size = os.path.getsize(compile_store._path("a"))
  monkeypatch.setattr(compile_store, "MAX_BYTES", int(2.5 * size))
  os.utime(compile_store._path("a"), (1, 1))
  compile_store.save("b", big)
  os.utime(compile_store._path("b"), (2, 2))
  compile_store.save("c", big)
  assert [compile_store.load(k) is not None for k in "abc"] == [False, True, True]


_TWO_PROCESSES = """
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_overlap._src.compile import compiler as compile_lib
from jax_overlap._src.compile import store as compile_store

role, folder = sys.argv[1], sys.argv[2]
compiled_marker, waiting_marker = (os.path.join(folder, n) for n in ("compiled", "waiting"))
if role == "first":
  # Compiles, then holds on to the result until the second process waits for it.
  real = compile_lib.compile_lowered
  def compile_then_wait(*a, **k):
    out = real(*a, **k)
    open(compiled_marker, "w").close()
    deadline = time.time() + 120
    while not os.path.exists(waiting_marker) and time.time() < deadline:
      time.sleep(0.05)
    time.sleep(0.5)
    return out
  compile_lib.compile_lowered = compile_then_wait
else:
  real_lock = compile_store.compiling
  def announce(key):
    open(waiting_marker, "w").close()
    return real_lock(key)
  compile_store.compiling = announce
mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
step = compile_lib.compile_for_target(lambda x, w: jnp.tanh(x @ w).sum(), x, w, target="h100x8")
print(json.dumps({"compiled": step.compiled is not None, "hlo": len(step.hlo_text)}))
"""


def test_two_processes_compiling_the_same_step_compile_it_once(store, tmp_path):
  # The second process asks while the first is still compiling (its compile done, the
  # entry not yet written): it waits on the entry's lock and reads the first's result.
  import json
  import subprocess
  import sys
  import time

  script = tmp_path / "compile.py"
  script.write_text(_TWO_PROCESSES)
  env = dict(os.environ)
  first = subprocess.Popen(
    [sys.executable, str(script), "first", str(tmp_path)], stdout=subprocess.PIPE, env=env
  )
  deadline = time.time() + 120
  while not (tmp_path / "compiled").exists() and first.poll() is None:
    assert time.time() < deadline, "the first process never compiled"
    time.sleep(0.05)
  second = subprocess.run(
    [sys.executable, str(script), "second", str(tmp_path)],
    stdout=subprocess.PIPE,
    env=env,
    timeout=180,
    check=True,
  )
  out_first, _ = first.communicate(timeout=180)
  assert first.returncode == 0
  a, b = json.loads(out_first), json.loads(second.stdout)
  assert (tmp_path / "waiting").exists()  # the second asked before the entry existed
  assert a["compiled"] and not b["compiled"]  # compiled once, read back once
  assert a["hlo"] == b["hlo"] > 0
  assert len(_entries(store)) == 1


def test_old_lock_files_go_with_the_pruning(store):
  store.mkdir(parents=True)
  old, fresh = store / ("a" * 64 + ".lock"), store / ("b" * 64 + ".lock")
  old.touch()
  fresh.touch()
  hours_ago = os.stat(old).st_mtime - 2 * 3600
  os.utime(old, (hours_ago, hours_ago))
  compile_store.save("some step", {"hlo": "text"})
  assert not old.exists() and fresh.exists()
  assert len(_entries(store)) == 1


def test_a_file_option_is_keyed_by_what_the_file_holds(store, tmp_path, monkeypatch):
  # A latency profile XLA schedules by: the same profile in two folders is one compile (a
  # notebook and a CLI run with cache folders of their own), a profile rewritten in place is
  # another compile, in the process and in the store.
  from jax_overlap._src.analysis import latency_profile

  fn, args = _step()
  text = latency_profile.profile_text(jax_overlap.analyze(fn, *args, target="h100x8"))
  a, b = tmp_path / "a" / "profile.pbtxt", tmp_path / "b" / "profile.pbtxt"
  for p in (a, b):
    p.parent.mkdir()
    p.write_text(text)
  compiles = []
  original = compile_lib.compile_lowered
  monkeypatch.setattr(
    compile_lib, "compile_lowered", lambda *x, **k: compiles.append(1) or original(*x, **k)
  )

  def scheduled(path):
    opts = {latency_profile.OPTION: str(path)}
    return compile_lib.compile_for_target(fn, *args, target="h100x8", xla_options=opts)

  first, second = scheduled(a), scheduled(b)
  assert len(compiles) == 1 and second.hlo_text == first.hlo_text
  compile_lib.clear_memo()
  assert scheduled(b).compiled is None and len(compiles) == 1  # read from the store
  a.write_text(text.replace("cost_us: ", "cost_us: 1"))
  scheduled(a)
  assert len(compiles) == 2
  # A path XLA does not read as input (an installation, a dump or a cache XLA writes) is
  # keyed by the path, never read.
  assert compile_lib._option_key("xla_gpu_cuda_data_dir", str(tmp_path)) == repr(str(tmp_path))
  assert compile_lib._option_key(latency_profile.OPTION, str(a)).startswith("<contents ")
  # A folder XLA picks a profile from is keyed by its files.
  compile_lib.clear_memo()
  scheduled(b.parent)
  (b.parent / "other.pbtxt").write_text(text)
  scheduled(b.parent)
  assert len(compiles) == 4


_JAX_CACHE = """
import json, os, sys, warnings
from jax_overlap.examples.cpu_devices import use_cpu_devices
use_cpu_devices(8)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jax_overlap._src.compile import compiler as compile_lib
mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
def deviceless_step(x, w):
  return jnp.tanh(x @ w).sum()
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  # keep_dump: never read back from the project's own store, so XLA compiles each time.
  steps = [compile_lib.compile_for_target(deviceless_step, x, w, target="h100x8", keep_dump=True)
           for _ in range(2)]
  local = jax.jit(lambda a: a * 2 + 1)(jnp.arange(8.0))
print(json.dumps({
  "entries": sorted(os.listdir(sys.argv[1])),
  "warnings": [str(c.message) for c in caught],
  "hlo": [len(s.hlo_text) for s in steps],
}))
"""


def test_deviceless_compiles_stay_out_of_jaxs_persistent_cache(tmp_path):
  # With the user's JAX compilation cache on, a compile for the local devices is kept there;
  # a deviceless one is not (JAX cannot load it back: it warned on every later compile of
  # the same step, and a process with the GPUs could have been handed it), and each such
  # compile still dumps what the analysis reads.
  import json
  import subprocess
  import sys

  script = tmp_path / "jax_cache.py"
  script.write_text(_JAX_CACHE)
  cache = tmp_path / "jax_cache"
  out = subprocess.run(
    [sys.executable, str(script), str(cache)],
    stdout=subprocess.PIPE,
    env=dict(os.environ),
    timeout=180,
    check=True,
  )
  got = json.loads(out.stdout)
  # The local compiles' entries alone (the deviceless ones are named after the retargeted
  # wrapper, 'jit_call').
  names = {e.split("-")[0] for e in got["entries"]}
  assert "jit__lambda" in names and "jit_call" not in names, got["entries"]
  assert not [w for w in got["warnings"] if "compilation cache" in w], got["warnings"]
  assert all(n > 0 for n in got["hlo"])


def test_memory_stats_read_from_json():
  stats = jax_overlap.analysis.MemoryStats.of({"arguments": 4096, "outputs": 1024})
  assert stats == jax_overlap.analysis.MemoryStats(arguments=4096, outputs=1024)
  assert (
    jax_overlap.analysis.MemoryStats.of({}) is None
    and jax_overlap.analysis.MemoryStats.of(stats) is stats
  )
  with pytest.raises(ValueError, match=r"unknown keys \['args'\]; the keys are arguments"):
    jax_overlap.analysis.MemoryStats.of({"args": 1})
  with pytest.raises(TypeError, match="expected analysis.MemoryStats or a mapping"):
    jax_overlap.analysis.MemoryStats.of(4096)
