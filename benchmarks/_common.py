"""Helpers shared by the benchmark scripts: machine description and result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time

# Virtual CPU devices for the scripts, set before JAX starts (imports no JAX).
from jax_overlap.examples.cpu_devices import use_cpu_devices  # noqa: F401

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def baseline_reports(fn, args, target: str, workload: str = "fsdp") -> dict:
  """The step analysed as written under XLA's defaults and under the recommended flags."""
  import jax_overlap

  return {
    "XLA defaults": jax_overlap.analyze(fn, *args, target=target, name="XLA defaults"),
    "recommended flags": jax_overlap.analyze(
      fn,
      *args,
      target=target,
      name="recommended flags",
      xla_options=jax_overlap.flags.as_compiler_options(target=target, workload=workload),
    ),
  }


def selected(fn, args, target: str):
  """(the step analysed as written, ``@overlap``'s step, its explanation, the seconds its
  selection took): the baselines of :func:`baseline_reports`, then the selection timed on
  its own (no cache)."""
  import jax_overlap

  reports = baseline_reports(fn, args, target)
  ov = jax_overlap.overlap(fn, target=target, cache=False)
  t0 = time.perf_counter()
  expl = ov.explain(*args)
  return reports, ov, expl, time.perf_counter() - t0


def machine() -> dict:
  import jax
  import jaxlib

  return {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "platform": platform.platform(),
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "devices": str(jax.devices()[0].platform) if jax.devices() else "none",
  }


def earlier_rows(name: str) -> list:
  """The rows of ``results/<name>.json`` from an earlier run ([] if there is none), for a
  run over part of a benchmark to keep the rest."""
  try:
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
      return json.load(f)["rows"]
  except (OSError, KeyError, ValueError):
    return []


def write(name: str, payload: dict, markdown: str | None = None) -> str:
  os.makedirs(RESULTS, exist_ok=True)
  path = os.path.join(RESULTS, f"{name}.json")
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=str)
  if markdown is not None:
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
      f.write(markdown)
  return path


def publish(name: str, payload: dict, markdown: list[str]) -> str:
  """Writes ``results/<name>.json`` (``payload`` and the machine) and ``<name>.md``
  (``markdown``'s lines and the machine), and says where."""
  where = machine()
  path = write(
    name, {**payload, "machine": where}, "\n".join([*markdown, "", f"Machine: {where}"]) + "\n"
  )
  print(f"wrote benchmarks/results/{name}.md")
  return path


def levers(expl, report, tuned_priority=None, tuned_caps=None) -> str:
  """The levers ``@overlap``'s chosen variant pulls, in one line: the rewrite, the GEMMs'
  emitter (and collectives held behind persistent cuBLAS GEMMs), whose estimates scheduled
  it, the other XLA options, the simulator tuner's runtime plan, and the environment
  settings judged on the step."""
  import jax_overlap

  opts = dict(expl.xla_options)
  name = expl.chosen or "the only variant"
  rewrite = "the step as written" if name.startswith("as written") else "rewritten"
  cms = len(expl.of_kind("collective_matmul"))
  if rewrite == "rewritten" and cms:
    rewrite += f" ({cms} collective matmul(s) planned)"
  gemms = (
    "cuBLAS GEMMs"
    if opts.pop("xla_gpu_enable_triton_gemm", None) in (False, "false")
    else "GEMMs as XLA picks them"
  )
  held = sum(1 for c in report.collectives if c.held_by)
  if held:
    gemms += f" ({held} collective(s) held behind persistent GEMMs)"
  profiled = opts.pop(jax_overlap.latency_profile.OPTION, None)
  schedule = "the cost model's latency profile" if profiled else "XLA's estimates"
  others = ", ".join(sorted(opts)) or "none"
  runtime = "-"
  if tuned_priority is not None:
    runtime = f"collective streams at {tuned_priority} priority, {tuned_caps or 0} kernel cap(s)"
  verdicts = jax_overlap.flags.judge_environment(report)
  paying = [f"{v.name}={v.value} ({-v.gain:+.1%})" for v in verdicts if v.recommended]
  best = max(verdicts, key=lambda v: v.gain, default=None)
  env = ", ".join(paying) or (
    f"none pays (best {best.name}={best.value}, {-best.gain:+.1%})" if best else "none judged"
  )
  return (
    f"{rewrite}; {gemms}; scheduled by {schedule}; other XLA options: {others}; "
    f"runtime plan (simulator's tuner): {runtime}; environment: {env}"
  )


def ms(t) -> str:
  """Seconds as milliseconds in a table cell ('-' for a value not measured)."""
  return "-" if t is None else f"{t * 1e3:.2f}"


# The tensor + sequence parallel step's sizes (jax_overlap.examples.tp_sp, flax_tp).
TP_SIZES = {
  "large": dict(hidden=8192, mlp=28672, heads=64, seq=8192),
  "medium": dict(hidden=4096, mlp=14336, heads=32, seq=4096),
  "tiny": dict(hidden=512, mlp=1024, heads=8, seq=512),  # a quick check of a script
}
