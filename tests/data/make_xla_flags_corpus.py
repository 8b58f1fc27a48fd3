"""Writes tests/data/xla_flags_corpus.json: XLA_FLAGS strings labelled by what jaxlib does.

The strings come from three places:
* public recipes (MaxText and JAX-Toolbox GPU recipes, JAX's GPU performance
  tips and FAQ, XLA's own docs), whole and flag by flag;
* XLA's own flag list, as the installed jaxlib prints it when it rejects a
  value (the head of its usage text): flags at their printed defaults, bare,
  and with a value of the wrong type;
* spellings users get wrong: quotes, blanks, single dashes, '--', repeated
  flags, text after the flags, values at the edges of each type.

Each string is labelled by running it: a fresh Python process with the string
in XLA_FLAGS starts jax's CPU backend, and the label is whether it aborted.

  python tests/data/make_xla_flags_corpus.py
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
START = "import jax; jax.devices()"

RECIPES = [
  # MaxText GPU recipe (A3, 2024).
  "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
  "--xla_gpu_graph_level=0 --xla_gpu_enable_highest_priority_async_stream=true "
  "--xla_gpu_all_reduce_combine_threshold_bytes=134217728 "
  "--xla_gpu_all_gather_combine_threshold_bytes=134217728 "
  "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864 "
  "--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true "
  "--xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true "
  "--xla_gpu_enable_triton_softmax_fusion=false --xla_gpu_enable_all_gather_combine_by_dim=false "
  "--xla_gpu_enable_reduce_scatter_combine_by_dim=false --xla_disable_hlo_passes=rematerialization",
  # The same recipe with the flags current jaxlibs removed taken out.
  "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
  "--xla_gpu_enable_command_buffer= --xla_gpu_enable_highest_priority_async_stream=true "
  "--xla_gpu_all_reduce_combine_threshold_bytes=134217728 "
  "--xla_gpu_all_gather_combine_threshold_bytes=134217728 "
  "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864 "
  "--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true "
  "--xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true "
  "--xla_gpu_enable_all_gather_combine_by_dim=false "
  "--xla_gpu_enable_reduce_scatter_combine_by_dim=false --xla_disable_hlo_passes=rematerialization",
  # JAX-Toolbox (PAX/T5X GPU recipes, 2023).
  "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_async_all_gather=true "
  "--xla_gpu_enable_async_reduce_scatter=true --xla_gpu_enable_triton_gemm=false "
  "--xla_gpu_simplify_all_fp_conversions --xla_gpu_enable_async_all_reduce=true "
  "--xla_gpu_enable_highest_priority_async_stream=true "
  "--xla_gpu_all_reduce_combine_threshold_bytes=51200 --xla_gpu_graph_level=0",
  "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
  "--xla_gpu_enable_highest_priority_async_stream=true "
  "--xla_gpu_all_reduce_combine_threshold_bytes=51200 --xla_gpu_enable_command_buffer=''",
  # JAX GPU performance tips.
  "--xla_gpu_enable_triton_softmax_fusion=true --xla_gpu_triton_gemm_any=True "
  "--xla_gpu_enable_async_collectives=true --xla_gpu_enable_latency_hiding_scheduler=true "
  "--xla_gpu_enable_highest_priority_async_stream=true",
  "--xla_gpu_triton_gemm_any=True --xla_gpu_enable_latency_hiding_scheduler=true "
  "--xla_gpu_enable_highest_priority_async_stream=true",
  "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_pipelined_all_gather=true "
  "--xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_pipelined_all_reduce=true "
  "--xla_gpu_enable_pipelined_collectives=false --xla_gpu_enable_while_loop_double_buffering=true",
  "--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_threshold_for_windowed_einsum_mib=0",
  "--xla_gpu_enable_nccl_user_buffers=true --xla_gpu_enable_nccl_comm_splitting=true",
  "--xla_gpu_enable_cudnn_fmha=true --xla_gpu_fused_attention_use_cudnn_rng=true",
  "--xla_gpu_deterministic_ops=true",
  "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0",
  "--xla_gpu_exhaustive_tiling_search=true",
  "--xla_gpu_enable_cublaslt=true --xla_gpu_enable_triton_gemm=false",
  "--xla_gpu_enable_dynamic_slice_fusion=true",
  "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/jax_autotune",
  "--xla_gpu_cuda_data_dir=/usr/local/cuda",
  "--xla_gpu_force_compilation_parallelism=1",
  "--xla_gpu_enable_xla_runtime_executable=true",
  "--xla_gpu_enable_custom_fusions=true --xla_gpu_enable_custom_fusions_re=cutlass_gemm",
  "--xla_gpu_enable_triton_hopper=true",
  "--xla_gpu_lhs_enable_gpu_async_tracker=true --xla_gpu_enable_nccl_per_stream_comms=true",
  "--xla_gpu_enable_async_collective_permute=true",
  "--xla_gpu_cudnn_gemm_fusion=true",
  "--xla_gpu_cudnn_gemm_fusion_level=2",
  "--xla_gpu_graph_min_graph_size=1",
  "--xla_gpu_strict_conv_algorithm_picker=false",
  "--xla_gpu_memory_limit_slop_factor=95",
  "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
  "--xla_gpu_enable_analytical_latency_estimator=true",
  "--xla_gpu_pgle_profile_file_or_directory_path=/tmp/profile.pbtxt",
  "--xla_gpu_dot_merger_threshold_mb=0",
  "--xla_gpu_collective_permute_decomposer_threshold=1024",
  "--xla_gpu_nccl_collective_max_nchannels=8",
  # TPU options put in XLA_FLAGS (they belong in LIBTPU_INIT_ARGS).
  "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
  "--xla_enable_async_all_gather=true",
  # CPU recipes from JAX's FAQ and tests.
  "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
  "--xla_cpu_multi_thread_eigen=false --intra_op_parallelism_threads=1",
  "--xla_force_host_platform_device_count=8",
  "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=false",
  "--xla_cpu_enable_fast_math=true",
  "--xla_cpu_use_thunk_runtime=false",
  # Dumping, from XLA's docs.
  "--xla_dump_to=/tmp/xla_dump",
  "--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_as_text",
  "--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_as_text=true --xla_dump_hlo_pass_re=.*",
  "--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_module_re=jit_train_step",
  "--xla_dump_to",
  "--xla_dump_hlo_pass_re",
  "--xla_dump_to=sponge",
  "--xla_dump_hlo_as_proto --xla_dump_to=/tmp/d",
  "--xla_dump_hlo_as_html=true --xla_dump_fusion_visualization",
  "--xla_dump_hlo_snapshots",
  # Pipelining spelled as newer XLA spells it.
  "--xla_gpu_pipeline_all_gather=on",
  "--xla_gpu_pipeline_reduce_scatter=off --xla_gpu_pipeline_all_reduce=on",
  # Environment variables written as flags.
  "--NCCL_MAX_CTAS=4",
  "--CUDA_DEVICE_MAX_CONNECTIONS=1",
]

EDGES = [
  "",
  "   ",
  "\t\n",
  "  --xla_gpu_autotune_level=0  ",
  "\n--xla_gpu_autotune_level=0\n--xla_gpu_enable_triton_gemm=false\n",
  "--",
  "-- --xla_gpu_autotune_level=0",
  "--xla_gpu_autotune_level=0 --",
  "--help",
  "-xla_gpu_autotune_level=0",
  "--xla-gpu-autotune-level=0",
  "--xla_gpu_autotune_level 0",
  "--xla_gpu_autotune_level = 0",
  "--xla_gpu_autotune_level=0 junk --xla_gpu_autotune_level=abc",
  "--xla_gpu_autotune_level=0 'junk'",
  "'--xla_gpu_enable_latency_hiding_scheduler=true'",
  '"--xla_gpu_enable_latency_hiding_scheduler=true"',
  "xla_gpu_enable_latency_hiding_scheduler=true",
  "/nonexistent/xla_flags.txt",
  "--xla_dump_to='/tmp/a b'",
  '--xla_dump_to="/tmp/a b"',
  '--xla_dump_to="/tmp/a \\"b\\""',
  '--xla_dump_to="unterminated',
  "--xla_dump_to='unterminated",
  '--xla_dump_to="x"y --xla_gpu_autotune_level=abc',
  '--xla_dump_to="x" --xla_gpu_autotune_level=abc',
  "--xla_dump_to=a'b",
  '--xla_gpu_autotune_level="3"',
  '--xla_gpu_autotune_level=" 3"',
  '--xla_gpu_autotune_level="3 "',
  "--xla_gpu_autotune_level=+3",
  "--xla_gpu_autotune_level=-3",
  "--xla_gpu_autotune_level=0x3",
  "--xla_gpu_autotune_level=3.0",
  "--xla_gpu_autotune_level=1e2",
  "--xla_gpu_autotune_level=007",
  "--xla_gpu_autotune_level=",
  "--xla_gpu_autotune_level=2147483647",
  "--xla_gpu_autotune_level=2147483648",
  "--xla_gpu_autotune_level=-2147483649",
  "--xla_gpu_all_gather_combine_threshold_bytes=9223372036854775807",
  "--xla_gpu_all_gather_combine_threshold_bytes=9223372036854775808",
  "--xla_gpu_all_gather_combine_threshold_bytes=-1",
  "--xla_gpu_all_gather_combine_threshold_bytes=1GB",
  "--xla_gpu_all_gather_combine_threshold_bytes=1_000",
  "--xla_gpu_all_gather_combine_threshold_bytes=134217728 "
  "--xla_gpu_all_gather_combine_threshold_bytes=0",
  "--xla_gpu_autotune_gemm_rtol=0.1",
  "--xla_gpu_autotune_gemm_rtol=.5",
  "--xla_gpu_autotune_gemm_rtol=5.",
  "--xla_gpu_autotune_gemm_rtol=1e-3",
  "--xla_gpu_autotune_gemm_rtol=+0.5",
  "--xla_gpu_autotune_gemm_rtol=-0.5",
  "--xla_gpu_autotune_gemm_rtol=inf",
  "--xla_gpu_autotune_gemm_rtol=nan",
  "--xla_gpu_autotune_gemm_rtol=abc",
  "--xla_gpu_autotune_gemm_rtol=0x1p3",
  "--xla_gpu_autotune_gemm_rtol=1,5",
  "--xla_gpu_autotune_gemm_rtol",
  "--xla_gpu_enable_latency_hiding_scheduler",
  "--xla_gpu_enable_latency_hiding_scheduler=TRUE",
  "--xla_gpu_enable_latency_hiding_scheduler=True",
  "--xla_gpu_enable_latency_hiding_scheduler=1",
  "--xla_gpu_enable_latency_hiding_scheduler=0",
  "--xla_gpu_enable_latency_hiding_scheduler=yes",
  "--xla_gpu_enable_latency_hiding_scheduler=on",
  "--xla_gpu_enable_latency_hiding_scheduler=2",
  "--xla_gpu_enable_latency_hiding_scheduler=",
  "--xla_gpu_enable_latency_hiding_scheduler=' true'",
  "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_latency_hiding_scheduler=false",
  "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_latency_hiding_scheduler=1",
  "--xla_gpu_enable_latency_hiding_schedule=true",
  "--xla_gpu_enable_latency_hiding_scheduler_extra=true",
  "--xla_gpu_enable_highest_priority_async_stream=false",
  "--xla_gpu_enable_command_buffer=",
  "--xla_gpu_enable_command_buffer=''",
  "--xla_gpu_enable_command_buffer=FUSION,CUBLAS",
  "--xla_gpu_enable_command_buffer=fusion",
  "--xla_gpu_enable_command_buffer=+FUSION,-CUBLAS",
  "--xla_gpu_enable_command_buffer=+FUSION,CUBLAS",
  "--xla_gpu_enable_command_buffer=FUSION,FOO",
  "--xla_gpu_enable_command_buffer",
  "--xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER",
  "--xla_gpu_disable_async_collectives=allreduce",
  "--xla_gpu_disable_async_collectives=",
  "--xla_gpu_disable_async_collectives=FOO",
  "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER",
  "--xla_gpu_enable_while_loop_unrolling=double_buffer",
  "--xla_step_marker_location=STEP_MARK_AT_ENTRY",
  "--xla_step_marker_location=entry",
  "--xla_gpu_shape_checks=IGNORE",
  "--xla_gpu_shape_checks=ignore",
  "--xla_gpu_detect_nan=none",
  "--xla_gpu_detect_nan=NONE",
  "--xla_cpu_opt_preset=fast_compile",
  "--xla_cpu_opt_preset=turbo",
  "--xla_fuel=dce=3",
  "--xla_fuel=dce",
  "--xla_gpu_experimental_max_unroll_factor=0",
  "--xla_gpu_experimental_max_unroll_factor=4",
  "--xla_disable_hlo_passes=rematerialization,while-loop-unroller",
  '--xla_disable_hlo_passes="rematerialization, cse"',
  "--xla_backend_extra_options=xla_cpu_disable_mlir=true",
  "--xla_gpu_ptx_compiler_extra_flags='-O3 -v'",
]


def aborts(text: str) -> bool:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
  env.update(XLA_FLAGS=text, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, timeout=300)
  return proc.returncode != 0


def xla_flag_list() -> list[tuple[str, str, str]]:
  """(name, printed default, type) for the flags at the head of XLA's usage text."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env.update(XLA_FLAGS="--xla_gpu_autotune_level=x", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0")
  proc = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True)
  out = []
  for m in re.finditer(
    r"^\t--(\w+)=(.*?)\s*\t(bool|int32|int64|float|string)\t", proc.stderr, re.M
  ):
    out.append((m.group(1), m.group(2), m.group(3)))
  return out


def from_flag_list() -> list[str]:
  """Every other flag at its printed default; every fourth also bare and with a wrong value."""
  wrong = {"bool": "maybe", "int32": "1.5", "int64": "ten", "float": "x1"}
  out = []
  for i, (name, default, type_) in enumerate(xla_flag_list()):
    if i % 2 == 0:
      out.append(f"--{name}={default}")
    if i % 4 == 1:
      out.append(f"--{name}")
      if type_ in wrong:
        out.append(f"--{name}={wrong[type_]}")
  return out


def main() -> None:
  import jaxlib

  strings = list(dict.fromkeys(RECIPES + EDGES + from_flag_list()))
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    labels = list(pool.map(aborts, strings))
  corpus = {
    "jaxlib": jaxlib.__version__,
    "label": "true when a process with this XLA_FLAGS aborts as jax starts its CPU backend",
    "entries": [{"xla_flags": s, "aborts": a} for s, a in zip(strings, labels)],
  }
  path = os.path.join(HERE, "xla_flags_corpus.json")
  with open(path, "w") as f:
    json.dump(corpus, f, indent=1)
    f.write("\n")
  print(f"wrote {path}: {len(strings)} strings, {sum(labels)} abort")


if __name__ == "__main__":
  main()
