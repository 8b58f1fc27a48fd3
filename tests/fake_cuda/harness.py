"""Builds the fake driver (xla_patches/testing/fake_cuda.c) and the test program
(fake_app.c), and runs the program under the runtime library with LD_PRELOAD.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess

from jax_overlap._src.runtime import library as runtime

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTING = REPO / "xla_patches" / "testing"
CC = os.environ.get("CC", "cc")

# A kernel like an XLA GEMM fusion and one like an NCCL channel (BACKGROUND.md section 2).
DEFAULT_FUNCS = "gemm_fusion_1:static=1024:regs=32;nccl_proxy:regs=96;loop_fusion_7:regs=16"


def build(out_dir: pathlib.Path) -> pathlib.Path:
  """Builds libcuda.so.1, fake_app (dlopen), fake_app_direct (linked) and a fake cuBLAS
  (libcublas_fake.so, legacy and Lt entry points) into out_dir."""
  out_dir.mkdir(parents=True, exist_ok=True)
  cmds = [
    [
      CC,
      "-O1",
      "-fPIC",
      "-shared",
      "-fvisibility=hidden",
      "-Wl,-Bsymbolic",
      "-Wl,-soname,libcuda.so.1",
      "-o",
      str(out_dir / "libcuda.so.1"),
      str(TESTING / "fake_cuda.c"),
      "-lpthread",
    ],
    [CC, "-O1", "-o", str(out_dir / "fake_app"), str(TESTING / "fake_app.c"), "-ldl", "-lpthread"],
    [
      CC,
      "-O1",
      "-DLINK_DIRECT",
      "-o",
      str(out_dir / "fake_app_direct"),
      str(TESTING / "fake_app.c"),
      str(out_dir / "libcuda.so.1"),
      f"-Wl,-rpath,{out_dir}",
      "-ldl",
      "-lpthread",
    ],
  ]
  cmds.append(
    [
      CC,
      "-O1",
      "-fPIC",
      "-shared",
      "-fvisibility=hidden",
      "-o",
      str(out_dir / "libcublas_fake.so"),
      str(TESTING / "fake_cublas.c"),
    ]
  )
  for cmd in cmds:
    subprocess.run(cmd, check=True, capture_output=True, text=True)
  return out_dir


@dataclasses.dataclass
class AppRun:
  returncode: int
  results: list[str]
  counters: dict[str, int]
  launches: list[dict[str, str]]
  log: list[str]
  stderr: str

  def launch_dyn(self, func: str) -> list[int]:
    return [int(x["dyn"]) for x in self.launches if x.get("func") == func and x["result"] == "0"]


def _parse(line: str) -> dict[str, str]:
  return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


def run_app(
  fake_dir: pathlib.Path,
  mode: str,
  actions: list[str],
  *,
  rules: str | None = None,
  preload: bool = True,
  env: dict[str, str] | None = None,
  funcs: str = DEFAULT_FUNCS,
  tmp: pathlib.Path | None = None,
) -> AppRun:
  """Runs fake_app MODE ACTIONS under the runtime library and parses what happened."""
  tmp = tmp or fake_dir
  log = tmp / f"fake_cuda_{os.getpid()}_{len(list(tmp.glob('fake_cuda_*.log')))}.log"
  e = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_OVERLAP_RT", "FAKE_CUDA", "NCCL_"))
  }
  e.pop("LD_PRELOAD", None)
  e.update(
    LD_LIBRARY_PATH=str(fake_dir),
    FAKE_CUDA_LOG=str(log),
    FAKE_CUDA_FUNCS=funcs,
  )
  if preload:
    e["LD_PRELOAD"] = str(runtime.library_path(runtime.RUNTIME_LIBRARY))
  if rules is not None:
    e["JAX_OVERLAP_RT_RULES"] = rules
  e.update(env or {})
  app = fake_dir / ("fake_app_direct" if mode == "direct" else "fake_app")
  proc = subprocess.run(
    [str(app), mode, *actions], capture_output=True, text=True, env=e, timeout=60
  )
  results, counters = [], {}
  for line in proc.stdout.splitlines():
    if line.startswith("result "):
      results.append(line[len("result ") :])
    elif line.startswith("counters "):
      counters = json.loads(line[len("counters ") :])
  lines = log.read_text().splitlines() if log.exists() else []
  launches = [_parse(x) for x in lines if re.match(r"^(launch|graphnode) ", x)]
  return AppRun(proc.returncode, results, counters, launches, lines, proc.stderr)
