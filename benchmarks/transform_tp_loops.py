"""The overlap transform on tensor + sequence parallel layers under ``lax.scan`` (deviceless).

The TP+SP block stack of ``jax_overlap.examples.tp_sp`` written as MaxText-style code
writes it: the blocks' weights stacked and the blocks run by ``lax.scan``
(``scan_layers=True``), with and without ``jax.checkpoint`` around each block
(``remat``), the same for plain ``jax.jit`` over sharded arrays (``build_gspmd``:
sharding constraints, no collectives written; @overlap converts it to shard_map), and a
Flax linen model written the MaxText way (``jax_overlap.examples.flax_tp``: logical axis
names, LayerNorm, separate Q/K/V, ``nn.scan`` over ``nn.remat``, plain ``jax.jit``).
@jax_overlap.overlap plans each loop body on its own: the sequence gathers and
reduce-scatters of one iteration become collective matmuls in pieces and its weight
gradients run beside its all-gathers. The variant selection also compiles the step with
the loop bodies as written (what the transform did before it planned loop bodies) and
with only the forward loops' bodies rewritten; the table gives the best estimate of each
from the same run. Per row: the analysis' step, compute and exposed share, the step over
the compute of the step as written, and sim.realize's contention-aware step under XLA's
stream priority for the step as written and for @overlap's choice.

Writes benchmarks/results/transform_tp_loops.{json,md}.
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
from jax_overlap.examples import flax_tp, tp_sp  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_list("targets", ["h100x8"], "Targets.")
absl_flags.DEFINE_list("sizes", ["large", "medium"], "Model sizes (see SIZES).")
absl_flags.DEFINE_list(
  "forms",
  ["scan", "scan+remat", "gspmd scan", "gspmd scan+remat", "flax scan+remat"],
  "Loop forms (see FORMS).",
)
absl_flags.DEFINE_integer("layers", 2, "Blocks.")

SIZES = _common.TP_SIZES
FORMS = {
  "scan": dict(scan_layers=True),
  "scan+remat": dict(scan_layers=True, remat=True),
  # plain jax.jit over sharded arrays (sharding constraints, no collectives written)
  "gspmd scan": dict(scan_layers=True),
  "gspmd scan+remat": dict(scan_layers=True, remat=True),
  # jax_overlap.examples.flax_tp: Flax linen, logical axis names, LayerNorm, separate
  # Q/K/V, nn.scan over nn.remat, plain jax.jit
  "flax scan+remat": {},
}


def _best(candidates, words: str):
  """The best estimate among the variants whose name has ``words`` (None if none)."""
  times = [t for n, t in candidates if words in n and t is not None]
  return min(times) if times else None


def run(target: str, form: str, size: str, rows: list) -> None:
  build = tp_sp.build_gspmd if form.startswith("gspmd") else tp_sp.build
  if form.startswith("flax"):
    build = flax_tp.build
  fn, args = build(target, layers=FLAGS.layers, **FORMS[form], **SIZES[size])
  written = jax_overlap.analyze(fn, *args, target=target, name="XLA defaults")
  ov = jax_overlap.overlap(fn, target=target, cache=False)
  expl = ov.explain(*args)
  rep = jax_overlap.analyze(ov, *args, target=target, name="@overlap")
  sim = {
    name: jax_overlap.sim.realize(r, "priority").results["priority"].makespan_s
    for name, r in (("written", written), ("overlap", rep))
  }
  tuned = jax_overlap.sim.tune(
    jax_overlap.sim.workload_from_report(rep), target=target, progress=False, max_evals=24
  )
  row = {
    "target": target,
    "form": form,
    "size": size,
    "config": {**SIZES[size], **FORMS[form], "layers": FLAGS.layers},
    "written_step_s": written.step_time_s,
    "written_compute_s": written.compute_time_s,
    "written_exposed_fraction": written.exposed_fraction,
    "step_s": rep.step_time_s,
    "compute_s": rep.compute_time_s,
    "exposed_fraction": rep.exposed_fraction,
    "vs_written_compute_bound": rep.step_time_s / written.compute_time_s,
    "bodies_as_written_s": _best(expl.candidates, "loop bodies as written"),
    "forward_bodies_only_s": _best(expl.candidates, "only forward loop bodies rewritten"),
    "sim_written_s": sim["written"],
    "sim_overlap_s": sim["overlap"],
    "chosen": expl.chosen,
    "loop_actions": [a.detail for a in expl.actions if "lax.scan" in a.where],
    "levers": _common.levers(expl, rep, tuned.plan.streams.priority, len(tuned.plan.kernels)),
  }
  rows.append(row)
  print(_line(row), flush=True)


def _line(r: dict) -> str:
  return (
    f"| {r['target']} | {r['form']} | {r['size']} | {_common.ms(r['written_step_s'])} "
    f"| {r['written_exposed_fraction']:.1%} | {_common.ms(r['step_s'])} | {_common.ms(r['compute_s'])} "
    f"| {r['exposed_fraction']:.1%} | {r['vs_written_compute_bound']:.3f} "
    f"| {_common.ms(r['bodies_as_written_s'])} | {_common.ms(r['forward_bodies_only_s'])} "
    f"| {_common.ms(r['sim_written_s'])} / {_common.ms(r['sim_overlap_s'])} |"
  )


def main(argv):
  del argv
  rows: list = []
  for target in FLAGS.targets:
    for form in FLAGS.forms:
      for size in FLAGS.sizes:
        run(target, form, size, rows)
  md = [
    "# @jax_overlap.overlap on tensor + sequence parallel layers under lax.scan",
    "",
    f"{FLAGS.layers} blocks, bf16, batch 1, tensor axis of 8 "
    "(jax_overlap.examples.tp_sp.build(scan_layers=True[, remat=True]); 'gspmd' rows: "
    "build_gspmd, plain jax.jit with sharding constraints, which @overlap converts to "
    "shard_map; 'flax' rows: jax_overlap.examples.flax_tp, Flax linen with logical axis "
    "names, LayerNorm, nn.scan over nn.remat). 'as written' is XLA's defaults. Deviceless "
    "estimates: jax_overlap.analyze (step, compute, exposed share) and sim.realize under "
    "XLA's stream priority; both models, and the same cost model chose @overlap's variant. "
    "'loop bodies as written' is the best variant of the same selection that leaves the "
    "loops' bodies as written (what @overlap did before it planned them); 'forward loop "
    "bodies only' the best that rewrites the forward scan's body and not the backward's.",
    "",
    "| target | form | size | as written ms | as written exposed | @overlap ms "
    "| @overlap compute ms | @overlap exposed | @overlap / compute as written "
    "| loop bodies as written ms | forward loop bodies only ms "
    "| sim: XLA priority, as written / @overlap ms |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    *[_line(r) for r in rows],
    "",
    *[
      f'- {r["target"]} {r["form"]} {r["size"]}: chose "{r["chosen"]}". Levers: {r["levers"]}.'
      for r in rows
    ],
  ]
  _common.publish("transform_tp_loops", {"sizes": SIZES, "forms": FORMS, "rows": rows}, md)


if __name__ == "__main__":
  app.run(main)
