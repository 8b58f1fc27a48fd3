"""Tests for the jax-overlap command line."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from jax_overlap import flags


def _env() -> dict[str, str]:
  """The command line's environment: CPU devices, no test-process XLA flags."""
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)
  return env


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "jax_overlap.cli", *args],
    capture_output=True,
    text=True,
    env=_env(),
    timeout=timeout,
  )


def test_flags_prints_an_export_line_that_validates():
  proc = cli("flags", "--target", "h100x8", "--workload", "fsdp")
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == ""  # no warnings either: the command uses the current API
  line = proc.stdout.splitlines()[0]
  assert line.startswith("export XLA_FLAGS=")
  value = shlex.split(line[len("export XLA_FLAGS=") :])[0]
  parsed, bad = flags.parse_xla_flags(value)
  assert bad == [] and parsed["xla_gpu_enable_latency_hiding_scheduler"] == "true"
  assert flags.validate(value) == []


def test_flags_table_explains_each_choice():
  proc = cli("flags", "--target", "a100x8", "--format", "table")
  assert proc.returncode == 0
  from jax_overlap._src.flags import aborts

  line = "xla_gpu_enable_analytical_latency_estimator = true"
  if aborts.aborts("xla_gpu_enable_analytical_latency_estimator")[0]:
    # This jaxlib's XLA aborts compiling loops with it: left out, and the table says why.
    assert f"# left out: {line}" in proc.stdout and "aborts the process" in proc.stdout
  else:
    assert line in proc.stdout and "# left out" not in proc.stdout
    assert "Ampere" in proc.stdout
  # The environment settings the simulator judged and found not to pay, each with its figure.
  not_set = proc.stdout.split("# not set: CUDA_DEVICE_MAX_CONNECTIONS = 1\n")[1].splitlines()[0]
  assert "does not pay: simulated step" in not_set and "FSDP transformer step" in not_set


def test_flags_check_reports_every_problem_and_exits_1():
  proc = cli(
    "flags",
    "--check",
    "--xla_gpu_enable_async_all_gather=true --xla_gpu_graph_level=0 --xla_gpu_enable_latency_hiding_scheduler=true",
  )
  assert proc.returncode == 1
  out = proc.stdout
  assert "xla_gpu_enable_async_all_gather was removed" in out
  assert "use xla_gpu_enable_command_buffer instead" in out
  assert "latency_hiding" not in out


def test_flags_check_clean_string_exits_0():
  proc = cli("flags", "--check", "--xla_gpu_enable_latency_hiding_scheduler=true")
  assert proc.returncode == 0 and "no problems" in proc.stdout


# Runs command lines in processes forked from one that has imported the command line once:
# each still exits with its own code and writes its own stdout and stderr, without paying
# for importing jax again per command line.
_FORKED = r"""
import json, os, sys, tempfile, traceback
import jax_overlap.cli as cli

results = []
for args in json.loads(sys.argv[1]):
  out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
  pid = os.fork()
  if pid == 0:
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.argv = ["jax-overlap", *args]
    code = 0
    try:
      cli.run()
    except SystemExit as e:
      if isinstance(e.code, str):
        print(e.code, file=sys.stderr)
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
      traceback.print_exc()
      code = 70
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  _, status = os.waitpid(pid, 0)
  texts = []
  for f in (out, err):
    f.seek(0)
    texts.append(f.read().decode())
  results.append([os.waitstatus_to_exitcode(status), *texts])
print(json.dumps(results))
"""


