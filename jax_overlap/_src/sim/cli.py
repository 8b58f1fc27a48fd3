"""``jax-overlap simulate``: run the SM-level simulator from the command line.

Usage (the words after ``simulate``)::

  jax-overlap simulate --paper [--sensitivity] [--json table.json]
  jax-overlap simulate --target h100x8 --workload fsdp [--policy all] [--tune]
                       [--json out.json] [--plot timeline.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

__all__ = ["main", "WORKLOADS"]

WORKLOADS = ("fsdp", "tp-gemm", "tp-attention", "tail", "large")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="jax-overlap simulate",
    description="Simulate compute/communication overlap on a GPU model under the five "
    "policies (sequential, concurrent, priority, shaping, priority+shaping).",
  )
  p.add_argument(
    "--paper",
    action="store_true",
    help="print the paper table (A40, A100, H100, MI250X) and compare it with "
    "the paper's 'up to 25.5%%'",
  )
  p.add_argument(
    "--sensitivity",
    action="store_true",
    help="with --paper: rerun the table with each assumed model constant at the ends of its "
    "plausible range and name the results that depend on an assumption",
  )
  p.add_argument("--target", default="h100x8", help="topology or GPU name (default h100x8)")
  p.add_argument(
    "--workload", default="fsdp", choices=WORKLOADS, help="synthetic workload (default fsdp)"
  )
  p.add_argument(
    "--policy",
    default="all",
    help="one of sequential, concurrent, priority, shaping, priority+shaping, or all (default)",
  )
  p.add_argument("--tune", action="store_true", help="also search shaping and priority")
  p.add_argument("--json", metavar="PATH", help="write the results as JSON")
  p.add_argument("--plot", metavar="PNG", help="write a timeline and SM heat map")
  p.add_argument("--no-progress", action="store_true", help="no progress display")
  return p


def _workload(name: str):
  from jax_overlap._src.sim import paper, workloads

  if name == "tail":
    return workloads.tail_effect()
  if name == "large":
    return workloads.large_step()
  return paper.paper_mixes()[name]


def main(argv: list[str]) -> int:
  """Runs ``jax-overlap simulate`` with ``argv`` (the words after "simulate").

  Returns:
    The exit status: 0 on success, 2 on bad arguments.
  """
  args = _parser().parse_args(argv)
  from jax_overlap._src.sim import paper, policies, tune

  progress = False if args.no_progress else None
  if args.sensitivity and not args.paper:
    print("jax-overlap simulate: --sensitivity needs --paper", file=sys.stderr)
    return 2
  if args.paper and args.sensitivity:
    sens = paper.sensitivity()
    print(sens.markdown())
    print()
    print(sens.verdict())
    if args.json:
      with open(args.json, "w") as f:
        changes = [dataclasses.asdict(c) for c in sens.changes()]
        json.dump({"changes": changes, "verdict": sens.verdict()}, f, indent=1)
    return 0
  if args.paper:
    table = paper.paper_table(progress=progress)
    print(table.markdown())
    if args.json:
      with open(args.json, "w") as f:
        f.write(table.to_json())
    return 0
  try:
    wl = _workload(args.workload)
    pols = policies.POLICIES if args.policy == "all" else (args.policy,)
    results = {}
    for p in pols:
      results[p] = policies.simulate(wl, target=args.target, policy=p, record=bool(args.plot))
  except ValueError as e:
    print(f"jax-overlap simulate: {e}", file=sys.stderr)
    return 2
  print(f"{wl.name} on {args.target}")
  base = results.get("concurrent")
  for p, r in results.items():
    rel = f"  ({1 - r.makespan_s / base.makespan_s:+.1%} vs concurrent)" if base else ""
    print(
      f"{p:>18}: {r.makespan_s * 1e3:10.4f} ms  compute slowdown {r.compute_slowdown:6.1%}{rel}"
    )
  out = {
    "workload": wl.name,
    "target": args.target,
    "results": {p: r.to_dict() for p, r in results.items()},
  }
  if args.tune:
    t = tune.tune(wl, target=args.target, progress=progress)
    print(
      f"{'tuned':>18}: {t.makespan_s * 1e3:10.4f} ms  ({t.gain:+.1%} vs {t.baseline}, "
      f"{t.evaluations} simulations, {t.method})"
    )
    plan = t.plan.to_dict() if t.plan is not None else None
    print(json.dumps(plan, indent=1) if plan else f"no runtime plan on {args.target}: {t.policy}")
    out["tuned"] = {"makespan_s": t.makespan_s, "gain": t.gain, "plan": plan}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  if args.plot:
    last = results[pols[-1]]
    last.plot(args.plot)
    print(f"wrote {args.plot} ({pols[-1]})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
