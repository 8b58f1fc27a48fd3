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
import glob
import re
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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


def while_bodies(text: str) -> dict[str, list[str]]:
  """Instruction lines of every while-loop body computation in an HLO text."""
  comps: dict[str, list[str]] = {}
  cur = None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%(\S+) ", line)
    if m and line.rstrip().endswith("{"):
      cur = m.group(1)
      comps[cur] = []
    elif line.startswith("}"):
      cur = None
    elif cur:
      comps[cur].append(line)
  names = re.findall(r"while\(.*?body=%([\w.\-]+)", text)
  return {n: comps[n] for n in names if n in comps}


def bracketed(lines: list[str]) -> dict[str, tuple[int, bool]]:
  """For each async all-gather / reduce-scatter start: (GEMMs before its done, is_sync)."""
  events = []
  for line in lines:
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\(", line)
    if not m:
      continue
    name, op = m.groups()
    sync = '"is_sync":true' in line
    if op == "fusion" and "gemm" in name:
      events.append((name, "gemm", sync))
    elif op in ("all-gather-start", "all-gather-done"):
      events.append((name, op.rsplit("-", 1)[1], sync))
    elif op in ("async-start", "async-done") and "reduce-scatter" in name:
      events.append((name, op.rsplit("-", 1)[1], sync))
  out = {}
  for i, (name, kind, sync) in enumerate(events):
    if kind == "start":
      done = name.replace("start", "done")
      j = next((j for j in range(i, len(events)) if events[j][0] == done), len(events))
      out[name] = (sum(1 for e in events[i:j] if e[1] == "gemm"), sync)
  return out


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
  with tempfile.TemporaryDirectory() as d:
    jax.jit(jax.grad(loss)).lower(params, x).compile({"xla_dump_to": d, **flags})
    (path,) = glob.glob(d + "/*gpu_after_optimizations.txt")
    with open(path) as f:
      return f.read()


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
    for body, lines in while_bodies(text).items():
      print(f"  {body}: {bracketed(lines)}")


if __name__ == "__main__":
  main()
