"""Learning-dynamics data selection vs. uniform sampling on a noisy-label task.

Task (generated here, seeded): 10-class classification of 32-d Gaussian inputs
labelled by a random teacher MLP; 40% of the training labels are replaced by
uniformly random classes; the test set is clean. Student: MLP 32-256-256-10,
Adam (lr 1e-3), batch 64.

* uniform: each step trains on 64 examples drawn uniformly, for a fixed number
  of steps.
* selection (RHO-loss style, Mindermann et al. 2022): a reference model of the
  same shape is trained on a separate noisy holdout set; its per-example loss
  on every training example is computed once. Each step draws 128 candidates,
  scores them with the current model's forward pass
  (:func:`jax_overlap.budget.data.per_example_scores`, excess loss against the
  reference), keeps the top half with :func:`jax_overlap.budget.data.select`
  (inside the jitted step, on a batch sharded over 8 CPU devices) and trains
  on those 64.

FLOPs come from the compiled steps' cost analysis
(:func:`jax_overlap.budget.compute.step_flops`); the selection run is charged
for the reference model's training, its scoring pass over the training set,
and the candidates' forward passes. Reported: FLOPs for the selection run to
reach the uniform run's final test loss, and their ratio.

Run: JAX_PLATFORMS=cpu python benchmarks/budget_selection.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import datetime  # noqa: E402
import functools  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_overlap.budget import compute, data  # noqa: E402

CONFIG = dict(seed=0, dim=32, classes=10, hidden=256, n_train=100_000, n_holdout=10_000,
              n_test=4_000, label_noise=0.2, dup_fraction=0.8, dup_pool=500, batch=64,
              candidates=256, lr=1e-3, uniform_steps=3000, selection_steps=3000,
              reference_steps=600, eval_every=50)


def make_task(cfg=CONFIG):
  """(train, holdout, test) splits; train and holdout share duplicates and label noise."""
  rng = np.random.default_rng(cfg["seed"])
  d, c = cfg["dim"], cfg["classes"]
  t1 = rng.normal(size=(d, 64)) / np.sqrt(d)
  t2 = rng.normal(size=(64, c)) / np.sqrt(64) * 4.0

  def sample(n, noise):
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = np.argmax(np.tanh(x @ t1) @ t2, axis=1)
    flip = rng.random(n) < noise
    y = np.where(flip, rng.integers(0, c, size=n), y)
    return x, y.astype(np.int32)

  pool = sample(cfg.get("dup_pool", 1), cfg["label_noise"])

  def noisy_split(n):
    x, y = sample(n, cfg["label_noise"])
    dup = rng.random(n) < cfg.get("dup_fraction", 0.0)
    pick = rng.integers(0, len(pool[0]), size=n)
    return np.where(dup[:, None], pool[0][pick], x), np.where(dup, pool[1][pick], y)

  train = noisy_split(cfg["n_train"])
  holdout = noisy_split(cfg["n_holdout"])
  test = sample(cfg["n_test"], 0.0)
  return train, holdout, test


def init_params(key, cfg=CONFIG):
  sizes = [cfg["dim"], cfg["hidden"], cfg["hidden"], cfg["classes"]]
  params = []
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    k = jax.random.fold_in(key, i)
    params.append({"w": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a), "b": jnp.zeros((b,))})
  return params


def forward(params, x):
  h = x
  for layer in params[:-1]:
    h = jax.nn.relu(h @ layer["w"] + layer["b"])
  return h @ params[-1]["w"] + params[-1]["b"]


def adam_init(params):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, opt, lr):
  t = opt["t"] + 1
  m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
  v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], grads)
  bc1, bc2 = 1 - 0.9**t, 1 - 0.999**t
  params = jax.tree.map(lambda p, m, v: p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + 1e-8), params, m, v)
  return params, {"m": m, "v": v, "t": t}


def train_step(params, opt, x, y, lr):
  def loss_fn(p):
    return jnp.mean(data.per_example_scores(forward(p, x), y)["loss"])

  loss, g = jax.value_and_grad(loss_fn)(params)
  params, opt = adam_update(params, g, opt, lr)
  return params, opt, loss


def select_and_train_step(params, opt, x, y, ref_loss, lr, keep, sharding):
  """Scores the candidates, keeps the best ``keep`` fraction, trains on them."""
  scores = data.per_example_scores(forward(params, x), y, reference_loss=ref_loss)
  sel = data.select({"x": x, "y": y}, scores["excess_loss"], keep, multiple_of=8, sharding=sharding)
  return train_step(params, opt, sel.batch["x"], sel.batch["y"], lr)


def eval_loss(params, x, y):
  logits = forward(params, x)
  s = data.per_example_scores(logits, y)
  return jnp.mean(s["loss"]), jnp.mean(jnp.argmax(logits, -1) == y)


def run(cfg=CONFIG, log=print):
  (xtr, ytr), (xho, yho), (xte, yte) = make_task(cfg)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  bs = NamedSharding(mesh, P("data"))
  rep = NamedSharding(mesh, P())
  lr, B, C = cfg["lr"], cfg["batch"], cfg["candidates"]
  keep = B / C
  step = jax.jit(functools.partial(train_step, lr=lr))
  sel_step = jax.jit(functools.partial(select_and_train_step, lr=lr, keep=keep, sharding=bs))
  ev = jax.jit(eval_loss)
  per_ex = jax.jit(lambda p, x, y: data.per_example_scores(forward(p, x), y)["loss"])

  def put(*arrays, sharding=bs):
    return [jax.device_put(a, sharding) for a in arrays]

  key = jax.random.PRNGKey(cfg["seed"])
  p0 = jax.device_put(init_params(key, cfg), rep)
  spec = lambda n, dt: jax.ShapeDtypeStruct((n,), dt, sharding=bs)
  xspec = lambda n: jax.ShapeDtypeStruct((n, cfg["dim"]), jnp.float32, sharding=bs)
  o0 = jax.device_put(adam_init(p0), rep)
  f_train = compute.step_flops(step.lower(p0, o0, xspec(B), spec(B, jnp.int32)).compile())
  f_sel = compute.step_flops(
      sel_step.lower(p0, o0, xspec(C), spec(C, jnp.int32), spec(C, jnp.float32)).compile()
  )
  f_eval = compute.step_flops(ev.lower(p0, *put(xte, yte)).compile())
  f_score_all = compute.step_flops(per_ex.lower(p0, *put(xtr, ytr)).compile())
  log(f"FLOPs: train step {f_train:.4g}, select+train step {f_sel:.4g} "
      f"({f_sel / f_train:.2f}x), scoring the training set {f_score_all:.4g}, eval {f_eval:.4g}")
  xte_d, yte_d = put(xte, yte)

  def train(n_steps, sampler, stepper, counter, label):
    params, opt = p0, o0
    curve = []
    for i in range(1, n_steps + 1):
      # Blocking keeps one program with collectives in flight at a time: the CPU
      # backend's in-process collectives can starve when several are queued on 2 cores.
      params, opt, _ = jax.block_until_ready(stepper(params, opt, *sampler(i)))
      counter.step()
      if i % cfg["eval_every"] == 0 or i == n_steps:
        loss, acc = ev(params, xte_d, yte_d)
        curve.append((i, counter.total, float(loss), float(acc)))
    log(f"{label}: {n_steps} steps, final test loss {curve[-1][2]:.4f} acc {curve[-1][3]:.4f}, "
        f"{counter.total:.4g} FLOPs")
    return params, curve

  rng = np.random.default_rng(cfg["seed"] + 1)

  def uniform_sampler(i):
    idx = rng.integers(0, len(xtr), size=B)
    return put(xtr[idx], ytr[idx])

  # Uniform baseline.
  _, uni = train(cfg["uniform_steps"], uniform_sampler, step, compute.FlopCounter(f_train), "uniform")
  target = uni[-1][2]

  # Reference model on the holdout set, then its loss on every training example.
  ref_counter = compute.FlopCounter(f_train)

  def holdout_sampler(i):
    idx = rng.integers(0, len(xho), size=B)
    return put(xho[idx], yho[idx])

  ref_params, _ = train(cfg["reference_steps"], holdout_sampler, step, ref_counter, "reference")
  ref_loss = np.asarray(per_ex(ref_params, *put(xtr, ytr)))
  overhead = ref_counter.total + f_score_all

  def cand_sampler(i):
    idx = rng.integers(0, len(xtr), size=C)
    return put(xtr[idx], ytr[idx], ref_loss[idx])

  sel_counter = compute.FlopCounter(f_sel)
  sel_counter.step(flops=overhead)
  _, sel = train(cfg["selection_steps"], cand_sampler, sel_step, sel_counter, "selection")
  reached = next(((i, f, loss) for i, f, loss, _ in sel if loss <= target), None)
  best = min(loss for _, _, loss, _ in uni)
  best_at = next(f for _, f, loss, _ in uni if loss == best)
  reached_best = next(((i, f, loss) for i, f, loss, _ in sel if loss <= best), None)
  return dict(f_train=f_train, f_sel=f_sel, f_eval=f_eval, overhead=overhead, uniform=uni,
              selection=sel, target=target, reached=reached, best=best, best_at=best_at,
              reached_best=reached_best)


def main() -> None:
  t0 = time.time()
  lines = [
      f"# budget_selection  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
      f"# machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, python "
      f"{platform.python_version()}, jax {jax.__version__}, 8 virtual CPU devices",
      f"# config: {CONFIG}",
  ]
  r = run(log=lambda s: (print(s), lines.append(s)))
  uni_flops = r["uniform"][-1][1]
  if r["reached"] is None:
    lines.append(f"selection did not reach the uniform final test loss {r['target']:.4f} "
                 f"within {CONFIG['selection_steps']} steps")
  else:
    step_i, flops, loss = r["reached"]
    lines.append(
        f"uniform final test loss {r['target']:.4f} after {uni_flops:.4g} FLOPs; selection reaches "
        f"{loss:.4f} at step {step_i} after {flops:.4g} FLOPs (reference model and scoring "
        f"included: {r['overhead']:.4g})"
    )
    lines.append(f"FLOP ratio selection / uniform = {flops / uni_flops:.3f}")
  if r["reached_best"] is None:
    lines.append(f"selection did not reach the uniform run's best test loss {r['best']:.4f}")
  else:
    step_i, flops, loss = r["reached_best"]
    lines.append(
        f"uniform best test loss {r['best']:.4f} at {r['best_at']:.4g} FLOPs; selection reaches it "
        f"at step {step_i} after {flops:.4g} FLOPs: ratio {flops / r['best_at']:.3f}"
    )
  lines.append(f"selection final test loss {r['selection'][-1][2]:.4f} "
               f"acc {r['selection'][-1][3]:.4f}; uniform acc {r['uniform'][-1][3]:.4f}")
  lines.append("curve (step, FLOPs, test loss, acc): uniform every 500 steps: " + ", ".join(
      f"({i}, {f:.3g}, {lo:.4f}, {a:.3f})" for i, f, lo, a in r["uniform"] if i % 500 == 0))
  lines.append("curve (step, FLOPs, test loss, acc): selection every 500 steps: " + ", ".join(
      f"({i}, {f:.3g}, {lo:.4f}, {a:.3f})" for i, f, lo, a in r["selection"] if i % 500 == 0))
  lines.append(f"# wall time {time.time() - t0:.1f} s")
  text = "\n".join(lines)
  print("\n".join(lines[-6:]))
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "budget_selection.txt")
  with open(path, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
