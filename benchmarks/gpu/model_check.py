"""The analysis' cost model against a GPU: estimated kernel times beside measured ones.

  python model_check.py run OUT.json [--sizes large,medium,large+scan_remat] [--steps 10]
  python model_check.py run OUT.json --sizes tiny                          # anywhere (CPU)
  python model_check.py run OUT.json --sizes large+adamw,large+flax_scan_remat  # training steps
  python model_check.py render IN.json OUT.md                              # the table

The program is one device's compute of the tensor + sequence parallel step that
``benchmarks/transform_tp.py`` analyses on h100x8 (``jax_overlap.examples.tp_sp``, 2 blocks,
bf16, value and gradient): the same einsums at the shapes one of 8 devices runs (the
gathered sequence, 1/8 of the heads, 1/8 of the MLP), without the collectives, so that one
GPU runs it. Forms (``SIZE+FORM``): ``scan_remat`` puts the blocks under ``lax.scan`` and
``jax.checkpoint``; ``adamw`` and ``flax_scan_remat`` are training steps as users write
them, with optax's AdamW update in a plain ``jax.jit`` step (unrolled blocks) or a Flax
module under ``nn.scan(nn.remat(Block))``. Per size:

* measured: the step's wall-clock time (median of ``--steps`` runs after warm-up) and, from
  a ``jax.profiler`` trace of 3 steps, each kernel's GPU time grouped by the HLO instruction
  that launched it (the trace's ``hlo_op``);
* estimated on the same compile: XLA's optimised HLO and thunk listing of the executable
  that is measured (``xla_dump_to``), read by ``analyze_hlo`` for the target named by
  ``--target`` (the GPU's catalogue entry, one device), so each estimate has a measured twin;
* estimated deviceless: ``jax_overlap.analyze(..., target=...)`` on abstract arguments, the
  figure a user gets on a laptop.

Nothing is fitted here: the estimates use the catalogue's and the cost model's defaults.
On CPU (no GPU) the run checks the script end to end with the host cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from _common import TP_SIZES  # noqa: E402

from jax_overlap._src.analysis import calibration  # noqa: E402

DEVICES = 8  # the h100x8 step whose per-device compute this is
# "large+scan_remat": blocks under lax.scan and jax.checkpoint; the training steps as users
# write them, with optax's AdamW update in the step: "adamw" (unrolled blocks, plain
# jax.jit) and "flax_scan_remat" (a Flax module under nn.scan(nn.remat(Block))).
FORMS = ("", "scan_remat", "adamw", "flax_scan_remat")


def local_sizes(size: str) -> dict:
  s = TP_SIZES[size]
  return dict(
    hidden=s["hidden"],
    heads=s["heads"] // DEVICES,
    head_dim=s["hidden"] // s["heads"],
    mlp=s["mlp"] // DEVICES,
    seq=s["seq"],
    layers=2,
  )


def build(size: str, scanned: bool = False, form: str = ""):
  """(step, args) with random inputs on the default device; ``scanned`` (or form
  "scan_remat"): the blocks under ``lax.scan`` over stacked weights, each under
  ``jax.checkpoint`` (as scanned, rematerialised models are written); form "adamw" or
  "flax_scan_remat": a training step with optax's AdamW (:func:`build_training`)."""
  import jax
  import jax.numpy as jnp

  if form in ("adamw", "flax_scan_remat"):
    return build_training(size, flax=form == "flax_scan_remat")
  scanned = scanned or form == "scan_remat"
  d = local_sizes(size)
  block, shapes = _block_fn(d)

  def loss(params, x):
    if scanned:
      x = jax.lax.scan(lambda x, w: (jax.checkpoint(block)(x, w), None), x, params)[0]
    else:
      for w in params:
        x = block(x, w)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss))
  keys = iter(jax.random.split(jax.random.key(0), 4 * d["layers"] + 1))
  params = [
    {n: jax.random.normal(next(keys), sh, jnp.bfloat16) / sh[0] ** 0.5 for n, sh in shapes.items()}
    for _ in range(d["layers"])
  ]
  x = jax.random.normal(next(keys), (1, d["seq"], d["hidden"]), jnp.bfloat16)
  if scanned:
    params = jax.tree.map(lambda *ws: jnp.stack(ws), *params)
  return step, (params, x), d


