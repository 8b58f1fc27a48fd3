"""Fitting the model's per-target constants to measurements.

Measurement format (what ``benchmarks/gpu/overlap_bench.cu`` writes, through
``benchmarks/gpu/run_all.sh``; one JSON file)::

  {"version": 1,
   "device": {"name": "NVIDIA H100 80GB HBM3", ...},   # optional
   "records": [
     {"gpu": "h100",                     # catalogue name (else read from "device")
      "policy": "shaping",               # one of sim.POLICIES
      "cap": 2,                          # blocks per SM of the compute kernel (shaping)
      "issue": "compute_first",          # which was launched first (default proxy_first)
      "compute": {"kind": "gemm", "m": 8192, "n": 8192, "k": 8192, "dtype": "bf16"},
      # or a kernel: {"kind": "fusion"|"custom"|..., "grid": 262144, "threads": 256,
      #               "regs": 19, "smem": 0, "flops": 1.3e11, "bytes": 3.2e9}
      "proxy": {"kind": "copy", "ctas": 16, "threads": 544, "regs": 96, "smem": 82240,
                "bytes": 268435456, "group_size": 1},   # or a collective kind
      "makespan_s": 0.00231,             # compute and proxy launched together, both done
      "proxy_latency_s": 0.00102,        # proxy issue to proxy done
      "compute_slowdown": 0.17,          # compute time beside the proxy / alone - 1
      "source": "free text: machine, driver, date"}]}

``gemm`` for ``compute`` and ``gemm_slowdown`` for ``compute_slowdown`` are accepted, and
flat keys (``gemm_m``, ``gemm_n``, ``gemm_k``, ``proxy_ctas``, ``proxy_threads``,
``proxy_regs``, ``proxy_bytes``). Any of the three measured quantities may be missing
(null); at least one must be present; records marked ``"skipped"`` are left out when a
file is read. Each record is simulated as the proxy (stream 1) and the compute kernel
(stream 0) issued in the record's order under the record's policy; ``cap`` shapes the compute kernel at that
many blocks per SM as written (the benchmark's plan has ``comm_block`` null).

Fit: the chosen constants (by default ``cta_copy_bandwidth`` and ``gemm_efficiency``; also
e.g. ``launch_overhead_s``, ``occupancy_exponent``) minimise the sum of squared residuals

  (predicted / measured - 1) for makespan_s and proxy_latency_s,
  (predicted - measured)     for compute_slowdown,

over log-parameters, from the best point of a coarse scan (x0.6 ... x1.25 per parameter;
the model has plateaus, e.g. a link-bound collective does not feel its CTAs' bandwidth),
with scipy.optimize.least_squares when scipy is installed, else a
Levenberg-Marquardt iteration in numpy with finite-difference Jacobians. The result
reports the RMS error before and after.

:func:`published_measurements` gives records built from published observations
(BACKGROUND section 2).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jax_overlap._src import deprecations, targets
from jax_overlap._src.sim import engine
from jax_overlap._src.sim.model import (
  COMPUTE_KINDS,
  Collective,
  Constants,
  Kernel,
  Workload,
  constants_for,
)
from jax_overlap._src.sim.policies import POLICIES, Policy, get_policy, simulate

__all__ = [
  "CalibrationResult",
  "CalibrationRow",
  "calibrate",
  "load_measurements",
  "predict",
  "published_measurements",
]

_QUANTITIES = ("makespan_s", "proxy_latency_s", "compute_slowdown")
_ALIASES = {"gemm_slowdown": "compute_slowdown"}


def _get(rec: Mapping, nested: str, key: str, flat: str, default=None):
  if isinstance(rec.get(nested), Mapping) and key in rec[nested]:
    return rec[nested][key]
  return rec.get(flat, default)


def _normalise(rec: Mapping, i: int) -> dict:
  if not isinstance(rec, Mapping):
    raise TypeError(f"sim.calibrate: measurements[{i}] must be a dict, got {type(rec).__name__}")
  where = f"sim.calibrate: measurements[{i}]"
  nested = "compute" if "compute" in rec else "gemm"
  compute = rec.get(nested)
  kind = compute.get("kind", "gemm") if isinstance(compute, Mapping) else "gemm"
  out = {
    "gpu": rec.get("gpu"),
    "policy": rec.get("policy", "concurrent"),
    "cap": rec.get("cap"),
    "issue": rec.get("issue", "proxy_first"),
    "compute_kind": kind,
    "dtype": _get(rec, nested, "dtype", "gemm_dtype", "bf16"),
    "ctas": _get(rec, "proxy", "ctas", "proxy_ctas"),
    "threads": _get(rec, "proxy", "threads", "proxy_threads"),
    "regs": _get(rec, "proxy", "regs", "proxy_regs"),
    "smem": _get(rec, "proxy", "smem", "proxy_smem"),
    "bytes": _get(rec, "proxy", "bytes", "proxy_bytes"),
    "kind": _get(rec, "proxy", "kind", "proxy_kind", "all-gather"),
    "group_size": _get(rec, "proxy", "group_size", "proxy_group_size", 8),
  }
  if kind == "gemm":
    fields: tuple[str, ...] = ("m", "n", "k")
    for f in fields:
      out[f] = _get(rec, nested, f, f"gemm_{f}")
  else:
    if kind not in COMPUTE_KINDS:
      raise ValueError(f"{where}: compute.kind must be one of {COMPUTE_KINDS}, got {kind!r}")
    fields = ("grid", "threads", "flops")
    out["kernel"] = {
      f: compute.get(f) for f in ("grid", "threads", "regs", "smem", "flops", "bytes")
    }
    for f in fields:
      out[f"compute_{f}"] = compute.get(f)
    fields = tuple(f"compute_{f}" for f in fields)
  for f in (*fields, "ctas", "bytes"):
    v = out[f]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
      raise ValueError(f"{where}: {f} must be a positive number, got {v!r}")
  if out["policy"] not in POLICIES:
    raise ValueError(f"{where}: policy must be one of {POLICIES}, got {out['policy']!r}")
  if out["issue"] not in ("proxy_first", "compute_first"):
    raise ValueError(
      f"{where}: issue must be 'proxy_first' or 'compute_first', got {out['issue']!r}"
    )
  cap = out["cap"]
  if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
    raise ValueError(f"{where}: cap must be null or an int >= 1, got {cap!r}")
  values = {_ALIASES.get(q, q): v for q, v in rec.items() if _ALIASES.get(q, q) in _QUANTITIES}
  meas = {q: v for q, v in values.items() if v is not None}
  if not meas:
    raise ValueError(f"{where} has none of {_QUANTITIES}; nothing to fit")
  for q, v in meas.items():
    if (
      isinstance(v, bool)
      or not isinstance(v, (int, float))
      or not math.isfinite(v)
      or (q != "compute_slowdown" and v <= 0)
    ):
      raise ValueError(f"{where}.{q} must be a positive number, got {v!r}")
  out["measured"] = meas
  return out


def load_measurements(path: str) -> list[dict]:
  """Reads a measurement JSON file (the format in the module docstring).

  Records marked ``"skipped"`` (configurations the benchmark could not run) are left
  out; a record without a ``gpu`` takes the catalogue name of the file's ``device``.
  """
  with open(path) as f:
    data = json.load(f)
  records = data["records"] if isinstance(data, Mapping) else data
  gpu = None
  if isinstance(data, Mapping) and isinstance(data.get("device"), Mapping):
    gpu = _catalogue_name(data["device"].get("name"))
  out = []
  for r in records:
    if isinstance(r, Mapping) and r.get("skipped"):
      continue
    if isinstance(r, Mapping) and r.get("gpu") is None and gpu is not None:
      r = {**r, "gpu": gpu}
    out.append(r)
  return out


def _catalogue_name(description) -> str | None:
  """The catalogue GPU a driver's device name describes, if any."""
  if not isinstance(description, str):
    return None
  low = description.lower()
  for name in targets.names():
    g = targets.get_gpu(name)
    if g.description.lower() == low:
      return g.name
  for key in ("h200", "h100", "a100", "a40"):
    if key in low:
      return key
  return None