def cli_many(*command_lines: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
  """``cli`` for several command lines, each in a process of its own."""
  proc = subprocess.run(
    [sys.executable, "-c", _FORKED, json.dumps([list(a) for a in command_lines])],
    capture_output=True,
    text=True,
    env=_env(),
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  return [
    subprocess.CompletedProcess(list(a), code, out, err)
    for a, (code, out, err) in zip(command_lines, json.loads(proc.stdout.splitlines()[-1]))
  ]


def test_help_lists_the_commands_and_their_flags():
  # --help (or -h) anywhere on the line: the commands and every flag, exit 0; simulate and
  # launch print their own.
  runs = cli_many(("--help",), ("flags", "-h"), ("analyze", "--helpshort"), ("simulate", "--help"))
  for proc in runs[:3]:
    assert proc.returncode == 0, proc.stderr
    for command in ("flags", "targets", "analyze", "simulate", "launch"):
      assert f"jax-overlap {command}" in proc.stdout
    for flag in ("--target", "--workload", "--check", "--format", "--xla-option", "--plot"):
      assert f"  {flag}: " in proc.stdout
  assert runs[3].returncode == 0 and "usage: jax-overlap simulate" in runs[3].stdout


def test_targets_lists_the_catalogue():
  proc = cli("targets")
  assert proc.returncode == 0
  for name in ("a40", "a100", "h100", "h200", "mi250x"):
    assert f"\n{name} " in proc.stdout


# Bad command lines, the exit code and the one line of error each must give.
_BAD_INPUT = [
  (
    ("flags", "--target", "v100x8"),
    2,
    "unknown target 'v100x8'; expected '<gpu>x<count>' with gpu one of a100",
  ),
  (("flags", "--workload", "moe"), 2, "unknown workload 'moe'; valid choices: fsdp"),
  (("frobnicate",), 2, "unknown command 'frobnicate'; choose one of flags, targets"),
  ((), 2, "missing command"),
  (("analyze", "nomodule"), 2, "expected MODULE:BUILDER"),
  (("analyze", "no_such_module_xyz:build"), 2, "cannot import module 'no_such_module_xyz'"),
  (("analyze", "jax_overlap.cli:nothing"), 2, "has no callable 'nothing'"),
  (
    ("analyze", "jax_overlap.examples.fsdp_transformer:build", "--target", "b300x8"),
    2,
    "unknown target 'b300x8'",
  ),
  (
    ("analyze", "jax_overlap.examples.fsdp_transformer:build", "--json", "/"),
    2,
    "--json / is a directory; give a file path such as /out.json",
  ),
  (
    ("analyze", "jax_overlap.examples.fsdp_transformer:build", "--plot", "/no_dir_xyz/t.png"),
    2,
    "--plot /no_dir_xyz/t.png: directory /no_dir_xyz does not exist",
  ),
  (("flags", "--format", "xml"), 2, "flag --format=xml: value should be one of"),
  (("flags", "--no_such_flag"), 2, "Unknown command line flag 'no_such_flag'"),
  (("launch", "--plan", "/no_such_plan.json", "--", "true"), 2, "no plan file"),
  (("launch", "--plan", "/", "--", "true"), 2, "--plan / is a directory"),
  (("simulate", "--target", "h999x8"), 2, "unknown target 'h999x8'"),
  (
    (
      "analyze",
      "jax_overlap.examples.fsdp_mlp:build",
      "-X",
      "xla_gpu_enable_latency_hidng_scheduler=1",
    ),
    2,
    "--xla-option xla_gpu_enable_latency_hidng_scheduler: xla_gpu_enable_latency_hidng_scheduler "
    "is not an option of jaxlib",
  ),
]


@pytest.fixture(scope="module")
def bad_input_runs():
  return dict(zip((a for a, _, _ in _BAD_INPUT), cli_many(*(a for a, _, _ in _BAD_INPUT))))


@pytest.mark.parametrize("args,code,match", _BAD_INPUT)
def test_bad_input_gets_one_line_errors(bad_input_runs, args, code, match):
  proc = bad_input_runs[args]
  assert proc.returncode == code
  err = proc.stderr.strip().splitlines()
  assert len(err) == 1, proc.stderr
  assert match in err[0]
  assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_analyze_a_builder_and_write_every_output(tmp_path):
  out = {k: str(tmp_path / f"r.{k}") for k in ("json", "png", "trace")}
  proc = cli(
    "analyze",
    "jax_overlap.examples.fsdp_transformer:build_small",
    "--target",
    "a100x8",
    "--recommended",
    "--json",
    out["json"],
    "--plot",
    out["png"],
    "--perfetto",
    out["trace"],
    "-X",
    "xla_gpu_memory_limit_slop_factor=90",
    "--environment",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "jax_overlap analysis" in proc.stdout and "on a100x8" in proc.stdout
  judged = proc.stdout.split("Environment settings judged on this step:\n")[1].splitlines()
  assert judged[0].strip().startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 ")
  assert "on this step (a100x8)" in judged[0] and "not a measurement" in judged[0]
  import json

  report = json.load(open(out["json"]))
  assert report["target"] == "a100x8" and report["num_collectives"] > 0
  assert report["xla_options"]["xla_gpu_memory_limit_slop_factor"] == "90"
  from jax_overlap._src.flags import aborts

  estimator = report["xla_options"].get("xla_gpu_enable_analytical_latency_estimator")
  assert estimator is (
    None if aborts.aborts("xla_gpu_enable_analytical_latency_estimator")[0] else True
  )
  assert open(out["png"], "rb").read(4) == b"\x89PNG"
  assert "traceEvents" in json.load(open(out["trace"]))


def test_flags_json_carries_the_environment_verdicts():
  proc = cli("flags", "--target", "h200x8", "--workload", "tensor_parallel", "--format", "json")
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  judged = {(v["name"], v["value"]): v for v in out["judged"]}
  assert ("CUDA_DEVICE_MAX_CONNECTIONS", "1") in judged and ("NCCL_MAX_CTAS", "8") in judged
  for v in judged.values():
    assert v["recommended"] == (v["gain"] >= 0.02)
    assert v["step"].endswith("(h200x8)") and v["step_s"] > 0 and v["baseline_s"] > 0
  # A variable is exported exactly where a verdict recommends it.
  assert set(out["env"]) == {n for n, _ in judged if judged[n, _]["recommended"]}


def test_analyze_runs_an_explicit_builder_under_its_mesh():
  # A step with bare PartitionSpecs on Explicit mesh axes, which its own script runs under
  # jax.set_mesh: the command sets the arrays' mesh, having none of its own.
  proc = cli("analyze", "jax_overlap.examples.explicit_llama:build_small", "--target", "h100x8")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "on h100x8" in proc.stdout and "all-gather" in proc.stdout


def test_the_command_runs_in_a_process_where_another_module_defined_target_first():
  # A benchmark or an example that defines absl's --target before the command's module is
  # imported: the command defines its other flags still, lists --target in its help, and
  # runs in that process.
  code = """
from absl import flags as absl_flags
absl_flags.DEFINE_string("target", "h100x8", "Defined first by another module.")
from jax_overlap import cli
cli._define_flags()
rest = absl_flags.FLAGS(["jax-overlap", "flags", "--workload=tensor_parallel", "--format=json"])
print("usage lists --target:", "  --target: " in cli.usage())
raise SystemExit(cli.main(rest))
"""
  proc = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300
  )
  assert proc.returncode == 0, proc.stderr
  first, report = proc.stdout.split("\n", 1)
  assert first == "usage lists --target: True"
  # The tensor-parallel choice, as the command prints it in a process of its own (not the
  # default fsdp one).
  alone, fsdp = cli_many(
    ("flags", "--workload=tensor_parallel", "--format=json"), ("flags", "--format=json")
  )
  assert json.loads(report)["xla_flags"] == json.loads(alone.stdout)["xla_flags"]
  assert json.loads(report)["xla_flags"] != json.loads(fsdp.stdout)["xla_flags"]
