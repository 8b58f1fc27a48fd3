"""Fitting the model's per-target constants to measurements.

The records (their format, reading them, the simulator's prediction of one) live in
:mod:`.measurements`.

Fit: the chosen constants (by default ``cta_copy_bandwidth`` and ``gemm_efficiency``; also
e.g. ``launch_overhead_s``, ``occupancy_exponent``) minimise the sum of squared residuals

  (predicted / measured - 1) for makespan_s and proxy_latency_s,
  (predicted - measured)     for compute_slowdown,

over log-parameters, from the best point of a coarse scan (x0.6 ... x1.25 per parameter;
the model has plateaus, e.g. a link-bound collective does not feel its CTAs' bandwidth),
with scipy.optimize.least_squares when scipy is installed, else a
Levenberg-Marquardt iteration in numpy with finite-difference Jacobians. The result
reports the RMS error before and after.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jax_overlap._src import deprecations
from jax_overlap._src.sim import engine
from jax_overlap._src.sim import measurements as measurements_lib
from jax_overlap._src.sim.model import Constants, constants_for

__all__ = ["CalibrationResult", "CalibrationRow", "calibrate"]


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
    measurements = measurements_lib.load_measurements(measurements)
  recs = [measurements_lib.normalise(r, i) for i, r in enumerate(measurements)]
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
  # Fractions stay fractions (Constants refuses them above 1).
  upper = {"gemm_efficiency": 1.0, "comm_sm_share": 1.0, "block_jitter": 1.0}
  x0 = np.log([max(float(getattr(const0, p)), 1e-12) for p in params])

  def consts(x) -> Constants:
    vals = {}
    for p, v in zip(params, np.exp(x)):
      v = min(float(v), upper.get(p, math.inf))
      vals[p] = int(round(v)) if isinstance(getattr(const0, p), int) else v
    return const0.replace(**vals)

  def residuals(x) -> np.ndarray:
    c = consts(x)
    return _residuals(recs, [measurements_lib.predict(r, topo, c) for r in recs])

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
  preds = [measurements_lib.predict(r, topo, c) for r in recs]
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
