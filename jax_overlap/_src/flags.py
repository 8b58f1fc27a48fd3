"""Version-safe XLA compiler options and NCCL/CUDA variables for overlap.

Recipes for overlapping collectives circulate as ``XLA_FLAGS`` strings. A flag
that the installed jaxlib does not know aborts the process when the backend
starts, with a C++ fatal error and no Python traceback. This module is the safe
way to choose and set those options:

* :data:`REGISTRY` lists the overlap-relevant options with their meaning,
  type, default and the jaxlib versions that accept them, including flags that
  were removed or renamed (and what replaces them).
* :func:`recommended` gives options for a GPU target and a workload, each
  choice explained in its registry entry.
* :func:`validate` checks a dict or an ``XLA_FLAGS`` string and returns every
  problem it finds, without ever aborting the process. Acceptance by the
  installed jaxlib is decided by jaxlib itself: options are tried as
  per-compile options, which fail with a catchable error. Where that would
  start the JAX backend too early, the trial runs in a short subprocess; its
  answers are cached per jaxlib version.
* :func:`configure` merges the choice into ``os.environ["XLA_FLAGS"]`` and the
  NCCL variables, keeping what the user set, and refuses once the backend is
  up (the flags would silently do nothing). :func:`as_compiler_options` gives
  the same choice for one ``jit`` without touching the environment.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from jax_overlap._src import cache as cache_lib
from jax_overlap._src import targets as targets_lib
from jax_overlap._src.errors import ConfigError

__all__ = [
    "Flag",
    "Problem",
    "REGISTRY",
    "WORKLOADS",
    "recommended",
    "validate",
    "configure",
    "as_compiler_options",
    "parse_xla_flags",
    "format_xla_flags",
    "accepted_by_jaxlib",
]

Workload = Literal["fsdp", "tensor_parallel", "data_parallel", "hybrid"]
WORKLOADS: tuple[str, ...] = ("fsdp", "tensor_parallel", "data_parallel", "hybrid")

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Flag:
  """One registry entry.

  Attributes:
    name: XLA option name (without ``--``) or environment variable name.
    kind: ``"xla"`` for XLA DebugOptions, ``"env"`` for an environment variable.
    type: ``"bool"``, ``"int"``, ``"float"``, ``"str"`` or ``"enum"``.
    meaning: one line saying what it does.
    default: the default of the newest jaxlib we know (None if unset/automatic).
    choices: allowed values for ``enum`` (and comma-list) flags.
    since: first jaxlib version known to accept it (None: before 0.10).
    removed_in: first jaxlib version known to reject it (None: still accepted).
    replacement: the option to use instead, when removed or renamed.
    why: why jax_overlap recommends the value it does, when it does.
  """

  name: str
  kind: Literal["xla", "env"]
  type: Literal["bool", "int", "float", "str", "enum", "list"]
  meaning: str
  default: Any = None
  choices: tuple[str, ...] = ()
  since: str | None = None
  removed_in: str | None = None
  replacement: str | None = None
  why: str = ""


def _f(*args, **kwargs) -> Flag:
  return Flag(*args, **kwargs)


# Defaults are those of jaxlib 0.10.2 (XLA commit 5a9e73c) unless noted.
_ENTRIES: tuple[Flag, ...] = (
    # --- scheduling -----------------------------------------------------------------
    _f(
        "xla_gpu_enable_latency_hiding_scheduler",
        "xla",
        "bool",
        "Schedule with the latency-hiding scheduler, which moves async collective starts early "
        "and dones late so they overlap compute.",
        default=False,
        why="Without it XLA schedules for memory and most collectives stay back to back with "
        "their users; it is the mechanism every overlap recipe relies on.",
    ),
    _f(
        "xla_gpu_enable_analytical_latency_estimator",
        "xla",
        "bool",
        "Cost collectives and fusions with an analytical model in the latency-hiding scheduler.",
        default=False,
        why="On Ampere (a100x8, a40x8) it is what lets the scheduler hide each layer's all-gather "
        "under the previous layer (exposed communication of an 8-layer FSDP step: 90% -> 6%); on "
        "Hopper XLA's default speed-of-light estimator does better, so it is not set there.",
    ),
    _f(
        "xla_gpu_enable_analytical_sol_latency_estimator",
        "xla",
        "bool",
        "Speed-of-light analytical estimator for collectives (Hopper/Blackwell).",
        default=True,
    ),
    _f(
        "xla_gpu_experimental_parallel_collective_overlap_limit",
        "xla",
        "int",
        "How many async collectives the scheduler may keep in flight at once.",
        default=1,
        why="Not raised by default: with one communication stream a second collective in flight "
        "only queues, and in deviceless FSDP analyses it exposed more reduce-scatter time.",
    ),
    _f(
        "xla_gpu_memory_limit_slop_factor",
        "xla",
        "int",
        "Percentage of device memory the latency-hiding scheduler may plan to use.",
        default=95,
    ),
    _f(
        "xla_gpu_enable_highest_priority_async_stream",
        "xla",
        "bool",
        "Create XLA's async collective streams at the highest stream priority.",
        default=True,
        why="This is the communication-priority control at stream level: the block dispatcher "
        "places collective blocks first when SMs free. jax_overlap's runtime library relies on it.",
    ),
    # --- combining --------------------------------------------------------------------
    _f(
        "xla_gpu_all_gather_combine_threshold_bytes",
        "xla",
        "int",
        "Combine all-gathers up to this many bytes into one collective.",
        default=30 * MiB,
        why="Left at XLA's default (about 30 MiB): large thresholds merge the gathers of several "
        "layers into one that nothing can hide (deviceless FSDP analyses: 17% -> 41% exposed).",
    ),
    _f(
        "xla_gpu_reduce_scatter_combine_threshold_bytes",
        "xla",
        "int",
        "Combine reduce-scatters up to this many bytes into one collective.",
        default=30 * MiB,
        why="Left at XLA's default: per-layer gradient reduce-scatters overlap the rest of the "
        "backward pass; combining them into a few large ones at the end exposes them.",
    ),
    _f(
        "xla_gpu_all_reduce_combine_threshold_bytes",
        "xla",
        "int",
        "Combine all-reduces up to this many bytes into one collective.",
        default=30 * MiB,
        why="Same trade-off as the reduce-scatter threshold for data-parallel gradients.",
    ),
    _f(
        "xla_gpu_enable_all_gather_combine_by_dim",
        "xla",
        "bool",
        "Only combine all-gathers that gather along the same dimension.",
        default=True,
    ),
    _f(
        "xla_gpu_enable_reduce_scatter_combine_by_dim",
        "xla",
        "bool",
        "Only combine reduce-scatters that scatter along the same dimension.",
        default=True,
    ),
    _f(
        "xla_gpu_dot_merger_threshold_mb",
        "xla",
        "int",
        "Merge dots that share an operand (e.g. the Q, K and V projections) into one, up to this "
        "many MB; 0 turns merging off.",
        default=32,
        why="Not set by the recipes. @overlap tries 0 in its variant that gathers the first "
        "layer's weights one by one: a merged dot waits for all of its weights and copies them "
        "into one buffer.",
    ),
    # --- loop pipelining ----------------------------------------------------------------
    _f(
        "xla_gpu_enable_pipelined_all_gather",
        "xla",
        "bool",
        "Pipeline all-gathers across while-loop iterations (issue next iteration's gather early).",
        default=False,
        replacement="xla_gpu_pipeline_all_gather",
        why="Scanned FSDP layers: the gather of layer i+1 runs during layer i.",
    ),
    _f(
        "xla_gpu_enable_pipelined_reduce_scatter",
        "xla",
        "bool",
        "Pipeline reduce-scatters across while-loop iterations.",
        default=True,
        replacement="xla_gpu_pipeline_reduce_scatter",
        why="Scanned FSDP backward: layer i's gradient reduce-scatter runs during layer i-1.",
    ),
    _f(
        "xla_gpu_enable_pipelined_all_reduce",
        "xla",
        "bool",
        "Pipeline all-reduces across while-loop iterations.",
        default=False,
        replacement="xla_gpu_pipeline_all_reduce",
        why="Scanned data-parallel or tensor-parallel layers.",
    ),
    _f(
        "xla_gpu_enable_pipelined_p2p",
        "xla",
        "bool",
        "Pipeline collective-permutes (send/recv) across while-loop iterations.",
        default=False,
        replacement="xla_gpu_pipeline_p2p",
    ),
    _f(
        "xla_gpu_enable_while_loop_double_buffering",
        "xla",
        "bool",
        "Unroll while loops by two so collectives of one iteration overlap the other.",
        default=False,
        why="Gives the scheduler room to overlap across iterations of scanned layers.",
    ),
    # Newer XLA spells the pipelining switches as tri-state options.
    _f(
        "xla_gpu_pipeline_all_gather",
        "xla",
        "enum",
        "Newer spelling of xla_gpu_enable_pipelined_all_gather.",
        choices=("on", "off"),
        since="0.11.0",
    ),
    _f(
        "xla_gpu_pipeline_reduce_scatter",
        "xla",
        "enum",
        "Newer spelling of xla_gpu_enable_pipelined_reduce_scatter.",
        choices=("on", "off"),
        since="0.11.0",
    ),
    _f(
        "xla_gpu_pipeline_all_reduce",
        "xla",
        "enum",
        "Newer spelling of xla_gpu_enable_pipelined_all_reduce.",
        choices=("on", "off"),
        since="0.11.0",
    ),
    _f(
        "xla_gpu_pipeline_p2p",
        "xla",
        "enum",
        "Newer spelling of xla_gpu_enable_pipelined_p2p.",
        choices=("on", "off"),
        since="0.11.0",
    ),
    # --- collective matmul ----------------------------------------------------------------
    _f(
        "xla_gpu_threshold_for_windowed_einsum_mib",
        "xla",
        "int",
        "Decompose einsums whose operands exceed this size (MiB) into windowed (collective) "
        "matmuls in the SPMD partitioner.",
        default=(1 << 63) - 1,
        why="Tensor-parallel layers: the all-gather or reduce-scatter beside a large matmul is "
        "split into a ppermute ring interleaved with partial matmuls.",
    ),
    _f(
        "xla_gpu_multi_streamed_windowed_einsum",
        "xla",
        "bool",
        "Run the partial matmuls of windowed einsums on separate streams.",
        default=True,
    ),
    _f(
        "xla_gpu_collective_permute_decomposer_threshold",
        "xla",
        "int",
        "Decompose collective-permutes above this size into send/recv pairs that can pipeline.",
        default=(1 << 63) - 1,
    ),
    # --- runtime --------------------------------------------------------------------------
    _f(
        "xla_gpu_enable_command_buffer",
        "xla",
        "list",
        "Kinds of thunks captured into CUDA graphs (command buffers); empty disables them.",
        default="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
        choices=(
            "FUSION",
            "CUBLAS",
            "CUBLASLT",
            "CUSTOM_CALL",
            "CUDNN",
            "COLLECTIVES",
            "CONDITIONAL",
            "WHILE",
            "DYNAMIC_SLICE_FUSION",
            "DYNAMIC_SLICE_COPY_FUSION",
        ),
        why="Kernels launched from a CUDA graph bypass launch-time occupancy shaping; set it to "
        "empty while the runtime library shapes kernels.",
    ),
    _f(
        "xla_gpu_nccl_collective_max_nchannels",
        "xla",
        "int",
        "Upper bound on NCCL channels (CTAs) per collective; 0 lets NCCL choose.",
        default=0,
    ),
    _f(
        "xla_gpu_disable_async_collectives",
        "xla",
        "list",
        "Collective kinds to run synchronously on the compute stream.",
        default="",
    ),
    _f(
        "xla_gpu_enable_nccl_user_buffers",
        "xla",
        "bool",
        "Register XLA's collective buffers with NCCL (fewer copies, needs a memory pool).",
        default=False,
    ),
    # --- removed or renamed: still found in public recipes ---------------------------------
    _f(
        "xla_gpu_enable_async_all_gather",
        "xla",
        "bool",
        "All-gathers are always async now.",
        removed_in="0.10.2",
        why="Drop it: async collectives are the default.",
    ),
    _f(
        "xla_gpu_enable_async_reduce_scatter",
        "xla",
        "bool",
        "Reduce-scatters are always async now.",
        removed_in="0.10.2",
        why="Drop it: async collectives are the default.",
    ),
    _f(
        "xla_gpu_enable_async_all_reduce",
        "xla",
        "bool",
        "All-reduces are always async now.",
        removed_in="0.10.2",
        why="Drop it: async collectives are the default.",
    ),
    _f(
        "xla_gpu_enable_async_collectives",
        "xla",
        "bool",
        "All collectives are async now.",
        removed_in="0.10.2",
        replacement="xla_gpu_disable_async_collectives",
        why="Drop it; to make some collectives synchronous use xla_gpu_disable_async_collectives.",
    ),
    _f(
        "xla_gpu_enable_async_collective_permute",
        "xla",
        "bool",
        "Collective-permutes are always async now.",
        removed_in="0.10.2",
        why="Drop it: async collectives are the default.",
    ),
    _f(
        "xla_gpu_enable_async_all_to_all",
        "xla",
        "bool",
        "All-to-alls are always async now.",
        removed_in="0.10.2",
        why="Drop it: async collectives are the default.",
    ),
    _f(
        "xla_gpu_lhs_enable_gpu_async_tracker",
        "xla",
        "bool",
        "The GPU async tracker is always used by the latency-hiding scheduler now.",
        removed_in="0.10.2",
        why="Drop it.",
    ),
    _f(
        "xla_gpu_enable_nccl_per_stream_comms",
        "xla",
        "bool",
        "Per-stream NCCL communicators were removed.",
        removed_in="0.10.2",
        why="Drop it.",
    ),
    _f(
        "xla_gpu_graph_level",
        "xla",
        "int",
        "CUDA graph level; replaced by a list of command-buffer thunk kinds.",
        removed_in="0.10.2",
        replacement="xla_gpu_enable_command_buffer",
        why="Use --xla_gpu_enable_command_buffer= (empty) for level 0, or a list of kinds.",
    ),
    _f(
        "xla_gpu_enable_custom_fusions",
        "xla",
        "bool",
        "Custom fusions are controlled by the command-buffer and fusion passes now.",
        removed_in="0.10.2",
        why="Drop it.",
    ),
    _f(
        "xla_gpu_enable_triton_softmax_fusion",
        "xla",
        "bool",
        "Triton softmax fusion is on by default now.",
        removed_in="0.10.2",
        why="Drop it.",
    ),
    _f(
        "xla_gpu_enable_triton_hopper",
        "xla",
        "bool",
        "Hopper Triton features are on by default now.",
        removed_in="0.10.2",
        why="Drop it.",
    ),
    _f(
        "xla_gpu_cudnn_gemm_fusion",
        "xla",
        "bool",
        "cuDNN GEMM fusion switch; replaced by a level.",
        removed_in="0.10.2",
        replacement="xla_gpu_cudnn_gemm_fusion_level",
        why="Use xla_gpu_cudnn_gemm_fusion_level (0 disables).",
    ),
    _f(
        "xla_gpu_simplify_all_fp_conversions",
        "xla",
        "bool",
        "Float-conversion simplification is always on now.",
        removed_in="0.10.2",
        why="Drop it.",
    ),
    _f(
        "xla_gpu_enable_xla_runtime_executable",
        "xla",
        "bool",
        "The XLA runtime executable was replaced by thunks.",
        removed_in="0.10.2",
        why="Drop it.",
    ),
    # --- NCCL and CUDA environment ----------------------------------------------------------
    _f(
        "NCCL_MAX_CTAS",
        "env",
        "int",
        "Upper bound on NCCL channels (CTAs) per communicator; overrides the communicator "
        "config XLA builds from xla_gpu_nccl_collective_max_nchannels.",
    ),
    _f(
        "NCCL_MIN_CTAS",
        "env",
        "int",
        "Lower bound on NCCL channels (CTAs) per communicator.",
    ),
    _f(
        "NCCL_NCHANNELS_PER_NET_PEER",
        "env",
        "int",
        "Channels per remote peer for network (inter-node) transfers.",
    ),
    _f(
        "NCCL_PROTO",
        "env",
        "str",
        "NCCL protocols to allow (LL, LL128, Simple; comma list, ^ to exclude).",
    ),
    _f(
        "NCCL_ALGO",
        "env",
        "str",
        "NCCL algorithms to allow (Ring, Tree, NVLS, CollnetDirect...).",
    ),
    _f(
        "NCCL_NVLS_ENABLE",
        "env",
        "enum",
        "NVLink SHARP (in-switch reductions) on H100/H200 NVSwitch systems.",
        choices=("0", "1"),
    ),
    _f(
        "NCCL_CUMEM_ENABLE",
        "env",
        "enum",
        "Use cuMem* allocations for NCCL buffers.",
        choices=("0", "1"),
    ),
    _f(
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "env",
        "int",
        "Hardware work queues per device; 1 serialises kernels from different streams.",
        default=8,
        why="Overlap needs more than one hardware queue; recipes that set 1 for ordering stop "
        "XLA's compute and communication streams from running side by side.",
    ),
)

REGISTRY: dict[str, Flag] = {f.name: f for f in _ENTRIES}


def _version_tuple(v: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def _jaxlib_version() -> str:
  import jaxlib

  return jaxlib.__version__


# ---------------------------------------------------------------------------
# Parsing and formatting XLA_FLAGS.
# ---------------------------------------------------------------------------

_TOKEN = re.compile(r"^--(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:=(?P<value>.*))?$", re.S)


def parse_xla_flags(text: str) -> tuple[dict[str, str], list[str]]:
  """Splits an ``XLA_FLAGS`` string into ``{name: value}`` and a list of bad tokens.

  ``--name`` alone means ``true``, as XLA reads it. Quoted values are honoured.
  """
  if not isinstance(text, str):
    raise TypeError(f"parse_xla_flags: expected a string, got {type(text).__name__}")
  try:
    tokens = shlex.split(text)
  except ValueError as e:
    return {}, [f"{text!r} ({e})"]
  out: dict[str, str] = {}
  bad: list[str] = []
  for tok in tokens:
    m = _TOKEN.match(tok)
    if not m:
      bad.append(tok)
      continue
    value = m.group("value")
    out[m.group("name")] = "true" if value is None else value
  return out, bad


def _format_value(v: Any) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  return str(v)


def format_xla_flags(options: Mapping[str, Any]) -> str:
  """Formats ``{name: value}`` as an ``XLA_FLAGS`` string."""
  parts = []
  for k, v in options.items():
    s = _format_value(v)
    needs_quotes = s == "" or re.search(r"\s", s) is not None
    parts.append(f"--{k}={shlex.quote(s) if needs_quotes else s}")
  return " ".join(parts)


# ---------------------------------------------------------------------------
# Asking the installed jaxlib.
# ---------------------------------------------------------------------------

_PROBE_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros((2,), jnp.float32))
out = {}
for name, value in json.loads(sys.stdin.read()):
  try:
    lowered.compile({name: value})
    out[name + "=" + json.dumps(value)] = None
  except Exception as e:  # noqa: BLE001
    out[name + "=" + json.dumps(value)] = str(e).splitlines()[0][:400]
print("JAX_OVERLAP_PROBE" + json.dumps(out))
"""

