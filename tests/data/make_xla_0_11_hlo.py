"""Writes xla_0_11_2_scanned_fsdp_h100.hlo.gz: a scanned FSDP step (jax_overlap.examples.
shard_map_fsdp, form "scan", 4 layers, hidden 256) as XLA 0.11.2 compiles it for h100x8
(deviceless; latency-hiding scheduler, loop pipeliner off). XLA 0.11's text differs from
0.10's in ways the HLO reader has to follow: tuple elements as operands (``%param.3#1``)
instead of get-tuple-element instructions, and fusions issued as ``async-start``.

Run with jax/jaxlib 0.11.2 and jax-cuda13-plugin 0.11.2 installed:
  JAX_PLATFORMS=cpu python tests/data/make_xla_0_11_hlo.py
"""

import gzip
import os

import jaxlib

import jax_overlap
from jax_overlap._src.compile import compiler as compile_lib
from jax_overlap.examples import shard_map_fsdp

CONFIG = dict(form="scan", layers=4, hidden=256, mlp=704, heads=4, seq=256)
PIPELINER_OFF = {
  f"xla_gpu_enable_pipelined_{k}": False for k in ("all_gather", "reduce_scatter", "all_reduce")
}


def options():
  return jax_overlap.flags.as_compiler_options(target="h100x8", xla_options=PIPELINER_OFF)


def main():
  assert jaxlib.__version__ == "0.11.2", jaxlib.__version__
  fn, args = shard_map_fsdp.build("h100x8", **CONFIG)
  step = compile_lib.compile_for_target(fn, *args, target="h100x8", xla_options=options())
  path = os.path.join(os.path.dirname(__file__), "xla_0_11_2_scanned_fsdp_h100.hlo.gz")
  with gzip.open(path, "wt") as f:
    f.write(step.hlo_text)
  print(path, len(step.hlo_text))


if __name__ == "__main__":
  main()
