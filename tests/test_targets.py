"""Tests for the GPU catalogue and compile-only meshes."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_overlap import targets


@pytest.mark.parametrize("name", ["a40", "a100", "a100-40", "h100", "h200", "mi250x"])
def test_catalogue_limits_are_consistent(name):
  g = targets.get_gpu(name)
  assert g.smem_per_block_optin <= g.smem_per_sm
  assert g.smem_per_block <= g.smem_per_block_optin
  assert g.max_threads_per_block <= g.max_threads_per_sm
  assert g.peak_bf16_flops > g.peak_fp32_flops
  # Machine balance (FLOP per byte of HBM) is in the range every modern GPU has.
  assert 50 < g.peak_bf16_flops / g.memory_bandwidth < 400


def test_published_per_sm_limits():
  # BACKGROUND section 2: public per-SM limits.
  assert targets.get_gpu("h100").sm_count == 132
  assert targets.get_gpu("h100").smem_per_sm == 228 * 1024
  assert targets.get_gpu("h100").smem_per_block_optin == 227 * 1024
  assert targets.get_gpu("a100").sm_count == 108
  assert targets.get_gpu("a100").smem_per_sm == 164 * 1024
  assert targets.get_gpu("a40").sm_count == 84
  assert targets.get_gpu("a40").max_threads_per_sm == 1536
  assert targets.get_gpu("mi250x").smem_per_sm == 64 * 1024
  assert targets.get_gpu("h200").memory_bandwidth > targets.get_gpu("h100").memory_bandwidth


@pytest.mark.parametrize(
  "name,hosts,per_host",
  [("h100x8", 1, 8), ("a100x4", 1, 4), ("h200x16", 2, 8), ("h100", 1, 8), ("A100X8", 1, 8)],
)
def test_topology_names(name, hosts, per_host):
  t = targets.get(name)
  assert (t.num_hosts, t.gpus_per_host) == (hosts, per_host)
  assert t.num_devices == hosts * per_host


def test_link_for_spans_hosts():
  t = targets.get("h200x16")
  assert t.link_for(8) == (t.gpu.link_bandwidth, t.gpu.link_latency_s)
  assert t.link_for(16) == (t.gpu.network_bandwidth, t.gpu.network_latency_s)


@pytest.mark.parametrize(
  "bad,match",
  [
    ("v100x8", "unknown target 'v100x8'.*valid choices|gpu one of a100"),
    ("h100x12", "whole hosts of 8"),
    ("h100x0", "at least 1"),
    ("", "unknown target"),
  ],
)
def test_bad_topology_names(bad, match):
  with pytest.raises(ValueError, match=match):
    targets.get(bad)


def test_bad_topology_type():
  with pytest.raises(TypeError, match="topology name"):
    targets.get(8)


def test_gpu_target_config_carries_catalogue_numbers():
  text = targets.gpu_target_config("a100")
  assert "core_count: 108" in text
  assert "shared_memory_per_block_optin: 166912" in text
  assert 'platform_name: "CUDA"' in text
  with pytest.raises(ValueError, match="only available for NVIDIA"):
    targets.gpu_target_config("mi250x")


def test_compile_only_mesh_shapes():
  mesh = targets.compile_only_mesh("h100x8", {"fsdp": 4, "tensor": 2})
  assert dict(mesh.shape) == {"fsdp": 4, "tensor": 2}
  assert mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
  mesh2 = targets.compile_only_mesh("h200x16", ("data", "fsdp"), (2, 8))
  assert mesh2.devices.size == 16
  with pytest.raises(ValueError, match="has 6 devices but h100x8 has 8"):
    targets.compile_only_mesh("h100x8", {"fsdp": 3, "tensor": 2})
  with pytest.raises(ValueError, match="only available for NVIDIA"):
    targets.compile_only_mesh("mi250xx8")
  # One axis is a one-name sequence: a string is not read letter by letter.
  with pytest.raises(TypeError, match=r"got the string 'fsdp'; write \('fsdp',\)"):
    targets.compile_only_mesh("h100x8", "fsdp")
  with pytest.raises(ValueError, match="axis names must differ"):
    targets.compile_only_mesh("h100x8", ("fsdp", "fsdp"), (4, 2))


@pytest.mark.parametrize("name", ["a40x8", "a100x8", "h100x8", "h200x8"])
def test_deviceless_compile_reports_target_memory(name):
  mesh = targets.compile_only_mesh(name, ("fsdp",))
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  compiled = jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile()
  stats = compiled.memory_analysis()
  # Each device holds 8 of the 64 rows.
  assert stats.argument_size_in_bytes == 8 * 256 * 4


def test_deviceless_compile_without_jax_platforms():
  # A machine without a GPU, JAX_PLATFORMS unset: the CUDA plugin's start-up check fails
  # (no cuDNN/driver), and the compile for h100x8 must still work.
  import os
  import subprocess
  import sys
  import textwrap

  code = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    import jax_overlap
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    r = jax_overlap.analyze(lambda a: jnp.tanh(a @ a), x, target="h100x8")
    assert r.kernels, "no kernels in the report"
    import os
    # The plugin's check is skipped for that one call only, not for the rest of the process.
    assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ
    print("COMPILED", jax.devices()[0].platform, r.step_time_s > 0)
    """
  )
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "COMPILED cpu True" in proc.stdout
