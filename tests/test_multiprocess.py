"""The decorated step on JAX's multi-controller runtime: 2 processes x 4 CPU devices."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jax_overlap.examples import multihost


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(port: int, pid: int, *extra: str, env_extra=None) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(env_extra or {})
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "jax_overlap.examples.multihost",
      f"--coordinator=127.0.0.1:{port}",
      "--num_processes=2",
      f"--process_id={pid}",
      "--local_devices=4",
      "--steps=3",
      *extra,
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
  )


def _run_pair(extra=(), attempts: int = 3, envs=(None, None)):
  """Starts both processes; a coordinator port taken in the meantime means another try.
  ``envs``: each process's extra environment variables. Processes still running after
  the timeout are killed (the test fails: they hung)."""
  for _ in range(attempts):
    port = _free_port()
    procs = [_launch(port, i, *extra, env_extra=envs[i]) for i in range(2)]
    try:
      outs = [p.communicate(timeout=240) for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    if any("address already in use" in err.lower() for _, err in outs):
      continue
    return procs, outs
  pytest.fail("could not find a free coordinator port")


@pytest.mark.slow
def test_two_processes_match_the_single_process_run():
  procs, outs = _run_pair()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  results = [
    json.loads(next(ln for ln in out.splitlines() if ln.startswith("{"))) for out, _ in outs
  ]
  assert {r["process"] for r in results} == {0, 1}
  assert results[0]["losses"] == results[1]["losses"]
  # The same decorated step on this process's 8 devices.
  single = multihost.run_training(3, (4, 2), overlap=True)
  assert results[0]["losses"] == pytest.approx(single, rel=1e-6)
  assert single[-1] < single[0]


@pytest.mark.slow
def test_a_missing_process_fails_within_the_timeout():
  port = _free_port()
  t0 = time.monotonic()
  # Process 1 never starts: process 0 must give up with a clear message, not hang.
  proc = _launch(port, 0, "--timeout_s=3")
  out, err = proc.communicate(timeout=120)
  # JAX's coordination service ends the process with a fatal error naming the cause
  # (a Python exception where jax raises one, exit code 3 from the script).
  assert proc.returncode != 0
  assert f"joining 127.0.0.1:{port} as process 0 of 2" in err
  assert any(m in err for m in ("DEADLINE_EXCEEDED", "another task died", "could not join"))
  assert time.monotonic() - t0 < 100


def _results(procs, outs) -> list[dict]:
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [json.loads(next(ln for ln in out.splitlines() if ln.startswith("{"))) for out, _ in outs]


def _shared_note(result) -> str:
  return next(n for n in result["notes"] if "shared by process 0" in n)


@pytest.mark.slow
def test_every_process_runs_process_0s_choice_whatever_its_cache_holds(tmp_path):
  # Each process has its own selection cache (its own host's disk).
  caches = [tmp_path / "process0", tmp_path / "process1"]
  envs = [{"JAX_OVERLAP_CACHE_DIR": str(c)} for c in caches]
  extra = ("--target=h100x8", "--steps=2")
  first = _results(*_run_pair(extra, envs=envs))
  assert first[0]["chosen"] == first[1]["chosen"]
  assert first[0]["losses"] == first[1]["losses"]
  assert "process 0 chose it" in _shared_note(first[0])
  assert "this process, 1, compiled no variant" in _shared_note(first[1])
  (entry_path,) = (caches[0] / "selection").glob("*.json")
  entry = json.loads(entry_path.read_text())
  assert entry["chosen"] == first[0]["chosen"]

  # Process 1's cache names another variant, of another program (an older choice), and
  # process 0's entry is corrupted: process 0 chooses again, and its choice wins on both.
  written = entry["base"].startswith("as written")
  other = "rewritten, one layer per collective" if written else "as written, recommended flags"
  stale = {**entry, "chosen": other, "base": other, "options": {}, "estimates": [[other, 1e-9]]}
  (caches[1] / "selection").mkdir(exist_ok=True)
  (caches[1] / "selection" / entry_path.name).write_text(json.dumps(stale))
  entry_path.write_text("{not json")
  second = _results(*_run_pair(extra, envs=envs))
  assert [r["chosen"] for r in second] == [entry["chosen"]] * 2
  assert second[0]["losses"] == second[1]["losses"] == first[0]["losses"]
  assert not any("remembered" in n for n in second[0]["notes"])
  assert "compiled no variant" in _shared_note(second[1])
  if entry["chosen"].endswith("scheduled by the cost model's estimates"):
    # Scheduled from a latency profile process 0 wrote: process 1 has it too.
    assert [p.name for p in (caches[1] / "latency_profiles").iterdir()] == [
      os.path.basename(entry["options"]["xla_gpu_pgle_profile_file_or_directory_path"])
    ]
  # Process 1 compiled nothing and remembered nothing of its own; process 0 wrote its
  # choice again.
  assert [p.name for p in (caches[1] / "selection").iterdir()] == [entry_path.name]
  assert json.loads((caches[1] / "selection" / entry_path.name).read_text()) == stale
  assert json.loads(entry_path.read_text())["chosen"] == entry["chosen"]
