"""The overlap transform on a mixture-of-experts step under plain jax.jit (deviceless).

jax_overlap.examples.moe at its defaults (4 blocks of causal attention and a top-1 MoE MLP
of 8 experts, hidden 2048, each expert's MLP 8192, capacity factor 1.25, sequence 2048,
vocabulary 32000, bf16 compute, float32 parameters, optax AdamW; experts split over an
``expert`` axis of 8 GPUs, every other weight FSDP over all of them), in two forms:
``lax.scan`` over ``jax.checkpoint`` and unrolled blocks. Compiled for each target under
XLA's defaults, the recommended flags and @jax_overlap.overlap; and the step's shard_map
form as converted (no rewrite, recommended flags), once with the tokens moved to their
experts by all-to-all where the cost model says it pays and once with every such move
gathered and sliced instead: what the all-to-alls gain in the conversion. Per variant: the
collectives XLA runs (count and bytes by kind), the analysis' step, exposed communication
and the simulator's contention-aware step (sim.realize, XLA's stream priority).

Writes benchmarks/results/transform_moe.{json,md}.
"""

from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.use_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap._src.transform import to_shard_map  # noqa: E402
from jax_overlap.examples import moe  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_list("targets", ["h100x8", "a100x8"], "Targets.")
absl_flags.DEFINE_list("forms", ["scan_remat", "unrolled"], "Block loop forms.")


def _converted(fn, args, target: str, all_to_all: bool):
  """The step's shard_map form as converted (no rewrite), jitted with its outputs' layouts."""
  closed = jax.make_jaxpr(fn)(*args)
  leaves = jax.tree.leaves(args)
  params = range(len(jax.tree.leaves(args[0])))
  conv = to_shard_map.convert(closed, leaves, None, params, target, all_to_all=all_to_all)
  return jax.jit(conv.fn), leaves


def _collectives(report) -> str:
  count, size = collections.Counter(), collections.Counter()
  for c in report.collectives:
    count[c.kind] += 1
    size[c.kind] += c.bytes
  return ", ".join(f"{count[k]} {k} ({size[k] / 2**20:.0f} MiB)" for k in sorted(count))


def run(target: str, form: str, rows: list, lines: list) -> None:
  fn, args = moe.build(target, scan=form == "scan_remat")
  reports, ov, expl, select_time = _common.selected(fn, args, target)
  reports["@overlap"] = jax_overlap.analyze(ov, *args, target=target, name="@overlap")
  recommended = jax_overlap.flags.as_compiler_options(target=target, workload="fsdp")
  for all_to_all, name in ((True, "converted, all-to-all"), (False, "converted, gathers")):
    conv, leaves = _converted(fn, args, target, all_to_all)
    reports[name] = jax_overlap.analyze(
      conv, *leaves, target=target, name=name, xla_options=recommended
    )
  lines += [
    f"### {target}, {form}",
    "",
    "| variant | step ms | exposed ms | exposed % | sim.realize ms | collectives |",
    "|---|---:|---:|---:|---:|---|",
  ]
  for name, r in reports.items():
    realized = jax_overlap.sim.realize(r, "priority").results["priority"].makespan_s
    collectives = _collectives(r)
    row = {
      **r.summary(),
      "target": target,
      "form": form,
      "variant": name,
      "exposed_fraction": r.exposed_fraction,
      "realize_priority_s": realized,
      "collectives": collectives,
    }
    if name == "@overlap":
      row.update(chosen=expl.chosen, selection_time_s=select_time)
    rows.append(row)
    lines.append(
      f"| {name} | {_common.ms(r.step_time_s)} | {_common.ms(r.exposed_comm_s)} | "
      f"{100 * r.exposed_fraction:.1f} | {_common.ms(realized)} | {collectives} |"
    )
  choice = next((n for n in expl.notes if n.startswith("chosen by the cost model")), "")
  self_judged = expl.chosen.endswith("scheduled by the cost model's estimates")
  lines += [
    "",
    f"@overlap chose: {expl.chosen}"
    + (
      " (self-judged: its schedule came from the cost model's latency profile)"
      if self_judged
      else ""
    )
    + f"; selection {select_time:.0f} s.",
    "",
    choice,
    "",
  ]
  print("\n".join(lines[-8:]))


def main(argv):
  del argv
  rows, lines = [], []
  for target in FLAGS.targets:
    for form in FLAGS.forms:
      run(target, form, rows, lines)
  cfg = moe.Config()
  head = [
    "# @jax_overlap.overlap on a mixture-of-experts step (GSPMD)",
    "",
    f"jax_overlap.examples.moe: {cfg.layers} blocks, hidden {cfg.hidden}, {cfg.experts} "
    f"experts of MLP {cfg.mlp}, top-1 routing, capacity factor {cfg.capacity_factor}, "
    f"sequence {cfg.seq}, vocabulary {cfg.vocab}, one sequence per GPU, bf16 compute, "
    "optax AdamW; experts split over an expert axis of 8 GPUs, the other weights FSDP over "
    "all 8; plain jax.jit with sharding constraints. 'converted, all-to-all' and "
    "'converted, gathers': the step's shard_map form as converted (no rewrite, recommended "
    "flags), with the tokens' moves between the batch and the experts by all-to-all where "
    "the cost model says it pays, and with every such move gathered and sliced. Estimates "
    "from jax_overlap.analyze (deviceless compile for the target, roofline and alpha-beta "
    "costs placed on XLA's schedule); sim.realize adds SM contention under XLA's stream "
    "priority. No GPU measured these figures.",
    "",
  ]
  _common.publish("transform_moe", {"rows": rows, "config": vars(cfg)}, head + lines)


if __name__ == "__main__":
  app.run(main)
