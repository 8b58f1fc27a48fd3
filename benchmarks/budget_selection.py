"""Learning-dynamics data selection vs. uniform sampling.

Task (generated here, seeded): 10-class classification of 32-d Gaussian inputs
labelled by a random linear teacher (argmax of x @ W); 100,000 training
examples, a clean 4,000-example test set. Student: MLP 32-256-256-10, Adam
(lr 1e-3), batch 64. Most examples are far from the class boundaries and are
learnt early: the redundancy that selection can skip.

* uniform: each step trains on 64 examples drawn uniformly, 3,000 steps.
* selection[method]: each step draws 256 candidates, scores them inside the
  jitted step with :func:`jax_overlap.budget.data.per_example_scores` (one
  forward pass), keeps the top quarter with
  :func:`jax_overlap.budget.data.select` (global top-k on a batch sharded over
  8 CPU devices, output kept sharded) and trains on those 64. Methods:
  ``loss``, ``el2n`` (error norm) and ``excess_loss`` (RHO-loss: loss minus a
  reference model's loss; the reference, same architecture, is trained on a
  separate holdout split and scores every training example once).

Two configurations: ``clean`` (no label noise) and the control ``noisy`` (5%
of train/holdout labels replaced by random classes), where the highest-loss
examples are mostly mislabelled.

FLOPs come from the compiled steps' cost analysis
(:func:`jax_overlap.budget.compute.step_flops`); a selection run is charged for
the candidates' forward passes and, for ``excess_loss``, the reference model's
training and its scoring pass over the training set. Reported: FLOPs for each
selection run to reach the uniform run's final (and best) test loss, and the
ratio to uniform's FLOPs.

Run: JAX_PLATFORMS=cpu python benchmarks/budget_selection.py
"""

from __future__ import annotations

import os

from jax_overlap.examples.cpu_devices import use_cpu_devices  # noqa: E402 - imports no JAX

use_cpu_devices(8)

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

CONFIG = dict(
  seed=0,
  dim=32,
  classes=10,
  hidden=256,
  n_train=100_000,
  n_holdout=10_000,
  n_test=4_000,
  label_noise=0.0,
  dup_fraction=0.0,
  batch=64,
  candidates=256,
  lr=1e-3,
  uniform_steps=3000,
  selection_steps=1500,
  reference_steps=300,
  eval_every=50,
  methods=("loss", "el2n"),
)
# The control: 5% of the labels flipped. Loss selection then chases the flipped
# labels; excess loss against a reference model avoids them.
NOISY = dict(CONFIG, label_noise=0.05, methods=("loss", "excess_loss"))


def make_task(cfg=CONFIG):
  """(train, holdout, test) splits; train and holdout share duplicates and label noise."""
  rng = np.random.default_rng(cfg["seed"])
  d, c = cfg["dim"], cfg["classes"]
  teacher = rng.normal(size=(d, c)) / np.sqrt(d)  # a linear teacher: classes are half-space cones

  def sample(n, noise):
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1)
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
  params = jax.tree.map(
    lambda p, m, v: p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + 1e-8), params, m, v
  )
  return params, {"m": m, "v": v, "t": t}


def train_step(params, opt, x, y, lr):
  def loss_fn(p):
    return jnp.mean(data.per_example_scores(forward(p, x), y)["loss"])

  loss, g = jax.value_and_grad(loss_fn)(params)
  params, opt = adam_update(params, g, opt, lr)
  return params, opt, loss


