"""MaxText's own train step under @overlap (jax_overlap.examples.maxtext): the decorated
step's numbers on CPU devices against the step's, and the deviceless comparison for h100x8,
under the XLA_FLAGS MaxText sets.

MaxText needs Python 3.12 or later and jax 0.11.1 or later; there `make test-jax` installs
it (the `maxtext` extra) and these tests fail, rather than skip, where it cannot be imported.
The step's shard_map form (gspmd="convert") is checked against the step on CPU devices too.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

_JAX = tuple(int(p) for p in jax.__version__.split(".")[:3])

pytestmark = [
  pytest.mark.skipif(
    sys.version_info < (3, 12) or _JAX < (0, 11, 1),
    reason="MaxText 0.2.5 needs Python 3.12 or later and jax 0.11.1 or later",
  ),
  pytest.mark.slow,
]

# A MaxText Llama 2 model small enough for CPU devices (2 scanned, rematerialised layers,
# FSDP over the 8 devices), in float32 so that two programs' results compare tightly.
TINY = dict(
  base_num_decoder_layers=2,
  base_emb_dim=64,
  base_mlp_dim=128,
  base_num_query_heads=4,
  base_num_kv_heads=4,
  head_dim=16,
  vocab_size=256,
  max_target_length=64,
  dtype="float32",
)

# The XLA_FLAGS MaxText sets, as its train and compile scripts do when the variable is unset
# (its HLO dump settings, a module filter among them), read from a process of its own: the
# configuration starts JAX's backends, so the CPU device count cannot be added after them.
_MAXTEXT_FLAGS = """
import json, os, sys
from jax_overlap.examples import maxtext
maxtext.require()  # fails, naming the extra, where MaxText is missing
maxtext.config(8, **json.loads(sys.argv[1]))
print(os.environ["XLA_FLAGS"])
"""

# Under those flags and the CPU device count, MaxText's step is built, run plain and under
# @overlap(target="h100x8"), and analysed for h100x8 as written and decorated. The selection
# leaves out the step's shard_map form (gspmd="as_written"), which the next test runs: it is
# estimated slower on h100x8, and its compiles would double this test's time.
_SCRIPT = """
import json, os, sys
import jax, numpy as np, jax_overlap
from jax_overlap.examples import maxtext

