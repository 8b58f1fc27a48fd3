"""The overlap transform on a Llama-style FSDP step: deviceless estimates on h100x8 and a100x8.

Deviceless part: 8 layers, bf16, hidden 4096, MLP 11008, sequence 2048, one
sequence per GPU, written with shard_map (jax_overlap.examples.shard_map_fsdp)
in four forms (unrolled, lax.scan, lax.scan under jax.checkpoint,
jax_overlap.fsdp.scan_layers) and as plain jax.jit over sharded arrays (GSPMD:
jax_overlap.examples.fsdp_transformer, unrolled and lax.scan under
jax.checkpoint, the partitioner inserting the collectives), and whole models
with an embedding and an output projection (llama_*: jax_overlap.examples.llama_fsdp,
every weight gathered at each use or once per layer, unrolled or lax.scan +
jax.checkpoint; llama_gspmd; flax: jax_overlap.examples.flax_optax), and three on a
2-D mesh, FSDP over 4 GPUs x tensor parallelism over 2 (gspmd_2d: fsdp_transformer with
its tensor axis; flax_llama_2d: jax_overlap.examples.flax_llama; nnx_llama_2d: the same
model in Flax NNX under nnx.jit, jax_overlap.examples.nnx_llama; explicit_llama_2d: the same
model in plain JAX on Explicit mesh axes, jax_overlap.examples.explicit_llama), compiled
for h100x8 and a100x8 under XLA defaults, the recommended flags, and
@jax_overlap.overlap;
see transform_overhead.py for the decorator's CPU costs.

Writes benchmarks/results/transform_fsdp.{json,md}.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.use_cpu_devices(8)  # before JAX starts

import jax  # noqa: E402
from absl import app  # noqa: E402
from absl import flags as absl_flags  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap.examples import fsdp_transformer as G  # noqa: E402
from jax_overlap.examples import shard_map_fsdp as S  # noqa: E402

FLAGS = absl_flags.FLAGS
absl_flags.DEFINE_list("targets", ["h100x8", "a100x8"], "Targets.")
FORMS = ["unrolled", "scan", "scan_remat", "scan_layers", "gspmd", "gspmd_scan_remat"]
# Whole models (embedding, output projection, next-token loss): jax_overlap.examples.llama_fsdp
# (grouped-query attention, every weight gathered at each use or once per layer, unrolled or
# lax.scan + jax.checkpoint), fsdp_transformer with a vocabulary under plain jax.jit (GSPMD),
# and flax_optax's Linen model with optax AdamW (float32 parameters, as Flax creates them).
# On a 2-D mesh (FSDP over 4 GPUs x tensor parallelism over 2, most weights split along two
# dimensions): fsdp_transformer with its tensor axis (gspmd_2d), flax_llama's Linen
# Llama laid out by logical axis rules with optax AdamW (flax_llama_2d), and the same Llama in
# Flax NNX (nnx_llama: nnx.scan over nnx.remat, nnx.Optimizer, a step under nnx.jit that
# updates the Modules in place; nnx_llama_2d), and in plain JAX with explicit sharding
# (explicit_llama: Explicit mesh axes, weights gathered by jax.sharding.reshard, matmuls over
# split dimensions with out_sharding=; explicit_llama_2d, run under jax.set_mesh).
MODELS = [
  "llama_per_use",
  "llama_per_layer",
  "llama_scan_remat",
  "llama_gspmd",
  "flax",
  "gspmd_2d",
  "flax_llama_2d",
  "nnx_llama_2d",
  "explicit_llama_2d",
]
absl_flags.DEFINE_list(
  "forms",
  FORMS + MODELS,
  "Layer loop forms (gspmd*: plain jax.jit over sharded arrays, no shard_map) and whole "
  "models (llama_*, flax).",
)


def _build(target: str, form: str, cfg: dict):
  if form in MODELS:
    return _build_model(target, form, cfg)
  if form == "gspmd":
    return G.build(target, **cfg)
  if form == "gspmd_scan_remat":
    return G.build(target, scan=True, remat=True, **cfg)
  return S.build(target, form=form, **cfg)


def _build_model(target: str, form: str, cfg: dict):
  sizes = dict(layers=cfg["layers"], seq=cfg["seq"], batch_per_device=cfg["batch_per_device"])
  if form == "flax":
    from jax_overlap.examples import flax_optax

    return flax_optax.build(target, hidden=cfg["hidden"], vocab=32000, **sizes)
  if form == "llama_gspmd":
    return G.build(target, vocab=32000, **cfg)
  if form == "gspmd_2d":
    return G.build(target, tensor_axis="tensor", scan=True, remat=True, **cfg)
  if form == "flax_llama_2d":
    from jax_overlap.examples import flax_llama

    return flax_llama.build(target, **_llama_sizes(cfg))
  if form == "nnx_llama_2d":
    from jax_overlap.examples import nnx_llama

    return nnx_llama.build(target, **_llama_sizes(cfg))
  if form == "explicit_llama_2d":
    from jax_overlap.examples import explicit_llama

    return explicit_llama.build(target, **_llama_sizes(cfg))
  from jax_overlap.examples import llama_fsdp

  loop, gather = {
    "llama_per_use": ("unrolled", "per_use"),
    "llama_per_layer": ("unrolled", "per_layer"),
    "llama_scan_remat": ("scan_remat", "per_use"),
  }[form]
  return llama_fsdp.build(
    target, form=loop, gather=gather, hidden=cfg["hidden"], mlp=cfg["mlp"], **sizes
  )


absl_flags.DEFINE_integer("layers", 8, "Layers.")
absl_flags.DEFINE_integer(
  "batch_per_device",
  1,
  "Sequences per GPU; other than 1 the results go to transform_fsdp_b<N>.{json,md}.",
)


def deviceless(rows, tables):
  cfg = dict(
    layers=FLAGS.layers,
    hidden=4096,
    mlp=11008,
    heads=32,
    seq=2048,
    batch_per_device=FLAGS.batch_per_device,
  )
  for target in FLAGS.targets:
    for form in FLAGS.forms:
      fn, args = _build(target, form, cfg)
      # Explicit mesh axes: the step runs under its mesh, as its script runs it.
      explicit = form == "explicit_llama_2d"
      with jax.set_mesh(_mesh_of(args)) if explicit else contextlib.nullcontext():
        _one(target, form, cfg, fn, args, rows, tables)


def _mesh_of(args):
  from jax_overlap.examples import explicit_llama

  return explicit_llama.mesh_of(args)


def _one(target: str, form: str, cfg: dict, fn, args, rows: list, tables: list) -> None:
  """Analyses one form's step on one target: a section of tables, its rows."""
  reports, ov, expl, select_time = _common.selected(fn, args, target)
  reports["@overlap"] = jax_overlap.analyze(ov, *args, target=target, name="@overlap")
  simulated = {}
  for name, r in reports.items():
    simulated[name] = jax_overlap.sim.realize(r, "priority").results["priority"].makespan_s
    rows.append(
      {
        **r.summary(),
        "variant": name,
        "form": form,
        "exposed_fraction": r.exposed_fraction,
        "vs_compute_bound": r.step_time_s / r.compute_time_s,
        "realize_priority_s": simulated[name],
        "matmul_flops": _matmul_flops(r),
        "xla_options": {k: str(v) for k, v in r.xla_options.items()},
      }
    )
  choice = next((n for n in expl.notes if n.startswith("chosen by the cost model")), "")
  self_judged = expl.chosen.endswith("scheduled by the cost model's estimates")
  chosen = reports["@overlap"]
  tuned = jax_overlap.sim.tune(
    jax_overlap.sim.workload_from_report(chosen), target=target, progress=False, max_evals=24
  )
  levers = _common.levers(expl, chosen, tuned.plan.streams.priority, len(tuned.plan.kernels))
  rows[-1]["levers"] = levers
  rows[-1]["choice"] = choice
  rows[-1]["chosen"] = expl.chosen
  rows[-1]["self_judged"] = self_judged
  rows[-1]["selection_time_s"] = select_time
  table = jax_overlap.compare(reports)
  mark = (
    (
      " @overlap's row is self-judged: its schedule came from a latency profile written "
      "by the cost model that estimates it."
    )
    if self_judged
    else ""
  )
  tables.append(
    f"### {target}, {form}\n\n{table.to_markdown()}\n\n"
    f"step / compute-only bound: "
    + ", ".join(f"{n} {r.step_time_s / r.compute_time_s:.3f}" for n, r in reports.items())
    + "\n\nsim.realize (SM contention, XLA's stream priority): "
    + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in simulated.items())
    + "\n\nmatmul work per GPU (FLOPs of the HLO's dots): "
    + ", ".join(f"{n} {_matmul_flops(r) / 1e12:.2f} TFLOP" for n, r in reports.items())
    + _counted(target, form, cfg)
    + f"\n\n{choice} (selection took {select_time:.0f} s).{mark}\n\nLevers: {levers}.\n"
  )
  print(f"\n{target} {form}\n{table}\n{choice}")