def select_and_train_step(params, opt, x, y, ref_loss, lr, keep, sharding, method):
  """Scores the candidates, keeps the best ``keep`` fraction, trains on them."""
  scores = data.per_example_scores(forward(params, x), y, reference_loss=ref_loss)
  sel = data.select({"x": x, "y": y}, scores[method], keep, multiple_of=8, sharding=sharding)
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
  ev = jax.jit(eval_loss)
  per_ex = jax.jit(lambda p, x, y: data.per_example_scores(forward(p, x), y)["loss"])

  def put(*arrays, sharding=bs):
    return [jax.device_put(a, sharding) for a in arrays]

  p0 = jax.device_put(init_params(jax.random.PRNGKey(cfg["seed"]), cfg), rep)
  o0 = jax.device_put(adam_init(p0), rep)
  spec = lambda n, dt: jax.ShapeDtypeStruct((n,), dt, sharding=bs)
  xspec = lambda n: jax.ShapeDtypeStruct((n, cfg["dim"]), jnp.float32, sharding=bs)
  f_train = compute.step_flops(step.lower(p0, o0, xspec(B), spec(B, jnp.int32)).compile())
  f_score_all = compute.step_flops(per_ex.lower(p0, *put(xtr, ytr)).compile())
  xte_d, yte_d = put(xte, yte)
  rng = np.random.default_rng(cfg["seed"] + 1)

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
    log(
      f"{label}: {n_steps} steps, final test loss {curve[-1][2]:.4f} acc {curve[-1][3]:.4f}, "
      f"{counter.total:.4g} FLOPs"
    )
    return params, curve

  def uniform_sampler(i):
    idx = rng.integers(0, len(xtr), size=B)
    return put(xtr[idx], ytr[idx])

  _, uni = train(
    cfg["uniform_steps"], uniform_sampler, step, compute.FlopCounter(f_train), "uniform"
  )
  out = dict(f_train=f_train, uniform=uni, methods={})

  ref_loss, overhead = np.zeros(len(xtr), np.float32), 0.0
  if any(m == "excess_loss" for m in cfg["methods"]):
    # Reference model on the holdout split, then its loss on every training example.
    def holdout_sampler(i):
      idx = rng.integers(0, len(xho), size=B)
      return put(xho[idx], yho[idx])

    ref_counter = compute.FlopCounter(f_train)
    ref_params, _ = train(cfg["reference_steps"], holdout_sampler, step, ref_counter, "reference")
    ref_loss = np.asarray(per_ex(ref_params, *put(xtr, ytr)))
    overhead = ref_counter.total + f_score_all

  def cand_sampler(i):
    idx = rng.integers(0, len(xtr), size=C)
    return put(xtr[idx], ytr[idx], ref_loss[idx])

  best = min(loss for _, _, loss, _ in uni)
  best_at = next(f for _, f, loss, _ in uni if loss == best)
  for method in cfg["methods"]:
    sel_step = jax.jit(
      functools.partial(select_and_train_step, lr=lr, keep=keep, sharding=bs, method=method)
    )
    f_sel = compute.step_flops(
      sel_step.lower(p0, o0, xspec(C), spec(C, jnp.int32), spec(C, jnp.float32)).compile()
    )
    counter = compute.FlopCounter(f_sel)
    extra = overhead if method == "excess_loss" else 0.0
    counter.step(flops=extra)
    log(
      f"{method}: select+train step {f_sel:.4g} FLOPs = {f_sel / f_train:.2f} x train step"
      + (f"; reference model + scoring the training set {extra:.4g} FLOPs" if extra else "")
    )
    _, sel = train(cfg["selection_steps"], cand_sampler, sel_step, counter, f"selection[{method}]")
    out["methods"][method] = dict(
      f_sel=f_sel,
      overhead=extra,
      curve=sel,
      reached=next(((i, f, lo) for i, f, lo, _ in sel if lo <= uni[-1][2]), None),
      reached_best=next(((i, f, lo) for i, f, lo, _ in sel if lo <= best), None),
    )
  out.update(target=uni[-1][2], best=best, best_at=best_at)
  return out


def report(cfg, r, lines):
  uni_flops = r["uniform"][-1][1]
  lines.append(
    f"uniform: final test loss {r['target']:.4f} after {uni_flops:.4g} FLOPs; best "
    f"{r['best']:.4f} at {r['best_at']:.4g} FLOPs"
  )
  lines.append(
    "  curve (step, FLOPs, test loss, acc): "
    + ", ".join(
      f"({i}, {f:.3g}, {lo:.4f}, {a:.3f})" for i, f, lo, a in r["uniform"] if i % 500 == 0
    )
  )
  for method, m in r["methods"].items():
    if m["reached"] is None:
      lines.append(
        f"selection[{method}]: did not reach the uniform final test loss within "
        f"{cfg['selection_steps']} steps (final {m['curve'][-1][2]:.4f})"
      )
    else:
      step_i, flops, loss = m["reached"]
      lines.append(
        f"selection[{method}]: reaches {loss:.4f} <= uniform final at step {step_i}, "
        f"{flops:.4g} FLOPs (selection and reference costs included): FLOP ratio "
        f"{flops / uni_flops:.3f}"
      )
    if m["reached_best"] is not None:
      step_i, flops, loss = m["reached_best"]
      lines.append(
        f"  reaches the uniform best {r['best']:.4f} at step {step_i}, {flops:.4g} FLOPs: "
        f"ratio {flops / r['best_at']:.3f}"
      )
    lines.append(f"  final test loss {m['curve'][-1][2]:.4f} acc {m['curve'][-1][3]:.4f}")
    lines.append(
      "  curve (step, FLOPs, test loss, acc): "
      + ", ".join(
        f"({i}, {f:.3g}, {lo:.4f}, {a:.3f})" for i, f, lo, a in m["curve"] if i % 500 == 0
      )
    )


def main() -> None:
  t0 = time.time()
  lines = [
    f"# budget_selection  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
    f"# machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, python "
    f"{platform.python_version()}, jax {jax.__version__}, 8 virtual CPU devices",
  ]
  log = lambda s: (print(s), lines.append(s))
  for name, cfg in (("clean", CONFIG), ("noisy", NOISY)):
    lines += ["", f"## {name}: {cfg}"]
    report(cfg, run(cfg, log=log), lines)
  lines.append(f"# wall time {time.time() - t0:.1f} s")
  text = "\n".join(lines)
  print(text)
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "budget_selection.txt")
  with open(path, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
