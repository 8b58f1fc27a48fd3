"""Compute governor vs. a fixed training schedule on a small classification task.

Task (generated here, seeded): 10-class classification of 32-d Gaussian inputs
labelled by a random linear teacher, 10% label noise in every split; 100,000
training, 5,000 validation and 5,000 test examples. Student: MLP
32-256-256-10, Adam (constant lr 1e-3), batch 64.

* fixed: 15,000 steps, evaluating the validation loss every 250 steps (a
  schedule sized generously, as fixed schedules usually are).
* governed: the same run, with a :class:`jax_overlap.budget.compute.ComputeGovernor`
  fed the cumulative FLOPs (training and evaluation, from the compiled steps'
  cost analysis) and the validation loss after each evaluation;
  ``flop_budget`` = the fixed run's FLOPs, ``window`` = 8 evaluations, and
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

_TASK_KEYS = ("seed", "dim", "classes", "hidden", "n_train", "n_holdout", "n_test", "batch", "lr")
CONFIG = dict(
  {k: task.CONFIG[k] for k in _TASK_KEYS},
  label_noise=0.1,
  dup_fraction=0.0,
  steps=15000,
  eval_every=250,
  window=8,
  rel_gain=0.01,
)


def make_splits(cfg=CONFIG):
  """Train, validation and test splits of one task (same teacher, same label noise)."""
  n = cfg["n_holdout"] // 2
  (xtr, ytr), (xho, yho), _ = task.make_task(dict(cfg, n_holdout=2 * n))
  return (xtr, ytr), (xho[:n], yho[:n]), (xho[n:], yho[n:])


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
    curve = []
    for i in range(1, cfg["steps"] + 1):
      idx = rng.integers(0, len(xtr), size=B)
      params, opt, _ = step(params, opt, jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx]))
      counter.step()
      if i % cfg["eval_every"] == 0:
        counter.step(flops=f_eval)
        val, _ = ev(params, jnp.asarray(xva), jnp.asarray(yva))
        curve.append((i, counter.total, float(val)))
        if governor is not None and governor.update(counter.total, float(val)).stop:
          break
    test, acc = ev(params, jnp.asarray(xte), jnp.asarray(yte))
    return i, counter.total, float(test), float(acc), curve

  fixed = train(None)
  # Chance-level loss ln(classes): 1% of it over the whole budget.
  threshold = cfg["rel_gain"] * float(np.log(cfg["classes"])) / (budget / 1e15)
  gov = compute.ComputeGovernor(
    flop_budget=budget, min_gain_per_pflop=threshold, window=cfg["window"], log=False
  )
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
  (fs, ff, fl, fa, fcurve), (gs, gf, gl, ga, _) = r["fixed"], r["governed"]
  gov = r["governor"]
  lines += [
    f"threshold: {gov.min_gain_per_pflop:.4g} loss/PFLOP; budget {r['budget']:.4g} FLOPs",
    f"fixed:    {fs} steps, {ff:.4g} FLOPs, final test loss {fl:.4f} (acc {fa:.4f})",
    f"governed: {gs} steps, {gf:.4g} FLOPs, final test loss {gl:.4f} (acc {ga:.4f}), "
    f"stop reason {gov.decisions[-1].reason}",
    f"FLOP saving {100 * (1 - gf / ff):.1f}%; final loss gap {100 * (gl - fl) / fl:+.2f}% "
    "(governed vs fixed)",
    "fixed run validation loss (step, FLOPs, loss) every 1500 steps: "
    + ", ".join(f"({i}, {f:.3g}, {v:.4f})" for i, f, v in fcurve if i % 1500 == 0),
    "governor decisions (last 8):",
    *("  " + str(d) for d in gov.decisions[-8:]),
    "same configuration, other seeds (data, initialization and batches):",
  ]
  for seed in (1, 2):
    o = run(dict(CONFIG, seed=seed), log=lambda s: None)
    (_, of, ol, *_), (os_, og, gl2, *_) = o["fixed"], o["governed"]
    lines.append(
      f"  seed {seed}: governed stops at step {os_} ({o['governor'].decisions[-1].reason}), "
      f"FLOP saving {100 * (1 - og / of):.1f}%, final loss gap {100 * (gl2 - ol) / ol:+.2f}%"
    )
  lines.append(f"# wall time {time.time() - t0:.1f} s")
  text = "\n".join(lines)
  print("\n".join(lines[-18:]))
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "budget_governor.txt")
  with open(path, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
