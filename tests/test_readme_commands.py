"""Every command in the README's shell blocks runs, as written or in its stated CPU form.

A README shell block is either run here (``RUN``: the block's commands, with
``jax-overlap`` and ``python`` found on ``PATH`` as this checkout's command line and
interpreter) or exempt with its reason (``EXEMPT``). A command added to the README without
an entry here fails ``test_every_readme_command_is_run_or_exempt``. How a GPU command is
mapped to this machine:

* ``jax-overlap analyze ... --target h100x8``: as written; it compiles deviceless.
* the multi-host recipe (two hosts of 8 GPUs): as written, twice on this machine, with
  ``JAX_COORDINATOR`` on 127.0.0.1, ``NUM_HOSTS=2``, ``HOST_INDEX`` 0 and 1, a runtime plan
  in ``plan.json``, and ``--local_devices=0`` (the host's GPUs) replaced by
  ``--local_devices=4`` (4 CPU devices per process, 8 in all).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import stat
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

EXEMPT = {
  "make demo": "about 2 minutes on 2 cores; nothing in the suite runs it, its parts are tested "
  "one by one (examples, analysis, simulator); run it by hand before changing its output block",
  "make test": "the suite itself; CI runs it (.ci/run)",
  'pip install -e ".[test,plot,progress]"': "installs from the network; `make` runs the same "
  "install (test_pip_lines_are_the_makefiles_install checks the spelling)",
  "pip install \"jax-cuda13-plugin==$(python -c 'import jaxlib; print(jaxlib.__version__)')\" "
  "\"jax-cuda13-pjrt==$(python -c 'import jaxlib; print(jaxlib.__version__)')\"": "installs "
  "from the network; `make` pins the same two packages to jaxlib's version",
}

_MULTIHOST = "multi-host recipe"


def _blocks() -> list[str]:
  return re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)


def _commands(block: str) -> list[str]:
  """The block's commands: continuation lines joined, comments and blank lines dropped."""
  joined = re.sub(r"\\\n\s*", "", block)
  lines = [re.sub(r"\s+#\s.*$", "", ln).strip() for ln in joined.splitlines()]
  return [re.sub(r"\s+", " ", ln) for ln in lines if ln and not ln.startswith("#")]


def _multihost_block() -> str:
  (block,) = [b for b in _blocks() if "jax_overlap.examples.multihost" in b]
  return block


def _readme_commands() -> list[str]:
  out = []
  for block in _blocks():
    if "jax_overlap.examples.multihost" in block:
      out.append(_MULTIHOST)
    else:
      out.extend(_commands(block))
  return out


