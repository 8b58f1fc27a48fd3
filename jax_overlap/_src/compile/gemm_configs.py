"""The tile configurations XLA gave a selection's Triton GEMM fusions, handed to the
selection's later compiles.

XLA's config assigner gives each Triton GEMM fusion its tiles. In a selection's compiles
(deviceless, autotuning level 0) jaxlib 0.11 and later take the first configuration of a
fusion's search space that compiles, and compile one per fusion to find it, in every
compile: for MaxText's step, 28 fusions, 1.8-3.1 s of each compile's HLO passes and as
much again in ``ptxas``, though the variants of one step share their fusions. The
assigner looks each fusion up in its cache first and compiles nothing for one found
there; at level 0 it never writes the cache.

:func:`record` writes it. A compile given :func:`options` dumps its module after the
assigner (``xla_dump_hlo_pass_re``); :func:`record` writes the configuration of each of
its GEMM fusions into the selection's directory, laid out as XLA's per-fusion cache
(``xla_gpu_per_fusion_autotune_cache_dir`` in its legacy format): one text file a fusion,
named by the SHA-256 of its key, which holds the device, the fusion's computation printed
canonically and the cache's version. The compiles after it find them there: for the same
computation on the same device, the configuration the assigner chose, without a compile.
Where a key is computed otherwise than XLA computes it, XLA finds no file and compiles as
before; a configuration is never applied to a fusion other than the one it was chosen for.

The cache's version is a constant of each XLA build that no file names. :func:`version`
finds it once per jaxlib (kept in the cache directory) by compiling a one-dot program
twice: once to read its fusion, once with a file for each version that might be XLA's,
each with other tiles; the tiles the second compile applied name the version, and show
that the whole scheme (key, printing, file) is XLA's own. Where no file is taken, nothing
is shared.

What XLA reads from such a file it keeps for the process, in a map that compiles with a
cache in the legacy format look up before they autotune. The probe's third compile checks
that the jaxlib's default format is the other one (jaxlib 0.12); where it is not, nothing
is shared, so that the user's own compiles never take a selection's untuned tiles. A
user's compile that sets ``xla_gpu_use_new_autotune_cache_format=false`` itself would.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from jax_overlap._src import cache

__all__ = ["DIR_OPTION", "OPTION_NAMES", "options", "record", "version"]

DIR_OPTION = "xla_gpu_per_fusion_autotune_cache_dir"
_DIR_PREFIX = "jax_overlap_gemm_"
_PASS_DUMP = "^config-assigner$"
_AFTER = "*after_config-assigner*"
_LOCK = threading.Lock()
_VERSION: dict[str, int | None] = {}  # by jaxlib version


def options(directory: str) -> dict[str, Any]:
  """The options that make a compile read the configurations in ``directory`` (made by
  :func:`new_directory`) and dump what :func:`record` reads."""
  return {
    "xla_gpu_use_new_autotune_cache_format": False,
    DIR_OPTION: directory,
    "xla_gpu_experimental_autotune_cache_mode": "AUTOTUNE_CACHE_MODE_READ",
    "xla_dump_hlo_pass_re": _PASS_DUMP,
  }


# Options that can change the configurations a fusion's search space holds or which of them
# compiles (XLA keeps what it read for the process: a selection with one of them set does
# not share, so that no other compile takes tiles chosen under it, nor it theirs).
_TILING = re.compile(r"tiling|autotun|triton|override_gemm|force_config|candidate_configs|spill")


def shapes_tiles(compile_options: Mapping[str, Any]) -> bool:
  """Whether ``compile_options`` set an option that can change the tiles XLA's assigner
  chooses (the selection's own autotuning level aside)."""
  return any(
    _TILING.search(k) and k not in ("xla_gpu_autotune_level", *OPTION_NAMES)
    for k in compile_options
  )


OPTION_NAMES = tuple(options(""))  # the options :func:`options` sets


def new_directory(parent: str) -> str:
  """A directory under ``parent`` for one selection's configurations."""
  return tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=parent)


def ours(compile_options: Mapping[str, Any]) -> str | None:
  """The directory :func:`options` named in ``compile_options``, or None."""
  directory = compile_options.get(DIR_OPTION)
  if isinstance(directory, str) and os.path.basename(directory).startswith(_DIR_PREFIX):
    return directory
  return None


