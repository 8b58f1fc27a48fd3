"""benchmarks/gpu/model_check.py: how measured kernels meet the analysis' instructions."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _module():
  spec = importlib.util.spec_from_file_location(
    "model_check", REPO / "benchmarks" / "gpu" / "model_check.py"
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


ESTIMATES = {
  "fusion.82": {"est_s": 8e-4, "kind": "fusion", "launch_name": "fusion_82"},
  "gemm_fusion_dot.14": {"est_s": 5e-4, "kind": "gemm", "launch_name": "gemm_fusion_dot_14"},
  "custom-call.11": {"est_s": 3e-4, "kind": "gemm", "launch_name": ""},
  "loop_add_fusion": {"est_s": 1e-5, "kind": "fusion", "launch_name": "loop_add_fusion"},
}


def test_kernels_replayed_from_a_command_buffer_are_matched_by_kernel_name():
  mc = _module()
  measured = {
    "kernel:fusion_82": 7e-4,  # inside a command buffer: by kernel name
    "kernel:gemm_fusion_dot_14": 4e-4,
    "kernel:nvjet_hsh_256x128_2cta": 2.5e-4,  # cuBLAS's own name: no instruction
    "loop_add_fusion": 2e-5,  # outside one: by hlo_op
  }
  c = mc.compare(ESTIMATES, measured)
  rows = {r["op"]: r["measured_s"] for r in c["top"]}
  assert rows["fusion.82"] == 7e-4 and rows["gemm_fusion_dot.14"] == 4e-4
  assert rows["loop_add_fusion"] == 2e-5 and rows["custom-call.11"] is None
  assert c["by_kind"]["fusion"] == {"est_s": 8e-4 + 1e-5, "measured_s": 7e-4 + 2e-5, "count": 2}
  assert c["left_over"] == {
    "instructions": 1,
    "est_s": 3e-4,
    "measured_s": 2.5e-4,
    "kernels": ["kernel:nvjet_hsh_256x128_2cta"],
  }
  assert c["matched_measured_s"] == 7e-4 + 4e-4 + 2e-5


def test_instructions_sharing_one_kernel_are_compared_as_one_row():
  # XLA emits one kernel for identical fusions: replayed from a command buffer, both
  # launches carry that kernel's name, and their time is compared with both estimates.
  mc = _module()
  est = {
    "loop_convert_fusion.2": {"est_s": 1e-3, "kind": "fusion", "launch_name": "lcf_2"},
    "loop_convert_fusion.3": {"est_s": 1e-3, "kind": "fusion", "launch_name": "lcf_2"},
    "fusion.9": {"est_s": 2e-4, "kind": "reduction", "launch_name": "fusion_9"},
  }
  c = mc.compare(est, {"kernel:lcf_2": 1.9e-3, "kernel:fusion_9": 2.1e-4})
  rows = {r["op"]: r for r in c["top"]}
  pair = rows["loop_convert_fusion.2 + loop_convert_fusion.3"]
  assert pair["est_s"] == 2e-3 and pair["measured_s"] == 1.9e-3 and pair["kind"] == "fusion"
  assert set(rows) == {"loop_convert_fusion.2 + loop_convert_fusion.3", "fusion.9"}
  assert c["by_kind"]["fusion"] == {"est_s": 2e-3, "measured_s": 1.9e-3, "count": 1}
  assert c["left_over"]["instructions"] == 0 and c["measured_not_estimated_s"] == {}
  # Matched by hlo_op (command buffers off), each instruction keeps its own row.
  c = mc.compare(est, {"loop_convert_fusion.2": 9e-4, "loop_convert_fusion.3": 1e-3})
  rows = {r["op"]: r["measured_s"] for r in c["top"]}
  assert rows["loop_convert_fusion.2"] == 9e-4 and rows["loop_convert_fusion.3"] == 1e-3


def test_the_committed_h200_run_renders(tmp_path):
  mc = _module()
  src = REPO / "benchmarks" / "results" / "model_check_nvidia_h200_2026-12-04.json"
  out = tmp_path / "r.md"
  assert mc.render(str(src), str(out)) == 0
  text = out.read_text()
  r = json.loads(src.read_text())
  large = r["programs"]["large"]
  ratio = large["estimate"]["compute_s"] / large["measured"]["kernel_s"]
  assert f"| large | {large['measured']['wall_s'] * 1e3:.3f} |" in text
  assert f"{ratio:.3f}" in text
  assert "no per-kernel comparison in this run" in text  # that run's kernels were all in a buffer


def test_training_steps_as_users_write_them_run_and_update_their_parameters():
  # The forms the GPU session measures beside the deviceless estimate: optax's AdamW in
  # a plain jax.jit step, and a Flax nn.scan(nn.remat(Block)) module (tiny sizes, CPU).
  import jax
  import numpy as np

  mc = _module()
  for form in ("adamw", "flax_scan_remat"):
    step, args, dims = mc.build("tiny", form=form)
    loss, params, opt_state = step(*args)
    assert np.isfinite(float(loss)), form
    before, after = jax.tree.leaves(args[0]), jax.tree.leaves(params)
    # Four weights per block: unrolled, a list of blocks; scanned, stacked along layers.
    assert len(before) == len(after) == (4 if form == "flax_scan_remat" else 4 * dims["layers"])
    assert any(not np.array_equal(a, b) for a, b in zip(before, after)), form
  with pytest.raises(SystemExit):
    mc.main(["run", "/tmp/never.json", "--sizes", "tiny+no_such_form"])
