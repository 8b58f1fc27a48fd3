"""Measurement records: the format GPU benchmarks write, reading it, and the simulator's
prediction of one record. :mod:`.calibrate` fits the model's constants to them.

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
      # either may add "time_s": its measured time alone, unshaped (optional)
      "proxy": {"kind": "copy", "ctas": 16, "threads": 544, "regs": 96, "smem": 82240,
                "bytes": 268435456, "group_size": 1},   # or a collective kind
      "makespan_s": 0.00231,             # compute and proxy launched together, both done
      "proxy_latency_s": 0.00102,        # proxy issue to proxy done
      "compute_slowdown": 0.17,          # compute time beside the proxy / alone (same cap) - 1
      "source": "free text: machine, driver, date"}]}

``gemm`` for ``compute`` and ``gemm_slowdown`` for ``compute_slowdown`` are accepted, and
flat keys (``gemm_m``, ``gemm_n``, ``gemm_k``, ``proxy_ctas``, ``proxy_threads``,
``proxy_regs``, ``proxy_bytes``). Any of the three measured quantities may be missing
(null); at least one must be present; records marked ``"skipped"`` are left out when a
file is read. Each record is simulated as the proxy (stream 1) and the compute kernel
(stream 0) issued in the record's order under the record's policy; ``cap`` shapes the
compute kernel at that many blocks per SM as written (the benchmark's plan has
``comm_block`` null).

Kernel costs or dispatch. A record whose compute kernel and proxy carry ``time_s`` (their
measured times alone) is simulated with those durations (:attr:`Kernel.time_s`): it then
checks the dispatcher, contention and occupancy rules alone, not the kernel-cost model.
``load_measurements(path, alone_times=True)`` fills them from what ``overlap_bench``
writes: the compute kernel's ``compute_alone_s`` where the record shaped none of its
launches, else the same kernel's in the records that shaped nothing; the file's
``baselines.proxy_alone_ms`` for the proxy.

:func:`published_measurements` gives records built from published observations
(BACKGROUND section 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

from jax_overlap._src import targets
from jax_overlap._src.sim.model import COMPUTE_KINDS, Collective, Constants, Kernel, Workload
from jax_overlap._src.sim.policies import POLICIES, Policy, get_policy, simulate

__all__ = ["QUANTITIES", "load_measurements", "normalise", "predict", "published_measurements"]

QUANTITIES = ("makespan_s", "proxy_latency_s", "compute_slowdown")
_ALIASES = {"gemm_slowdown": "compute_slowdown"}


def _get(rec: Mapping, nested: str, key: str, flat: str, default=None):
  if isinstance(rec.get(nested), Mapping) and key in rec[nested]:
    return rec[nested][key]
  return rec.get(flat, default)


def normalise(rec: Mapping, i: int) -> dict:
  """Record ``i`` in one form (nested keys, current names, measured quantities apart),
  checked; raises naming the record and the key for anything malformed."""
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
    "compute_time_s": compute.get("time_s") if isinstance(compute, Mapping) else None,
    "proxy_time_s": _get(rec, "proxy", "time_s", "proxy_time_s"),
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
  for f in ("compute_time_s", "proxy_time_s"):
    v = out[f]
    if v is not None and (
      isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
    ):
      raise ValueError(
        f"{where}: {f.replace('_time_s', '')}.time_s must be a positive number of seconds or "
        f"absent, got {v!r}"
      )
  if out["policy"] not in POLICIES:
    raise ValueError(f"{where}: policy must be one of {POLICIES}, got {out['policy']!r}")
  if out["issue"] not in ("proxy_first", "compute_first"):
    raise ValueError(
      f"{where}: issue must be 'proxy_first' or 'compute_first', got {out['issue']!r}"
    )
  cap = out["cap"]
  if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
    raise ValueError(f"{where}: cap must be null or an int >= 1, got {cap!r}")
  values = {_ALIASES.get(q, q): v for q, v in rec.items() if _ALIASES.get(q, q) in QUANTITIES}
  meas = {q: v for q, v in values.items() if v is not None}
  if not meas:
    raise ValueError(f"{where} has none of {QUANTITIES}; nothing to fit")
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


def load_measurements(path: str, *, alone_times: bool = False) -> list[dict]:
  """Reads a measurement JSON file (the format in the module docstring).

  Records marked ``"skipped"`` (configurations the benchmark could not run) are left
  out; a record without a ``gpu`` takes the catalogue name of the file's ``device``.
  With ``alone_times``, each record's compute kernel and proxy get the ``time_s``
  ``overlap_bench`` measured for them alone (module docstring); a record for which the
  file has none raises, naming it.
  """
  with open(path) as f:
    data = json.load(f)
  records = data["records"] if isinstance(data, Mapping) else data
  gpu = None
  if isinstance(data, Mapping) and isinstance(data.get("device"), Mapping):
    gpu = targets.catalogue_gpu(data["device"].get("name"))
  out = []
  for r in records:
    if isinstance(r, Mapping) and r.get("skipped"):
      continue
    if isinstance(r, Mapping) and r.get("gpu") is None and gpu is not None:
      r = {**r, "gpu": gpu}
    out.append(r)
  if alone_times:
    baselines = data.get("baselines", {}) if isinstance(data, Mapping) else {}
    out = _with_alone_times(out, baselines, path)
  return out


def _with_alone_times(records: list, baselines: Mapping, path: str) -> list[dict]:
  """``records`` with ``compute.time_s`` and ``proxy.time_s`` from what the benchmark
  measured alone (see the module docstring)."""

  def key(r) -> str:
    return json.dumps(r.get("compute", r.get("gemm")), sort_keys=True)

  unshaped: dict[str, float] = {}
  for r in records:
    if not r.get("shaped_launches") and r.get("compute_alone_s"):
      unshaped.setdefault(key(r), float(r["compute_alone_s"]))
  proxy_ms = baselines.get("proxy_alone_ms")
  out = []
  for i, r in enumerate(records):
    compute = unshaped.get(key(r)) if r.get("shaped_launches") else r.get("compute_alone_s")
    if compute is None or not proxy_ms:
      raise ValueError(
        f"sim.load_measurements({path!r}, alone_times=True): record {i} has no measured time "
        "alone for its "
        + ("proxy (baselines.proxy_alone_ms)" if not proxy_ms else "compute kernel")
        + "; read the file without alone_times"
      )
    nested = "compute" if "compute" in r else "gemm"
    out.append(
      {
        **r,
        nested: {**r[nested], "time_s": float(compute)},
        "proxy": {**r.get("proxy", {}), "time_s": float(proxy_ms) * 1e-3},
      }
    )
  return out


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
    time_s=r.get("proxy_time_s"),
  )
  if r["compute_kind"] == "gemm":
    comp = Kernel.gemm("compute", int(r["m"]), int(r["n"]), int(r["k"]), dtype=r["dtype"])
    comp = dataclasses.replace(comp, time_s=r.get("compute_time_s"))
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
      time_s=r.get("compute_time_s"),
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
  r = normalise(record, 0) if "measured" not in record else record
  wl, policy = _workload(r), _policy(r)
  res = simulate(wl, target=target, policy=policy, constants=constants)
  g = res.timing("compute")
  p = res.timing("proxy")
  # The benchmark's slowdown is against the kernel alone under the same cap.
  alone = Workload((wl.item("compute"),), "alone")
  iso = simulate(alone, target=target, policy=policy, constants=constants).timing("compute")
  iso = iso.end_s - iso.start_s
  return {
    "makespan_s": res.makespan_s,
    "proxy_latency_s": p.end_s - p.ready_s,
    "compute_slowdown": g.duration_s / iso - 1.0,
  }


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