def _model(dump_dir: str) -> str | None:
  """XLA's name for the device in the cache's keys (``DeviceDescriptionToCacheKey``), from
  the target configuration the compile dumped; None without one."""
  files = glob.glob(os.path.join(dump_dir, "*gpu_target_config.pbtxt"))
  if not files:
    return None
  text = open(files[0]).read()

  def number(name: str, default: float = 0) -> float:
    m = re.search(rf"\b{name}: ([0-9.e+-]+)", text)
    return float(m.group(1)) if m else default

  cc = re.search(r"cuda_compute_capability \{([^}]*)\}", text)
  if cc is None:
    return None
  major = re.search(r"major: (\d+)", cc.group(1))
  minor = re.search(r"minor: (\d+)", cc.group(1))
  dnn = re.search(r"dnn_version_info \{([^}]*)\}", text)
  parts = [
    re.search(rf"{k}: (\d+)", dnn.group(1)) if dnn else None for k in ("major", "minor", "patch")
  ]
  dnn_version = ".".join(p.group(1) if p else "0" for p in parts)
  return (
    f"CUDA: {major.group(1) if major else 0}.{minor.group(1) if minor else 0}, "
    f"Cores: {int(number('core_count'))}, GPU clock: {number('clock_rate_ghz'):g} GHz, "
    f"Memory bandwidth: {round(number('memory_bandwidth') / 1e9):g} GB/s, "
    f"L2 cache: {number('l2_cache_size') / (1 << 20):g} MB, DNN version: {dnn_version}"
  )


_COMPUTATION = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) (\(.*?\)) -> (.*?) \{\n(.*?)\n\}$", re.M | re.S)
_FUSION = re.compile(r"fusion\(.*?calls=(%[\w.\-]+).*?backend_config=(\{.*\})\s*$", re.M)
_METADATA = re.compile(r", metadata=\{[^}]*\}")


def canonical(name: str, params: str, result: str, body: str) -> str | None:
  """A fused computation printed as XLA prints it in the cache's keys (``HloPrintOptions::
  Canonical`` with operand shapes; ``AutotuneCacheKey::HloInstructionToCanonicalString``),
  or None for one this printing may not match: calling other computations, or holding a
  constant that is not a scalar."""
  from jaxlib import _hlo

  if re.search(r"\b(calls|to_apply|body|condition)=", body):
    return None
  if re.search(r"\[[0-9,]+\][^ ]* constant\(", body):
    return None
  body = _METADATA.sub("", body)
  module = _hlo.hlo_module_from_text(
    f"HloModule canonical\n\nENTRY {name} {params} -> {result} {{\n{body}\n}}\n"
  )
  printing = _hlo.HloPrintOptions.canonical()
  printing.print_operand_shape = True
  printing.print_ids = False
  printing.canonicalize_computations = True
  text = module.to_string(printing)
  at = text.index("ENTRY ")
  return text[text.index("{", at) :].rstrip()


def _result(config: Mapping[str, Any]) -> str:
  """An ``AutotuneResult`` text holding the Triton GEMM ``config`` (the fusion's
  ``triton_gemm_config``, as its backend config prints it: fields at their defaults are
  left out, as the text format leaves them)."""
  fields = []
  for key, value in config.items():
    if isinstance(value, bool):
      if value:
        fields.append(f"  {key}: true")
    elif int(value) != 0:
      fields.append(f"  {key}: {int(value)}")
  return "triton {\n" + "\n".join(fields) + "\n}\n"


def file_name(model: str, hlo: str, cache_version: int) -> str:
  """The file XLA reads a fusion's result from: the SHA-256 of its key, base64 (URL-safe,
  unpadded)."""
  key = f"<key model='{model}', hlo='{hlo}', version={cache_version}>"
  digest = hashlib.sha256(key.encode()).digest()
  return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() + ".textproto"


def chosen(dump_dir: str) -> list[tuple[str, dict[str, Any]]]:
  """(canonical computation, configuration) of each Triton GEMM fusion the compile dumped
  into ``dump_dir`` gave tiles to (its module after the config assigner)."""
  files = sorted(glob.glob(os.path.join(dump_dir, _AFTER)))
  if not files:
    return []
  text = open(files[-1]).read()
  blocks = {m.group(1): m for m in _COMPUTATION.finditer(text)}
  out = []
  seen = set()
  for m in _FUSION.finditer(text):
    called, backend = m.group(1), m.group(2)
    if called in seen or '"__triton_gemm"' not in backend or called not in blocks:
      continue
    seen.add(called)
    found = re.search(r'"triton_gemm_config":(\{[^{}]*\})', backend)
    if found is None:
      continue
    hlo = canonical(*blocks[called].groups())
    if hlo is not None:
      out.append((hlo, json.loads(found.group(1))))
  return out


def record(dump_dir: str, compile_options: Mapping[str, Any]) -> int:
  """Writes into the directory ``compile_options`` name (:func:`options`) the configuration
  of each Triton GEMM fusion of the compile dumped into ``dump_dir``, for the compiles
  after it; the number of files written. Nothing where the cache's version is unknown."""
  directory = ours(compile_options)
  cache_version = _VERSION.get(_jaxlib())
  if directory is None or cache_version is None:
    return 0
  model = _model(dump_dir)
  if model is None:
    return 0
  written = 0
  for hlo, config in chosen(dump_dir):
    path = os.path.join(directory, file_name(model, hlo, cache_version))
    if not os.path.exists(path):
      cache.write_text(path, _result(config))
      written += 1
  return written


