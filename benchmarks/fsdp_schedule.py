"""How XLA schedules scan_layers' collectives on a compile-only GPU mesh, per flag set.

Compiles ``jax.grad`` of a stack of FSDP MLP layers run by
:func:`jax_overlap.fsdp.scan_layers` for a deviceless target (no GPU needed),
and prints, for every while-loop body of the optimized HLO, how many GEMM
fusions each asynchronous all-gather and reduce-scatter brackets (start ...
done), and whether XLA made it synchronous.

Usage::

  JAX_PLATFORMS=cpu python -m benchmarks.fsdp_schedule --prefetch 1
  JAX_PLATFORMS=cpu python benchmarks/fsdp_schedule.py --target h100x8 --layers 6
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap._src.analysis import hlo, schedule
from jax_overlap._src.compile.compiler import compile_for_target
from jax_overlap.fsdp import scan_layers
from jax_overlap.targets import compile_only_mesh

LHS = {"xla_gpu_enable_latency_hiding_scheduler": True}
COMBINE = {
  "xla_gpu_all_gather_combine_threshold_bytes": 1 << 30,
  "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 30,
}
LIMIT2 = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
ANALYTICAL = {"xla_gpu_enable_analytical_latency_estimator": True}

FLAG_SETS = {
  "defaults": {},
  "lhs": LHS,
  "lhs+analytical": {**LHS, **ANALYTICAL},
  "lhs+limit2": {**LHS, **LIMIT2},
  "lhs+combine": {**LHS, **COMBINE},
  "recommended": {**LHS, **COMBINE, **LIMIT2},
  "recommended+analytical": {**LHS, **COMBINE, **LIMIT2, **ANALYTICAL},
  "recommended+pipelined_ag": {
    **LHS,
    **COMBINE,
    **LIMIT2,
    "xla_gpu_enable_pipelined_all_gather": True,
  },
  "recommended+double_buffer": {
    **LHS,
    **COMBINE,
    **LIMIT2,
    "xla_gpu_enable_while_loop_double_buffering": True,
  },
}


def compile_hlo(target: str, layers: int, width: int, batch: int, prefetch: int, flags: dict):
  """The optimized HLO text of grad(scan_layers MLP stack) for ``target``."""
  mesh = compile_only_mesh(target, ("fsdp",))

  def layer(p, c):
    h = jnp.tanh(c @ p["w1"]) @ p["w2"]
    return c + h, None

  specs = {"w1": P(None, "fsdp"), "w2": P(None, "fsdp")}
  fn = jax.shard_map(
    lambda p, c: scan_layers(layer, p, c, prefetch=prefetch)[0],
    mesh=mesh,
    in_specs=(specs, P("fsdp")),
    out_specs=P("fsdp"),
  )
  loss = lambda p, c: jnp.sum(fn(p, c).astype(jnp.float32) ** 2)
  params = {
    n: jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=NamedSharding(mesh, s))
    for n, s in specs.items()
  }
  x = jax.ShapeDtypeStruct((batch, width), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  return compile_for_target(
    jax.jit(jax.grad(loss)), params, x, target=target, xla_options=flags
  ).hlo_text


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--target", default="h100x8")
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--width", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=8192)
  parser.add_argument("--prefetch", type=int, default=1)
  parser.add_argument("--flags", nargs="*", default=list(FLAG_SETS), choices=list(FLAG_SETS))
  args = parser.parse_args(argv)
  for name in args.flags:
    text = compile_hlo(
      args.target, args.layers, args.width, args.batch, args.prefetch, FLAG_SETS[name]
    )
    print(f"== {name}")
    module = hlo.parse_module(text)
    for body in schedule.while_bodies(module):
      found = {b.name: (b.gemms, b.synchronous) for b in schedule.collective_brackets(module, body)}
      print(f"  {body}: {found}")


if __name__ == "__main__":
  main()