@pytest.fixture
def shell(tmp_path):
  """Runs a command line with this checkout's `jax-overlap` and `python` first on PATH."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, target in (("jax-overlap", "-m jax_overlap.cli "), ("python", "")):
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {target}"$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env.update(
    PATH=f"{bin_dir}:{env['PATH']}",
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    JAX_PLATFORMS="cpu",
  )

  def run(command: str, *, timeout: int = 300, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run(
      ["bash", "-c", command],
      cwd=tmp_path,
      env={**env, **extra_env},
      capture_output=True,
      text=True,
      timeout=timeout,
    )

  run.cwd = tmp_path
  run.env = env
  return run


def _check_flags_fsdp(proc, cwd):
  assert proc.returncode == 0, proc.stderr
  (line,) = proc.stdout.splitlines()
  assert line.startswith("export XLA_FLAGS='--xla_gpu_enable_latency_hiding_scheduler=true")
  assert "pipelined_all_gather=true" in line and "double_buffering=true" in line
  assert "overlap_limit" not in line
  # docs/flags.md shows this very line (as jaxlib 0.10.2 prints it) and explains it, and
  # names the one option a later jaxlib adds.
  docs = (ROOT / "docs" / "flags.md").read_text()
  added = " --xla_disable_hlo_passes=dynamic-slice-copy-fusion-async-wrapper"
  if added in line:
    assert f"`{added.strip()}`" in docs
    line = line.replace(added, "")
  assert line in docs


def _check_flags_table(proc, cwd):
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  names = [i for i, ln in enumerate(lines) if ln.startswith("xla_")]
  assert len(names) >= 4
  assert all(lines[i + 1].startswith("    ") and len(lines[i + 1]) > 20 for i in names)


def _check_flags_check(proc, cwd):
  assert proc.returncode == 1
  assert "xla_gpu_enable_async_all_gather" in proc.stdout + proc.stderr


def _check_targets(proc, cwd):
  assert proc.returncode == 0, proc.stderr
  rows = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln and ln[0].islower()}
  assert {"a100", "h100", "h200", "mi250x"} <= set(rows)
  assert rows["h100"].endswith("yes") and rows["mi250x"].endswith("no")


def _check_help(proc, cwd):
  assert proc.returncode == 0, proc.stderr
  for command in ("analyze", "flags", "launch", "simulate", "targets"):
    assert command in proc.stdout


def _check_analyze(proc, cwd):
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((cwd / "r.json").read_text())
  assert report["target"] == "h100x8"
  # The README quotes this step's time and exposed share (from analysis_fsdp.md).
  readme = README.read_text()
  quoted = re.search(r"benchmarks: ([\d.]+) ms<!--", readme).group(1)
  made_with = json.loads((ROOT / "benchmarks/results/analysis_fsdp.json").read_text())["machine"]
  if jax.__version__ == made_with["jax"]:
    assert f"{report['step_time_s'] * 1e3:.3f}" == quoted
  else:  # another XLA schedules and fuses otherwise: the same step, within a few percent
    assert report["step_time_s"] * 1e3 == pytest.approx(float(quoted), rel=0.05)
  assert (cwd / "t.png").read_bytes()[:4] == b"\x89PNG"
  assert "traceEvents" in json.loads((cwd / "trace.json").read_text())


def _check_analyze_environment(proc, cwd):
  assert proc.returncode == 0, proc.stderr[-3000:]
  judged = proc.stdout.split("Environment settings judged on this step:\n")[1].splitlines()
  assert [ln.split()[0].split("=")[0] for ln in judged] == [
    "CUDA_DEVICE_MAX_CONNECTIONS",
    *["NCCL_MAX_CTAS"] * 4,
  ]
  assert all("on this step (h100x8)" in ln for ln in judged)


_HAS_CUDA_PLUGIN = __import__("importlib").util.find_spec("jax_plugins.xla_cuda13") is not None

RUN = {
  "jax-overlap flags --target h100x8 --workload fsdp": _check_flags_fsdp,
  "jax-overlap flags --target a100x8 --format table": _check_flags_table,
  'jax-overlap flags --check "--xla_gpu_enable_async_all_gather=true"': _check_flags_check,
  "jax-overlap targets": _check_targets,
  "jax-overlap --help": _check_help,
  "jax-overlap analyze jax_overlap.examples.fsdp_transformer:build --target h100x8 "
  "--recommended --plot t.png --json r.json --perfetto trace.json": _check_analyze,
  "jax-overlap analyze jax_overlap.examples.tp_sp:build --environment": _check_analyze_environment,
}


def test_every_readme_command_is_run_or_exempt():
  commands = _readme_commands()
  assert "make demo" in commands and "make test" in commands  # the quick start's two
  unmapped = [c for c in commands if c not in RUN and c not in EXEMPT and c != _MULTIHOST]
  assert unmapped == []
  assert _MULTIHOST in commands
  # Nothing mapped here has left the README unnoticed.
  assert set(RUN) | set(EXEMPT) <= set(commands)


def test_pip_lines_are_the_makefiles_install():
  makefile = (ROOT / "Makefile").read_text()
  assert '-e ".[test,plot,progress]"' in makefile
  assert '"jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v"' in makefile


@pytest.mark.parametrize("command", list(RUN))
def test_readme_command_runs(shell, command):
  if "analyze" in command and not _HAS_CUDA_PLUGIN:
    pytest.skip("needs jax-cuda13-plugin for deviceless compiles")
  RUN[command](shell(command), shell.cwd)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_multihost_recipe_runs_as_two_processes(shell):
  block = _multihost_block()
  first, *rest = block.splitlines()
  # The first line sets the three variables each host sets; here the test sets them.
  assert re.match(r"export JAX_COORDINATOR=\S+ NUM_HOSTS=2 HOST_INDEX=0\b", first)
  script = "\n".join(rest)
  assert script.count("--local_devices=0") == 1
  script = "set -e\n" + script.replace("--local_devices=0", "--local_devices=4")
  from jax_overlap import runtime

  runtime.Plan(target="h100", streams={"priority": "highest"}).to_json(shell.cwd / "plan.json")
  env = {k: v for k, v in shell.env.items() if k != "JAX_PLATFORMS"}
  for _ in range(3):  # a coordinator port taken in the meantime means another try
    port = _free_port()
    procs = [
      subprocess.Popen(
        ["bash", "-c", script],
        cwd=shell.cwd,
        env={
          **env,
          "JAX_COORDINATOR": f"127.0.0.1:{port}",
          "NUM_HOSTS": "2",
          "HOST_INDEX": str(i),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
      for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    if not any("address already in use" in err.lower() for _, err in outs):
      break
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [
    json.loads(next(ln for ln in out.splitlines() if ln.startswith("{"))) for out, _ in outs
  ]
  assert {r["process"] for r in results} == {0, 1}
  assert results[0]["losses"] == results[1]["losses"]
  assert len(results[0]["losses"]) == 3 and results[0]["losses"][-1] < results[0]["losses"][0]


def test_multihost_recipe_mesh_fits_its_target():
  # On the GPUs the recipe's processes hold the target's devices (h100x16: 16); the
  # example's default mesh must cover exactly those and divide the model it trains.
  from jax_overlap import targets
  from jax_overlap.examples import gpt, multihost

  (name,) = re.findall(r"flags --target (\S+)", _multihost_block())
  count = targets.get(name).num_devices
  fsdp, tensor = multihost.mesh_shape("", count)
  assert fsdp * tensor == count
  cfg = gpt.Config(layers=2, hidden=64, heads=4, mlp=128, seq=16, batch=16)
  assert cfg.batch % fsdp == 0 and cfg.heads % tensor == 0 and cfg.hidden % fsdp == 0


def test_supported_versions_are_the_pins():
  # The README's version section quotes pyproject.toml's pin of jax and names make targets
  # that exist.
  tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  jax_pins = [d for d in project["dependencies"] if re.match(r"jax\b(?!lib)", d)]
  section = README.read_text().split("## Supported versions")[1].split("\n## ")[0]
  assert jax_pins and all(f"`{pin}`" in " ".join(section.split()) for pin in jax_pins)
  makefile = (ROOT / "Makefile").read_text()
  for target in re.findall(r"`make ([\w-]+)", section):
    assert re.search(rf"^{target}:", makefile, re.M), target
