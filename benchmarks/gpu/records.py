"""Post-processing of ``overlap_bench`` output: the file ``sim.calibrate`` reads.

  python records.py resources BENCH.json PTXAS.log GPU   # registers (ptxas -v) and residency
  python records.py names BENCH.json RUNTIME.log          # kernel names the library saw
  python records.py check BENCH.json                      # a cap meant to shape shaped nothing?
  python records.py dry-run BENCH.json GPU                # fill measurements from the model
  python records.py calibrate BENCH.json GPU              # fit the model's constants
  python records.py gaps GAPS.json GPU                     # launch gaps beside the model's
  python records.py dispatch DISPATCH.json                 # copies behind cuBLASLt GEMMs
  python records.py report RESULT.json GPU OUT.md          # measured table beside the model

``run_all.sh`` runs them in that order (``dry-run`` only without a GPU). Each command
rewrites BENCH.json in place (``calibrate`` and ``report`` only read it).

The dry run's "measurements" are the simulator's predictions for the benchmark's own
configurations, with constants set apart from the defaults (``DRY_RUN_TRUTH``), and say so
in every record (``"source"``): they test the round trip (benchmark output -> calibration
-> constants recovered), not the model.
"""

from __future__ import annotations

import json
import re
import sys

# Constants the dry run pretends the GPU has (calibration should recover them).
DRY_RUN_TRUTH = {"cta_copy_bandwidth": 26e9, "occupancy_exponent": 0.3}
# What the dry run then fits, starting from the target's defaults.
FIT_PARAMS = ("cta_copy_bandwidth", "occupancy_exponent")
_OWN_KERNELS = {"loop_fusion", "attention_like"}


