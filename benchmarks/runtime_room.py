"""Where occupancy shaping can make room for an NCCL channel, on the kernels XLA really launches.

The FSDP transformer example is compiled deviceless for each target with ``xla_dump_to``;
each kernel launch's block size and dynamic shared memory come from XLA's thunk listing,
its registers and static shared memory from ``ptxas -v`` on the dumped PTX. For every
launch, the runtime library's rule (``runtime.room_cap``, the same arithmetic as
``jor_room_cap``) says whether any cap leaves room beside its blocks for one communication
block, and if not, which limit stands in the way. Two communication blocks: NCCL's
Simple-protocol channel as launched by default (544 threads) and with ``NCCL_NTHREADS=256``
(288 threads); both built for 96 registers with 82,240 bytes of dynamic shared memory.

No GPU is involved: these are the rule's answers on real launch configurations, not
timings. Deviceless compiles are not autotuned (GEMM fusions get default tiles; cuBLAS
calls are not in the thunk listing's kernels), so GEMM rows describe XLA's default
Triton tiles, not the tuned kernels a GPU would pick.

  python benchmarks/runtime_room.py   # writes benchmarks/results/runtime_room.{json,md}
"""

from __future__ import annotations

import collections
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

TARGETS = {"h100x8": (9, 0), "a100x8": (8, 0)}
# Kernels a deviceless compile does not show: library GEMM tiles as the simulator models
# them (sim.gemm_config, from cuBLAS/CUTLASS kernel names and configurations), and the GPU
# benchmark's own kernels (benchmarks/gpu/overlap_bench.cu; registers from ptxas, sm_90).
MODELLED = {
  "library GEMM tile (sim.gemm_config)": None,
  "loop fusion (overlap_bench: 256 threads, 19 regs)": (256, 19, 0, 0),
  "attention tile (overlap_bench: 128 threads, 32 regs, 48 KB)": (128, 32, 0, 49152),
}
CHANNELS = {"NCCL default (544 threads)": 544, "NCCL_NTHREADS=256 (288 threads)": 288}


def launches(target: str, cc: tuple[int, int]):
  """(kind, launch name, threads, dynamic smem, registers, static smem) per kernel launch."""
  from jax_overlap._src.analysis import analyze as analysis
  from jax_overlap._src.compile import compiler as compile_lib
  from jax_overlap._src.compile import ptx
  from jax_overlap.examples import fsdp_transformer

  fn, args = fsdp_transformer.build(target)
  step = compile_lib.compile_for_target(fn, *args, target=target, keep_dump=True)
  try:
    report = analysis.analyze_compiled(step)
    res = ptx.kernel_resources(step.dump_dir, cc)
  finally:
    shutil.rmtree(step.dump_dir, ignore_errors=True)
  out = []
  for k in report.kernels:
    if k.launch_name and k.launch_name in res and k.threads_per_block > 0:
      r = res[k.launch_name]
      out.append(
        (k.kind, k.launch_name, k.threads_per_block, k.smem_bytes, r.registers, r.static_smem)
      )
  return out