tiny = json.loads(sys.argv[1])
step, (state, batch) = maxtext.build_local(donate=False, **tiny)
decorated = jax_overlap.overlap(step, target="h100x8", gspmd="as_written")
new_state, metrics = step(state, batch)
new_state_ov, metrics_ov = decorated(state, batch)
values = lambda tree: [
  np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
  for a in jax.tree.leaves(tree)
]
np.savez(sys.argv[2], *values(new_state))
np.savez(sys.argv[3], *values(new_state_ov))
reports = {
  "as written": jax_overlap.analyze(step, state, batch, target="h100x8"),
  "@overlap": jax_overlap.analyze(decorated, state, batch, target="h100x8"),
}
print(json.dumps({
  "xla_flags": os.environ["XLA_FLAGS"],
  "chosen": decorated.explain(state, batch).chosen,
  "loss": [float(m["scalar"]["learning/loss"]) for m in (metrics, metrics_ov)],
  "reports": {k: {**r.summary(), "exposed_fraction": r.exposed_fraction} for k, r in reports.items()},
  "trained": any(not np.array_equal(x, y) for x, y in zip(values(state), values(new_state))),
}))
"""


def test_overlap_on_maxtexts_step_under_its_xla_flags(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  dump = str(tmp_path / "xla_dump") + "/"
  tiny = json.dumps({**TINY, "dump_hlo_local_dir": dump})

  def run(script, *args, timeout):
    proc = subprocess.run(
      [sys.executable, "-c", script, tiny, *args],
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stdout.strip().splitlines()[-1]

  flags = run(_MAXTEXT_FLAGS, timeout=120)
  assert flags == (
    f"--xla_dump_to={dump} --xla_dump_large_constants --xla_dump_hlo_module_re=jit_train_step"
  )
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
  plain, decorated = tmp_path / "plain.npz", tmp_path / "decorated.npz"
  out = json.loads(run(_SCRIPT, str(plain), str(decorated), timeout=540))
  assert out["xla_flags"] == env["XLA_FLAGS"]  # MaxText leaves a variable that is set
  # Numbers: the chosen variant's against the step's.
  chosen = out["chosen"]
  loss, loss_ov = out["loss"]
  assert np.isfinite(loss) and loss > 0
  a, b = np.load(plain), np.load(decorated)
  assert len(a.files) == len(b.files) > 10
  if chosen.startswith("as written"):
    # Compiler options only: the same program, bit for bit.
    assert loss_ov == loss, chosen
    for k in a.files:
      np.testing.assert_array_equal(a[k], b[k], err_msg=chosen)
  else:
    # A program rewritten in its shard_map form: its sums may run in another order.
    np.testing.assert_allclose(loss_ov, loss, rtol=1e-5, err_msg=chosen)
    for k in a.files:
      np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=chosen)
  assert out["trained"]  # the step changed the state
  # Deviceless for h100x8: the selection keeps the step as written among its candidates.
  written, ov = out["reports"]["as written"], out["reports"]["@overlap"]
  for r in (written, ov):
    assert r["target"] == "h100x8" and r["comm_time_s"] > 0 and r["num_collectives"] > 0, r
  assert ov["step_time_s"] <= written["step_time_s"] * (1 + 1e-9), out
  print(
    f"\nMaxText step, {TINY}, on h100x8: {written['step_time_s'] * 1e3:.3f} ms, exposed "
    f"{written['exposed_fraction']:.1%} as written; {ov['step_time_s'] * 1e3:.3f} ms, exposed "
    f"{ov['exposed_fraction']:.1%} under @overlap ({chosen})"
  )


def test_shard_map_form_of_maxtexts_step_computes_the_step():
  # The step converted to shard_map and rewritten, run whatever the cost model says: its
  # values are the step's to float32 rounding. (Its RMSNorm moves a split from one
  # dimension to another: test_to_shard_map.py's transposed value.)
  import jax_overlap
  from jax_overlap.examples import maxtext

  step, (state, batch) = maxtext.build_local(donate=False, **TINY)
  converted = jax_overlap.overlap(
    step, target="h100x8", select="rewrite", gspmd="convert", cache=False
  )
  assert converted.explain(state, batch).chosen.startswith("shard_map form")
  (new_state, metrics), (new_state_c, metrics_c) = step(state, batch), converted(state, batch)
  loss, loss_c = (float(m["scalar"]["learning/loss"]) for m in (metrics, metrics_c))
  np.testing.assert_allclose(loss_c, loss, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(new_state_c)):
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)


# Llama 2's layer at a quarter of its width: large enough that compute, not latency, sets the
# step, small enough to compile in seconds.
MEDIUM = dict(
  base_num_decoder_layers=2,
  base_emb_dim=1024,
  base_mlp_dim=2816,
  base_num_query_heads=8,
  base_num_kv_heads=8,
  head_dim=128,
  vocab_size=8192,
  max_target_length=1024,
)


@pytest.mark.parametrize("parallelism,bound", [("fsdp", 1.05), ("tensor", 1.15)])
def test_shard_map_form_costs_about_what_the_step_costs(parallelism, bound):
  # Converted as the partitioner lays MaxText's step out (its checkpoint names, the RMSNorm
  # scale multiplied in by an einsum, AdamW's clipped gradients reduce-scattered inside the
  # backward loop, the RMSNorm backward's per-row sums all-reduced), the shard_map form is
  # estimated within a few percent of the step as written (2.3-2.9x slower before); the
  # tensor-parallel bound is looser (its full-width form: 0.97-0.99x the step).
  import jax_overlap
  from jax_overlap.examples import maxtext

  overrides = dict(MEDIUM)
  if parallelism == "tensor":
    overrides["ici_tensor_parallelism"] = 8
  step, args = maxtext.build("h100x8", **overrides)
  fn, converted_args, converted = maxtext.shard_map_form(step, args)
  assert not converted.replicated, converted.summary()
  workload = "fsdp" if parallelism == "fsdp" else "tensor_parallel"
  options = jax_overlap.flags.as_compiler_options(target="h100x8", workload=workload)
  written = jax_overlap.analyze(step, *args, target="h100x8", xla_options=options)
  form = jax_overlap.analyze(fn, *converted_args, target="h100x8", xla_options=options)
  ratio = form.step_time_s / written.step_time_s
  print(f"\nMaxText {parallelism} step's shard_map form: {ratio:.3f}x the step as written")
  assert ratio <= bound, (ratio, converted.summary())


def test_maxtexts_tensor_parallel_step_in_batch_parts_computes_the_step():
  # MaxText's tensor-parallel step (8-way, a batch of 8 on every device) converted to
  # shard_map with its loop bodies in 4 parts of the batch: both loops run in parts, and the
  # loss and the new state are the step's to float32 rounding (a weight gradient is the
  # parts' sums added).
  from jax_overlap._src.transform.evaluate import VariantConfig, collect_stats, evaluate_program
  from jax_overlap.examples import maxtext

  tiny = {**TINY, "ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 8}
  tiny.update(base_num_query_heads=8, base_num_kv_heads=8, head_dim=8)
  step, (state, batch) = maxtext.build_local(donate=False, **tiny)
  converted, _, _ = maxtext.shard_map_form(step, (state, batch))  # on the flat arguments
  leaves = jax.tree.leaves((state, batch))
  closed = jax.make_jaxpr(converted)(*leaves)
  cfg = VariantConfig(prefetch=0, reduce_scatter="as_written", annotate=False, batch_parts=4)
  actions: list = []
  assert collect_stats(closed.jaxpr, cfg, actions, [0]).split4_loops == 2
  assert sum(a.kind == "batch_parts" for a in actions) == 2
  tree = jax.tree.structure(jax.eval_shape(step, state, batch))  # flat outputs too
  flat = jax.jit(lambda *a: evaluate_program(closed, a, cfg))(*leaves)
  new_state_p, metrics_p = jax.tree.unflatten(tree, flat)
  new_state, metrics = step(state, batch)
  loss, loss_p = (float(m["scalar"]["learning/loss"]) for m in (metrics, metrics_p))
  np.testing.assert_allclose(loss_p, loss, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(new_state_p)):
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
