"""`jax-overlap launch`: plan validation, environment, exec; a JAX program under the library."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jax_overlap import runtime, sim
from jax_overlap._src.runtime import launch
from jax_overlap._src.runtime import library as runtime_impl

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def plan_file(tmp_path):
  path = tmp_path / "plan.json"
  runtime.Plan(
    target="h100",
    kernels=[{"match": "gemm_fusion_*", "blocks_per_sm": 2}],
    streams={"priority": "highest"},
  ).to_json(path)
  return path


def test_environment_prepends_the_library_and_keeps_preloads(plan_file):
  lib = runtime.library_path()
  env = launch.launch_environment(
    runtime.Plan.from_json(plan_file),
    plan_path=str(plan_file),
    verbose=True,
    no_command_buffers=True,
    environ={
      "LD_PRELOAD": "/opt/a.so:/opt/b.so",
      "XLA_FLAGS": "--xla_foo=1 --xla_gpu_enable_command_buffer=FUSION",
    },
  )
  assert env["LD_PRELOAD"] == f"{lib}:/opt/a.so:/opt/b.so"
  assert env["JAX_OVERLAP_RT_PLAN"] == str(plan_file)
  assert env["JAX_OVERLAP_RT_RULES"].startswith("version\t1\nkernel\tglob\tgemm_fusion_*")
  assert env["JAX_OVERLAP_RT_VERBOSE"] == "1"
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_gpu_enable_command_buffer="
  # Launching twice does not stack the library.
  again = launch.launch_environment(None, environ=env)
  assert again["LD_PRELOAD"] == env["LD_PRELOAD"]
  assert "JAX_OVERLAP_RT_RULES" not in again


def test_plans_with_regions_turn_command_buffers_off_and_say_so(tmp_path, capsys):
  path = tmp_path / "regions.json"
  runtime.Plan(target="h100", regions={"mlp": {"blocks_per_sm": 1}}).to_json(path)
  base = {"XLA_FLAGS": '--xla_dump_to="/tmp/a b" --xla_gpu_autotune_level=0'}
  env = launch.launch_environment(runtime.Plan.from_json(path), environ=base)
  # The user's flags are kept as XLA reads them (the quoted value stays one value).
  assert env["XLA_FLAGS"] == (
    '--xla_dump_to="/tmp/a b" --xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer='
  )
  from jax_overlap import flags

  assert flags.parse_xla_flags(env["XLA_FLAGS"])[0]["xla_dump_to"] == "/tmp/a b"
  assert flags.validate(env["XLA_FLAGS"]) == []
  # Kept when asked, or when the user already chose in XLA_FLAGS.
  kept = launch.launch_environment(
    runtime.Plan.from_json(path), environ=base, no_command_buffers=False
  )
  assert "xla_gpu_enable_command_buffer" not in kept["XLA_FLAGS"]
  chose = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"}
  assert (
    launch.launch_environment(runtime.Plan.from_json(path), environ=chose)["XLA_FLAGS"]
    == "--xla_gpu_enable_command_buffer=FUSION"
  )
  # A plan without regions leaves them alone.
  plain = runtime.Plan(target="h100", kernels=[{"match": "x", "blocks_per_sm": 1}])
  assert "XLA_FLAGS" not in launch.launch_environment(plain, environ={})
  # The command line says why.
  assert launch.main(["--plan", str(path), "--dry-run", "--", "python", "t.py"]) == 0
  err = capsys.readouterr().err
  assert "the plan has occupancy regions" in err and "--keep-command-buffers" in err
  assert "XLA_FLAGS=" in err and "--xla_gpu_enable_command_buffer=" in err
  assert launch.main(["--plan", str(path), "--keep-command-buffers", "--dry-run", "--", "t"]) == 0
  assert "occupancy regions" not in capsys.readouterr().err


def test_dry_run(plan_file, capsys):
  assert launch.main(["--plan", str(plan_file), "--dry-run", "--", "python", "train.py"]) == 0
  err = capsys.readouterr().err
  assert "jax-overlap launch: LD_PRELOAD=" in err
  assert "jax-overlap launch: exec python train.py" in err


@pytest.mark.parametrize(
  "content,message",
  [
    (
      '{"version": 1, "kernels": [{"match": "x", "blocks_per_sm": 0}]}',
      "kernels[0]: kernel rule 'blocks_per_sm' must be a positive integer (>= 1), got 0",
    ),
    ('{"version": 1, "target": "h999"}', "'target': unknown GPU 'h999'"),
    ('{"version": 1,', "malformed JSON"),
    ('{"version": 1, "kernelz": []}', "unknown key 'kernelz'"),
  ],
)
def test_bad_plan_is_refused_before_running(tmp_path, capsys, content, message):
  path = tmp_path / "plan.json"
  path.write_text(content)
  assert launch.main(["--plan", str(path), "--", "true"]) == 2
  err = capsys.readouterr().err
  assert f"jax-overlap launch: error: invalid plan {path}" in err
  assert message in err


def test_usage_errors(tmp_path, capsys):
  assert launch.main([]) == 2
  assert "no command given" in capsys.readouterr().err
  assert launch.main(["--plan", str(tmp_path / "none.json"), "--", "true"]) == 2
  assert "no plan file" in capsys.readouterr().err
  assert launch.main(["--bogus", "--", "true"]) == 2


def _launch_in_subprocess(args, env=None, timeout=180):
  code = (
    "import sys; from jax_overlap._src.runtime.launch import main; sys.exit(main(sys.argv[1:]))"
  )
  e = {k: v for k, v in os.environ.items() if not k.startswith("JAX_OVERLAP_RT")}
  e.pop("LD_PRELOAD", None)
  e.update(env or {})
  return subprocess.run(
    [sys.executable, "-c", code, *args], capture_output=True, text=True, env=e, timeout=timeout
  )


def test_exec_runs_the_command_with_the_library(plan_file):
  probe = (
    "import json, os; from jax_overlap import runtime; s = runtime.status(); "
    "print(json.dumps({'loaded': s.loaded, 'rules': s.rules, 'plan': s.plan_path, "
    "'preload': os.environ['LD_PRELOAD']}))"
  )
  out = _launch_in_subprocess(["--plan", str(plan_file), "--", sys.executable, "-c", probe])
  assert out.returncode == 0, out.stderr
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["loaded"] is True
  assert got["rules"] == 1
  assert got["plan"] == str(plan_file)
  assert got["preload"].split(":")[0] == str(runtime.library_path())


def test_missing_command_exits_127():
  out = _launch_in_subprocess(["--", "/nonexistent/program"])
  assert out.returncode == 127
  assert "cannot run '/nonexistent/program'" in out.stderr


def test_jitted_program_is_unchanged_under_the_library(plan_file, tmp_path):
  code = (
    "import numpy as np, jax, jax.numpy as jnp, sys\n"
    "from jax_overlap import runtime\n"
    "f = jax.jit(runtime.occupancy(lambda x: jnp.tanh(x @ x.T).sum(0), blocks_per_sm=1))\n"
    "x = jnp.arange(64.0).reshape(8, 8) / 64\n"
    "np.save(sys.argv[1], np.asarray(f(x)))\n"
    "print(runtime.status().loaded)\n"
  )
  plain = subprocess.run(
    [sys.executable, "-c", code, str(tmp_path / "a.npy")],
    capture_output=True,
    text=True,
    timeout=180,
  )
  assert plain.returncode == 0, plain.stderr
  assert plain.stdout.strip() == "False"
  shaped = _launch_in_subprocess(
    [
      "--plan",
      str(plan_file),
      "--verbose",
      "--",
      sys.executable,
      "-c",
      code,
      str(tmp_path / "b.npy"),
    ]
  )
  assert shaped.returncode == 0, shaped.stderr
  assert shaped.stdout.strip() == "True"
  assert "counters: launches_seen=0" in shaped.stderr  # CPU: no kernel launches
  import numpy as np

  np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))


@pytest.mark.slow
def test_library_path_builds_into_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(runtime_impl, "_PACKAGE_LIB_DIR", tmp_path / "not_installed")
  path = runtime_impl.library_path(runtime_impl.RUNTIME_LIBRARY)
  assert path.is_file() and tmp_path in path.parents
  assert runtime_impl.library_path(runtime_impl.RUNTIME_LIBRARY) == path  # cached


def test_no_compiler_gives_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setenv("CXX", "")
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(
    RuntimeError, match="no C\\+\\+ compiler found to build the runtime libraries"
  ):
    runtime_impl.compiler()


def test_build_failure_reports_the_compiler_output(tmp_path):
  root = tmp_path / "src"
  for rel in (
    runtime_impl._lib.LIBRARIES[runtime_impl.RUNTIME_LIBRARY]["sources"]
    + runtime_impl._lib.LIBRARIES[runtime_impl.RUNTIME_LIBRARY]["headers"]
  ):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text("this is not C++\n")
  with pytest.raises(RuntimeError, match="building libjax_overlap_rt.so failed"):
    runtime_impl.build_library(runtime_impl.RUNTIME_LIBRARY, tmp_path / "out", root=root)
  with pytest.raises(RuntimeError, match="sources not found"):
    runtime_impl.build_library(runtime_impl.RUNTIME_LIBRARY, tmp_path / "out", root=tmp_path / "x")


@pytest.mark.slow
def test_gpu_benchmark_dry_run(tmp_path):
  script = REPO / "benchmarks" / "gpu" / "run_all.sh"
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_OVERLAP_RT")}
  env.pop("LD_PRELOAD", None)
  env["PYTHON"] = sys.executable
  env["BUILD_DIR"] = str(tmp_path)
  out = subprocess.run(
    ["bash", str(script), "--dry-run"], capture_output=True, text=True, env=env, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "plan ok: plan_shape_all.json" in out.stderr
  assert "SKIP overlap_bench run: dry run" in out.stderr
  assert "outputs identical with and without shaping" in out.stderr
  assert "CUDA-runtime-like CUkernel launch shaped (launches_shaped=2)" in out.stderr
  # cuBLAS's SM-count target: set through dlsym on the fake cuBLAS, and the JAX program run
  # under plan_library_gemms.json (on CPU no cuBLAS handle: identical outputs, nothing set).
  assert "fake cuBLAS: a handle and a cuBLASLt descriptor created through dlsym" in out.stderr
  assert "JAX check, library GEMMs: jax_check: 5 outputs identical with and without cuBLAS's" in (
    out.stderr
  )
  # The launch-gap program is built and lists its cases beside the simulator's constants.
  gaps = json.loads((tmp_path / "launch_gaps.json").read_text())
  assert gaps["measured"] is False and set(gaps["cases"]) == {
    "same_stream",
    "event_other_stream",
    "graph_same_stream",
    "graph_event_other_stream",
  }
  assert "launch gaps (dry run: nothing measured)" in out.stderr
  assert "event_other_stream: -; simulator 1.80 us" in out.stderr
  # The GEMM dispatch probe is built and lists the SM-count targets (0: the device's;
  # 132 - 32, 132 - 64 and half of an H100/H200) of cuBLASLt's descriptor and of the legacy
  # cuBLAS handle XLA's GEMM thunks use, in both orders and priorities.
  dispatch = json.loads((tmp_path / "gemm_dispatch.json").read_text())
  targets = collections.Counter(
    (r["gemm"]["api"], r["gemm"]["sm_count_target"]) for r in dispatch["records"]
  )
  assert dispatch["measured"] is False and targets == {
    (api, t): 4 for api in ("cublasLt", "cublas") for t in (0, 100, 68, 66)
  }
  assert {(r["priority"], r["issue"]) for r in dispatch["records"]} == {
    (p, i) for p in (True, False) for i in ("compute_first", "proxy_first")
  }
  assert (
    "GEMM dispatch (dry run: nothing measured): cublasLt target device; cublasLt target 100"
    in out.stderr
  )
  assert "; cublas target device; cublas target 100" in out.stderr
  # The sweep's output is what sim.calibrate reads: every kind x cap x priority x issue, the
  # registers from ptxas, and (dry run) the simulator's predictions, marked as such.
  data = json.loads((tmp_path / "overlap_bench.json").read_text())
  records = sim.load_measurements(str(tmp_path / "overlap_bench.json"))
  kinds = {r["compute"].get("name", r["compute"]["kind"]) for r in records}
  assert kinds == {"gemm", "loop_fusion", "attention_like"}
  assert {(r["cap"], r["policy"]) for r in records} >= {
    (None, "concurrent"),
    (None, "priority"),
    (None, "sequential"),
    (1, "shaping"),
    (4, "priority+shaping"),
  }
  assert len(records) == 3 * (4 * 2 * 2 + 1) and data["measured"] is False
  assert all(r["source"].startswith("dry run: simulator prediction") for r in records)
  assert all(r["proxy"]["regs"] > 0 for r in records)
  # Both issue orders for every concurrent policy; the sequential record has one stream.
  orders = collections.Counter((r["issue"], r["policy"]) for r in records)
  for policy in ("concurrent", "priority", "shaping", "priority+shaping"):
    assert orders[("compute_first", policy)] == orders[("proxy_first", policy)] > 0
  assert orders[("compute_first", "sequential")] == 3
  own = [r for r in records if r["compute"]["kind"] != "gemm"]
  assert all(r["compute"]["regs"] > 0 and r["compute"]["natural_blocks_per_sm"] > 1 for r in own)
  # The round trip: the script's calibration from the defaults recovers the constants the
  # records were generated with (read from its own report line, not fitted again here).
  truth = {"cta_copy_bandwidth": 26e9, "occupancy_exponent": 0.3}
  fit = re.search(r"calibrate on h100: RMS error (\S+) -> (\S+) \(\w+\); fitted (.*)", out.stderr)
  assert fit, out.stderr[-3000:]
  assert float(fit[1]) > 0.05 and float(fit[2]) < 1e-3
  fitted = dict(kv.split("=") for kv in fit[3].strip().split(", "))
  assert set(fitted) == set(truth)
  for k, v in truth.items():
    assert float(fitted[k]) == pytest.approx(v, rel=0.02)
