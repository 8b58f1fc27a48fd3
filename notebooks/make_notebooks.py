"""Writes the tutorial notebooks (run it after changing a cell; `make test` executes them)."""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = """import os
# 8 virtual CPU devices, set before JAX starts (the notebooks run without a GPU).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
import jax, jax.numpy as jnp, numpy as np
import jax_overlap
print(jax.__version__, jax.device_count(), "devices")"""

NOTEBOOKS = {
    "01_quickstart.ipynb": [
        new_markdown_cell(
            "# jax_overlap quick start\n\n"
            "Decorate a sharded training step with `@jax_overlap.overlap`, check that it computes "
            "the same numbers, see what it rewrote, and estimate on a laptop how the step "
            "schedules on 8 H100s."
        ),
        new_code_cell(SETUP),
        new_markdown_cell(
            "A Llama-style decoder written with `shard_map`: every weight is sharded over `fsdp` "
            "and all-gathered in the layer that uses it; autodiff turns each gather into a "
            "gradient reduce-scatter."
        ),
        new_code_cell(
            """from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jax_overlap.examples import shard_map_fsdp as S

mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
cfg = S.Config(layers=3, hidden=64, mlp=128, heads=4, seq=16, dtype="float32", learning_rate=0.1)
params = S.init_params(cfg, mesh, jax.random.key(0))
x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 16, 64)), NamedSharding(mesh, P("fsdp")))
step = S.make_step(cfg, mesh)

plain = jax.jit(step)
fast = jax_overlap.overlap(step, prefetch=1)
a = b = params
for i in range(3):
    a, la = plain(a, x)
    b, lb = fast(b, x)
    print(f"step {i}: jit {float(la):.6f}  overlap {float(lb):.6f}")
assert all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))"""
        ),
        new_markdown_cell("What the transform did, and why:"),
        new_code_cell("print(fast.explain(params, x))"),
        new_markdown_cell(
            "The same step compiled deviceless for 8xH100: XLA defaults, the recommended flags, "
            "and the transform (which compiles its variants for the target and keeps the one the "
            "cost model estimates fastest)."
        ),
        new_code_cell(
            """fn, args = S.build("h100x8", layers=2, hidden=1024, mlp=2816, heads=8, seq=512)
reports = {
    "XLA defaults": jax_overlap.analyze(fn, *args, target="h100x8"),
    "recommended flags": jax_overlap.analyze(fn, *args, target="h100x8",
                                             xla_options=jax_overlap.flags.as_compiler_options(target="h100x8")),
    "@overlap": jax_overlap.analyze(jax_overlap.overlap(fn, target="h100x8"), *args, target="h100x8"),
}
print(jax_overlap.compare(reports))"""
        ),
        new_code_cell(
            """print(jax_overlap.flags.validate("--xla_gpu_enable_async_all_gather=true --xla_gpu_enable_latency_hiding_scheduler=true"))"""
        ),
    ],
    "02_schedule_analysis.ipynb": [
        new_markdown_cell(
            "# Deviceless schedule analysis on H100 and A100\n\n"
            "`jax_overlap.analyze` compiles the step for the GPU topology (no GPU needed), reads "
            "XLA's scheduled HLO and thunk listing, and places every kernel and collective on the "
            "compute and communication streams with a roofline / alpha-beta cost model."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            """from jax_overlap.examples import fsdp_transformer
reports = {}
for target in ("h100x8", "a100x8"):
    fn, args = fsdp_transformer.build_small(target)
    for name, opts in (("defaults", None), ("recommended", jax_overlap.flags.as_compiler_options(target=target, workload="fsdp"))):
        reports[f"{target} {name}"] = jax_overlap.analyze(fn, *args, target=target, xla_options=opts)
print(jax_overlap.compare(reports))"""
        ),
        new_code_cell(
            """r = reports["a100x8 recommended"]
print(r)
path = r.plot("a100_recommended.png")
from IPython.display import Image
Image(path)"""
        ),
        new_markdown_cell("Every kernel keeps XLA's launch configuration and its estimated time:"),
        new_code_cell(
            """for k in [k for k in r.kernels if k.kind == "gemm"][:5]:
    print(f"{k.name:28s} grid={k.grid_blocks:6d} threads={k.threads_per_block:4d} mnk={k.gemm_mnk} {k.time_s*1e6:8.1f} us")
for c in r.collectives[:5]:
    print(f"{c.name:28s} {c.kind:15s} {c.bytes/2**20:7.1f} MiB group={c.group_size} exposed={c.exposed_s*1e6:7.1f} us")"""
        ),
        new_markdown_cell(
            "On the cluster, the same metrics come from a real profiler trace. Here, a trace of "
            "the CPU devices (XLA:CPU runs collectives synchronously, so nothing overlaps):"
        ),
        new_code_cell(
            """import tempfile
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("fsdp",))
@jax.jit
def f(w, x):
    def body(w, x):
        return jax.lax.psum_scatter(jnp.tanh(x @ jax.lax.all_gather(w, "fsdp", axis=0, tiled=True)), "fsdp", tiled=True)
    return jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P("fsdp"))(w, x)
w = jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P("fsdp")))
x = jax.device_put(jnp.ones((512, 256)), NamedSharding(mesh, P("fsdp")))
f(w, x).block_until_ready()
d = tempfile.mkdtemp()
with jax.profiler.trace(d):
    f(w, x).block_until_ready()
print(jax_overlap.profile.measure(d))"""
        ),
    ],
    "03_occupancy_and_priority.ipynb": [
        new_markdown_cell(
            "# Occupancy shaping and communication priority, simulated\n\n"
            "An NCCL channel is one CTA of 640 threads with ~96 registers: it needs a whole SM. "
            "When compute kernels hold every SM, collectives wait. The SM-level simulator "
            "reproduces the H100 tail effect and shows when priority and shaping help. Its "
            "dispatcher places blocks in order, as an H200 was measured to do: a collective "
            "launched behind a many-wave kernel at equal priority waits for that kernel's last "
            "wave; at the highest priority it holds back the kernel's next blocks instead "
            "(`benchmarks/results/runtime_nvidia_h200_2026-12-04.md`)."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            """sim = jax_overlap.sim
wl = sim.tail_effect()
for policy in ("sequential", "concurrent", "priority"):
    res = sim.simulate(wl, target="h100", policy=policy)
    print(f"{policy:12s} makespan {res.makespan_s*1e3:7.3f} ms")"""
        ),
        new_markdown_cell("A tensor-parallel chain of GEMMs and all-gathers, and the tuner's plan for the runtime library:"),
        new_code_cell(
            """wl = sim.tp_chain(n=4)
tuned = sim.tune(wl, target="h100", progress=False)
print(f"{tuned.baseline} (XLA's default) {tuned.baseline_s*1e3:.3f} ms -> tuned {tuned.makespan_s*1e3:.3f} ms ({tuned.gain*100:.1f}%)")
print(tuned.plan.to_json())
print(tuned.format_table(5))"""
        ),
        new_code_cell(
            """table = sim.paper_table(("a100", "h100"), tune=False)
print(table)"""
        ),
        new_code_cell(
            """res = sim.simulate(wl, target="h100", policy=tuned.policy, record=True)
path = sim.plot(res, "tp_chain.png")
from IPython.display import Image
Image(path)"""
        ),
    ],
    "04_budgets.ipynb": [
        new_markdown_cell(
            "# Memory, compute and data, decided together\n\n"
            "Memory breakdown of a step for H100 (deviceless), a compute governor with a stopping "
            "rule, and learning-dynamics data selection inside a sharded step."
        ),
        new_code_cell(SETUP),
        new_code_cell(
            """from jax_overlap.examples import fsdp_mlp
fn, args = fsdp_mlp.build("h100x8", layers=2, hidden=1024, mlp=4096, tokens_per_device=1024)
b = jax_overlap.budget.memory.breakdown(fn, *args, target="h100x8")
print(b)"""
        ),
        new_code_cell(
            """gov = jax_overlap.budget.compute.ComputeGovernor(flop_budget=1e16, min_gain_per_pflop=0.5, window=4, log=False)
for k in range(1, 200):
    loss = 2.0 / np.sqrt(k) + 0.3
    d = gov.update(flops=k * 2e13, loss=loss)
    if d.stop:
        break
print(f"stopped at evaluation {d.index} after {d.flops/1e15:.2f} PFLOP: {d.reason}, loss {d.loss:.3f}")"""
        ),
        new_code_cell(
            """from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((8,), ("data",))
logits = jax.device_put(jax.random.normal(jax.random.key(0), (64, 10)), NamedSharding(mesh, P("data")))
labels = jax.device_put(jax.random.randint(jax.random.key(1), (64,), 0, 10), NamedSharding(mesh, P("data")))
scores = jax_overlap.budget.data.per_example_scores(logits, labels)
print({k: v.shape for k, v in scores.items()} if isinstance(scores, dict) else scores)"""
        ),
    ],
}


def main():
  for name, cells in NOTEBOOKS.items():
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, os.path.join(HERE, name))
    print("wrote", name)


if __name__ == "__main__":
  main()