def main() -> int:
  from jax_overlap import runtime
  from jax_overlap._src import targets

  if shutil.which("ptxas") is None:
    print("runtime_room.py: needs ptxas (CUDA toolkit)", file=sys.stderr)
    return 1
  rows, summary = [], []
  for target, cc in TARGETS.items():
    gpu = targets.get(target).gpu
    ls = launches(target, cc)
    by_kind = collections.defaultdict(list)
    for item in ls:
      by_kind[item[0]].append(item)
    for kind, items in sorted(by_kind.items()):
      row = {
        "target": target,
        "gpu": gpu.name,
        "kind": kind,
        "launches": len(items),
        "natural_blocks_per_sm": sorted(
          {runtime.blocks_per_sm(gpu, t, g, s + d) for _, _, t, d, g, s in items}
        ),
        "registers": [min(x[4] for x in items), max(x[4] for x in items)],
      }
      for label, threads in CHANNELS.items():
        comm = runtime.CommBlock.nccl(gpu, threads)
        caps, limits = collections.Counter(), collections.Counter()
        for _, _, t, d, g, s in items:
          natural = runtime.blocks_per_sm(gpu, t, g, s + d)
          cap, why = runtime.room_cap(gpu, comm, t, g, s, d, max(natural, 1))
          caps[cap] += 1
          limits.update(why)
        row[label] = {
          "with_room": sum(n for c, n in caps.items() if c > 0),
          "room_caps": {str(c): n for c, n in sorted(caps.items()) if c > 0},
          "no_room_limits": dict(limits),
        }
      rows.append(row)
    summary.append((target, len(ls)))
  modelled = []
  for name in ("a40", "a100", "h100", "h200"):
    gpu = targets.get_gpu(name)
    for label, cfg in MODELLED.items():
      if cfg is None:
        from jax_overlap import sim

        g = sim.gemm_config(gpu, 8192, 8192, 8192, "bf16")
        cfg = (g.threads, g.regs, 0, g.smem)
      t, regs, static, dyn = cfg
      natural = runtime.blocks_per_sm(gpu, t, regs, static + dyn)
      entry = {"gpu": name, "kernel": label, "config": cfg, "natural_blocks_per_sm": natural}
      for ch, threads in CHANNELS.items():
        cap, why = runtime.room_cap(
          gpu, runtime.CommBlock.nccl(gpu, threads), t, regs, static, dyn, natural
        )
        entry[ch] = {"cap": cap, "limits": list(why)}
      modelled.append(entry)
  md = [
    "# Room for an NCCL channel beside the kernels of a real compiled step",
    "",
    "FSDP transformer example (`jax_overlap.examples.fsdp_transformer`), compiled deviceless; "
    "launch configurations from XLA's thunk listing, registers from ptxas on XLA's PTX; the "
    "answer is the runtime library's room rule (`runtime.room_cap`), not a timing. "
    "Launches per target: " + ", ".join(f"{t} {n}" for t, n in summary) + ".",
    "",
    "| target | kind | launches | blocks/SM | registers | with room (544 thr) | caps | "
    "limits in the way | with room (288 thr) | limits in the way |",
    "|---|---|---:|---|---|---:|---|---|---:|---|",
  ]
  a, b = CHANNELS
  for r in rows:
    md.append(
      f"| {r['target']} | {r['kind']} | {r['launches']} | {r['natural_blocks_per_sm']} | "
      f"{r['registers'][0]}-{r['registers'][1]} | {r[a]['with_room']} | {r[a]['room_caps']} | "
      f"{r[a]['no_room_limits'] or '-'} | {r[b]['with_room']} | {r[b]['no_room_limits'] or '-'} |"
    )
  md += [
    "",
    "Kernels a deviceless compile does not show (one 8192^3 bf16 GEMM tile as the simulator "
    "models cuBLAS/CUTLASS; the GPU benchmark's own kernels):",
    "",
    "| gpu | kernel | blocks/SM | largest cap with room (544 thr) | limits | (288 thr) | limits |",
    "|---|---|---:|---:|---|---:|---|",
  ]
  for e in modelled:
    md.append(
      f"| {e['gpu']} | {e['kernel']} | {e['natural_blocks_per_sm']} | {e[a]['cap'] or 'none'} | "
      f"{', '.join(e[a]['limits']) or '-'} | {e[b]['cap'] or 'none'} | "
      f"{', '.join(e[b]['limits']) or '-'} |"
    )
  md += [
    "",
    "`caps`: how many launches get each largest cap with room (1 = one block per SM beside "
    "the channel). `limits in the way` counts, over launches with no room, the limits that "
    "fail at one block per SM (a launch can count under several).",
  ]
  _common.write(
    "runtime_room",
    {"rows": rows, "modelled": modelled, "channels": CHANNELS, "machine": _common.machine()},
    "\n".join(md),
  )
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
