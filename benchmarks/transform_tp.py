"""The overlap transform on a Megatron-style tensor + sequence parallel step (deviceless).

2 blocks (fused QKV, attention on local heads, output projection, MLP), bf16, hidden 8192,
MLP 28672, 64 heads, sequence 8192, batch 1, a ``tensor`` axis over all 8 GPUs
(jax_overlap.examples.tp_sp), compiled for the target under XLA defaults, the recommended
flags and @jax_overlap.overlap; per variant the analysis' exposed communication and step
over compute-only bound, and sim.realize's contention-aware estimate under XLA's own policy
(collective streams at the highest priority).

Writes benchmarks/results/transform_tp.{json,md}.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap.examples import tp_sp  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_list("targets", ["h100x8"], "Targets.")
absl_flags.DEFINE_integer("layers", 2, "Blocks.")
absl_flags.DEFINE_integer("hidden", 8192, "Hidden size.")
absl_flags.DEFINE_integer("mlp", 28672, "MLP size.")
absl_flags.DEFINE_integer("heads", 64, "Heads.")
absl_flags.DEFINE_integer("seq", 8192, "Sequence length.")


def main(argv):
  del argv
  cfg = dict(
    layers=FLAGS.layers, hidden=FLAGS.hidden, mlp=FLAGS.mlp, heads=FLAGS.heads, seq=FLAGS.seq
  )
  rows, tables = [], []
  for target in FLAGS.targets:
    fn, args = tp_sp.build(target, **cfg)
    reports = {
      "XLA defaults": jax_overlap.analyze(fn, *args, target=target, name="XLA defaults"),
      "recommended flags": jax_overlap.analyze(
        fn,
        *args,
        target=target,
        name="recommended flags",
        xla_options=jax_overlap.flags.as_compiler_options(target, "fsdp"),
      ),
    }
    ov = jax_overlap.overlap(fn, target=target, cache=False)
    t0 = time.perf_counter()
    expl = ov.explain(*args)
    select_s = time.perf_counter() - t0
    reports["@overlap"] = jax_overlap.analyze(ov, *args, target=target, name="@overlap")
    lines = []
    for name, r in reports.items():
      real = jax_overlap.sim.realize(r, ["priority"]).results["priority"].makespan_s
      row = {
        "target": target,
        "variant": name,
        "step_s": r.step_time_s,
        "compute_s": r.compute_time_s,
        "exposed_fraction": r.exposed_fraction,
        "vs_compute_bound": r.step_time_s / r.compute_time_s,
        "realize_priority_s": real,
      }
      rows.append(row)
      lines.append(
        f"| {target} | {name} | {r.step_time_s * 1e3:.2f} | {r.compute_time_s * 1e3:.2f} "
        f"| {r.exposed_fraction:.1%} | {row['vs_compute_bound']:.3f} | {real * 1e3:.2f} |"
      )
    tables.append("\n".join(lines))
    chosen = expl.notes[-1] if expl.notes else ""
    rings = [a.detail for a in expl.of_kind("collective_matmul")]
    classify = [a.detail for a in expl.of_kind("classify")]
    rows.append(
      {
        "target": target,
        "explain_classify": classify,
        "rings": rings,
        "choice": chosen,
        "selection_s": select_s,
      }
    )
    print(target, "\n".join(lines), chosen, sep="\n")
  md = [
    "# @jax_overlap.overlap on a tensor + sequence parallel step",
    "",
    f"{FLAGS.layers} blocks, bf16, hidden {FLAGS.hidden}, MLP {FLAGS.mlp}, {FLAGS.heads} heads, "
    f"sequence {FLAGS.seq}, batch 1, tensor axis of 8 (jax_overlap.examples.tp_sp). Deviceless "
    "estimates (jax_overlap.analyze: roofline kernels, alpha-beta collectives on XLA's "
    "schedule); sim.realize: the simulator's contention-aware step under XLA's own policy. "
    "Both are models: the same cost model chose @overlap's variant.",
    "",
    "| target | variant | step ms | compute ms | exposed comm | step / compute bound | "
    "sim.realize ms |",
    "|---|---|---:|---:|---:|---:|---:|",
    *tables,
    "",
  ]
  for r in rows:
    if "choice" in r:
      md += [f"{r['target']}: {r['choice']} (selection {r['selection_s']:.0f} s)", ""]
      md += [f"- {c}" for c in r["explain_classify"]]
      md += [f"- {len(r['rings'])} collective matmul ring(s)"] + [
        f"  - {d}" for d in r["rings"][:6]
      ]
  md.append(f"\nMachine: {_common.machine()}")
  _common.write(
    "transform_tp",
    {"config": cfg, "rows": rows, "machine": _common.machine()},
    "\n".join(md) + "\n",
  )
  print("wrote benchmarks/results/transform_tp.md")


if __name__ == "__main__":
  app.run(main)
