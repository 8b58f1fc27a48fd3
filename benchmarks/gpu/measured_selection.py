"""``@overlap(select="measure")`` on the local GPU: the cost model's best variants of a
one-device step timed on the device, measured beside estimated.

  python measured_selection.py OUT.json [--layers 4] [--hidden 2048] [--dry-run]

The step is the FSDP transformer of ``jax_overlap.examples.shard_map_fsdp`` on a mesh of
the first local device (its gathers are trivial; its variants differ in compute: XLA's
dot merger, the schedules written from latency profiles). With no ``target`` the
decorator resolves the device's own topology (``targets.from_devices``); the selection
compiles its variants deviceless for it, times the best three on the device and keeps the
fastest measured. ``--dry-run`` runs the same on CPU, where nothing is timed (the decorator
says so), then times the same three variants on CPU through ``measure.measured_choice`` to
exercise the timing path.

Writes OUT.json: the device, jax's version, the chosen variant, how it was chosen, each
variant's estimate and, for the timed ones, its measured median step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _concrete(abstract, seed: int = 0):
  import jax
  import jax.numpy as jnp

  leaves, tree = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = [
    jax.device_put((jax.random.normal(k, a.shape, jnp.float32) * 0.02).astype(a.dtype), a.sharding)
    for k, a in zip(keys, leaves)
  ]
  return jax.tree.unflatten(tree, out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--dry-run", action="store_true", help="run on CPU, time on CPU")
  args = parser.parse_args(argv)

  import jax
  import numpy as np
  from jax.sharding import Mesh

  import jax_overlap
  from jax_overlap._src.transform import measure
  from jax_overlap.examples import shard_map_fsdp as S

  device = jax.devices()[0]
  if not args.dry_run and device.platform == "cpu":
    print("measured_selection: no GPU here; use --dry-run", file=sys.stderr)
    return 2
  mesh = Mesh(np.array([device]), ("fsdp",))
  sizes = dict(layers=args.layers, hidden=args.hidden, mlp=args.hidden * 11 // 4)
  sizes.update(heads=max(1, args.hidden // 128), seq=args.seq)
  fn, abstract = S.build(None, mesh=mesh, **sizes)
  params, batch = _concrete(abstract)
  target = "h100x1" if args.dry_run else None  # on a GPU: the device's own topology
  t0 = time.perf_counter()
  step = jax_overlap.overlap(fn, target=target, select="measure", cache=False)
  built = step.build(params, batch)
  seconds = time.perf_counter() - t0
  choice = built.choice
  if args.dry_run:  # the timing path, on CPU
    notes: list[str] = []
    timed = measure.measured_choice(
      choice, lambda c: jax.jit(fn), (params, batch), {}, notes, platforms=("cpu",), steps=2
    )
    choice_rows = timed
  else:
    choice_rows = choice
  measured = dict(choice_rows.measured)
  result = {
    "device": str(device.device_kind),
    "platform": device.platform,
    "jax": jax.__version__,
    "sizes": sizes,
    "dry_run": args.dry_run,
    "selection_s": round(seconds, 1),
    "chosen": choice_rows.name,
    "how": choice_rows.how,
    "variants": [
      {
        "name": e.name,
        "estimate_ms": e.step_time_s * 1e3,
        "measured_ms": (measured[e.name] * 1e3 if e.name in measured else None),
      }
      for e in choice_rows.estimates
    ],
    "notes": built.explanation.notes,
  }
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps({k: result[k] for k in ("device", "chosen", "how", "selection_s")}))
  for row in result["variants"]:
    m = row["measured_ms"]
    print(
      f"  {row['estimate_ms']:9.3f} ms estimated  {'' if m is None else f'{m:9.3f} ms measured'}  {row['name']}"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