_probe_lock = threading.Lock()
_probe_cache: dict[str, str | None] = {}


def _cache_path() -> str:
  return os.path.join(cache_lib.cache_dir(), f"xla_options-jaxlib-{_jaxlib_version()}.json")


def _load_disk_cache() -> None:
  try:
    with open(_cache_path()) as f:
      data = json.load(f)
    if isinstance(data, dict):
      _probe_cache.update(data)
  except (OSError, ValueError):
    pass


def _save_disk_cache() -> None:
  try:
    cache_lib.write_text(_cache_path(), json.dumps(_probe_cache, indent=0, sort_keys=True))
  except OSError:
    pass


def _backend_started() -> bool:
  from jax._src import xla_bridge

  return bool(xla_bridge.backends_are_initialized())


def _probe_value(v: Any) -> Any:
  if isinstance(v, (bool, int, float)):
    return v
  return str(v)


def _probe(pairs: Iterable[tuple[str, Any]]) -> dict[str, str | None]:
  """Tries each (option, value) as a per-compile option of the installed jaxlib.

  Returns ``{"name=<json value>": None or the error line}``. In-process when the
  backend is already up (each trial is a tiny CPU compile); otherwise in a
  subprocess, so that the caller's backend is not started before it has set
  its flags. Results are cached per jaxlib version.
  """
  keyed = {f"{n}={json.dumps(_probe_value(v))}": (n, _probe_value(v)) for n, v in pairs}
  with _probe_lock:
    if not _probe_cache:
      _load_disk_cache()
    todo = [pv for k, pv in keyed.items() if k not in _probe_cache]
    if todo:
      if _backend_started():
        import jax
        import jax.numpy as jnp

        lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros((2,), jnp.float32))
        for n, v in todo:
          try:
            lowered.compile({n: v})
            _probe_cache[f"{n}={json.dumps(v)}"] = None
          except Exception as e:  # noqa: BLE001 - jaxlib raises several error types
            _probe_cache[f"{n}={json.dumps(v)}"] = str(e).splitlines()[0][:400]
      else:
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
        env["JAX_PLATFORMS"] = "cpu"
        try:
          proc = subprocess.run(
              [sys.executable, "-c", _PROBE_SCRIPT],
              input=json.dumps(todo),
              capture_output=True,
              text=True,
              env=env,
              timeout=300,
          )
        except (OSError, subprocess.TimeoutExpired) as e:
          raise ConfigError(f"flags: could not ask jaxlib which options it accepts: {e}") from e
        line = next(
            (ln for ln in proc.stdout.splitlines() if ln.startswith("JAX_OVERLAP_PROBE")), None
        )
        if line is None:
          raise ConfigError(
              "flags: the jaxlib option probe failed (exit code "
              f"{proc.returncode}): {proc.stderr.strip()[-600:]}"
          )
        _probe_cache.update(json.loads(line[len("JAX_OVERLAP_PROBE") :]))
      _save_disk_cache()
    return {k: _probe_cache[k] for k in keyed}