def _load(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _save(path: str, data: dict) -> None:
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")


def resources(path: str, log_path: str, gpu: str) -> int:
  """Fills registers of the benchmark's own kernels from ptxas and their residency on ``gpu``
  (the runtime library's arithmetic), where the benchmark could not ask the driver."""
  from jax_overlap import runtime
  from jax_overlap._src.compile import ptx

  data = _load(path)
  with open(log_path) as f:
    regs = {name: r.registers for name, r in ptx.parse_ptxas_log(f.read()).items()}
  missing = sorted((_OWN_KERNELS | {"nccl_proxy"}) - set(regs))
  if missing:
    print(f"records.py: ptxas log {log_path} has no register count for {missing}", file=sys.stderr)
    return 1
  for r in data["records"]:
    c, p = r["compute"], r["proxy"]
    if p.get("regs") is None:
      p["regs"] = regs["nccl_proxy"]
    if c.get("name") in _OWN_KERNELS:
      if c.get("regs") is None:
        c["regs"] = regs[c["name"]]
      if c.get("natural_blocks_per_sm") is None:
        c["natural_blocks_per_sm"] = runtime.blocks_per_sm(gpu, c["threads"], c["regs"], c["smem"])
      if r.get("meant_to_shape") is not None and r.get("cap"):
        r["meant_to_shape"] = c["natural_blocks_per_sm"] > r["cap"]
  _save(path, data)
  return 0


def names(path: str, log_path: str) -> int:
  """Records the kernel names the runtime library reported (``JAX_OVERLAP_RT_VERBOSE=2``)."""
  data = _load(path)
  with open(log_path, errors="replace") as f:
    seen = sorted(set(re.findall(r"kernel (\S+): static smem", f.read())))
  data["kernel_names"] = seen
  _save(path, data)
  print(f"records.py: {len(seen)} kernel names seen by the runtime library")
  return 0


def room(data: dict, gpu: str) -> None:
  """Adds, per shaping record of an own kernel, what the library's room rule says of its cap."""
  from jax_overlap import runtime

  for r in data["records"]:
    c, p = r["compute"], r["proxy"]
    if not r.get("cap") or c.get("name") not in _OWN_KERNELS or c.get("regs") is None:
      continue
    comm = runtime.CommBlock(p["threads"], p["regs"], p["smem"])
    cap, why = runtime.room_cap(gpu, comm, c["threads"], c["regs"], 0, c["smem"], r["cap"])
    r["room_rule"] = {"cap": cap, "limits": list(why)}


def check(path: str) -> int:
  """Fails when a configuration meant to shape (an own kernel above its cap, the runtime
  library loaded) shaped no launch."""
  data = _load(path)
  if not data.get("measured"):
    print("records.py: check: nothing measured (dry run)")
    return 0
  bad = [
    f"{r['compute'].get('name', r['compute']['kind'])} cap {r['cap']} ({r['policy']})"
    for r in data["records"]
    if r.get("meant_to_shape") and not r.get("shaped_launches")
  ]
  if not data.get("runtime_loaded"):
    print(
      "records.py: check: the runtime library was not preloaded: nothing was shaped",
      file=sys.stderr,
    )
    return 1
  if bad:
    print(
      f"records.py: check: configurations meant to shape shaped nothing: {bad}", file=sys.stderr
    )
    return 1
  n = sum(1 for r in data["records"] if r.get("meant_to_shape"))
  print(f"records.py: check: all {n} configurations meant to shape shaped their launches")
  return 0


def dry_run(path: str, gpu: str) -> int:
  """Fills each record's measurements with the simulator's prediction under DRY_RUN_TRUTH."""
  from jax_overlap import sim
  from jax_overlap._src.sim import measurements as cal

  data = _load(path)
  truth = sim.constants_for(gpu, DRY_RUN_TRUTH)
  for i, r in enumerate(data["records"]):
    r["gpu"] = gpu
    probe = {**r, "makespan_s": 1.0}  # any measurement, to read the configuration
    pred = cal.predict(cal.normalise(probe, i), gpu, truth)
    r.update(
      makespan_s=pred["makespan_s"],
      proxy_latency_s=pred["proxy_latency_s"],
      compute_slowdown=pred["compute_slowdown"],
      source=f"dry run: simulator prediction with {DRY_RUN_TRUTH}, not a measurement",
    )
  room(data, gpu)
  data["measured"] = False
  _save(path, data)
  print(f"records.py: dry run: {len(data['records'])} records predicted by the simulator")
  return 0


def calibrate(path: str, gpu: str) -> int:
  from jax_overlap import sim

  res = sim.calibrate(path, target=gpu, params=FIT_PARAMS)
  print(
    f"records.py: calibrate on {gpu}: RMS error {res.error_before:.3g} -> {res.error_after:.3g} "
    f"({res.method}); fitted {', '.join(f'{k}={v:.4g}' for k, v in res.params.items())}"
  )
  return 0


def _gap_lines(gaps: dict, gpu: str) -> list[str]:
  """launch_gaps.cu's cases beside the simulator's launch_overhead_s and event_latency_s."""
  from jax_overlap._src.sim.constants import constants_for

  c = constants_for(gpu)
  model = {
    "same_stream": c.launch_overhead_s,
    "event_other_stream": c.event_latency_s,
    "graph_same_stream": c.launch_overhead_s,
    "graph_event_other_stream": c.event_latency_s,
  }
  lines = []
  for name, v in gaps["cases"].items():
    measured = (
      "-"
      if v is None
      else f"{v['median_s'] * 1e6:.2f} us (p10-p90 "
      + (f"{v['p10_s'] * 1e6:.2f}-{v['p90_s'] * 1e6:.2f})")
    )
    lines.append(f"{name}: {measured}; simulator {model[name] * 1e6:.2f} us")
  return lines


def gaps(path: str, gpu: str) -> int:
  data = _load(path)
  where = "" if data.get("measured") else " (dry run: nothing measured)"
  res = data.get("timer_resolution_ns")
  timer = f"; timer step {res} ns" if res else ""
  print(f"records.py: launch gaps{where}{timer}: " + "; ".join(_gap_lines(data, gpu)))
  return 0


def dispatch(path: str) -> int:
  """One line on gemm_dispatch.cu's output: per API and SM-count target, the GEMM alone, the SMs
  its grid left free, and the copy's latency launched behind it at the greatest priority
  (and the GEMM's time beside it)."""
  data = _load(path)
  recs = data.get("records", [])
  conn = data.get("cuda_device_max_connections")
  where = "" if data.get("measured") else " (dry run: nothing measured)"
  env = f", CUDA_DEVICE_MAX_CONNECTIONS={conn}" if conn else ""
  parts = []
  for r in recs:
    if not (r["priority"] and r["issue"] == "compute_first"):
      continue
    api = r["gemm"].get("api", "cublasLt")
    target = f"{api} target {r['gemm']['sm_count_target'] or 'device'}"
    if r.get("proxy_latency_s") is None:
      parts.append(target)
      continue
    sim = dispatch_prediction(data, r) if not r["gemm"]["sm_count_target"] else None
    parts.append(
      f"{target}: GEMM {_ms(r['gemm_alone_s'])} ms alone, {r['free_sms']:g} SMs free, "
      f"copy behind it {_ms(r['proxy_latency_s'])} ms (alone {_ms(r['proxy_alone_s'])}"
      + (f"; simulated {_ms(sim)}" if sim is not None else "")
      + f"), GEMM beside it {_ms(r['gemm_s'])} ms"
    )
  print(f"records.py: GEMM dispatch{where}{env}: " + "; ".join(parts))
  for api, follows in target_followed(data).items():
    print(
      f"records.py: {api}: the persistent grid {'follows' if follows else 'ignores'} an "
      "SM-count target (sim.gemm.SM_COUNT_TARGET_FOLLOWED)"
    )
  return 0


def target_followed(data: dict) -> dict[str, bool]:
  """Per API of gemm_dispatch's records: whether a GEMM at an SM-count target below the
  device's left SMs free behind it (a probe found at least half the SMs the target leaves),
  where measured."""
  sms = data.get("device", {}).get("sm_count") or 0
  out: dict[str, bool] = {}
  for r in data.get("records", []):
    target, free = r["gemm"]["sm_count_target"], r.get("free_sms")
    if not target or free is None or not sms or target >= sms:
      continue
    api = r["gemm"].get("api", "cublasLt")
    out[api] = out.get(api, False) or free >= (sms - target) / 2
  return out


def dispatch_prediction(data: dict, rec: dict) -> float | None:
  """The simulator's copy latency for one of gemm_dispatch's records at the device's own SM
  count: its GEMM and copy with their measured times alone, launched in the record's order,
  the copy's stream at the greatest priority or not, and one hardware queue where the run
  had CUDA_DEVICE_MAX_CONNECTIONS=1 (``sim.Policy(single_queue=True)``). None where the
  record lacks the times."""
  import dataclasses

  from jax_overlap import sim
  from jax_overlap._src import targets

  if rec.get("gemm_alone_s") is None or rec.get("proxy_alone_s") is None:
    return None
  gpu = targets.catalogue_gpu(data.get("device", {}).get("name", "")) or "h200"
  g = rec["gemm"]
  gemm = sim.Kernel.gemm("gemm", g["m"], g["n"], g["k"], dtype=g.get("dtype", "bf16"))
  gemm = dataclasses.replace(gemm, time_s=rec["gemm_alone_s"])
  p = data["proxy"]
  copy = sim.Collective(
    "proxy", "copy", float(p["bytes"]), group_size=1, stream=1, channels=int(p["ctas"]),
    threads=int(p["threads"]), regs=96, smem=int(p["smem"]), time_s=rec["proxy_alone_s"],
  )  # fmt: skip
  items = (gemm, copy) if rec["issue"] == "compute_first" else (copy, gemm)
  policy = sim.Policy(
    "measured",
    priority=bool(rec["priority"]),
    single_queue=str(data.get("cuda_device_max_connections")) == "1",
  )
  res = sim.simulate(sim.Workload(items, "gemm_dispatch"), target=gpu, policy=policy)
  t = res.timing("proxy")
  return t.end_s - t.ready_s


def _ms(v) -> str:
  return "-" if v is None else f"{v * 1e3:.3f}"


def sweep_rows(path: str, gpu: str) -> list[tuple[dict, dict, dict]]:
  """Each measured record of a sweep with two predictions under the shipped constants:
  the kernels at the simulator's own costs (as the benchmark describes them), and at their
  measured times alone (``load_measurements(alone_times=True)``: the dispatcher,
  contention and occupancy rules alone). Sorted as the report prints them."""
  from jax_overlap import sim
  from jax_overlap._src.sim import engine
  from jax_overlap._src.sim import measurements as cal
  from jax_overlap._src.sim.constants import constants_for

  topo = engine.resolve_target(gpu)
  const = constants_for(topo.gpu)
  recs = sim.load_measurements(path)
  timed = sim.load_measurements(path, alone_times=True)
  kinds = {"gemm": 0, "loop_fusion": 1, "attention_like": 2}
  order = {p: i for i, p in enumerate(sim.POLICIES)}
  rows = [
    (r, cal.predict(r, topo, const), cal.predict(t, topo, const)) for r, t in zip(recs, timed)
  ]
  return sorted(
    rows,
    key=lambda row: (
      kinds.get(row[0]["compute"].get("name", row[0]["compute"]["kind"]), 9),
      row[0]["cap"] or 0,
      row[0]["issue"],
      order[row[0]["policy"]],
    ),
  )


def within(rows, tolerance: float = 0.2) -> dict[str, int]:
  """How many rows the prediction at measured times alone gets within ``tolerance``, per
  quantity and for both."""
  out = {"rows": len(rows), "makespan_s": 0, "proxy_latency_s": 0, "both": 0}
  for r, _, timed in rows:
    ok = [abs(timed[q] / r[q] - 1) <= tolerance for q in ("makespan_s", "proxy_latency_s")]
    out["makespan_s"] += ok[0]
    out["proxy_latency_s"] += ok[1]
    out["both"] += all(ok)
  return out


def report(path: str, gpu: str, out: str) -> int:
  """A Markdown table of a measured sweep, each row beside the simulator's predictions
  with the shipped constants: kernels at the model's own costs / at their measured times
  alone (:func:`sweep_rows`)."""
  data = _load(path)
  if not data.get("measured"):
    print(f"records.py: report: {path} holds no measurements (dry run)", file=sys.stderr)
    return 1
  rows = sweep_rows(path, gpu)
  n = within(rows)
  base = data.get("baselines", {})
  lines = [
    f"# `overlap_bench` on an {data.get('gpu', data['device'].get('name'))}",
    "",
    f"{data.get('date', '')}, driver {data.get('driver', '?')}, jax {data.get('jax', '?')}; "
    f"`benchmarks/gpu/run_all.sh` (written by `records.py report`). Proxy alone: "
    f"{base.get('proxy_alone_ms', float('nan')):.3f} ms. Times are medians of the sweep's "
    "repetitions, in ms. *sim* columns: the simulator's prediction for the same "
    f"configuration with the constants it ships for {gpu}, the kernels at the model's own "
    "costs (as the benchmark describes them) / at their measured times alone (so that only "
    "the dispatcher, contention and occupancy rules are tested). These are the model's "
    f"figures, not measurements. At measured times alone, within 20%: makespan "
    f"{n['makespan_s']} of {n['rows']} rows, proxy latency {n['proxy_latency_s']}, both "
    f"{n['both']}.",
    "",
    "| compute | policy | cap | issued first | makespan | proxy latency | compute | shaped "
    "launches | sim makespan | sim proxy latency |",
    "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r, own, timed in rows:
    pred = (own, timed)
    name = r["compute"].get("name", r["compute"]["kind"])
    first = "-" if r["policy"] == "sequential" else r["issue"].split("_")[0]
    lines.append(
      f"| {name} | {r['policy']} | {r['cap'] or '-'} | {first} | {_ms(r.get('makespan_s'))} "
      f"| {_ms(r.get('proxy_latency_s'))} | {_ms(r.get('compute_s'))} "
      f"| {r.get('shaped_launches', '-')} "
      f"| {' / '.join(_ms(p.get('makespan_s')) for p in pred)} "
      f"| {' / '.join(_ms(p.get('proxy_latency_s')) for p in pred)} |"
    )
  if data.get("launch_gaps", {}).get("measured"):
    g = data["launch_gaps"]
    lines += [
      "",
      f"Launch gaps (`launch_gaps.cu`, median over {next(iter(g['cases'].values()))['n']} "
      f"pairs, global timer step {g.get('timer_resolution_ns')} ns), from one kernel's end "
      "to the next one's start, beside the simulator's constant for it:",
      "",
      *[f"- {line}" for line in _gap_lines(g, gpu)],
    ]
  with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"records.py: report: {len(rows)} records -> {out}")
  return 0


def main(argv: list[str]) -> int:
  cmds = {
    "resources": (resources, 3),
    "names": (names, 2),
    "check": (check, 1),
    "dry-run": (dry_run, 2),
    "calibrate": (calibrate, 2),
    "gaps": (gaps, 2),
    "dispatch": (dispatch, 1),
    "report": (report, 3),
  }
  if not argv or argv[0] not in cmds or len(argv) - 1 != cmds[argv[0]][1]:
    print(__doc__, file=sys.stderr)
    return 2
  fn, _ = cmds[argv[0]]
  return fn(*argv[1:])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