def _block_fn(d: dict):
  """One block of the step (attention on this device's heads, output projection, MLP)."""
  import jax
  import jax.numpy as jnp

  hk = d["heads"] * d["head_dim"]

  def block(x, w):
    qkv = jnp.einsum("bsh,hk->bsk", x, w["wqkv"])
    b, s, _ = qkv.shape
    q, k, v = jnp.split(qkv.reshape(b, s, 3, d["heads"], d["head_dim"]), 3, axis=2)
    q, k, v = (t[:, :, 0] for t in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / d["head_dim"] ** 0.5
    att = jax.nn.softmax(att, -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att.astype(x.dtype), v).reshape(b, s, hk)
    x = x + jnp.einsum("bsk,kh->bsh", o, w["wo"])
    h = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", x, w["w1"]))
    return x + jnp.einsum("bsf,fh->bsh", h, w["w2"])

  shapes = {
    "wqkv": (d["hidden"], 3 * hk),
    "wo": (hk, d["hidden"]),
    "w1": (d["hidden"], d["mlp"]),
    "w2": (d["mlp"], d["hidden"]),
  }
  return block, shapes


def build_training(size: str, flax: bool):
  """A training step as users write one: loss, gradients and optax's AdamW update under
  ``jax.jit``, with the blocks unrolled (``flax=False``) or as a Flax module scanned and
  rematerialised (``nn.scan(nn.remat(Block))``). Returns (step, (params, opt_state, x),
  sizes); the step returns the loss and the new parameters and optimizer state."""
  import jax
  import jax.numpy as jnp
  import optax

  d = local_sizes(size)
  block, shapes = _block_fn(d)
  x = jax.random.normal(jax.random.key(1), (1, d["seq"], d["hidden"]), jnp.bfloat16)
  opt = optax.adamw(1e-4)
  if flax:
    import flax.linen as nn

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        w = {
          n: self.param(n, nn.initializers.lecun_normal(), sh, jnp.bfloat16)
          for n, sh in shapes.items()
        }
        return block(x, w), None

    stack = nn.scan(
      nn.remat(Block),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=d["layers"],
    )()
    params = stack.init(jax.random.key(0), x, None)

    def forward(params, x):
      return stack.apply(params, x, None)[0]
  else:
    keys = iter(jax.random.split(jax.random.key(0), 4 * d["layers"]))
    params = [
      {
        n: jax.random.normal(next(keys), sh, jnp.bfloat16) / sh[0] ** 0.5
        for n, sh in shapes.items()
      }
      for _ in range(d["layers"])
    ]

    def forward(params, x):
      for w in params:
        x = block(x, w)
      return x

  def loss(params, x):
    return jnp.mean(jnp.square(forward(params, x).astype(jnp.float32)))

  @jax.jit
  def step(params, opt_state, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, opt_state = opt.update(grads, opt_state, params)
    return value, optax.apply_updates(params, updates), opt_state

  return step, (params, opt.init(params), x), d


def estimate_deviceless(step, args, target: str) -> dict:
  import jax

  import jax_overlap

  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  t0 = time.perf_counter()
  report = jax_overlap.analyze(step, *abstract, target=target, name="deviceless")
  return {
    "compute_s": report.compute_time_s,
    "step_s": report.step_time_s,
    "flops": report.flops,
    "kernels": len(report.kernels),
    "seconds": time.perf_counter() - t0,
  }


def compare(per_op_est: dict, per_op_meas: dict) -> dict:
  """Estimated and measured time per kernel kind and per instruction: the calibration's
  matching (``calibration.match``), without its full list of rows."""
  out = calibration.match(per_op_est, per_op_meas)
  out.pop("rows")
  return out


def run(out: str, sizes: list[str], steps: int, target: str | None, deviceless: bool) -> int:
  import jax
  import jaxlib

  dev = jax.devices()[0]
  on_gpu = dev.platform == "gpu"
  if target is None and on_gpu:
    name = dev.device_kind.lower()
    target = next((f"{g}x1" for g in ("h200", "h100", "a100") if g in name), None)
    if target is None:
      print(f"model_check: {dev.device_kind} is not in the catalogue", file=sys.stderr)
      return 1
  result = {
    "device": dev.device_kind,
    "platform": dev.platform,
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "target": target,
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "programs": {},
  }
  for name in sizes:
    size, _, form = name.partition("+")
    t0 = time.perf_counter()
    step, args, dims = build(size, form=form)
    summary, per_op_est, executable, inputs = calibration.estimate_same_compile(step, args, target)
    with tempfile.TemporaryDirectory(prefix="model_check_") as trace_dir:
      meas = calibration.measure_step(executable, inputs, steps, trace_dir)
    entry = {
      "sizes": dims,
      "estimate": summary,
      "measured": {k: v for k, v in meas.items() if k not in ("per_op_s",)},
      "comparison": compare(per_op_est, meas["per_op_s"]),
      # What the comparison was made from, so that it can be made again without a GPU.
      "per_op_measured_s": meas["per_op_s"],
      "per_op_estimate": per_op_est,
    }
    if deviceless and target is not None:
      try:
        entry["deviceless"] = estimate_deviceless(step, args, target)
      except Exception as e:  # noqa: BLE001 - recorded, the rest still runs
        entry["deviceless"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    entry["seconds"] = time.perf_counter() - t0
    result["programs"][name] = entry
    est, m = summary["compute_s"], meas["kernel_s"]
    print(
      f"model_check {name}: measured step {meas['wall_s'] * 1e3:.3f} ms (kernels "
      f"{m * 1e3:.3f} ms), estimated compute {est * 1e3:.3f} ms "
      f"(estimate / measured kernels {est / m if m else float('nan'):.3f})",
      flush=True,
    )
    with open(out, "w") as f:
      json.dump(result, f, indent=1)
  return 0


def render(path: str, out: str) -> int:
  with open(path) as f:
    r = json.load(f)
  lines = [
    f"# Cost model against a measured {r['device']}",
    "",
    f"{r['date']}, jax {r['jax']} / jaxlib {r['jaxlib']}, estimates for `{r['target']}` with "
    "the catalogue's and the cost model's defaults (nothing fitted to this run). Program: one "
    "device's compute of the h100x8 tensor + sequence parallel step (`transform_tp.py`), "
    "2 blocks, bf16, value and gradient, without the collectives "
    "(`benchmarks/gpu/model_check.py`). Measured: wall-clock median and kernel time from a "
    "`jax.profiler` trace (per HLO instruction, `hlo_op`). Estimated: `analyze_hlo` on the "
    "HLO and thunk listing of the same compile; deviceless: `jax_overlap.analyze` on abstract "
    "arguments.",
    "",
    "| size | measured step (ms) | measured kernels (ms) | estimated compute, same compile (ms) "
    "| estimate / measured | deviceless estimate (ms) |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for size, p in r["programs"].items():
    m, e = p["measured"], p["estimate"]
    dl = p.get("deviceless", {})
    dls = f"{dl['compute_s'] * 1e3:.3f}" if "compute_s" in dl else dl.get("error", "-")
    lines.append(
      f"| {size} | {m['wall_s'] * 1e3:.3f} | {m['kernel_s'] * 1e3:.3f} | "
      f"{e['compute_s'] * 1e3:.3f} | {e['compute_s'] / m['kernel_s']:.3f} | {dls} |"
    )
  for size, p in r["programs"].items():
    c = p["comparison"]
    if "left_over" not in c and not c["matched_measured_s"]:
      names = sorted({n for ns in p["measured"]["kernel_names"].values() for n in ns})
      lines += [
        "",
        f"{size}: no per-kernel comparison in this run. Every kernel ran from a command buffer "
        f"(CUDA graph), which the trace names by the buffer ({', '.join(f'`{k}`' for k in p['measured']['kernel_names'])}; "
        f"kernels such as {', '.join(f'`{n}`' for n in names[:3])}), and this version of the "
        "script matched kernels by that name only. It now matches such kernels by kernel name "
        "and also measures with command buffers off (`session.sh`); that has not run on a GPU yet.",
      ]
      continue
    lines += [
      "",
      f"## {size}: by kernel kind",
      "",
      "| kind | kernels | estimated (ms) | measured (ms) | estimate / measured |",
      "| --- | --- | --- | --- | --- |",
    ]
    for kind, k in sorted(c["by_kind"].items(), key=lambda kv: -kv[1]["measured_s"]):
      ratio = k["est_s"] / k["measured_s"] if k["measured_s"] else float("nan")
      lines.append(
        f"| {kind} | {k['count']} | {k['est_s'] * 1e3:.3f} | {k['measured_s'] * 1e3:.3f} | "
        f"{ratio:.3f} |"
      )
    lines += [
      "",
      f"Largest measured kernels ({size}):",
      "",
      "| instruction | kind | GEMM (M, N, K) | estimated (us) | measured (us) | ratio |",
      "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in c["top"][:10]:
      ms = row["measured_s"] or 0.0
      ratio = row["est_s"] / ms if ms else float("nan")
      lines.append(
        f"| `{row['op']}` | {row['kind']} | {row.get('gemm_mnk', '')} | {row['est_s'] * 1e6:.1f} | "
        f"{ms * 1e6:.1f} | {ratio:.2f} |"
      )
    lo = c["left_over"]
    lines.append("")
    lines.append(
      f"Left over after matching: {lo['instructions']} instructions with no kernel matched "
      f"(estimated {lo['est_s'] * 1e3:.3f} ms) against {lo['measured_s'] * 1e3:.3f} ms of "
      f"kernels matched to no instruction (library kernels replayed from a command buffer, "
      f"named by the library: {', '.join(f'`{k}`' for k in lo['kernels'][:4]) or 'none'})."
    )
  with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(out)
  return 0


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("run")
  p.add_argument("out")
  p.add_argument("--sizes", default="large,medium,large+scan_remat")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--target", default=None, help="catalogue topology (default: the GPU's, x1)")
  p.add_argument("--no-deviceless", action="store_true")
  q = sub.add_parser("render")
  q.add_argument("json")
  q.add_argument("out")
  a = parser.parse_args(argv)
  if a.cmd == "render":
    return render(a.json, a.out)
  sizes = [s for s in a.sizes.split(",") if s]
  unknown = [
    s for s in sizes if s.partition("+")[0] not in TP_SIZES or s.partition("+")[2] not in FORMS
  ]
  if unknown:
    parser.error(
      f"unknown sizes {unknown}; expected SIZE or SIZE+FORM, SIZE one of {sorted(TP_SIZES)}, "
      f"FORM one of {sorted(f for f in FORMS if f)}"
    )
  return run(a.out, sizes, a.steps, a.target, not a.no_deviceless)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