def accepted_by_jaxlib(name: str, value: Any = None) -> bool:
  """Whether the installed jaxlib accepts option ``name`` (with ``value``, if given)."""
  flag = REGISTRY.get(name)
  if value is None:
    value = _default_probe_value(flag)
  return _probe([(name, value)])[f"{name}={json.dumps(_probe_value(value))}"] is None


def _default_probe_value(flag: Flag | None) -> Any:
  if flag is None:
    return True
  if flag.type == "bool":
    return True if flag.default is None else bool(flag.default)
  if flag.type == "int":
    return int(flag.default) if flag.default is not None else 0
  if flag.type == "float":
    return float(flag.default) if flag.default is not None else 0.0
  if flag.type == "enum":
    return flag.choices[0]
  return "" if flag.default is None else str(flag.default)


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem found by :func:`validate`.

  Attributes:
    name: the option or variable.
    kind: ``"unknown"``, ``"removed"``, ``"renamed"``, ``"bad_value"``, ``"malformed"``,
      ``"not_yet_supported"`` or ``"counterproductive"``.
    message: what is wrong and what would be right.
    severity: ``"error"`` (jaxlib would reject it or the process would abort) or
      ``"warning"`` (accepted, but works against overlap).
    suggestion: the option to use instead, if any.
  """

  name: str
  kind: str
  message: str
  severity: Literal["error", "warning"] = "error"
  suggestion: str | None = None

  def __str__(self) -> str:
    return f"{self.severity}: {self.message}"


_BOOL_WORDS = {"true", "false", "1", "0"}


def _check_value(flag: Flag, value: Any) -> str | None:
  """Returns why ``value`` is not a valid value of ``flag``, or None."""
  s = _format_value(value).strip()
  if flag.type == "bool":
    if isinstance(value, bool) or s.lower() in _BOOL_WORDS:
      return None
    return f"expects true or false, got {s!r}"
  if flag.type == "int":
    if isinstance(value, bool):
      return f"expects an integer, got {value!r}"
    if isinstance(value, int) or re.fullmatch(r"[+-]?\d+", s):
      return None
    return f"expects an integer, got {s!r}"
  if flag.type == "float":
    try:
      float(s)
      return None
    except ValueError:
      return f"expects a number, got {s!r}"
  if flag.type == "enum":
    if s in flag.choices:
      return None
    return f"expects one of {', '.join(flag.choices)}, got {s!r}"
  if flag.type == "list" and flag.choices:
    items = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x.upper() not in flag.choices]
    if bad:
      return f"expects a comma list of {', '.join(flag.choices)}; unknown item(s) {', '.join(bad)}"
  return None


def _normalise_flags(flags: str | Mapping[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
  problems: list[Problem] = []
  if isinstance(flags, str):
    parsed, bad = parse_xla_flags(flags)
    for tok in bad:
      problems.append(
          Problem(
              tok,
              "malformed",
              f"{tok!r} is not an XLA flag; XLA_FLAGS tokens look like --name=value "
              "(for example --xla_gpu_enable_latency_hiding_scheduler=true)",
          )
      )
    return dict(parsed), problems
  if isinstance(flags, Mapping):
    out = {}
    for k, v in flags.items():
      if not isinstance(k, str) or not k:
        problems.append(
            Problem(str(k), "malformed", f"option names must be non-empty strings, got {k!r}")
        )
        continue
      out[k[2:] if k.startswith("--") else k] = v
    return out, problems
  raise TypeError(
      "validate: flags must be an XLA_FLAGS string or a dict of option names to values, got "
      f"{type(flags).__name__}"
  )


def validate(flags: str | Mapping[str, Any], *, probe: bool = True) -> list[Problem]:
  """Checks XLA options and NCCL/CUDA variables; never aborts the process.

  Args:
    flags: an ``XLA_FLAGS`` string, or a dict of option (or environment
      variable) names to values.
    probe: ask the installed jaxlib whether it accepts each XLA option (the
      ground truth; cached per jaxlib version). With ``probe=False`` only the
      registry is consulted.

  Returns:
    Every problem found, errors first. An empty list means the flags are safe
    to put in ``XLA_FLAGS``.

  Example:
    >>> [p.kind for p in validate("--xla_gpu_enable_async_all_gather=true")]  # doctest: +SKIP
    ['removed']
  """
  options, problems = _normalise_flags(flags)
  version = _version_tuple(_jaxlib_version())
  to_probe: list[tuple[str, Any]] = []
  for name, value in options.items():
    flag = REGISTRY.get(name)
    if flag is None and not name.startswith("xla_"):
      problems.append(
          Problem(
              name,
              "unknown",
              f"{name!r} is neither an XLA option (they start with xla_) nor a known NCCL/CUDA "
              "variable",
          )
      )
      continue
    if flag is not None and not flag.removed_in:
      why = _check_value(flag, value)
      if why:
        problems.append(Problem(name, "bad_value", f"{name} {why}"))
        continue
      problems.extend(_counterproductive(flag, value))
    if flag is not None and flag.kind == "env":
      continue
    if flag is not None and flag.removed_in and not probe:
      if version >= _version_tuple(flag.removed_in):
        problems.append(_removed_problem(flag))
      continue
    to_probe.append((name, _probe_value(_coerce_for_probe(flag, value))))

  if probe and to_probe:
    answers = _probe(to_probe)
    for name, value in to_probe:
      err = answers[f"{name}={json.dumps(value)}"]
      if err is None:
        continue
      flag = REGISTRY.get(name)
      if "No such compile option" not in err:
        problems.append(Problem(name, "bad_value", f"{name}: {err}"))
      elif flag is not None and flag.removed_in:
        problems.append(_removed_problem(flag))
      elif flag is not None and flag.since and version < _version_tuple(flag.since):
        older = [f.name for f in _ENTRIES if f.replacement == name]
        hint = f"; this jaxlib spells it {older[0]}" if older else ""
        problems.append(
            Problem(
                name,
                "not_yet_supported",
                f"{name} needs jaxlib >= {flag.since}, installed {_jaxlib_version()}{hint}",
                suggestion=older[0] if older else None,
            )
        )
      elif flag is not None and flag.replacement:
        problems.append(
            Problem(
                name,
                "renamed",
                f"{name} is not accepted by jaxlib {_jaxlib_version()}; use "
                f"{flag.replacement} instead",
                suggestion=flag.replacement,
            )
        )
      else:
        close = _close_names(name)
        hint = f"; did you mean {close}?" if close else ""
        problems.append(
            Problem(
                name,
                "unknown",
                f"{name} is not an option of jaxlib {_jaxlib_version()}; in XLA_FLAGS it "
                f"would abort the process at backend start{hint}",
                suggestion=close,
            )
        )
  problems.sort(key=lambda p: p.severity != "error")
  return problems


def _removed_problem(flag: Flag) -> Problem:
  hint = f"; use {flag.replacement} instead" if flag.replacement else ""
  return Problem(
      flag.name,
      "renamed" if flag.replacement else "removed",
      f"{flag.name} was removed from XLA (jaxlib {_jaxlib_version()} rejects it; in XLA_FLAGS it "
      f"aborts the process at backend start){hint}. {flag.why}".strip(),
      suggestion=flag.replacement,
  )


def _counterproductive(flag: Flag, value: Any) -> list[Problem]:
  s = _format_value(value).strip().lower()
  if flag.name == "xla_gpu_enable_highest_priority_async_stream" and s in ("false", "0"):
    return [
        Problem(
            flag.name,
            "counterproductive",
            f"{flag.name}=false puts collectives on normal-priority streams: compute blocks "
            "then take the SMs first and communication waits (the priority control is off)",
            severity="warning",
        )
    ]
  if flag.name == "CUDA_DEVICE_MAX_CONNECTIONS" and s == "1":
    return [
        Problem(
            flag.name,
            "counterproductive",
            "CUDA_DEVICE_MAX_CONNECTIONS=1 gives the device one hardware queue, so kernels of "
            "XLA's compute and communication streams cannot run side by side",
            severity="warning",
        )
    ]
  return []


def _coerce_for_probe(flag: Flag | None, value: Any) -> Any:
  if isinstance(value, (bool, int, float)):
    return value
  s = str(value)
  if flag is not None and flag.type == "bool":
    return s.lower() in ("true", "1")
  if flag is not None and flag.type == "int" and re.fullmatch(r"[+-]?\d+", s.strip()):
    return int(s)
  return s


def _close_names(name: str) -> str | None:
  import difflib

  known = [f.name for f in _ENTRIES if f.kind == "xla" and not f.removed_in]
  match = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
  return match[0] if match else None


# ---------------------------------------------------------------------------
# Recommendations.
# ---------------------------------------------------------------------------


def _check_workload(workload: str) -> str:
  if workload not in WORKLOADS:
    raise ValueError(f"unknown workload {workload!r}; valid choices: {', '.join(WORKLOADS)}")
  return workload


@functools.lru_cache(maxsize=64)
def _recommended(target: str, workload: str) -> tuple[tuple[str, Any], ...]:
  """The recommendation table. Each choice is justified in the flag's ``why``.

  The per-GPU split comes from deviceless analyses of 8-layer bf16 FSDP steps
  (hidden 4096, MLP 11008), unrolled and scanned, on h100x8 and a100x8
  (benchmarks/flags_profiles.py writes the table): on Hopper, XLA's default
  speed-of-light estimator already overlaps the gathers and the analytical
  estimator exposes more reduce-scatter time; on Ampere the analytical
  estimator is what hides the gathers.
  """
  topo = targets_lib.get(target)
  gpu = topo.gpu
  hopper = gpu.vendor == "nvidia" and gpu.compute_capability >= (9, 0)
  opts: dict[str, Any] = {
      "xla_gpu_enable_latency_hiding_scheduler": True,
      "xla_gpu_enable_highest_priority_async_stream": True,
  }
  if not hopper:
    opts["xla_gpu_enable_analytical_latency_estimator"] = True
  if workload in ("fsdp", "hybrid"):
    opts.update(
        {
            "xla_gpu_enable_pipelined_all_gather": True,
            "xla_gpu_enable_pipelined_reduce_scatter": True,
            "xla_gpu_enable_while_loop_double_buffering": True,
        }
    )
    if hopper:
      opts["xla_gpu_enable_pipelined_all_reduce"] = True
  if workload in ("data_parallel", "hybrid"):
    opts["xla_gpu_enable_pipelined_all_reduce"] = True
    opts["xla_gpu_enable_while_loop_double_buffering"] = True
  if workload in ("tensor_parallel", "hybrid"):
    opts.update(
        {
            "xla_gpu_threshold_for_windowed_einsum_mib": 0,
            "xla_gpu_multi_streamed_windowed_einsum": True,
        }
    )
  if gpu.link.startswith("pcie"):
    # PCIe boxes need few channels to saturate the link; fewer CTAs leave more SMs to compute.
    opts["NCCL_MAX_CTAS"] = 4
  return tuple(opts.items())


def _translate_for_installed(opts: dict[str, Any]) -> dict[str, Any]:
  """Swaps options the installed jaxlib spells differently (old vs new names)."""
  xla = [(k, v) for k, v in opts.items() if REGISTRY[k].kind == "xla"]
  answers = _probe(xla)
  out: dict[str, Any] = {}
  for k, v in opts.items():
    flag = REGISTRY[k]
    if flag.kind == "env" or answers[f"{k}={json.dumps(_probe_value(v))}"] is None:
      out[k] = v
      continue
    if flag.replacement and REGISTRY[flag.replacement].type == "enum" and isinstance(v, bool):
      new_v = "on" if v else "off"
      if _probe([(flag.replacement, new_v)])[f"{flag.replacement}={json.dumps(new_v)}"] is None:
        out[flag.replacement] = new_v
        continue
    # Neither spelling is accepted: leave it out rather than abort the process.
  return out


def recommended(
    target: str = "h100x8", workload: str = "fsdp", *, check_installed: bool = True
) -> dict[str, Any]:
  """Overlap options for a GPU target and a workload.

  Each choice is explained by the ``why`` of its :data:`REGISTRY` entry.

  Args:
    target: topology name ("h100x8", "a100x8", "h200x16", ...) or GPU name.
    workload: "fsdp", "tensor_parallel", "data_parallel" or "hybrid".
    check_installed: translate to the spelling the installed jaxlib accepts
      and drop anything it rejects (asks jaxlib; cached per version).

  Returns:
    ``{name: value}``: XLA options (no ``--``) and NCCL/CUDA variables.

  Raises:
    ValueError: for an unknown target or workload.

  Example:
    >>> recommended("h100x8", "fsdp")["xla_gpu_enable_latency_hiding_scheduler"]  # doctest: +SKIP
    True
  """
  _check_workload(workload)
  topo = targets_lib.get(target)
  opts = dict(_recommended(topo.name, workload))
  if check_installed:
    opts = _translate_for_installed(opts)
  return opts


def as_compiler_options(
    target: str = "h100x8", workload: str = "fsdp", **overrides: Any
) -> dict[str, Any]:
  """The XLA part of :func:`recommended`, for ``jax.jit(..., compiler_options=...)``.

  Environment variables (NCCL, CUDA) are left out: they cannot be set per compile.

  Raises:
    ConfigError: if an override is rejected by the installed jaxlib.
  """
  opts = {k: v for k, v in recommended(target, workload).items() if REGISTRY[k].kind == "xla"}
  if overrides:
    errors = [p for p in validate(overrides) if p.severity == "error"]
    if errors:
      raise ConfigError("as_compiler_options: " + "; ".join(p.message for p in errors))
    env_like = [k for k in overrides if REGISTRY.get(k) and REGISTRY[k].kind == "env"]
    if env_like:
      raise ConfigError(
          f"as_compiler_options: {', '.join(env_like)} are environment variables, not compile "
          "options; set them with configure() or in the environment"
      )
    opts.update(overrides)
  return opts


def configure(
    target: str = "h100x8",
    workload: str = "fsdp",
    *,
    on_conflict: Literal["error", "keep", "replace"] = "error",
    environ: dict[str, str] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
  """Sets the recommended options in ``XLA_FLAGS`` and the NCCL variables.

  What the user already has in ``XLA_FLAGS`` is kept. A flag the user set to a
  different value than the recommendation is a conflict: by default it is
  refused with a message naming both values (``on_conflict="keep"`` keeps the
  user's, ``"replace"`` takes the recommendation). Overrides win over both.

  Args:
    target: topology name.
    workload: see :data:`WORKLOADS`.
    on_conflict: what to do when ``XLA_FLAGS`` already sets an option differently.
    environ: the environment to edit (``os.environ`` by default).
    **overrides: options to set instead of the recommended values.

  Returns:
    The options that were applied.

  Raises:
    ConfigError: if the JAX backend is already initialized (the flags would do
      nothing), on a conflict, or if the resulting flags contain an error
      (a flag the installed jaxlib would abort on).
  """
  if on_conflict not in ("error", "keep", "replace"):
    raise ValueError(
        f"configure: on_conflict must be 'error', 'keep' or 'replace', got {on_conflict!r}"
    )
  env = os.environ if environ is None else environ
  if environ is None and _backend_started():
    raise ConfigError(
        "configure: the JAX backend is already initialized, so XLA_FLAGS and NCCL variables set "
        "now would silently do nothing. Call jax_overlap.flags.configure(...) before the first "
        "JAX computation (or jax.devices()), or pass the options per compile with "
        "jax.jit(f, compiler_options=jax_overlap.flags.as_compiler_options(...))."
    )
  wanted = recommended(target, workload)
  unknown = [k for k in overrides if k not in REGISTRY and not k.startswith("xla_")]
  if unknown:
    raise ConfigError(
        f"configure: unknown override(s) {', '.join(unknown)}: overrides are XLA options "
        "(xla_...) or NCCL/CUDA variables from jax_overlap.flags.REGISTRY"
    )
  existing, bad = parse_xla_flags(env.get("XLA_FLAGS", ""))
  if bad:
    raise ConfigError(
        f"configure: XLA_FLAGS already holds malformed token(s) {', '.join(map(repr, bad))}; "
        "fix them first (tokens look like --name=value)"
    )
  conflicts = []
  merged_xla = dict(existing)
  env_vars: dict[str, str] = {}
  for k, v in {**wanted, **overrides}.items():
    flag = REGISTRY.get(k)
    s = _format_value(v)
    if flag is not None and flag.kind == "env":
      have = env.get(k)
      if have is not None and have != s and k not in overrides:
        if on_conflict == "error":
          conflicts.append(f"{k}: environment has {have}, recommended {s}")
          continue
        if on_conflict == "keep":
          continue
      env_vars[k] = s
      continue
    have = existing.get(k)
    if have is not None and have.lower() != s.lower() and k not in overrides:
      if on_conflict == "error":
        conflicts.append(f"--{k}: XLA_FLAGS has {have}, recommended {s}")
        continue
      if on_conflict == "keep":
        continue
    merged_xla[k] = s
  if conflicts:
    raise ConfigError(
        "configure: XLA_FLAGS or the environment already set these differently: "
        + "; ".join(conflicts)
        + ". Pass the value you want as an override (configure(..., name=value)), or "
        "on_conflict='keep' / 'replace'."
    )
  problems = [p for p in validate(merged_xla) if p.severity == "error"]
  if problems:
    raise ConfigError(
        "configure: the resulting XLA_FLAGS would not work with jaxlib "
        f"{_jaxlib_version()}: " + "; ".join(p.message for p in problems)
    )
  # Edit single flags: keep the user's order and add ours after it.
  env["XLA_FLAGS"] = format_xla_flags(merged_xla)
  for k, v in env_vars.items():
    env[k] = v
  applied = {k: merged_xla[k] for k in merged_xla if k not in existing or existing[k] != merged_xla[k]}
  applied.update(env_vars)
  return applied
