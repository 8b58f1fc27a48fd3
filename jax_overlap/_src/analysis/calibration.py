"""Kernel costs calibrated on a real GPU: one factor per kernel kind, fitted to a
measured step, stored per GPU and jaxlib, and used by the analysis for that GPU.

:func:`calibrate` (``jax-overlap calibrate MODULE:BUILDER``) compiles a jitted step for
the local GPU once, runs it, profiles a few steps (``jax.profiler``), and matches each
measured kernel to the HLO instruction XLA launched it for: by the trace's ``hlo_op``, or
for kernels replayed from a command buffer by kernel name (the launch names of XLA's
thunk listing; identical fusions that share one kernel are compared as one row). The
cost model's estimate of the same compile (:func:`estimate_same_compile`) gives each
instruction's roofline time. :func:`fit` then sets, per kernel kind, the factor on the
roofline body (the estimate less the launch overhead) that makes the matched estimates
sum to the measured time. Kinds with fewer than 3 matched instructions, or under 1% of
the matched time, take the factor of all matched kernels. Library kernels replayed from
a command buffer (cuBLAS) carry the library's names and cannot be matched: they are left
out of the fit, and reported.

The calibration is written to the cache directory (``calibrations/<gpu>-jaxlib<v>.json``),
keyed by the GPU's catalogue name and the installed jaxlib, since XLA's kernels change
with it. :func:`cost_model_for` gives the analysis the stored calibration of a target's
GPU for the installed jaxlib; ``analyze`` and ``@overlap`` use it unless given a
``cost_model``, and the report's notes name it. The measured step should be one
device's work as the target runs it (a shard_map body at the per-device shapes, or the
step on one GPU): the calibration corrects kernel costs, not collectives.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping

from jax_overlap._src import cache, targets
from jax_overlap._src.analysis import cost_model as cm

__all__ = [
  "Calibration",
  "calibrate",
  "cost_model_for",
  "estimate_same_compile",
  "fingerprint",
  "fit",
  "load",
  "match",
  "measure_step",
  "path",
  "save",
]

MIN_KERNELS = 3
MIN_SHARE = 0.01


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Per-kind factors on the cost model's kernel times, fitted on one GPU.

  Attributes:
    gpu: the catalogue GPU ("h200").
    device: the driver's name of the measured device.
    jaxlib: the jaxlib whose XLA compiled the measured kernels.
    factors: (kind, factor) pairs: a kernel of that kind takes its roofline body time
      times the factor (plus the launch overhead).
    overall: the factor of all matched kernels together (kinds not in ``factors``).
    kernels: instructions matched to measured kernels.
    programs: names of the measured programs.
    measured_s, estimated_s: their matched kernel time, measured and estimated.
  """

  gpu: str
  device: str
  jaxlib: str
  factors: tuple[tuple[str, float], ...]
  overall: float
  kernels: int
  programs: tuple[str, ...] = ()
  measured_s: float = 0.0
  estimated_s: float = 0.0

  def factor(self, kind: str) -> float:
    """The factor on a kernel of ``kind``."""
    return dict(self.factors).get(kind, self.overall)

  def describe(self) -> str:
    kinds = ", ".join(f"{k} x{f:.3f}" for k, f in self.factors)
    return (
      f"kernel times calibrated on {self.device} (jaxlib {self.jaxlib}; {self.kernels} "
      f"kernels of {', '.join(self.programs) or 'one program'}): {kinds}, others "
      f"x{self.overall:.3f}"
    )

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["factors"] = dict(self.factors)
    d["programs"] = list(self.programs)
    return d

  @classmethod
  def from_dict(cls, d: Mapping) -> Calibration:
    return cls(
      gpu=str(d["gpu"]),
      device=str(d["device"]),
      jaxlib=str(d["jaxlib"]),
      factors=tuple(sorted((str(k), float(v)) for k, v in dict(d["factors"]).items())),
      overall=float(d["overall"]),
      kernels=int(d["kernels"]),
      programs=tuple(d.get("programs", ())),
      measured_s=float(d.get("measured_s", 0.0)),
      estimated_s=float(d.get("estimated_s", 0.0)),
    )


