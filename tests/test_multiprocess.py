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


def _launch(port: int, pid: int, *extra: str) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
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


def _run_pair(extra=(), attempts: int = 3):
  """Starts both processes; a coordinator port taken in the meantime means another try."""
  for _ in range(attempts):
    port = _free_port()
    procs = [_launch(port, i, *extra) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
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