def _workload(r: dict) -> Workload:
  proxy = Collective(
    "proxy",
    r["kind"],
    float(r["bytes"]),
    group_size=int(r["group_size"]),
    stream=1,
    channels=int(r["ctas"]),
    threads=int(r["threads"]) if r["threads"] else None,
    regs=int(r["regs"]) if r["regs"] else None,
    smem=int(r["smem"]) if r["smem"] is not None else None,
  )
  if r["compute_kind"] == "gemm":
    comp = Kernel.gemm("compute", int(r["m"]), int(r["n"]), int(r["k"]), dtype=r["dtype"])
  else:
    k = r["kernel"]
    comp = Kernel(
      "compute",
      grid=int(k["grid"]),
      threads=int(k["threads"]),
      regs=int(k["regs"] or 32),
      smem=int(k["smem"] or 0),
      flops=float(k["flops"]),
      bytes=float(k["bytes"] or 0.0),
      kind=r["compute_kind"],
      dtype=r["dtype"],
    )
  items = (comp, proxy) if r["issue"] == "compute_first" else (proxy, comp)
  return Workload(items, "calibration")


def _policy(r: dict) -> Policy | str:
  """The record's policy; a cap shapes the compute kernel as written."""
  if r["cap"] is None or r["policy"] in ("sequential", "concurrent", "priority"):
    return r["policy"]
  base = get_policy(r["policy"])
  return Policy(base.name, priority=base.priority, shaping={"compute": int(r["cap"])})