def fit(
  rows: Iterable[Mapping],
  *,
  gpu: str,
  device: str,
  jaxlib: str,
  programs: Iterable[str] = (),
  launch_s: float = cm.CostModel.kernel_overhead_s,
) -> Calibration:
  """Per-kind factors from matched rows (``kind``, ``est_s``, ``measured_s``; rows whose
  ``measured_s`` is None are left out). See the module docstring."""
  totals: dict[str, list[float]] = {}
  for r in rows:
    if r.get("measured_s") is None or r.get("kind") in (None, "mixed"):
      continue
    body = max(float(r["est_s"]) - launch_s, 0.0)
    t = totals.setdefault(str(r["kind"]), [0.0, 0.0, 0])
    t[0] += float(r["measured_s"])
    t[1] += body
    t[2] += 1
  measured = sum(t[0] for t in totals.values())
  body = sum(t[1] for t in totals.values())
  count = sum(int(t[2]) for t in totals.values())
  if count == 0 or body <= 0 or measured <= 0:
    raise ValueError(
      "calibration.fit: no instruction was matched to a measured kernel; a calibration "
      "needs a profiled step whose kernels carry their HLO instructions"
    )
  factors = tuple(
    sorted(
      (kind, t[0] / t[1])
      for kind, t in totals.items()
      if t[2] >= MIN_KERNELS and t[0] >= MIN_SHARE * measured and t[1] > 0
    )
  )
  return Calibration(
    gpu=targets.get_gpu(gpu).name,
    device=device,
    jaxlib=jaxlib,
    factors=factors,
    overall=measured / body,
    kernels=count,
    programs=tuple(programs),
    measured_s=measured,
    estimated_s=body + count * launch_s,
  )


def match(per_op_est: Mapping[str, Mapping], per_op_meas: Mapping[str, float]) -> dict:
  """Estimated and measured time per instruction and per kernel kind.

  ``per_op_est``: instruction -> {"est_s", "kind", "launch_name", ...}; ``per_op_meas``:
  instruction (or ``"kernel:<name>"`` for a kernel replayed from a command buffer) ->
  measured seconds per step. Returns ``rows`` (each instruction with its ``measured_s``,
  None where no kernel matched), ``by_kind``, ``top`` (the 15 longest), the instructions
  left without a kernel, the measured kernels left without an instruction
  (``measured_not_estimated_s``) and both together (``left_over``)."""
  by_launch: dict[str, list[str]] = {}
  for op, e in per_op_est.items():
    if e.get("launch_name"):
      by_launch.setdefault(e["launch_name"], []).append(op)
  est = {op: dict(e) for op, e in per_op_est.items()}
  measured: dict[str, float] = {}
  missing: dict[str, float] = {}
  for key, t in per_op_meas.items():
    op = key
    if key.startswith("kernel:"):
      ops = sorted(by_launch.get(key[len("kernel:") :], ()))
      op = " + ".join(ops) if ops else None
      if len(ops) > 1 and op not in est:
        parts = [est.pop(o) for o in ops]
        kinds = {p["kind"] for p in parts}
        est[op] = {
          "est_s": sum(p["est_s"] for p in parts),
          "kind": kinds.pop() if len(kinds) == 1 else "mixed",
          "launch_name": parts[0]["launch_name"],
        }
    if op in est:
      measured[op] = measured.get(op, 0.0) + t
    else:
      missing[key] = t
  rows = [{"op": op, **e, "measured_s": measured.get(op)} for op, e in est.items()]
  left = [r for r in rows if r["measured_s"] is None]
  by_kind: dict[str, dict] = {}
  for r in rows:
    if r["measured_s"] is None:
      continue
    k = by_kind.setdefault(r["kind"], {"est_s": 0.0, "measured_s": 0.0, "count": 0})
    k["est_s"] += r["est_s"]
    k["measured_s"] += r["measured_s"]
    k["count"] += 1
  rows.sort(key=lambda r: -(r["measured_s"] or 0.0))
  return {
    "rows": rows,
    "by_kind": by_kind,
    "top": rows[:15],
    "unmatched_estimates": [r["op"] for r in left],
    "measured_not_estimated_s": missing,
    "matched_measured_s": sum(r["measured_s"] or 0.0 for r in rows),
    "left_over": {
      "instructions": len(left),
      "est_s": sum(r["est_s"] for r in left),
      "measured_s": sum(missing.values()),
      "kernels": sorted(missing, key=lambda k: -missing[k])[:10],
    },
  }


