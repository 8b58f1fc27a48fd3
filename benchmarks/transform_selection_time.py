"""How long @jax_overlap.overlap's variant selection takes for a deep model, and a restart.

The Llama-style FSDP step of ``transform_fsdp`` (bf16, hidden 4096, MLP 11008, sequence
2048, one sequence per GPU) at 32 layers, in the forms users write (by default the
rematerialized ``lax.scan`` and the unrolled layers, in shard_map and as plain ``jax.jit``
over sharded arrays, GSPMD, whose selection also compiles the step's shard_map form),
compiled deviceless for h100x8.
Per form: the first selection (every variant compiled and analysed, a fresh selection
cache) and the same step decorated again by a new ``overlap`` in the same process (the
remembered choice read back; JAX's trace cache is warm, so a restarted job also pays
one trace of the step). Wall-clock on this machine, one run each.
Each form's first selection is also timed with every variant compiled on its own
(``JAX_OVERLAP_SHARED_KERNELS=0``), in the same run, so the two compare on one machine:
by default the variants share XLA's kernel cache (``jax_overlap._src.compile.kernel_cache``).

Writes benchmarks/results/transform_selection_time.{json,md}.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.use_cpu_devices(8)  # before JAX starts

from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap.examples import fsdp_transformer as G  # noqa: E402
from jax_overlap.examples import shard_map_fsdp as S  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_integer("layers", 32, "Layers.")
absl_flags.DEFINE_string("target", "h100x8", "Target.")
absl_flags.DEFINE_list(
  "forms",
  ["scan_remat", "unrolled", "gspmd_scan_remat", "gspmd"],
  "Program forms: shard_map_fsdp's, and gspmd* (fsdp_transformer, plain jax.jit; the "
  "selection also compiles their shard_map form).",
)


def _build(form: str, cfg: dict):
  if form == "gspmd":
    return G.build(FLAGS.target, **cfg)
  if form == "gspmd_scan_remat":
    return G.build(FLAGS.target, scan=True, remat=True, **cfg)
  return S.build(FLAGS.target, form=form, **cfg)


def main(argv):
  del argv
  cfg = dict(layers=FLAGS.layers, hidden=4096, mlp=11008, heads=32, seq=2048, batch_per_device=1)
  rows = []
  for form in FLAGS.forms:
    fn, args = _build(form, cfg)
    # Each variant compiled on its own first (a fresh cache directory: no stored compile).
    os.environ["JAX_OVERLAP_SHARED_KERNELS"] = "0"
    with tempfile.TemporaryDirectory() as cache_dir:
      os.environ["JAX_OVERLAP_CACHE_DIR"] = cache_dir
      t0 = time.perf_counter()
      alone = jax_overlap.overlap(fn, target=FLAGS.target).explain(*args)
      unshared = time.perf_counter() - t0
    os.environ.pop("JAX_OVERLAP_SHARED_KERNELS")
    with tempfile.TemporaryDirectory() as cache_dir:
      os.environ["JAX_OVERLAP_CACHE_DIR"] = cache_dir
      t0 = time.perf_counter()
      explanation = jax_overlap.overlap(fn, target=FLAGS.target).explain(*args)
      first = time.perf_counter() - t0
      t0 = time.perf_counter()
      again = jax_overlap.overlap(fn, target=FLAGS.target).explain(*args)
      recalled = time.perf_counter() - t0
    os.environ.pop("JAX_OVERLAP_CACHE_DIR", None)
    row = {
      "form": form,
      "layers": FLAGS.layers,
      "target": FLAGS.target,
      "variants": len(explanation.candidates),
      "chosen": explanation.chosen,
      "chosen_again": again.chosen,
      "selection_s": first,
      "selection_unshared_s": unshared,
      "same_estimates_unshared": dict(alone.candidates) == dict(explanation.candidates),
      "restart_s": recalled,
    }
    rows.append(row)
    print(row, flush=True)
  # Rows of the forms not rerun are kept from the earlier results.
  earlier = _common.earlier_rows("transform_selection_time")
  rerun = {r["form"] for r in rows}
  rows = [r for r in earlier if r.get("form") not in rerun] + rows
  lines = [
    "# @overlap's variant selection on a 32-layer FSDP step",
    "",
    f"shard_map_fsdp and (gspmd*) fsdp_transformer {cfg}, deviceless for {FLAGS.target}, one run each on this machine "
    "(wall clock). First: every variant compiled and analysed, a fresh selection cache. "
    "Again: a new decorator on the same step in the same process (the remembered choice; "
    "JAX's trace cache is warm, a restarted job also traces the step once). Each row's "
    "times are from its own run. 'each variant alone': the first selection with every "
    "variant compiled on its own (JAX_OVERLAP_SHARED_KERNELS=0), timed in the same run; "
    "'same estimates': whether both selections estimated every variant the same.",
    "",
    "| form | layers | variants compiled | first selection s | each variant alone s | "
    "same estimates | again s | chosen |",
    "|---|---:|---:|---:|---:|---|---:|---|",
  ]
  for r in rows:
    alone = r.get("selection_unshared_s")
    lines.append(
      f"| {r['form']} | {r['layers']} | {r['variants']} | {r['selection_s']:.1f} | "
      + (f"{alone:.1f}" if alone is not None else "-")
      + f" | {r.get('same_estimates_unshared', '-')} | {r['restart_s']:.2f} | {r['chosen']} |"
    )
  lines += ["", f"Machine: {_common.machine()}"]
  _common.write(
    "transform_selection_time",
    {"machine": _common.machine(), "rows": rows},
    "\n".join(lines) + "\n",
  )


if __name__ == "__main__":
  app.run(main)