def predict(record: Mapping, target, constants: Constants) -> dict:
  """Simulated makespan_s, proxy_latency_s and compute_slowdown of one measurement record."""
  r = _normalise(record, 0) if "measured" not in record else record
  res = simulate(_workload(r), target=target, policy=_policy(r), constants=constants)
  g = res.timing("compute")
  p = res.timing("proxy")
  iso = res.isolated_s["compute"]
  return {
    "makespan_s": res.makespan_s,
    "proxy_latency_s": p.end_s - p.ready_s,
    "compute_slowdown": g.duration_s / iso - 1.0,
  }


@dataclasses.dataclass(frozen=True)
class CalibrationRow(deprecations.ReadAsDict):
  """One measurement record beside the model's prediction for it.

  Attributes:
    policy: the record's policy.
    compute: the compute kernel's kind.
    cap: the blocks-per-SM cap it ran under (None: unshaped).
    ctas: the communication proxy's CTAs.
    measured: the measured quantities (``makespan_s``, ``proxy_latency_s``, ...).
    predicted: the model's value of each measured quantity, with the fitted constants.
  """

  policy: str
  compute: str
  cap: int | None
  ctas: int
  measured: Mapping[str, float]
  predicted: Mapping[str, float]

  _was_dict = "sim.CalibrationResult.table"


@dataclasses.dataclass
class CalibrationResult:
  """Fitted constants and the model's error against the measurements.

  Attributes:
    constants: the fitted Constants.
    params: fitted values of the free parameters.
    error_before: RMS residual with the starting constants.
    error_after: RMS residual with the fitted constants.
    table: one :class:`CalibrationRow` per record: measured and predicted quantities.
    method: "scipy" or "numpy".
    identified: how many of the fitted parameters the measurements determine: the rank
      of the residuals' Jacobian (in log-parameters) at the fit, counting singular values
      above 1e-3 of the largest. Below ``len(params)``, some parameters (or combinations)
      are not pinned down by these records.
    insensitive: parameters the residuals do not respond to at all at the fit (a 1%
      change moves no residual by more than 1e-6): the data says nothing about them.
  """

  constants: Constants
  params: dict
  error_before: float
  error_after: float
  table: list[CalibrationRow]
  method: str
  identified: int = 0
  insensitive: tuple[str, ...] = ()