def _base(name: str) -> str:
  return name.split("@", 1)[0]


def _repeatable(step, args, kwargs):
  """(a jit of ``step`` that donates nothing, the inputs it takes): a step is run several
  times on the same arguments here, which a step donating them would delete after its
  first run. The user's jit runs inside, its own shardings kept, its donation moot."""
  import jax

  from jax_overlap._src.compile import retarget

  jitted = step if hasattr(step, "lower") else jax.jit(step)
  whole, inputs = retarget.of_inputs(jitted, args, kwargs)
  leaves = jax.tree.leaves((args, kwargs))
  return jax.jit(whole), [leaves[i] for i in inputs]


def estimate_same_compile(step, args, target) -> tuple[dict, dict, object, list]:
  """The cost model on XLA's HLO and thunk listing of one compile of ``step`` for the
  local devices, per instruction, and that compile's executable (run it, so that the
  estimate and the measurement are of the same kernels: a second compile could autotune
  to others), compiled to donate nothing, with the arrays it takes. Returns (summary,
  per-instruction estimates, executable, its arguments). An ``nnx.jit`` or
  ``eqx.filter_jit`` step is its ``jax.jit`` on the arrays its wrapper passes it."""
  from jax_overlap._src import framework_jits

  if framework_jits.is_wrapped_step(step):
    return framework_jits.on_arguments(
      step, args, {}, lambda jitted, a, kw: _estimated(jitted, a, kw, target)
    )
  return _estimated(step, args, {}, target)


def _estimated(step, args, kwargs, target):
  from jax_overlap._src.analysis import analyze as analysis
  from jax_overlap._src.compile import compiler

  run, inputs = _repeatable(step, args, kwargs)
  compiled = compiler.compile_for_target(run, *inputs, target=None)
  report = analysis.analyze_hlo(
    compiled.hlo_text,
    compiled.thunk_text,
    thunk_metadata=compiled.thunk_metadata,
    target=target,
    name="same compile",
    cost_model=cm.CostModel(),
  )
  per_op: dict[str, dict] = {}
  for k in report.kernels:
    row = per_op.setdefault(
      _base(k.name),
      {"est_s": 0.0, "kind": k.kind, "flops": 0.0, "bytes": 0.0, "launch_name": k.launch_name},
    )
    row["est_s"] += k.time_s
    row["flops"] += k.flops
    row["bytes"] += k.bytes_accessed
    if k.gemm_mnk:
      row["gemm_mnk"] = list(k.gemm_mnk)
  summary = {
    "compute_s": report.compute_time_s,
    "step_s": report.step_time_s,
    "flops": report.flops,
    "kernels": len(report.kernels),
    "notes": list(report.notes),
  }
  return summary, per_op, compiled.compiled, inputs


def measure_step(step, args, steps: int, trace_dir: str, traced: int = 3) -> dict:
  """Wall time of ``steps`` runs, and the device kernels of ``traced`` more under the
  profiler, per instruction (``hlo_op``; ``"kernel:<name>"`` for kernels replayed from a
  command buffer), in seconds per step."""
  import jax

  from jax_overlap._src.analysis import profile

  for _ in range(3):
    jax.block_until_ready(step(*args))
  wall = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    wall.append(time.perf_counter() - t0)
  with jax.profiler.trace(trace_dir):
    for _ in range(traced):
      jax.block_until_ready(step(*args))
  data, _ = profile.load_trace(trace_dir)
  events = [e for ev in profile.device_events(data["traceEvents"]).values() for e in ev]
  per_op: dict[str, float] = {}
  names: dict[str, set] = {}
  unattributed = 0.0
  for e in events:
    op = e.get("args", {}).get("hlo_op", "")
    if op.startswith("command_buffer"):
      op = "kernel:" + e.get("name", "")
    dur = e["dur"] * 1e-6 / traced
    if not op:
      unattributed += dur
      continue
    per_op[op] = per_op.get(op, 0.0) + dur
    names.setdefault(op, set()).add(e.get("name", ""))
  return {
    "wall_s": statistics.median(wall),
    "wall_all_s": wall,
    "kernel_s": sum(per_op.values()) + unattributed,
    "unattributed_s": unattributed,
    "per_op_s": per_op,
    "kernel_names": {op: sorted(n)[:3] for op, n in names.items()},
  }


