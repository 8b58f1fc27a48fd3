"""Memory plan for an FSDP transformer training step on h100x8 under two budgets.

The step (Adam, causal self-attention + MLP blocks, weights sharded over the
8-way ``fsdp`` axis) is built for every candidate of
remat policy x optimizer-state sharding x prefetch depth, compiled deviceless
for 8 H100, broken down by :func:`jax_overlap.budget.memory.breakdown` and
ranked by estimated step time. Prefetch depth is the number of weight
all-gathers XLA may keep in flight ahead of the compute that needs them:
0 makes gathers synchronous (``xla_gpu_disable_async_collectives=ALLGATHER``),
``d >= 1`` enables the analytical latency estimator and
``xla_gpu_experimental_parallel_collective_overlap_limit=d``.

Run: JAX_PLATFORMS=cpu python benchmarks/budget_memory_plan.py
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time

# Deviceless GPU compilation runs on the CPU platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_overlap._src.targets import compile_only_mesh  # noqa: E402
from jax_overlap.budget import memory  # noqa: E402

CONFIG = dict(
  layers=2,
  d_model=4096,
  d_ff=16384,
  heads=32,
  batch=32,
  seq=2048,
  param_dtype="float32",
  compute_dtype="bfloat16",
  target="h100x8",
  budgets_gib=(8, 6),
)
GiB = 2**30


def prefetch_options(depth: int) -> dict:
  if depth == 0:
    return {"xla_gpu_disable_async_collectives": "ALLGATHER"}
  return {
    "xla_gpu_enable_analytical_latency_estimator": True,
    "xla_gpu_experimental_parallel_collective_overlap_limit": depth,
  }


def make_builder(cfg: dict = CONFIG, mesh=None):
  mesh = mesh or compile_only_mesh(cfg["target"], {"fsdp": 8})
  L, D, F, H = cfg["layers"], cfg["d_model"], cfg["d_ff"], cfg["heads"]
  B, T = cfg["batch"], cfg["seq"]
  pdt, cdt = jnp.dtype(cfg["param_dtype"]), jnp.dtype(cfg["compute_dtype"])
  shapes = {"wqkv": (L, D, 3 * D), "wo": (L, D, D), "w1": (L, D, F), "w2": (L, F, D)}

  def block(h, w):
    x = h * jax.lax.rsqrt(jnp.mean(h.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6).astype(
      cdt
    )
    qkv = x @ w["wqkv"].astype(cdt)
    q, k, v = jnp.split(qkv.reshape(B, T, 3 * H, D // H), 3, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // H) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), -1).astype(cdt), v)
    h = h + checkpoint_name(a.reshape(B, T, D) @ w["wo"].astype(cdt), "attn_out")
    u = checkpoint_name(jax.nn.gelu(h @ w["w1"].astype(cdt)), "mlp_hidden")
    return h + u @ w["w2"].astype(cdt)

  def builder(remat_policy, shard_opt_state, prefetch):
    layer = jax.checkpoint(block, policy=remat_policy)

    def loss_fn(params, x, y):
      h = x
      for i in range(L):
        h = layer(h, {k: v[i] for k, v in params.items()})
      return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    def step(params, opt, x, y):
      loss, g = jax.value_and_grad(loss_fn)(params, x, y)
      t = opt["count"] + 1
      mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt["mu"], g)
      nu = jax.tree.map(lambda n, g: 0.999 * n + 0.001 * g * g, opt["nu"], g)
      upd = jax.tree.map(
        lambda m, n: m / (1 - 0.9**t) / (jnp.sqrt(n / (1 - 0.999**t)) + 1e-8), mu, nu
      )
      params = jax.tree.map(lambda p, u: p - 1e-4 * u, params, upd)
      return params, {"mu": mu, "nu": nu, "count": t}, loss

    wspec = NamedSharding(mesh, P(None, "fsdp"))
    ospec = wspec if shard_opt_state else NamedSharding(mesh, P())
    params = {k: jax.ShapeDtypeStruct(s, pdt, sharding=wspec) for k, s in shapes.items()}
    opt = {
      "mu": {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=ospec) for k, s in shapes.items()},
      "nu": {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=ospec) for k, s in shapes.items()},
      "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    }
    x = jax.ShapeDtypeStruct((B, T, D), cdt, sharding=NamedSharding(mesh, P("fsdp")))
    y = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    fn = jax.jit(step, donate_argnums=(0, 1), compiler_options=prefetch_options(prefetch))
    return fn, (params, opt, x, y)

  return builder


def main() -> None:
  t0 = time.time()
  builder = make_builder()
  cache: dict = {}
  out = [
    f"# budget_memory_plan  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
    f"# machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, python "
    f"{platform.python_version()}, jax {jax.__version__}, deviceless compile for h100x8",
    f"# config: {CONFIG}",
    "# remat policies: nothing, dots, names:attn_out,mlp_hidden, everything; "
    "shard_opt_state: False/True; prefetch: 0,1,2",
  ]
  for gib in CONFIG["budgets_gib"]:
    p = memory.plan(
      builder,
      gib * GiB,
      target=CONFIG["target"],
      remat_policies=("nothing", "dots", "names:attn_out,mlp_hidden", "everything"),
      prefetch=(0, 1, 2),
      cache=cache,
    )
    out += ["", str(p), "", "chosen breakdown:", str(p.choice.breakdown)]
  out.append(f"\n# wall time {time.time() - t0:.1f} s")
  text = "\n".join(out)
  print(text)
  path = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "budget_memory_plan.txt"
  )
  with open(path, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