@deprecations.keyword_only("target", api="jax_overlap.sim.calibrate")
def calibrate(
  measurements: Sequence[Mapping] | str,
  *,
  target,
  params: Sequence[str] = ("cta_copy_bandwidth", "gemm_efficiency"),
  start: Constants | None = None,
  max_iter: int = 30,
) -> CalibrationResult:
  """Fits per-target model constants to measurements by least squares.

  Args:
    measurements: records (see the module docstring) or a path to a JSON file.
    target: the GPU (or topology) they were measured on.
    params: names of :class:`Constants` fields to fit.
    start: starting constants (default: the target's).
    max_iter: iteration limit.

  Returns:
    A :class:`CalibrationResult`.

  Raises:
    ValueError: empty or malformed measurements, unknown parameter names.

  Example:
    >>> res = calibrate(published_measurements("h100"), target="h100")  # doctest: +SKIP
    >>> res.error_after <= res.error_before                        # doctest: +SKIP
    True
  """
  if isinstance(measurements, str):
    measurements = load_measurements(measurements)
  recs = [_normalise(r, i) for i, r in enumerate(measurements)]
  if not recs:
    raise ValueError("sim.calibrate: measurements is empty")
  topo = engine.resolve_target(target)
  for i, r in enumerate(recs):
    if r["gpu"] is not None and r["gpu"] != topo.gpu.name:
      raise ValueError(
        f"sim.calibrate: measurements[{i}] is for gpu {r['gpu']!r}, not the target "
        f"{topo.gpu.name!r}"
      )
  const0 = start or constants_for(topo.gpu)
  fields = {f.name for f in dataclasses.fields(Constants)}
  bad = [p for p in params if p not in fields or isinstance(getattr(const0, p), bool)]
  if bad or not params:
    raise ValueError(f"sim.calibrate: params must name Constants fields, got {list(params)}")
  upper = {"gemm_efficiency": 1.0}
  x0 = np.log([max(float(getattr(const0, p)), 1e-12) for p in params])

  def consts(x) -> Constants:
    vals = {}
    for p, v in zip(params, np.exp(x)):
      v = min(float(v), upper.get(p, math.inf))
      vals[p] = int(round(v)) if isinstance(getattr(const0, p), int) else v
    return const0.replace(**vals)

  def residuals(x) -> np.ndarray:
    c = consts(x)
    return _residuals(recs, [predict(r, topo, c) for r in recs])

  r0 = residuals(x0)
  # Coarse start: the model has plateaus (a link-bound collective does not feel its CTAs'
  # bandwidth), so scan a few factors per parameter before the local fit.
  factors = np.log([0.6, 0.8, 1.0, 1.25])
  best_x, best_cost = x0, float(r0 @ r0)
  for offs in itertools.product(*([factors] * min(len(params), 3))):
    xs = x0.copy()
    xs[: len(offs)] += offs
    for j, p in enumerate(params):
      if p in upper:
        xs[j] = min(xs[j], math.log(upper[p]) - 1e-9)
    rs = residuals(xs)
    if float(rs @ rs) < best_cost:
      best_x, best_cost = xs, float(rs @ rs)
  x0 = best_x
  try:
    from scipy.optimize import least_squares  # type: ignore[import-not-found]

    lo = np.full(len(params), -np.inf)
    hi = np.array([math.log(upper.get(p, math.inf)) if p in upper else np.inf for p in params])
    # Central differences: min(link, CTAs x per-CTA bandwidth) has one-sided slopes.
    sol = least_squares(
      residuals,
      np.minimum(x0, hi - 1e-9),
      bounds=(lo, hi),
      jac="3-point",
      diff_step=1e-3,
      max_nfev=max_iter * (2 * len(params) + 1),
    )
    x, method = sol.x, "scipy"
  except ImportError:
    x, method = _lm(residuals, x0, max_iter), "numpy"
  c = consts(x)
  preds = [predict(r, topo, c) for r in recs]
  r1 = _residuals(recs, preds)
  jac = _jacobian(residuals, x, 1e-2)
  sv = np.linalg.svd(jac, compute_uv=False) if jac.size else np.zeros(0)
  identified = int(np.sum(sv > 1e-3 * sv.max())) if sv.size and sv.max() > 0 else 0
  insensitive = tuple(
    p for j, p in enumerate(params) if np.max(np.abs(jac[:, j]), initial=0.0) * 1e-2 < 1e-6
  )
  table = []
  for r, pred in zip(recs, preds):
    table.append(
      CalibrationRow(
        policy=r["policy"],
        compute=r["compute_kind"],
        cap=r["cap"],
        ctas=r["ctas"],
        measured=r["measured"],
        predicted={q: pred[q] for q in r["measured"]},
      )
    )
  return CalibrationResult(
    constants=c,
    params={p: getattr(c, p) for p in params},
    error_before=float(np.sqrt(np.mean(r0**2))),
    error_after=float(np.sqrt(np.mean(r1**2))),
    table=table,
    method=method,
    identified=identified,
    insensitive=insensitive,
  )