def _jaxlib() -> str:
  import jaxlib

  return jaxlib.__version__


def _dir() -> str:
  return os.path.join(cache.cache_dir(), "calibrations")


def path(gpu: str, jaxlib: str | None = None) -> str:
  """Where the calibration of ``gpu`` for ``jaxlib`` (default: the installed one) lives."""
  return os.path.join(_dir(), f"{targets.get_gpu(gpu).name}-jaxlib{jaxlib or _jaxlib()}.json")


def save(calibration: Calibration) -> str:
  """Writes ``calibration`` where :func:`load` finds it; returns the path."""
  p = path(calibration.gpu, calibration.jaxlib)
  cache.write_text(p, json.dumps(calibration.to_dict(), indent=1, sort_keys=True))
  return p


def load(gpu: str, jaxlib: str | None = None) -> Calibration | None:
  """The stored calibration of ``gpu`` for ``jaxlib`` (default: the installed one), or
  None. A file that cannot be read raises, naming it."""
  p = path(gpu, jaxlib)
  if not os.path.exists(p):
    return None
  try:
    with open(p) as f:
      return Calibration.from_dict(json.load(f))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(
      f"calibration: cannot read {p} ({type(e).__name__}: {e}); delete it or calibrate again"
    ) from None


def fingerprint() -> str:
  """A hash of every stored calibration (a new one changes what the analysis estimates,
  so cached selections keyed by it are not reused)."""
  h = hashlib.sha256()
  for p in sorted(glob.glob(os.path.join(_dir(), "*.json"))):
    with open(p, "rb") as f:
      h.update(os.path.basename(p).encode() + b"\0" + f.read())
  return h.hexdigest()[:16]


def cost_model_for(gpu) -> cm.CostModel:
  """The cost model for ``gpu``: the default one, with the stored calibration of that GPU
  for the installed jaxlib where there is one."""
  name = getattr(gpu, "name", gpu)
  cal = load(name) if name in targets.GPUS else None
  return cm.CostModel(calibration=cal) if cal is not None else cm.CostModel()


def calibrate(
  fn,
  *args,
  name: str = "step",
  steps: int = 10,
  store: bool = True,
  trace_dir: str | None = None,
) -> Calibration:
  """Calibrates the cost model's kernel costs on the local GPU with ``fn(*args)``.

  Args:
    fn: a jitted step (or a function, jitted here) whose arguments live on the local GPU.
    *args: its arguments.
    name: the program's name, recorded in the calibration.
    steps: timed steps (3 more are profiled).
    store: write the calibration where ``analyze`` and ``@overlap`` find it.
    trace_dir: where the profile goes (default: a temporary directory).

  Returns:
    The :class:`Calibration`.

  Raises:
    RuntimeError: there is no GPU, or the GPU is not in the catalogue.
  """
  import jax

  devices = jax.devices()
  if devices[0].platform != "gpu":
    raise RuntimeError(
      f"calibrate needs a GPU to run the step on; the local devices are "
      f"{devices[0].platform} ({len(devices)}). Run it on a machine with the GPU the "
      "calibration is for"
    )
  device = devices[0].device_kind
  gpu = targets.catalogue_gpu(device)
  if gpu is None:
    raise RuntimeError(
      f"calibrate: {device!r} is not in the GPU catalogue ({', '.join(targets.GPUS)})"
    )
  if steps < 1:
    raise ValueError(f"calibrate: steps must be at least 1, got {steps}")
  summary, per_op_est, executable, inputs = estimate_same_compile(fn, args, f"{gpu}x1")
  with tempfile.TemporaryDirectory() as tmp:
    measured = measure_step(executable, inputs, steps, trace_dir or tmp)
  matched = match(per_op_est, measured["per_op_s"])
  cal = fit(matched["rows"], gpu=gpu, device=device, jaxlib=_jaxlib(), programs=(name,))
  if store:
    save(cal)
  return cal