def _jaxlib() -> str:
  import jaxlib

  return jaxlib.__version__


def _store() -> str:
  return os.path.join(cache.cache_dir(), f"gemm_configs-{_jaxlib()}.json")


# The probe's candidate configurations, one a version: tiles small enough for any dot.
_TILES = [
  {"block_m": m, "block_n": n, "block_k": k, "num_stages": s, "num_warps": w, "num_ctas": 1}
  for m in (16, 32, 64)
  for n in (16, 32, 64)
  for k in (16, 32, 64)
  for s in (1, 2)
  for w in (2, 4)
]


def version() -> int | None:
  """The version of XLA's per-fusion cache keys in the installed jaxlib, found by
  :func:`_probe` once per jaxlib (kept in the cache directory); None where XLA took none
  of the probe's files (or its config assigner does not compile at level 0: jaxlib 0.10)."""
  key = _jaxlib()
  with _LOCK:
    if key in _VERSION:
      return _VERSION[key]
    found: int | None = None
    try:
      with open(_store()) as f:
        found = json.load(f)["version"]
    except (OSError, ValueError, KeyError, TypeError):
      found = _probe()
      try:
        cache.write_text(_store(), json.dumps({"version": found}))
      except OSError:
        pass
    _VERSION[key] = found
    return found


def _taken(compiled, tiles: list[dict[str, int]]) -> int | None:
  """The number (from 1) of the entry of ``tiles`` the probe's one fusion was compiled with,
  or None; ``compiled``'s dump is removed."""
  applied = chosen(compiled.dump_dir)
  shutil.rmtree(compiled.dump_dir, ignore_errors=True)
  if len(applied) != 1:
    return None
  got = applied[0][1]
  for n, tile in enumerate(tiles, start=1):
    if all(int(got.get(k, 0)) == v for k, v in tile.items()):
      return n
  return None


def _probe() -> int | None:
  """Compiles a one-dot program for an H100 and returns the version whose file a second
  compile took (see the module's description), or None: also where a third, in the
  jaxlib's default cache format, takes it too (XLA's map of what it read is then one the
  user's autotuned compiles look up)."""
  from jax_overlap._src.flags.validation import version_tuple

  if version_tuple(_jaxlib()) < (0, 11):
    return None
  import jax
  import jax.numpy as jnp

  from jax_overlap._src.compile import compiler

  def step(a, b):
    return jnp.tanh(jnp.dot(a, b, preferred_element_type=jnp.float32))

  args = (
    jax.ShapeDtypeStruct((176, 272), jnp.float16),
    jax.ShapeDtypeStruct((272, 144), jnp.float16),
  )
  work = tempfile.mkdtemp(prefix="jax_overlap_gemm_probe_")
  try:
    first = compiler.compile_for_target(
      jax.jit(step),
      *args,
      target="h100x1",
      xla_options={"xla_gpu_autotune_level": 0, "xla_dump_hlo_pass_re": _PASS_DUMP},
      keep_dump=True,
    )
    fusions = chosen(first.dump_dir)
    model = _model(first.dump_dir)
    shutil.rmtree(first.dump_dir, ignore_errors=True)
    if len(fusions) != 1 or model is None:
      return None
    hlo, default = fusions[0]
    directory = new_directory(work)
    tiles = [t for t in _TILES if any(default.get(k) != v for k, v in t.items())]
    for n, tile in enumerate(tiles, start=1):
      cache.write_text(os.path.join(directory, file_name(model, hlo, n)), _result(tile))
    second = compiler.compile_for_target(
      jax.jit(step),
      *args,
      target="h100x1",
      xla_options={"xla_gpu_autotune_level": 0, **options(directory)},
      keep_dump=True,
    )
    found = _taken(second, tiles)
    if found is None:
      return None
    # XLA keeps what it read in a map of the process that every compile with a cache in
    # the legacy format looks up before it autotunes: where that is the jaxlib's default,
    # the level-0 tiles shared here would be taken by the user's own autotuned compiles.
    # A compile in the default format that takes the probe's tiles from that map says so.
    third = compiler.compile_for_target(
      jax.jit(step),
      *args,
      target="h100x1",
      xla_options={"xla_gpu_autotune_level": 0, "xla_dump_hlo_pass_re": _PASS_DUMP},
      keep_dump=True,
    )
    return None if _taken(third, tiles) is not None else found
  except Exception:  # noqa: BLE001 - a jaxlib without these options: nothing shared
    return None
  finally:
    shutil.rmtree(work, ignore_errors=True)