def _residuals(recs: list[dict], preds: list[dict]) -> np.ndarray:
  """Relative residuals of times, absolute of slowdowns, record by record."""
  out = []
  for r, pred in zip(recs, preds):
    for q, m in r["measured"].items():
      out.append(pred[q] - m if q == "compute_slowdown" else pred[q] / m - 1.0)
  return np.asarray(out)


def _jacobian(fun, x: np.ndarray, h: float) -> np.ndarray:
  """Central-difference Jacobian of ``fun`` at ``x``."""
  cols = []
  for j in range(len(x)):
    xp, xm = x.copy(), x.copy()
    xp[j] += h
    xm[j] -= h
    cols.append((fun(xp) - fun(xm)) / (2 * h))
  return np.stack(cols, axis=1) if cols else np.empty((len(fun(x)), 0))


def _lm(fun, x0: np.ndarray, max_iter: int) -> np.ndarray:
  """Levenberg-Marquardt with central-difference Jacobians (numpy fallback)."""
  x = np.array(x0, dtype=float)
  r = fun(x)
  lam = 1e-2
  for _ in range(max_iter):
    jac = _jacobian(fun, x, 1e-3)
    g = jac.T @ r
    a = jac.T @ jac
    improved = False
    for _ in range(8):
      step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
      xn = x + step
      rn = fun(xn)
      if rn @ rn < r @ r:
        x, r, lam, improved = xn, rn, lam / 3, True
        break
      lam *= 4
    if not improved or np.linalg.norm(step) < 1e-6:
      break
  return x


def published_measurements(gpu: str = "h100") -> list[dict]:
  """Records built from published observations (BACKGROUND section 2), for tests.

  * H100: a 132-block GEMM beside a 24-CTA all-gather "nearly doubles" (NVIDIA developer
    forum, tail effect): compute_slowdown 0.9.
  * A100/H100: overlapped GEMMs slow by 18.9% on average (arXiv 2507.03114): a multi-wave
    GEMM beside a collective, compute_slowdown 0.189.
  * NCCL all-gather on 8 GPUs over NVLink: ~360 GB/s bus bandwidth on H100, ~230 GB/s on A100
    (nccl-tests, published DGX results): proxy_latency_s of a 1 GiB all-gather alone.
  """
  busbw = {"h100": 360e9, "h200": 360e9, "a100": 230e9, "a100-40": 230e9}
  if gpu not in busbw:
    raise ValueError(
      f"sim.published_measurements: no published figures for {gpu!r}; choose one of {sorted(busbw)}"
    )
  nbytes = float(1 << 30)
  recs = [
    {
      "gpu": gpu,
      "policy": "concurrent",
      "gemm": {"m": 16384, "n": 16384, "k": 8192},
      "proxy": {"ctas": 24 if gpu.startswith("h") else 16, "bytes": 4 * nbytes},
      "compute_slowdown": 0.189,
      "source": "arXiv 2507.03114 (average overlap slowdown)",
    },
    {
      "gpu": gpu,
      "policy": "sequential",
      "gemm": {"m": 16384, "n": 16384, "k": 8192},
      "proxy": {"ctas": 24 if gpu.startswith("h") else 16, "bytes": nbytes},
      "proxy_latency_s": nbytes * 7 / 8 / busbw[gpu],
      "source": "nccl-tests all_gather_perf bus bandwidth, 8 GPUs NVLink",
    },
  ]
  if gpu in ("h100", "h200"):
    recs.append(
      {
        "gpu": gpu,
        "policy": "concurrent",
        "gemm": {"m": 128 * 12, "n": 256 * 11, "k": 8192},
        "proxy": {"ctas": 24, "bytes": nbytes},
        "compute_slowdown": 0.9,
        "source": "NVIDIA developer forum, tail effect",
      }
    )
  return recs
