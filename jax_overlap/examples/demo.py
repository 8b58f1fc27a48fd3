"""The jax_overlap demo: see how a sharded training step will overlap on GPUs.

  make demo            # or: python -m jax_overlap.examples.demo --target h100x8

Steps:
  1. the recommended, version-checked XLA options for the target;
  2. a Llama-style FSDP transformer step compiled deviceless for the target,
     analysed under XLA defaults and under the recommended options;
  3. timelines (PNG), a Perfetto trace, the report JSON and a summary written
     to --out (default ./demo_out).
"""

from __future__ import annotations

import os
import shlex
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "h100x8", "GPU topology to analyse for (h100x8, a100x8, h200x16...).")
flags.DEFINE_string("out", "demo_out", "Directory for the outputs.")
flags.DEFINE_integer("layers", 4, "Decoder layers.")
flags.DEFINE_integer("hidden", 2048, "Hidden size.")
flags.DEFINE_integer("mlp", 5632, "MLP size.")
flags.DEFINE_integer("heads", 16, "Attention heads.")
flags.DEFINE_integer("seq", 1024, "Sequence length.")
flags.DEFINE_bool("scan", False, "Stack the layers and lax.scan over them.")


def _section(title: str) -> None:
  print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def main(argv) -> None:
  del argv
  import jax_overlap
  from jax_overlap.examples import fsdp_transformer

  os.makedirs(FLAGS.out, exist_ok=True)
  target = FLAGS.target

  _section(f"1. Recommended XLA options for {target} (checked against this jaxlib)")
  opts = jax_overlap.flags.recommended(target, "fsdp")
  xla = {k: v for k, v in opts.items() if jax_overlap.flags.REGISTRY[k].kind == "xla"}
  print("export XLA_FLAGS=" + shlex.quote(jax_overlap.flags.format_xla_flags(xla)))
  for k, v in opts.items():
    if jax_overlap.flags.REGISTRY[k].kind == "env":
      print(f"export {k}={v}")
  stale = "--xla_gpu_enable_async_all_gather=true --xla_gpu_graph_level=0"
  print(f"\nA recipe with stale flags ({stale}) would abort at backend start; validate() says:")
  for p in jax_overlap.flags.validate(stale):
    print(f"  {p}")

  _section(f"2. Deviceless analysis of an FSDP transformer step on {target}")
  cfg = dict(layers=FLAGS.layers, hidden=FLAGS.hidden, mlp=FLAGS.mlp, heads=FLAGS.heads,
             seq=FLAGS.seq, scan=FLAGS.scan)
  print(f"model: {cfg}")
  fn, args = fsdp_transformer.build(target, **cfg)
  t0 = time.perf_counter()
  base = jax_overlap.analyze(fn, *args, target=target, name="XLA defaults")
  rec = jax_overlap.analyze(
      fn, *args, target=target, name="recommended flags",
      xla_options=jax_overlap.flags.as_compiler_options(target, "fsdp"),
  )
  print(f"(two deviceless compiles and analyses in {time.perf_counter() - t0:.1f} s)\n")
  print(rec)
  print()
  table = jax_overlap.compare([base, rec])
  print(table)

  _section("3. Outputs")
  paths = {
      "timeline, XLA defaults": base.plot(os.path.join(FLAGS.out, "timeline_defaults.png")),
      "timeline, recommended flags": rec.plot(os.path.join(FLAGS.out, "timeline_recommended.png")),
      "Perfetto trace (ui.perfetto.dev)": rec.to_perfetto(os.path.join(FLAGS.out, "trace_recommended.json")),
      "report JSON": os.path.join(FLAGS.out, "report_recommended.json"),
      "summary": os.path.join(FLAGS.out, "summary.md"),
  }
  rec.to_json(paths["report JSON"])
  with open(paths["summary"], "w") as f:
    f.write(f"# jax_overlap demo on {target}\n\nModel: {cfg}\n\n{table.to_markdown()}\n")
  for what, p in paths.items():
    print(f"  {what:34s} {p}")


if __name__ == "__main__":
  app.run(main)