def _matmul_flops(report) -> float:
  """FLOPs of the step's matmul kernels on one GPU, as the analysis counts them from the
  compiled HLO."""
  return float(sum(k.flops for k in report.kernels if k.kind in ("gemm", "convolution")))


def _counted(target: str, form: str, cfg: dict) -> str:
  """The matmul work per GPU counted from the model's shapes, where the example counts it
  (a second estimate of what the compiled step should compute)."""
  if form not in ("flax_llama_2d", "nnx_llama_2d", "explicit_llama_2d"):
    return ""
  from jax_overlap.examples import flax_llama

  c = flax_llama.Config(**_llama_sizes(cfg))
  gpus = jax_overlap.targets.get(target).num_devices
  flops = flax_llama.step_flops(c, data=gpus // c.model_axis) / gpus
  return (
    f"; counted from the model's shapes (flax_llama.step_flops, each block's forward "
    f"recomputed in full): {flops / 1e12:.2f} TFLOP"
  )


def _llama_sizes(cfg: dict) -> dict:
  return dict(
    hidden=cfg["hidden"], mlp=cfg["mlp"], heads=cfg["heads"], kv_heads=8, layers=cfg["layers"],
    seq=cfg["seq"], batch_per_device=cfg["batch_per_device"],
  )  # fmt: skip


def _merged(name: str, rows: list, tables: list) -> tuple[list, list]:
  """This run's rows and sections with those of the earlier results for the targets and
  forms not rerun (a run over some forms updates only their sections)."""
  path = os.path.join(_common.RESULTS, name)
  done = {(r["target"], r["form"]) for r in rows if "target" in r}
  try:
    with open(path + ".json") as f:
      old_rows = json.load(f)["rows"]
    with open(path + ".md") as f:
      old_sections = f.read().split("\n### ")[1:]
  except (OSError, KeyError, ValueError):
    return rows, tables
  kept_rows = [r for r in old_rows if (r.get("target"), r.get("form")) not in done]
  new_keys = {t.split("\n", 1)[0].removeprefix("### ") for t in tables}
  kept = [
    "### " + t.rstrip("\n") + "\n" for t in old_sections if t.split("\n", 1)[0] not in new_keys
  ]
  order = {f"{t}, {f}": (i, j) for i, t in enumerate(["h100x8", "a100x8", *FLAGS.targets])
           for j, f in enumerate(FORMS + MODELS)}  # fmt: skip
  sections = sorted(kept + tables, key=lambda t: order.get(t[4:].split("\n", 1)[0], (99, 99)))
  return kept_rows + rows, sections


def main(argv):
  del argv
  rows, tables = [], []
  deviceless(rows, tables)
  b = FLAGS.batch_per_device
  name = "transform_fsdp" if b == 1 else f"transform_fsdp_b{b}"
  rows, tables = _merged(name, rows, tables)
  payload = {
    "machine": _common.machine(),
    "rows": rows,
    "layers": FLAGS.layers,
    "batch_per_device": b,
  }
  per_gpu = "one sequence per GPU" if b == 1 else f"{b} sequences per GPU"
  md = (
    "# @jax_overlap.overlap on a Llama-style FSDP step\n\n"
    f"{FLAGS.layers} layers, bf16, hidden 4096, MLP 11008, 32 heads, sequence 2048, {per_gpu}; "
    f"shard_map with explicit gathers, and GSPMD (gspmd*: sharded arrays under jax.jit; "
    f"@overlap also tries their shard_map form, variants named 'shard_map form'); whole "
    "models (llama_*: embedding and output projection over a vocabulary of 32000, "
    "grouped-query attention with 8 KV heads, every weight sharded and gathered at each use "
    "(per_use) or once per layer (per_layer), unrolled or lax.scan + jax.checkpoint; "
    "llama_gspmd: the gspmd step with a vocabulary; flax: flax_optax's Linen MLP language "
    "model with optax AdamW, float32 parameters; on a 2-D mesh of FSDP over 4 GPUs x tensor "
    "parallelism over 2, weights split along two dimensions: gspmd_2d, the gspmd step "
    "scanned and rematerialized with its tensor axis, flax_llama_2d, a Linen Llama "
    "(grouped-query attention with 8 KV heads, nn.scan(nn.remat)) laid out by logical axis "
    "rules, optax AdamW with clipping, float32 parameters, one sequence per 2 GPUs; "
    "nnx_llama_2d, the same model in Flax NNX under nnx.jit; explicit_llama_2d, the same "
    "model in plain JAX on Explicit mesh axes, weights gathered by jax.sharding.reshard, "
    "lax.scan + jax.checkpoint, run under jax.set_mesh). "
    f"Machine of the latest run: {payload['machine']} (each section's selection time is "
    "from its own run).\n\n"
    "Estimates from jax_overlap.analyze (deviceless compile for the target, roofline and "
    "alpha-beta costs placed on XLA's schedule). CPU costs of the decorator: "
    "transform_overhead.md.\n\n" + "\n".join(tables)
  )
  print("wrote", _common.write(name, payload, md))


if __name__ == "__main__":
  app.run(main)
