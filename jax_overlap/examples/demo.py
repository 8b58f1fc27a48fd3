"""The jax_overlap demo: train with overlap, see the GPU schedule, tune the runtime controls.

  make demo            # or: python -m jax_overlap.examples.demo [--steps 50] [--target h100x8]

1. Trains a small GPT-style decoder on a 4x2 (fsdp x tensor) mesh of 8 CPU
   devices, once with plain ``jax.jit`` and once with ``@jax_overlap.overlap``;
   the two loss curves must match.
2. Compiles the same train step (the same architecture at a GPU-sized
   configuration) deviceless for the target and compares XLA defaults, the
   recommended flags and the transformed step.
3. Runs the SM-level simulator's tuner on the transformed step's kernel
   sequence: predicted gain of communication priority + occupancy shaping, and
   the runtime plan for ``jax-overlap launch --plan``.
4. Writes timelines (PNG), a Perfetto trace, the plan and a summary to --out.
"""

from __future__ import annotations

import os

# The demo trains on 8 virtual CPU devices; set this before JAX starts.
from jax_overlap.examples.cpu_devices import use_cpu_devices  # noqa: E402 - imports no JAX

use_cpu_devices(8)

import json  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 50, "Training steps per run.")
flags.DEFINE_string(
  "target", "h100x8", "GPU topology for the analysis (h100x8, a100x8, h200x16...)."
)
flags.DEFINE_string("out", "demo_out", "Directory for the outputs.")
flags.DEFINE_string("mesh", "4x2", "CPU training mesh, fsdp x tensor.")
flags.DEFINE_integer("layers", 2, "Decoder layers (training run).")
flags.DEFINE_integer("hidden", 128, "Hidden size (training run).")
flags.DEFINE_integer("gpu_layers", 4, "Decoder layers of the configuration analysed for the GPU.")
flags.DEFINE_integer("gpu_hidden", 2048, "Hidden size of the configuration analysed for the GPU.")
flags.DEFINE_integer("gpu_seq", 1024, "Sequence length of the configuration analysed for the GPU.")
flags.DEFINE_integer("gpu_batch", 16, "Global batch of the configuration analysed for the GPU.")
flags.DEFINE_bool("tune", True, "Run the simulator's tuner.")


def _section(title: str) -> None:
  print(f"\n== {title} " + "=" * max(0, 72 - len(title)), flush=True)


def _progress(total: int, desc: str):
  try:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
  except ImportError:
    return None


def train(step_fn, params, opt, batches, mesh, steps: int, desc: str):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  losses, times = [], []
  bar = _progress(steps, desc)
  for i in range(steps):
    tokens = jax.device_put(batches[i], NamedSharding(mesh, P("fsdp")))
    t0 = time.perf_counter()
    params, opt, loss = step_fn(params, opt, tokens)
    loss = float(loss)
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    if bar is not None:
      bar.set_postfix(loss=f"{loss:.4f}", step_ms=f"{times[-1] * 1e3:.1f}")
      bar.update(1)
    elif i % 10 == 0 or i == steps - 1:
      print(f"  {desc} step {i:3d}  loss {loss:.4f}  {times[-1] * 1e3:.1f} ms", flush=True)
  if bar is not None:
    bar.close()
  return params, losses, times


