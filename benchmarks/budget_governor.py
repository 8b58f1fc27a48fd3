"""Compute governor vs. a fixed training schedule on a small classification task.

Task (generated here, seeded): 10-class classification of 32-d Gaussian inputs
labelled by a random teacher MLP, 10% label noise in every split; 20,000
training, 4,000 validation and 4,000 test examples. Student: MLP
32-256-256-10, Adam (constant lr 1e-3), batch 64.

* fixed: 6,000 steps, evaluating the validation loss every 100 steps.
* governed: the same run, with a :class:`jax_overlap.budget.compute.ComputeGovernor`
  fed the cumulative FLOPs (training and evaluation, from the compiled steps'
  cost analysis) and the validation loss after each evaluation;
  ``flop_budget`` = the fixed run's FLOPs, ``window`` = 5 evaluations, and
  ``min_gain_per_pflop`` = 1% of the chance-level loss ln(10) per budget:
  stop when spending the whole budget at the current rate would improve the
  loss by less than 1% of ln(10).

Reported: FLOPs of both runs, the saving, and the final test losses.

Run: JAX_PLATFORMS=cpu python benchmarks/budget_governor.py
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import budget_selection as task  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_overlap.budget import compute  # noqa: E402

CONFIG = dict(task.CONFIG, label_noise=0.1, steps=6000, eval_every=100, window=5,
              rel_gain=0.01, seed=0)


def make_splits(cfg=CONFIG):
  (xtr, ytr), (xva, yva), _ = task.make_task(cfg)
  # A test split of the same (noisy) distribution, from an independent seed.
  (xte, yte), _, _ = task.make_task(dict(cfg, seed=cfg["seed"] + 100, n_train=cfg["n_test"]))
  return (xtr, ytr), (xva, yva), (xte, yte)


def run(cfg=CONFIG, log=print):
  (xtr, ytr), (xva, yva), (xte, yte) = make_splits(cfg)
  step = jax.jit(functools.partial(task.train_step, lr=cfg["lr"]))
  ev = jax.jit(task.eval_loss)
  p0 = task.init_params(jax.random.PRNGKey(cfg["seed"]), cfg)
  o0 = task.adam_init(p0)
  B = cfg["batch"]
  f_step = compute.step_flops(step, p0, o0, jnp.zeros((B, cfg["dim"])), jnp.zeros((B,), jnp.int32))
  f_eval = compute.step_flops(ev, p0, jnp.asarray(xva), jnp.asarray(yva))
  log(f"FLOPs: train step {f_step:.4g}, evaluation {f_eval:.4g}")
  budget = cfg["steps"] * f_step + (cfg["steps"] // cfg["eval_every"]) * f_eval

  def train(governor):
    rng = np.random.default_rng(cfg["seed"] + 1)  # same batches for both runs
    params, opt = p0, o0
    counter = compute.FlopCounter(f_step)
    for i in range(1, cfg["steps"] + 1):
      idx = rng.integers(0, len(xtr), size=B)
      params, opt, _ = step(params, opt, jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx]))
      counter.step()
      if i % cfg["eval_every"] == 0:
        counter.step(flops=f_eval)
        val, _ = ev(params, jnp.asarray(xva), jnp.asarray(yva))
        if governor is not None and governor.update(counter.total, float(val)).stop:
          break
    test, acc = ev(params, jnp.asarray(xte), jnp.asarray(yte))
    return i, counter.total, float(test), float(acc)

  fixed = train(None)
  # Chance-level loss ln(classes): 1% of it over the whole budget.
  threshold = cfg["rel_gain"] * float(np.log(cfg["classes"])) / (budget / 1e15)
  gov = compute.ComputeGovernor(flop_budget=budget, min_gain_per_pflop=threshold,
                                window=cfg["window"], log=False)
  governed = train(gov)
  return dict(fixed=fixed, governed=governed, governor=gov, budget=budget, f_step=f_step)


def main() -> None:
  t0 = time.time()
  lines = [
      f"# budget_governor  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
      f"# machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, python "
      f"{platform.python_version()}, jax {jax.__version__}, 1 CPU device",
      f"# config: {CONFIG}",
  ]
  r = run(log=lambda s: (print(s), lines.append(s)))
  (fs, ff, fl, fa), (gs, gf, gl, ga) = r["fixed"], r["governed"]
  gov = r["governor"]
  lines += [
      f"threshold: {gov.min_gain_per_pflop:.4g} loss/PFLOP; budget {r['budget']:.4g} FLOPs",
      f"fixed:    {fs} steps, {ff:.4g} FLOPs, final test loss {fl:.4f} (acc {fa:.4f})",
      f"governed: {gs} steps, {gf:.4g} FLOPs, final test loss {gl:.4f} (acc {ga:.4f}), "
      f"stop reason {gov.decisions[-1].reason}",
      f"FLOP saving {100 * (1 - gf / ff):.1f}%; final loss gap {100 * (gl - fl) / fl:+.2f}% "
      "(governed vs fixed)",
      "governor decisions (last 8):",
      *("  " + str(d) for d in gov.decisions[-8:]),
      f"# wall time {time.time() - t0:.1f} s",
  ]
  text = "\n".join(lines)
  print("\n".join(lines[-14:]))
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "budget_governor.txt")
  with open(path, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
