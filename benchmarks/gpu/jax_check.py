"""Checks that a jitted JAX program gives identical outputs with and without shaping.

  python jax_check.py run OUT.npz        # run the program, save its outputs
  python jax_check.py compare A.npz B.npz [WHAT]

``run_all.sh`` runs it once plainly and once under ``jax-overlap launch`` with a
plan that shapes every kernel, then compares. Occupancy shaping only changes
how many blocks share an SM, never what a kernel computes, so the outputs must
be bitwise equal. A third run sets cuBLAS's SM-count target (``plan_library_gemms.json``):
its outputs are compared and reported, not required equal (a target may make cuBLAS choose
another algorithm). Autotuning is turned off (``--xla_gpu_autotune_level=0``) in
both runs so that XLA picks the same kernels whatever their timings.
"""

from __future__ import annotations

import json
import sys


def _program():
  import jax
  import jax.numpy as jnp

  from jax_overlap import runtime

  def layer(x, w):
    return jax.nn.gelu(x @ w)

  shaped_layer = runtime.occupancy(layer, blocks_per_sm=1, name="check")

  def loss(params, x):
    for i, w in enumerate(params):
      x = shaped_layer(x, w) if i % 2 else layer(x, w)
    return jnp.mean(x**2)

  @jax.jit
  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, [w - 0.1 * g for w, g in zip(params, grads)]

  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  params = [jax.random.normal(k, (512, 512), jnp.float32) / 512**0.5 for k in keys[:4]]
  x = jax.random.normal(keys[4], (256, 512), jnp.float32)
  for _ in range(3):
    value, params = step(params, x)
  return {"loss": value, **{f"w{i}": w for i, w in enumerate(params)}}


def run(out: str) -> int:
  import numpy as np

  from jax_overlap import runtime

  outputs = _program()
  np.savez(out, **{k: np.asarray(v) for k, v in outputs.items()})
  s = runtime.status()
  import jax

  print(
    json.dumps(
      {
        "backend": jax.default_backend(),
        "runtime_loaded": s.loaded,
        "launches_seen": s.counters.launches_seen,
        "launches_shaped": s.counters.launches_shaped,
        "graph_nodes_shaped": s.counters.graph_nodes_shaped,
        "launches_fallback": s.counters.launches_fallback,
        "gemm_handles_seen": s.counters.gemm_handles_seen,
        "gemm_handles_targeted": s.counters.gemm_handles_targeted,
        "gemm_descs_seen": s.counters.gemm_descs_seen,
        "gemm_descs_targeted": s.counters.gemm_descs_targeted,
        "gemm_target_errors": s.counters.gemm_target_errors,
      }
    )
  )
  return 0


def compare(a: str, b: str, what: str = "shaping") -> int:
  import numpy as np

  with np.load(a) as x, np.load(b) as y:
    if sorted(x.files) != sorted(y.files):
      print(f"jax_check: different outputs: {sorted(x.files)} vs {sorted(y.files)}")
      return 1
    bad = [k for k in x.files if not np.array_equal(x[k], y[k])]
  if bad:
    print(f"jax_check: outputs differ with {what}: {', '.join(bad)}")
    return 1
  print(f"jax_check: {len(x.files)} outputs identical with and without {what}")
  return 0


def main(argv: list[str]) -> int:
  if len(argv) == 2 and argv[0] == "run":
    return run(argv[1])
  if len(argv) in (3, 4) and argv[0] == "compare":
    return compare(*argv[1:])
  print(__doc__, file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