def main(argv) -> None:
  del argv
  import jax
  import numpy as np
  from jax.sharding import AxisType

  import jax_overlap
  from jax_overlap.examples import gpt

  os.makedirs(FLAGS.out, exist_ok=True)
  target = FLAGS.target
  t_start = time.perf_counter()
  try:
    f, t = (int(v) for v in FLAGS.mesh.lower().split("x"))
  except ValueError:
    raise app.UsageError(f"--mesh must look like 4x2 (fsdp x tensor), got {FLAGS.mesh!r}") from None
  if f * t != len(jax.devices()):
    raise app.UsageError(f"--mesh {FLAGS.mesh} needs {f * t} devices, have {len(jax.devices())}")

  # ---------------------------------------------------------------- 1. train
  _section(f"1. Train a GPT on a {f}x{t} (fsdp x tensor) mesh of CPU devices, plain and @overlap")
  mesh = jax.make_mesh((f, t), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
  cfg = gpt.Config(layers=FLAGS.layers, hidden=FLAGS.hidden, heads=max(t, 4))
  print(f"model: {cfg}")
  params = gpt.init_params(cfg, mesh, jax.random.key(0))
  opt = gpt.init_opt_state(params)
  source = gpt.token_batches(cfg, seed=0)
  batches = [next(source) for _ in range(FLAGS.steps)]
  step = gpt.make_train_step(cfg, mesh)
  _, plain_losses, plain_times = train(
    jax.jit(step), params, opt, batches, mesh, FLAGS.steps, "jax.jit "
  )
  ov_step = jax_overlap.overlap(step)
  _, ov_losses, ov_times = train(ov_step, params, opt, batches, mesh, FLAGS.steps, "@overlap")
  diff = float(np.max(np.abs(np.array(plain_losses) - np.array(ov_losses))))
  print(
    f"loss {plain_losses[0]:.4f} -> {plain_losses[-1]:.4f}; largest difference between the two "
    f"curves: {diff:.3g}"
  )
  med_plain, med_ov = float(np.median(plain_times[1:])), float(np.median(ov_times[1:]))
  print(
    f"median step time: jit {med_plain * 1e3:.1f} ms, @overlap {med_ov * 1e3:.1f} ms (CPU; "
    "XLA:CPU runs collectives synchronously, so no overlap is expected here)"
  )
  explanation = ov_step.explain(params, opt, jax.numpy.asarray(batches[0]))
  print(explanation)

  # ---------------------------------------------------------- 2. analysis
  _section(f"2. The same step compiled deviceless for {target}")
  # seq + 1 tokens give seq positions of next-token prediction.
  gcfg = dict(
    layers=FLAGS.gpu_layers,
    hidden=FLAGS.gpu_hidden,
    heads=16,
    mlp=4 * FLAGS.gpu_hidden,
    seq=FLAGS.gpu_seq + 1,
    batch=FLAGS.gpu_batch,
    vocab=32000,
    dtype="bfloat16",
  )
  print(f"GPU-sized configuration: {gcfg}")
  fn, args = gpt.build(target, **gcfg)
  reports = {}
  reports["XLA defaults"] = jax_overlap.analyze(fn, *args, target=target, name="XLA defaults")
  reports["recommended flags"] = jax_overlap.analyze(
    fn,
    *args,
    target=target,
    name="recommended flags",
    xla_options=jax_overlap.flags.as_compiler_options(target=target, workload="hybrid"),
  )
  ov_gpu = jax_overlap.overlap(fn, target=target, workload="hybrid")
  reports["@overlap"] = jax_overlap.analyze(ov_gpu, *args, target=target, name="@overlap")
  table = jax_overlap.compare(reports)
  print(table)
  chosen = ov_gpu.explain(*args)
  if chosen.candidates:
    print("\n@overlap's variants, estimated by the cost model:")
    width = max(len(name) for name, _ in chosen.candidates)
    for name, t_ in chosen.candidates:
      est = f"{t_ * 1e3:8.3f} ms" if t_ != float("inf") else "did not compile (see explain())"
      print(f"  {'*' if name == chosen.chosen else ' '} {name:{width}s} {est}")

  # ------------------------------------------------------------ 3. tuner
  tune_summary = {}
  if FLAGS.tune:
    _section("3. Occupancy shaping and communication priority, simulated on the SMs")
    best = reports["@overlap"]
    real = jax_overlap.sim.realize(best)
    print(real.table() if hasattr(real, "table") else real)
    workload = jax_overlap.sim.workload_from_report(best)
    res = jax_overlap.sim.tune(workload, target=target, progress=False)
    print(
      f"\npredicted step time as XLA runs it (collective streams at the highest priority) "
      f"{res.baseline_s * 1e3:.3f} ms, with the tuned plan {res.makespan_s * 1e3:.3f} ms: "
      f"gain {res.gain * 100:.1f}% ({res.evaluations} simulations, {res.method})"
    )
    if res.no_room:
      why = sorted({w for ws in res.no_room.values() for w in ws})
      print(
        f"{len(res.no_room)} kernel(s) beside collectives leave no room for an NCCL channel "
        f"at any cap ({', '.join(why)}-limited): the plan does not cap them"
      )
    if res.plan is None:
      print(f"no runtime plan: {target} is not an NVIDIA target (the tuned policy: {res.policy})")
    else:
      plan_path = os.path.join(FLAGS.out, "plan.json")
      res.plan.to_json(plan_path)
      print(
        f"plan for `jax-overlap launch --plan {plan_path} -- python train.py`: "
        f"{json.dumps(res.plan.to_dict())[:300]}"
      )
      # The rules name kernels as the driver reports them: check them against the compiled step.
      check = jax_overlap.runtime.check_plan(res.plan, best)
      print(f"plan check against the compiled step: {check}")
    # Settings that cannot be set per compile, judged on the same step.
    print("environment settings judged on this step (simulated):")
    for v in jax_overlap.flags.judge_environment(best):
      print(f"  {v.why.split(' (the simulator')[0]}")
    tune_summary = {
      "baseline": res.baseline,
      "baseline_ms": res.baseline_s * 1e3,
      "tuned_ms": res.makespan_s * 1e3,
      "no_room": len(res.no_room),
      "gain": res.gain,
    }
    if res.plan is not None:
      tune_summary["plan"] = plan_path
      tune_summary["rules_matching_nothing"] = list(check.unmatched)
    try:
      sim_res = jax_overlap.sim.simulate(workload, target=target, policy=res.policy, record=True)
      jax_overlap.sim.plot(sim_res, os.path.join(FLAGS.out, "sm_occupancy.png"))
    except Exception as e:  # noqa: BLE001 - a picture must not fail the demo
      print(f"(simulator plot skipped: {e})")

  # ------------------------------------------------------------ 4. outputs
  _section("4. Outputs")
  paths = {}
  for name, r in reports.items():
    slug = name.replace(" ", "_").replace("@", "")
    paths[f"timeline, {name}"] = r.plot(os.path.join(FLAGS.out, f"timeline_{slug}.png"))
  paths["Perfetto trace (ui.perfetto.dev)"] = reports["@overlap"].to_perfetto(
    os.path.join(FLAGS.out, "trace_overlap.json")
  )
  if tune_summary.get("plan"):
    paths["runtime plan"] = tune_summary["plan"]
  if FLAGS.tune and os.path.exists(os.path.join(FLAGS.out, "sm_occupancy.png")):
    paths["SM occupancy (simulated)"] = os.path.join(FLAGS.out, "sm_occupancy.png")
  summary = os.path.join(FLAGS.out, "summary.md")
  with open(summary, "w") as fh:
    fh.write(
      f"# jax_overlap demo\n\n## Training on {FLAGS.mesh} CPU devices\n\n"
      f"{cfg}\n\nloss {plain_losses[0]:.4f} -> {plain_losses[-1]:.4f} over {FLAGS.steps} steps; "
      f"largest difference between jit and @overlap curves {diff:.3g}\n\n"
      f"## Deviceless analysis on {target}\n\n{gcfg}\n\n{table.to_markdown()}\n"
      + (f"\n## Tuned runtime controls\n\n{json.dumps(tune_summary)}\n" if tune_summary else "")
    )
  paths["summary"] = summary
  with open(os.path.join(FLAGS.out, "losses.json"), "w") as fh:
    json.dump({"jit": plain_losses, "overlap": ov_losses}, fh)
  for what, p in paths.items():
    print(f"  {what:34s} {p}")
  print(f"\ndone in {time.perf_counter() - t_start:.0f} s")
  if diff > 1e-5:
    raise SystemExit(f"the loss curves differ by {diff}: the transform changed the arithmetic")


if __name__ == "__main__":
  app.run(main)
