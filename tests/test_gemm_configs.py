"""A selection's compiles hand each other the tiles XLA's config assigner chose for their
Triton GEMM fusions (jaxlib 0.11 and later: its assigner compiles one configuration per
fusion at autotuning level 0), through XLA's own per-fusion cache."""

import glob
import os

import jaxlib
import pytest

import jax_overlap
from jax_overlap._src import cache
from jax_overlap._src.compile import compiler, gemm_configs, kernel_cache
from jax_overlap._src.flags.validation import version_tuple
from jax_overlap._src.transform import compiles
from jax_overlap.examples import fsdp_transformer as G

assigner_compiles = pytest.mark.skipif(
  version_tuple(jaxlib.__version__) < (0, 11),
  reason="jaxlib 0.10's config assigner takes its default tiles without a compile",
)


def _compile(fn, args, options):
  return compiler.compile_for_target(
    fn, *args, target="h100x8", xla_options={**compiles.NO_AUTOTUNING, **options}, keep_dump=True
  )


def _tiles(config, like):
  """``config``'s values (its backend config prints them as strings) of ``like``'s keys."""
  return {k: int(config.get(k, 0)) for k in like}


@assigner_compiles
def test_the_probe_finds_the_cache_version_xla_takes_files_for():
  assert isinstance(gemm_configs.version(), int)


@assigner_compiles
def test_every_gemm_fusion_of_a_step_finds_its_file(tmp_path):
  # XLA takes a file only where the key (device, canonical computation, version) is its own:
  # given other tiles in every file, a compile that applied them to all of its GEMM fusions
  # looked none of them up in vain, and compiled none. XLA keeps what it read for the
  # process: the step's sizes are its own, so that no other test's fusion is one of these.
  assert gemm_configs.version() is not None
  fn, args = G.build("h100x8", layers=2, scan=True, hidden=576, mlp=1600, heads=9, seq=320)
  base = jax_overlap.flags.as_compiler_options(target="h100x8", workload="fsdp")
  directory = gemm_configs.new_directory(str(tmp_path))
  first = _compile(fn, args, {**base, **gemm_configs.options(directory)})
  chosen = gemm_configs.chosen(first.dump_dir)
  assert chosen and len(os.listdir(directory)) == len({h for h, _ in chosen})
  other = {"block_m": 32, "block_n": 32, "block_k": 32, "num_stages": 1, "num_warps": 4}
  other["num_ctas"] = 1
  assert all(_tiles(c, other) != other for _, c in chosen)
  for path in glob.glob(os.path.join(directory, "*.textproto")):
    cache.write_text(path, gemm_configs._result(other))
  # Another variant of the step (one of the selection's option changes).
  variant = {**base, "xla_gpu_enable_highest_priority_async_stream": False}
  second = _compile(fn, args, {**variant, **gemm_configs.options(directory)})
  applied = gemm_configs.chosen(second.dump_dir)
  assert len(applied) == len(chosen)
  assert all(_tiles(c, other) == other for _, c in applied)


@assigner_compiles
def test_shared_tiles_change_no_kernel_grid_or_estimate():
  fn, args = G.build_small("h100x8", layers=2, scan=True)
  base = {
    **jax_overlap.flags.as_compiler_options(target="h100x8", workload="fsdp"),
    **compiles.NO_AUTOTUNING,
  }
  with kernel_cache.Shared() as shared:
    seed = shared.seed(base)
    assert gemm_configs.ours(seed)
    jax_overlap.analyze(fn, *args, target="h100x8", xla_options=seed)
    assert os.listdir(gemm_configs.ours(seed))
    given = {k: v for k, v in shared.copy(base).items() if k != kernel_cache.OPTION}
    shared_tiles = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=given)
  alone = jax_overlap.analyze(fn, *args, target="h100x8", xla_options=base)
  kernels = [(k.name, k.grid_blocks, k.threads_per_block, k.smem_bytes) for k in alone.kernels]
  assert [
    (k.name, k.grid_blocks, k.threads_per_block, k.smem_bytes) for k in shared_tiles.kernels
  ] == kernels
  assert shared_tiles.step_time_s == alone.step_time_s


def test_options_the_user_sets_for_the_cache_are_left_alone():
  with kernel_cache.Shared() as shared:
    mine = {"xla_gpu_per_fusion_autotune_cache_dir": "/my/cache"}
    given = shared.copy(mine)
  assert given["xla_gpu_per_fusion_autotune_cache_dir"] == "/my/cache"
  assert gemm_configs.ours(given) is None
  assert gemm_configs.record("/nonexistent", given) == 0


def test_keys_are_named_as_xla_names_their_files():
  # XLA's file for a key is the SHA-256 of "<key model='...', hlo='...', version=N>",
  # base64 URL-safe without padding (a file name read from XLA's own log, jaxlib 0.12.1).
  hlo = (
    "{\n  tmp_0 = bf16[4096,2048]{1,0} parameter(0)\n"
    "  tmp_1 = bf16[4096,8192]{1,0} parameter(1)\n"
    "  ROOT tmp_2 = bf16[2048,8192]{1,0} dot(bf16[4096,2048]{1,0} tmp_0, bf16[4096,8192]{1,0} "
    "tmp_1), lhs_contracting_dims={0}, rhs_contracting_dims={0}\n}"
  )
  model = (
    "CUDA: 9.0, Cores: 132, GPU clock: 1.98 GHz, Memory bandwidth: 3352 GB/s, L2 cache: 50 MB, "
    "DNN version: 0.0.0"
  )
  assert (
    gemm_configs.file_name(model, hlo, 60)
    == "BW8HNeXSX6HXYBZyaETCKjjh4iygl-y6V-AsUy6shdk.textproto"
  )


def test_a_selection_with_options_that_change_tiles_shares_none():
  with kernel_cache.Shared() as shared:
    for mine in (
      {"xla_gpu_exhaustive_tiling_search": True},
      {"xla_gpu_enable_triton_gemm": False},
      {"xla_gpu_filter_kernels_spilling_registers_on_autotuning": False},
    ):
      assert gemm_configs.ours(shared.copy(mine)) is None
  assert not gemm_configs.shapes_tiles(compiles.NO_AUTOTUNING)
