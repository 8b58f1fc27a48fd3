"""Choosing and setting overlap options: recommendations, ``configure``, per-compile options.

:func:`recommended` gives the options for a GPU target and a workload (each
choice explained by its registry entry), translated to the spelling the
installed jaxlib accepts. :func:`configure` merges them into
``os.environ["XLA_FLAGS"]`` and the NCCL variables, keeping what the user set,
and refuses once the backend is up (the flags would silently do nothing).
:func:`as_compiler_options` gives the same choice for one ``jit`` without
touching the environment.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, Literal

from jax_overlap._src import deprecations
from jax_overlap._src import targets as targets_lib
from jax_overlap._src.errors import ConfigError
from jax_overlap._src.flags import aborts as aborts_lib
from jax_overlap._src.flags import environment, per_compile, syntax
from jax_overlap._src.flags import probe as probe_lib
from jax_overlap._src.flags.registry import REGISTRY, WORKLOADS, Workload
from jax_overlap._src.flags.validation import validate

__all__ = ["recommended", "as_compiler_options", "configure", "backend_started", "check_workload"]


def backend_started() -> bool:
  from jax._src import xla_bridge

  return bool(xla_bridge.backends_are_initialized())


def check_workload(workload: str) -> str:
  if workload not in WORKLOADS:
    raise ValueError(f"unknown workload {workload!r}; valid choices: {', '.join(WORKLOADS)}")
  return workload


# XLA:GPU's pass (jaxlib 0.11 and later) that wraps dynamic-slice and dynamic-update-slice
# copies in async start/done pairs before scheduling.
ASYNC_SLICE_COPY_PASS = "dynamic-slice-copy-fusion-async-wrapper"


@functools.cache
def async_slice_copies() -> bool:
  """Whether the installed XLA:GPU (its CUDA plugin) has :data:`ASYNC_SLICE_COPY_PASS`.

  Asked of the plugin library itself, whose pass names are strings in it: a feature, not a
  version, so a jaxlib that drops or renames the pass is not given an option for it.
  """
  import importlib.util
  import mmap

  for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      spec = None
    if spec is None or not spec.submodule_search_locations:
      continue
    for folder in spec.submodule_search_locations:
      path = os.path.join(folder, "xla_cuda_plugin.so")
      try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
          return m.find(ASYNC_SLICE_COPY_PASS.encode()) >= 0
      except (OSError, ValueError):
        continue
  return False


def loop_schedule_options() -> dict[str, Any]:
  """XLA options that keep a layer loop's collectives overlapping its GEMMs on the installed
  XLA: ``xla_disable_hlo_passes`` naming :data:`ASYNC_SLICE_COPY_PASS` where XLA has the pass
  (see the registry's ``why``), else none."""
  return {"xla_disable_hlo_passes": ASYNC_SLICE_COPY_PASS} if async_slice_copies() else {}


@functools.lru_cache(maxsize=64)
def _recommended(topo: targets_lib.Topology, workload: str) -> tuple[tuple[str, Any], ...]:
  """The recommendation table. Each choice is justified in the flag's ``why``.

  The per-GPU split comes from deviceless analyses of 8-layer bf16 FSDP steps
  (hidden 4096, MLP 11008), unrolled and scanned, on h100x8 and a100x8
  (benchmarks/analysis_fsdp.py writes the table): on Hopper, XLA's default
  speed-of-light estimator already overlaps the gathers and the analytical
  estimator exposes more reduce-scatter time; on Ampere the analytical
  estimator is what hides the gathers. Keyed by the topology itself, so that one built by
  the user (not in the catalogue by name) is recommended for too.
  """
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
        **loop_schedule_options(),
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
  # CUDA_DEVICE_MAX_CONNECTIONS and NCCL's channel cap: where the simulator says they pay on
  # the workload's representative step (:mod:`.environment`).
  opts.update(environment.environment(topo, workload))
  return tuple(opts.items())


def _translate_for_installed(opts: dict[str, Any]) -> dict[str, Any]:
  """Swaps options the installed jaxlib spells differently (old vs new names)."""
  tokens = {k: syntax.format_token(k, v) for k, v in opts.items() if REGISTRY[k].kind == "xla"}
  renamed = {}
  for k, v in opts.items():
    flag = REGISTRY[k]
    if flag.replacement and REGISTRY[flag.replacement].type == "enum" and isinstance(v, bool):
      renamed[k] = (flag.replacement, "on" if v else "off")
  answers = probe_lib.judge(
    list(tokens.values()) + [syntax.format_token(n, v) for n, v in renamed.values()]
  )
  out: dict[str, Any] = {}
  for k, v in opts.items():
    if k not in tokens or answers[tokens[k]].accepted:
      out[k] = v
    elif k in renamed and answers[syntax.format_token(*renamed[k])].accepted:
      out[renamed[k][0]] = renamed[k][1]
    # Neither spelling is accepted: leave it out rather than abort the process.
  return out


@deprecations.keyword_only("target", "workload", api="jax_overlap.flags.recommended")
def recommended(
  *, target: str = "h100x8", workload: Workload = "fsdp", check_installed: bool = True
) -> dict[str, Any]:
  """Overlap options for a GPU target and a workload.

  Each XLA choice is explained by the ``why`` of its :data:`REGISTRY` entry; NCCL and CUDA
  variables are set where the simulator says they pay on the workload's representative step
  (:func:`judge_environment` gives each verdict, also for the user's own step).

  Args:
    target: topology name ("h100x8", "a100x8", "h200x16", ...) or GPU name.
    workload: "fsdp", "tensor_parallel", "data_parallel" or "hybrid".
    check_installed: translate to the spelling the installed jaxlib accepts
      and drop anything it rejects or aborts some compiles with (asks jaxlib; cached
      per version; :mod:`jax_overlap._src.flags.aborts`).

  Returns:
    ``{name: value}``: XLA options (no ``--``) and NCCL/CUDA variables.

  Raises:
    ValueError: for an unknown target or workload.

  Example:
    >>> recommended(target="h100x8")["xla_gpu_enable_latency_hiding_scheduler"]  # doctest: +SKIP
    True
  """
  check_workload(workload)
  topo = targets_lib.get(target)
  opts = dict(_recommended(topo, workload))
  if check_installed:
    opts = _translate_for_installed(opts)
    # An option the installed XLA aborts some compiles with is left out: set in XLA_FLAGS
    # it would reach every program of the process.
    for name in aborts_lib.aborting(opts):
      del opts[name]
  return opts


@deprecations.keyword_only("target", "workload", api="jax_overlap.flags.as_compiler_options")
def as_compiler_options(
  *,
  target: str = "h100x8",
  workload: Workload = "fsdp",
  xla_options: Mapping[str, Any] | None = None,
  **overrides: Any,
) -> dict[str, Any]:
  """The XLA part of :func:`recommended`, for ``jax.jit(..., compiler_options=...)``.

  Environment variables (NCCL, CUDA) are left out: they cannot be set per compile.
  Options are spelled as the installed jaxlib takes them per compile
  (:mod:`.per_compile`: since jaxlib 0.11, e.g., the loop pipeliner's enum switches).

  Args:
    target: topology name.
    workload: see :data:`WORKLOADS`.
    xla_options: XLA options to set instead of (or besides) the recommended ones.
    **overrides: the same, the earlier spelling (deprecated).

  Raises:
    ConfigError: if an option is rejected by the installed jaxlib.
  """
  overrides = deprecations.merged_overrides(
    "jax_overlap.flags.as_compiler_options", xla_options, overrides
  )
  opts = {
    k: v
    for k, v in recommended(target=target, workload=workload).items()
    if REGISTRY[k].kind == "xla"
  }
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
  return per_compile.spelled(opts)


@deprecations.keyword_only("target", "workload", api="jax_overlap.flags.configure")
def configure(
  *,
  target: str = "h100x8",
  workload: Workload = "fsdp",
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
  if environ is None and backend_started():
    raise ConfigError(
      "configure: the JAX backend is already initialized, so XLA_FLAGS and NCCL variables set "
      "now would silently do nothing. Call jax_overlap.flags.configure(...) before the first "
      "JAX computation (or jax.devices()), or pass the options per compile with "
      "jax.jit(f, compiler_options=jax_overlap.flags.as_compiler_options(...))."
    )
  wanted = recommended(target=target, workload=workload)
  unknown = [k for k in overrides if k not in REGISTRY and not k.startswith("xla_")]
  if unknown:
    raise ConfigError(
      f"configure: unknown override(s) {', '.join(unknown)}: overrides are XLA options "
      "(xla_...) or NCCL/CUDA variables from jax_overlap.flags.REGISTRY"
    )
  current = env.get("XLA_FLAGS", "")
  existing, bad = syntax.parse_xla_flags(current)
  if bad:
    raise ConfigError(
      f"configure: XLA_FLAGS already holds malformed token(s) {', '.join(map(repr, bad))}; "
      "fix them first (tokens look like --name=value)"
    )
  already = [p for p in validate(current) if p.severity == "error"]
  if already:
    raise ConfigError(
      "configure: XLA_FLAGS already holds flags XLA would abort on; fix them first: "
      + "; ".join(p.message for p in already)
    )
  conflicts = []
  merged_xla = dict(existing)
  env_vars: dict[str, str] = {}
  for k, v in {**wanted, **overrides}.items():
    flag = REGISTRY.get(k)
    s = syntax.format_value(v)
    if flag is not None and flag.kind == "env":
      # Environment values compare exactly; XLA's booleans in any case.
      have, into, where = env.get(k), env_vars, f"{k}: environment"
      same = have == s
    else:
      have, into, where = existing.get(k), merged_xla, f"--{k}: XLA_FLAGS"
      same = have is not None and have.lower() == s.lower()
    if have is not None and not same and k not in overrides:
      if on_conflict == "error":
        conflicts.append(f"{where} has {have}, recommended {s}")
      if on_conflict in ("error", "keep"):
        continue
    into[k] = s
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
      f"{probe_lib.jaxlib_version()}: " + "; ".join(p.message for p in problems)
    )
  # Edit single flags: keep the user's order and add ours after it.
  env["XLA_FLAGS"] = syntax.format_xla_flags(merged_xla)
  for k, v in env_vars.items():
    env[k] = v
  applied = {
    k: merged_xla[k] for k in merged_xla if k not in existing or existing[k] != merged_xla[k]
  }
  applied.update(env_vars)
  return applied
