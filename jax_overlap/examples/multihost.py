"""Multi-process training with @jax_overlap.overlap on JAX's own distributed runtime.

One process per host (here: per group of CPU devices), all running this script::

  python -m jax_overlap.examples.multihost --coordinator=10.0.0.1:1234 \\
      --num_processes=2 --process_id=0 --local_devices=4 [--steps=3] [--mesh=4x2] [--out=...] \\
      [--target=h100x8]

The mesh is fsdp x tensor over every process's devices: ``--mesh`` as given, or by default
2-way tensor parallel and the rest FSDP (2 processes x 4 devices: 4x2; 2 hosts x 8 GPUs: 8x2).

Each process calls ``jax.distributed.initialize``; the mesh spans every
process's devices, parameters and batches are global arrays assembled from the
same host data on every process, and the decorated GPT step runs as one SPMD
program. With ``--target``, ``@overlap`` chooses among its variants for that GPU target:
process 0 chooses (from its selection cache or its deviceless compiles) and every process
runs its choice, printed as ``chosen`` beside the losses. On CPU, collectives across processes use gloo. On a GPU cluster leave
``--local_devices`` at 0 (use the GPUs) and launch one process per host with
your cluster launcher (see the README's multi-host recipe).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("coordinator", "127.0.0.1:12345", "host:port of process 0.")
flags.DEFINE_integer("num_processes", 2, "Number of processes.")
flags.DEFINE_integer("process_id", 0, "This process's index.")
flags.DEFINE_integer("local_devices", 4, "CPU devices per process (0: use the platform's devices).")
flags.DEFINE_integer("steps", 3, "Training steps.")
flags.DEFINE_string(
  "mesh",
  "",
  "fsdp x tensor mesh over all processes' devices, e.g. 8x2; empty: derived from the device "
  "count (tensor 2 where the count is even, fsdp the rest).",
)
flags.DEFINE_string("out", "", "Write the losses here (process 0).")
flags.DEFINE_integer("timeout_s", 60, "Give up if the other processes do not join within this.")
flags.DEFINE_bool("overlap", True, "Decorate the step with @jax_overlap.overlap.")
flags.DEFINE_string(
  "target", "", "Choose among @overlap's variants for this GPU target (e.g. h100x8)."
)


def mesh_shape(spec: str, device_count: int) -> tuple[int, int]:
  """The (fsdp, tensor) mesh: ``spec`` as written ("4x2"), or derived from the device count.

  Example:
    >>> mesh_shape("", 16), mesh_shape("", 8), mesh_shape("", 1), mesh_shape("2x1", 8)
    ((8, 2), (4, 2), (1, 1), (2, 1))
  """
  if spec:
    f, t = (int(v) for v in spec.split("x"))
    return f, t
  t = 2 if device_count % 2 == 0 else 1
  return device_count // t, t


def run_training(
  steps: int,
  mesh_shape: tuple[int, int],
  overlap: bool,
  target: str | None = None,
  explained: list | None = None,
) -> list[float]:
  """Trains the demo GPT on a global mesh; returns the losses (same on every process).

  ``target``: the GPU target ``@overlap`` chooses its variant for (None: no choice).
  ``explained``: if given, the decorated step's ``explain()`` is appended to it.
  """
  import jax
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_overlap
  from jax_overlap.examples import gpt

  mesh = jax.make_mesh(mesh_shape, ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
  cfg = gpt.Config(layers=2, hidden=64, heads=4, mlp=128, seq=16, batch=16)
  # Host data identical on every process; each process supplies its own shards.
  host_params = jax.tree.map(np.asarray, jax.device_get(_host_init(cfg)))
  specs = gpt.param_specs(cfg)

  def global_array(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  params = jax.tree.map(global_array, host_params, specs, is_leaf=lambda s: isinstance(s, P))
  opt = {
    "m": jax.tree.map(lambda p: global_array(np.zeros(p.shape, p.dtype), p.sharding.spec), params),
    "v": jax.tree.map(lambda p: global_array(np.zeros(p.shape, p.dtype), p.sharding.spec), params),
    "count": global_array(np.zeros((), np.int32), P()),
  }
  step = gpt.make_train_step(cfg, mesh)
  step = jax_overlap.overlap(step, target=target) if overlap else jax.jit(step)
  source = gpt.token_batches(cfg, seed=0)
  losses = []
  for _ in range(steps):
    tokens = global_array(next(source), P("fsdp"))
    if explained is not None and not losses and overlap:
      explained.append(step.explain(params, opt, tokens))
    params, opt, loss = step(params, opt, tokens)
    losses.append(float(np.asarray(jax.device_get(loss))))
  return losses


def _host_init(cfg):
  """Parameters computed on one local device (the same on every process)."""
  import jax
  import numpy as np

  from jax_overlap.examples import gpt

  mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
  return gpt.init_params(cfg, mesh, jax.random.key(0))


def main(argv) -> None:
  del argv
  if FLAGS.local_devices:
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jax_overlap.examples.cpu_devices import use_cpu_devices

    use_cpu_devices(FLAGS.local_devices)
  import jax

  if FLAGS.local_devices:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  print(
    f"multihost: joining {FLAGS.coordinator} as process {FLAGS.process_id} of "
    f"{FLAGS.num_processes} (timeout {FLAGS.timeout_s} s)",
    file=sys.stderr,
    flush=True,
  )
  try:
    jax.distributed.initialize(
      coordinator_address=FLAGS.coordinator,
      num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id,
      initialization_timeout=FLAGS.timeout_s,
    )
  except Exception as e:  # noqa: BLE001 - report and exit non-zero, never hang
    print(
      f"multihost: process {FLAGS.process_id} could not join {FLAGS.coordinator} within "
      f"{FLAGS.timeout_s} s: {str(e).splitlines()[0]}",
      file=sys.stderr,
      flush=True,
    )
    sys.exit(3)
  f, t = mesh_shape(FLAGS.mesh, jax.device_count())
  if f * t != jax.device_count():
    print(
      f"multihost: mesh {FLAGS.mesh} needs {f * t} devices, the processes have "
      f"{jax.device_count()}",
      file=sys.stderr,
    )
    sys.exit(2)
  explained: list = []
  losses = run_training(FLAGS.steps, (f, t), FLAGS.overlap, FLAGS.target or None, explained)
  result = {"process": jax.process_index(), "losses": losses}
  if explained:
    result.update(chosen=explained[0].chosen, notes=explained[0].notes)
  print(json.dumps(result), flush=True)
  if FLAGS.out and jax.process_index() == 0:
    with open(FLAGS.out, "w") as fh:
      json.dump(losses, fh)
  jax.distributed.shutdown()


if __name__ == "__main__":
  app.run(main)
