"""MaxText's own train step under @jax_overlap.overlap, deviceless on h100x8.

MaxText 0.2.5's train step built with its own functions (jax_overlap.examples.maxtext:
pyconfig with model_name=llama2-7b, train_compile.get_shaped_inputs,
maxtext_utils.get_functional_train_with_signature): Llama 2 7B's layer (hidden 4096,
MLP 11008, 32 heads), bf16, scanned layers rematerialised in full, AdamW, sequence 2048,
at 2 and 8 layers; FSDP over the 8 GPUs with one sequence per GPU, and (--parallelism tensor)
tensor parallelism over the 8 GPUs with a batch of 8 x 2048. Each step is analysed as
written, under XLA's defaults and under the recommended flags, and under @overlap (a fresh
selection, its wall-clock time recorded). Needs Python 3.12 and MaxText
(pip install 'jax_overlap[maxtext]'). Each row runs in a process of its own.

Writes benchmarks/results/transform_maxtext.{json,md} (the script is not named maxtext.py: run
as a script, its folder comes first on sys.path and the name would shadow MaxText); a run
over some rows keeps the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.use_cpu_devices(8)  # before JAX starts

from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap.examples import maxtext  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_string("target", "h100x8", "Target.")
absl_flags.DEFINE_list("layers", ["2", "8"], "Decoder layer counts.")
absl_flags.DEFINE_list("parallelism", ["fsdp"], "fsdp and/or tensor.")

# MaxText configuration per parallelism (the rest: jax_overlap.examples.maxtext.DEFAULTS).
PARALLELISM = {
  "fsdp": {"ici_fsdp_parallelism": 8, "per_device_batch_size": 1},
  "tensor": {"ici_tensor_parallelism": 8, "ici_fsdp_parallelism": 1, "per_device_batch_size": 1},
}
# MaxText's global batch: per_device_batch_size times the device count.
BATCH = {"fsdp": "8 x 2048, one sequence per GPU", "tensor": "8 x 2048, on every GPU"}


def main(argv):
  del argv
  combos = [(p, n) for p in FLAGS.parallelism for n in FLAGS.layers]
  if len(combos) > 1:
    # One process a row: XLA keeps the tiles a selection's compiles read for the process
    # (jax_overlap/_src/compile/gemm_configs.py), and a later selection of the same layers
    # would start from them: not the fresh start a row's selection time is.
    for parallelism, layers in combos:
      subprocess.run(
        [
          sys.executable,
          os.path.abspath(__file__),
          f"--target={FLAGS.target}",
          f"--parallelism={parallelism}",
          f"--layers={layers}",
        ],
        check=True,
      )
    return
  rows, sections = [], []
  for parallelism in FLAGS.parallelism:
    for layers in (int(n) for n in FLAGS.layers):
      overrides = {**PARALLELISM[parallelism], "base_num_decoder_layers": layers}
      workload = "fsdp" if parallelism == "fsdp" else "tensor_parallel"
      # A fresh cache: no stored compile, no remembered choice.
      with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["JAX_OVERLAP_CACHE_DIR"] = cache_dir
        os.environ.pop("JAX_OVERLAP_COMPILE_CACHE_DIR", None)
        result = maxtext.compare(FLAGS.target, workload=workload, **overrides)
      os.environ.pop("JAX_OVERLAP_CACHE_DIR")
      reports = result["reports"]
      key = f"{FLAGS.target}, {parallelism}, {layers} layers"
      for name, r in reports.items():
        rows.append(
          {
            **r.summary(),
            "variant": name,
            "parallelism": parallelism,
            "layers": layers,
            "batch": BATCH[parallelism],
            "exposed_fraction": r.exposed_fraction,
            "maxtext_overrides": overrides,
            "xla_options": {k: str(v) for k, v in r.xla_options.items()},
          }
        )
      rows[-1]["chosen"] = result["chosen"]
      rows[-1]["selection_time_s"] = result["selection_s"]
      table = jax_overlap.compare(reports)
      sections.append(
        f"### {key}\n\nbatch {BATCH[parallelism]}\n\n{table.to_markdown()}\n\n"
        f"@overlap chose: {result['chosen']} (selection took {result['selection_s']:.0f} s, "
        "a fresh cache).\n"
      )
      print(f"\n{key}\n{table}\nchosen: {result['chosen']} ({result['selection_s']:.0f} s)")
  rows, sections = _merged(rows, sections)
  _common.publish(
    "transform_maxtext",
    {"rows": rows, "target": FLAGS.target, "maxtext_defaults": maxtext.DEFAULTS},
    [
      "# @jax_overlap.overlap on MaxText's train step",
      "",
      "MaxText 0.2.5's own train step (jax_overlap.examples.maxtext: pyconfig with "
      "model_name=llama2-7b, train_compile.get_shaped_inputs, "
      "maxtext_utils.get_functional_train_with_signature): Llama 2 7B's layer, bf16, scanned "
      "layers rematerialised in full, AdamW, sequence 2048, XLA's dot-product attention. "
      "Estimates from jax_overlap.analyze (a deviceless compile for the target); 'XLA "
      "defaults' and 'recommended flags' are the step as written, 'shard_map form' the step "
      "converted to shard_map as @overlap converts it, as written (recommended flags), "
      "'@overlap' the variant its cost model chose. The selection time is the wall clock of a "
      "selection on the machine below with a fresh cache (no stored compile, no remembered "
      "choice; the one-time probe of XLA's tile cache included: the variants its search "
      "compiles, deviceless on the machine's CPU cores beside whatever else ran there), each "
      "row in a process of its own.",
      "",
      *sections,
    ],
  )


def _merged(rows: list, sections: list) -> tuple[list, list]:
  """This run's rows and sections with the earlier results' for the configurations not rerun."""
  done = {(r["target"], r["parallelism"], r["layers"]) for r in rows}
  kept_rows = [
    r
    for r in _common.earlier_rows("transform_maxtext")
    if (r.get("target"), r.get("parallelism"), r.get("layers")) not in done
  ]
  try:
    with open(os.path.join(_common.RESULTS, "transform_maxtext.md")) as f:
      old = f.read().split("\n### ")[1:]
  except OSError:
    old = []
  new_keys = {s.split("\n", 1)[0].removeprefix("### ") for s in sections}
  kept = []
  for s in old:
    s = s.split("\nMachine: ", 1)[0].rstrip("\n")
    if s.split("\n", 1)[0] not in new_keys:
      kept.append("### " + s + "\n")

  def order(s):
    _, parallelism, layers = s.removeprefix("### ").split("\n", 1)[0].split(", ")
    return (parallelism != "fsdp", int(layers.split()[0]))

  return kept_rows + rows, sorted(kept + sections, key=order)


if __name__ == "__main__":
  app.run(main)
