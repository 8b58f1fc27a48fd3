"""Attention in pieces of query rows on the tensor + sequence parallel step (deviceless).

The attention-output reduce-scatter of a TP+SP block is communication-bound (its transfer
takes longer than the output projection it follows), and in the forward pass nothing else
is independent of it. Computing attention in pieces of query rows
(``tp_sp.build(attention_pieces=c)``, each piece's output projection reduce-scattered on
its own) gives the reduce-scatter of one piece the next piece's attention to run beside.
This benchmark measures what that costs and gains, under XLA's defaults and under
@jax_overlap.overlap, against the step with attention whole: the analysis' step, compute,
exposed share, and the simulator's contention-aware step (sim.realize, XLA's stream
priority). The backward pass of the pieces is what JAX derives from them (the key and value
gradients summed over the pieces).

Writes benchmarks/results/transform_tp_attention.{json,md}.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.use_cpu_devices(8)  # before JAX starts

from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap.examples import tp_sp  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_list("targets", ["h100x8"], "Targets.")
absl_flags.DEFINE_list("sizes", ["large", "medium"], "Model sizes (see SIZES).")
absl_flags.DEFINE_list("pieces", ["1", "2", "4"], "Query-row pieces of attention.")
absl_flags.DEFINE_integer("layers", 2, "Blocks.")

SIZES = _common.TP_SIZES


def run(target: str, size: str, rows: list) -> None:
  written = None  # XLA defaults' compute with attention whole: the compute-only bound
  for c in (int(v) for v in FLAGS.pieces):
    fn, args = tp_sp.build(target, layers=FLAGS.layers, attention_pieces=c, **SIZES[size])
    ov = jax_overlap.overlap(fn, target=target, cache=False)
    chosen = ov.explain(*args).chosen
    reports = {
      "XLA defaults": jax_overlap.analyze(fn, *args, target=target, name="XLA defaults"),
      "@overlap": jax_overlap.analyze(ov, *args, target=target, name="@overlap"),
    }
    if written is None:
      written = reports["XLA defaults"].compute_time_s
    for name, r in reports.items():
      real = jax_overlap.sim.realize(r, "priority")
      row = {
        "target": target,
        "size": size,
        "config": {**SIZES[size], "layers": FLAGS.layers},
        "attention_pieces": c,
        "variant": name,
        "chosen": chosen if name == "@overlap" else None,
        "step_s": r.step_time_s,
        "compute_s": r.compute_time_s,
        "exposed_fraction": r.exposed_fraction,
        "vs_compute_bound": r.step_time_s / r.compute_time_s,
        "vs_written_compute_bound": r.step_time_s / written,
        "priority_s": real.results["priority"].makespan_s,
      }
      rows.append(row)
      print(_line(row), flush=True)


def _line(row: dict) -> str:
  return (
    f"| {row['target']} | {row['size']} | {row['attention_pieces']} | {row['variant']} "
    f"| {row['step_s'] * 1e3:.2f} | {row['compute_s'] * 1e3:.2f} "
    f"| {row['exposed_fraction']:.1%} | {row['vs_compute_bound']:.3f} "
    f"| {row['vs_written_compute_bound']:.3f} | {row['priority_s'] * 1e3:.2f} |"
  )


def main(argv):
  del argv
  rows: list = []
  for target in FLAGS.targets:
    for size in FLAGS.sizes:
      run(target, size, rows)
  chosen = sorted(
    {(r["size"], r["attention_pieces"], r["chosen"]) for r in rows if r["chosen"]},
  )
  md = [
    "# Attention in pieces of query rows on a tensor + sequence parallel step",
    "",
    f"{FLAGS.layers} blocks, bf16, batch 1, tensor axis of 8 "
    "(jax_overlap.examples.tp_sp.build(attention_pieces=c)): attention computed in c pieces "
    "of query rows, each piece's output projection reduce-scattered on its own. Deviceless "
    "estimates: jax_overlap.analyze (step, compute, exposed share) and sim.realize under "
    "XLA's stream priority, both models (the same cost model chose @overlap's variant). "
    "'step / compute as written' divides by the compute of the step with attention whole "
    "under XLA's defaults (c = 1).",
    "",
    "| target | size | attention pieces | variant | step ms | compute ms | exposed comm "
    "| step / its compute | step / compute as written | sim: XLA priority ms |",
    "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    *[_line(r) for r in rows],
    "",
    *[f'- {s}, {c} piece(s): @overlap chose "{v}"' for s, c, v in chosen],
  ]
  _common.publish(
    "transform_tp_attention", {"sizes": SIZES, "layers": FLAGS.layers, "rows": rows}, md
  )


if __name__ == "__main__":
  app.run(main)
