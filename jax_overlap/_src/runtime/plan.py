"""Runtime plans: which kernels and regions get occupancy shaping, which streams priority.

(Over 500 lines: the plan's schema, each section's validation with its error messages,
and its two serializations, JSON and the runtime library's rules text, which change
together; the residency arithmetic is in :mod:`jax_overlap._src.runtime.residency`.)

A plan is a versioned JSON document, written by hand or by the simulator's tuner
through ``Plan(...).to_json()``::

  {
    "version": 1,
    "target": "h100",
    "kernels": [
      {"match": "gemm_fusion_*", "blocks_per_sm": 2},
      {"regex": "^sm90_xmma_gemm_.*", "padding_bytes": 16384}
    ],
    "regions": {"mlp": {"blocks_per_sm": 1}},
    "streams": {"priority": "highest"},
    "comm_block": "auto",
    "library_gemms": {"sm_count_target": 100}
  }

``comm_block`` is the communication block every cap must make room for: ``"auto"``
(NCCL's channel on the device the program runs on, :meth:`CommBlock.nccl`), an
explicit ``{"threads": 544, "regs_per_thread": 96, "smem_bytes": 82240}``, or
``null`` to apply caps as written. A kernel for which no cap leaves room is left
alone and counted (``runtime.status().counters.no_room``).

``library_gemms`` (optional) sets an SM-count target on every cuBLAS handle and cuBLASLt
matmul descriptor the program creates (:class:`LibraryGemms`): cuBLAS's own lever for
leaving SMs to a concurrent stream beside its GEMMs, which on Hopper are persistent kernels
holding every SM. Whether it shrinks their grid is measured, not assumed
(``benchmarks/gpu/gemm_dispatch.cu``); the simulator's tuner does not propose it.

``jax-overlap launch`` validates it and hands it to the runtime library
(``libjax_overlap_rt.so``) as compact rules (:meth:`Plan.to_rules`).

The residency arithmetic the runtime library applies at launch (``xla_patches/runtime/
shaping.h``) is in :mod:`jax_overlap._src.runtime.residency`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from jax_overlap._src import deprecations, targets
from jax_overlap._src.runtime.residency import _is_int

__all__ = [
  "PLAN_VERSION",
  "CommBlock",
  "KernelRule",
  "RegionRule",
  "StreamPolicy",
  "LibraryGemms",
  "Plan",
  "region_id",
  "PlanCheck",
  "check_plan",
]

PLAN_VERSION = 1
_API = "jax_overlap.runtime.Plan"

_TOP_KEYS = (
  "comm_block",
  "comment",
  "kernels",
  "library_gemms",
  "regions",
  "streams",
  "target",
  "version",
)
_LIBRARY_GEMM_KEYS = ("comment", "sm_count_target")
_COMM_KEYS = ("regs_per_thread", "smem_bytes", "threads")
_KERNEL_KEYS = ("blocks_per_sm", "comment", "match", "padding_bytes", "regex")
_REGION_KEYS = ("blocks_per_sm", "comment")
_STREAM_KEYS = ("comment", "create_order", "priority", "promote_requested")
_PRIORITIES = ("default", "highest")


def _check_keys(where: str, found: Mapping[str, Any], valid: tuple[str, ...]) -> None:
  if not isinstance(found, Mapping):
    raise TypeError(f"{_API}: {where} must be a JSON object, got {type(found).__name__}")
  for key in found:
    if key not in valid:
      raise ValueError(f"{_API}: {where}: unknown key {key!r}; valid keys: {', '.join(valid)}")


def _check_text(where: str, value: Any) -> str:
  if not isinstance(value, str):
    raise TypeError(f"{_API}: {where} must be a string, got {type(value).__name__}")
  if not value:
    raise ValueError(f"{_API}: {where} must not be empty")
  if any(c in value for c in "\t\n\r"):
    raise ValueError(f"{_API}: {where} must not contain tabs or line breaks, got {value!r}")
  return value


def _check_positive(where: str, value: Any) -> int:
  if not _is_int(value):
    raise TypeError(f"{_API}: {where} must be an integer, got {type(value).__name__} {value!r}")
  if value < 1:
    raise ValueError(f"{_API}: {where} must be a positive integer (>= 1), got {value}")
  return value


def region_id(name: str | int) -> int:
  """The 64-bit id the runtime library uses for an occupancy region.

  A non-negative integer (or a string of decimal digits) is its own id; any
  other name maps to a stable hash at or above 2**62, so named and numbered
  regions never collide.

  Raises:
    TypeError: if ``name`` is neither a string nor an integer.
    ValueError: for a negative or too large integer or an empty name.
  """
  if _is_int(name):
    if not 0 <= name < 2**62:
      raise ValueError(f"jax_overlap.occupancy: region id must be in [0, 2**62), got {name}")
    return name
  if not isinstance(name, str):
    raise TypeError(
      f"jax_overlap.occupancy: region name must be a string or an integer, got "
      f"{type(name).__name__}"
    )
  if not name:
    raise ValueError("jax_overlap.occupancy: region name must not be empty")
  if name.isdigit() and int(name) < 2**62:
    return int(name)
  digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
  return (int.from_bytes(digest, "little") & (2**62 - 1)) | 2**62


def _exactly_one(a: str, a_value: Any, b: str, b_value: Any, note: str = "") -> tuple[str, Any]:
  """The one of two kernel-rule fields that is set, as (name, value); ValueError otherwise."""
  if (a_value is None) == (b_value is None):
    raise ValueError(
      f"{_API}: a kernel rule needs exactly one of {a!r}{note} or {b!r}, got "
      f"{a}={a_value!r}, {b}={b_value!r}"
    )
  return (a, a_value) if a_value is not None else (b, b_value)


@dataclasses.dataclass(frozen=True)
class KernelRule:
  """Kernels selected by name and what to do with them.

  Exactly one of ``match`` (a shell glob, as fnmatch) and ``regex`` (searched
  anywhere in the name, ECMAScript syntax in the runtime library), and exactly
  one of ``blocks_per_sm`` (cap on resident blocks per SM) and
  ``padding_bytes`` (extra dynamic shared memory per block).

  Example:
    >>> KernelRule(match="gemm_fusion_*", blocks_per_sm=2)  # doctest: +ELLIPSIS
    KernelRule(match='gemm_fusion_*', ...)
  """

  match: str | None = None
  regex: str | None = None
  blocks_per_sm: int | None = None
  padding_bytes: int | None = None

  def __post_init__(self):
    key, pattern = _exactly_one("match", self.match, "regex", self.regex, note=" (glob)")
    _check_text(f"kernel rule {key!r}", pattern)
    if key == "regex":
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"{_API}: kernel rule 'regex' {pattern!r} does not compile: {e}") from None
    key, value = _exactly_one(
      "blocks_per_sm", self.blocks_per_sm, "padding_bytes", self.padding_bytes
    )
    _check_positive(f"kernel rule {key!r}", value)

  @property
  def pattern(self) -> str:
    return self.match if self.match is not None else self.regex  # type: ignore[return-value]

  def to_dict(self) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class RegionRule:
  """Blocks per SM for the kernels launched inside one ``jax_overlap.occupancy`` region."""

  name: str
  blocks_per_sm: int

  def __post_init__(self):
    if _is_int(self.name):
      object.__setattr__(self, "name", str(self.name))
    _check_text("region name", self.name)
    region_id(self.name)
    _check_positive(f"regions[{self.name!r}] 'blocks_per_sm'", self.blocks_per_sm)

  @property
  def id(self) -> int:
    return region_id(self.name)


@dataclasses.dataclass(frozen=True)
class StreamPolicy:
  """Stream priorities.

  Attributes:
    priority: ``"highest"`` creates selected streams at the greatest priority of
      cuCtxGetStreamPriorityRange; ``"default"`` leaves streams alone.
    create_order: 0-based creation indices of the streams to promote (counted
      over cuStreamCreate and cuStreamCreateWithPriority in the process).
    promote_requested: promote every stream created with a non-default priority.
      Defaults to true when ``priority`` is ``"highest"`` and ``create_order`` is
      empty.

  XLA already creates its async collective streams at the highest priority
  (``--xla_gpu_enable_highest_priority_async_stream``, on by default).
  """

  priority: Literal["highest", "default"] = "default"
  create_order: tuple[int, ...] = ()
  promote_requested: bool | None = None

  def __post_init__(self):
    if self.priority not in _PRIORITIES:
      raise ValueError(
        f"{_API}: streams 'priority' must be one of {', '.join(_PRIORITIES)}, got {self.priority!r}"
      )
    if isinstance(self.create_order, (str, bytes)) or not isinstance(self.create_order, Iterable):
      raise TypeError(
        f"{_API}: streams 'create_order' must be a list of integers, got "
        f"{type(self.create_order).__name__}"
      )
    order = tuple(self.create_order)
    for i, v in enumerate(order):
      if not _is_int(v):
        raise TypeError(f"{_API}: streams 'create_order'[{i}] must be an integer, got {v!r}")
      if v < 0:
        raise ValueError(f"{_API}: streams 'create_order'[{i}] must be >= 0, got {v}")
    object.__setattr__(self, "create_order", order)
    if self.promote_requested is not None and not isinstance(self.promote_requested, bool):
      raise TypeError(
        f"{_API}: streams 'promote_requested' must be true or false, got {self.promote_requested!r}"
      )

  @property
  def promotes_requested(self) -> bool:
    if self.promote_requested is not None:
      return self.promote_requested
    return self.priority == "highest" and not self.create_order

  def to_dict(self) -> dict[str, Any]:
    out: dict[str, Any] = {"priority": self.priority}
    if self.create_order:
      out["create_order"] = list(self.create_order)
    if self.promote_requested is not None:
      out["promote_requested"] = self.promote_requested
    return out


@dataclasses.dataclass(frozen=True)
class LibraryGemms:
  """What the runtime library sets on cuBLAS's GEMMs (``xla_patches/runtime/library_gemms.h``).

  Attributes:
    sm_count_target: the number of SMs cuBLAS's heuristics target, set on every cuBLAS
      handle (``cublasSetSmCountTarget``) and cuBLASLt matmul descriptor
      (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``) as the program creates them: below the
      device's SM count it asks for GEMMs that leave SMs to a concurrent stream. Counted
      in ``runtime.status().counters`` (``gemm_handles_targeted``,
      ``gemm_descs_targeted``, ``gemm_target_errors``).
  """

  sm_count_target: int

  def __post_init__(self):
    n = self.sm_count_target
    if not _is_int(n):
      raise TypeError(
        f"{_API}: library_gemms 'sm_count_target' must be an integer (an SM count), got {n!r}"
      )
    if not 1 <= n <= 4096:
      raise ValueError(
        f"{_API}: library_gemms 'sm_count_target' must be an SM count from 1 to 4096, got {n}"
      )

  def to_dict(self) -> dict[str, Any]:
    return {"sm_count_target": self.sm_count_target}


def _library_gemms(spec: Any) -> LibraryGemms | None:
  if spec is None or isinstance(spec, LibraryGemms):
    return spec
  if not isinstance(spec, Mapping):
    raise TypeError(
      f"{_API}: 'library_gemms' must be a JSON object such as {{\"sm_count_target\": 100}}, "
      f"got {type(spec).__name__}"
    )
  _check_keys("library_gemms", spec, _LIBRARY_GEMM_KEYS)
  if "sm_count_target" not in spec:
    raise ValueError(f"{_API}: library_gemms: missing key 'sm_count_target'")
  return LibraryGemms(spec["sm_count_target"])


def _kernel_rule(index: int, rule: Any) -> KernelRule:
  if isinstance(rule, KernelRule):
    return rule
  where = f"kernels[{index}]"
  _check_keys(where, rule, _KERNEL_KEYS)
  fields = {k: v for k, v in rule.items() if k != "comment"}
  try:
    return KernelRule(**fields)
  except (TypeError, ValueError) as e:
    raise type(e)(str(e).replace(f"{_API}: ", f"{_API}: {where}: ", 1)) from None


def _region_rules(regions: Any) -> tuple[RegionRule, ...]:
  if isinstance(regions, Mapping):
    out = []
    for name, spec in regions.items():
      if isinstance(spec, RegionRule):
        out.append(spec)
        continue
      if _is_int(spec):
        out.append(RegionRule(name, spec))
        continue
      _check_keys(f"regions[{name!r}]", spec, _REGION_KEYS)
      if "blocks_per_sm" not in spec:
        raise ValueError(f"{_API}: regions[{name!r}]: missing key 'blocks_per_sm'")
      out.append(RegionRule(name, spec["blocks_per_sm"]))
    return tuple(out)
  if isinstance(regions, Iterable) and not isinstance(regions, (str, bytes)):
    rules = tuple(regions)
    for r in rules:
      if not isinstance(r, RegionRule):
        raise TypeError(f"{_API}: regions must map names to blocks_per_sm, got an item {r!r}")
    return rules
  raise TypeError(f"{_API}: regions must be a JSON object, got {type(regions).__name__}")


@dataclasses.dataclass(frozen=True)
class CommBlock:
  """Launch footprint of one communication block (an NCCL channel) a cap makes room for.

  Attributes:
    threads: threads per block.
    regs_per_thread: registers per thread (0: unknown, not checked).
    smem_bytes: static plus dynamic shared memory per block.

  Example:
    >>> CommBlock.nccl("h100")
    CommBlock(threads=544, regs_per_thread=96, smem_bytes=82240)
  """

  threads: int
  regs_per_thread: int = 0
  smem_bytes: int = 0

  def __post_init__(self):
    for name in _COMM_KEYS:
      value = getattr(self, name)
      if not _is_int(value):
        raise TypeError(f"{_API}: comm_block.{name} must be an integer, got {value!r}")
    if not 1 <= self.threads <= 1024:
      raise ValueError(f"{_API}: comm_block.threads must be 1-1024, got {self.threads}")
    if not 0 <= self.regs_per_thread <= 255:
      raise ValueError(
        f"{_API}: comm_block.regs_per_thread must be 0-255, got {self.regs_per_thread}"
      )
    if self.smem_bytes < 0:
      raise ValueError(f"{_API}: comm_block.smem_bytes must be >= 0, got {self.smem_bytes}")

  @classmethod
  def nccl(cls, gpu: str | targets.Gpu, nthreads: int | None = None) -> CommBlock:
    """NCCL's channel on ``gpu``, as the runtime library's ``"auto"`` (``jor_nccl_comm_block``).

    NCCL (src/include/device.h) builds its kernels with
    ``__launch_bounds__(NCCL_MAX_NTHREADS = 640, 1)``, which bounds registers at 96 per
    thread, and launches them with ``ncclShmemDynamicSize`` bytes of dynamic shared memory:
    ``(unroll * 32 + 1) * 16`` bytes per warp for 20 warps (unroll 8 on sm_80 and later,
    82,240 bytes; 4 on sm_70). The block size is the Simple protocol's, which carries
    large messages: ``NCCL_NTHREADS`` (default 512, from the environment when
    ``nthreads`` is None) plus one synchronization warp. LL128 and tree channels launch
    640 threads: pass ``nthreads=640`` to make room for those.
    """
    g = targets.get_gpu(gpu)
    if g.vendor != "nvidia" or g.compute_capability[0] < 7:
      raise ValueError(f"{_API}: no NCCL channel footprint for {g.name} ({g.vendor})")
    if nthreads is None:
      nthreads = _nccl_simple_threads(os.environ.get("NCCL_NTHREADS"))
    unroll = 8 if g.compute_capability[0] >= 8 else 4
    return cls(int(nthreads), 96, (unroll * 32 + 1) * 16 * (640 // 32))

  def to_dict(self) -> dict[str, int]:
    return {
      "threads": self.threads,
      "regs_per_thread": self.regs_per_thread,
      "smem_bytes": self.smem_bytes,
    }


def _nccl_simple_threads(value: str | None) -> int:
  """Threads of NCCL's Simple-protocol channel for an NCCL_NTHREADS value (as the library)."""
  n = 512
  if value is not None and value.strip().isdigit():
    v = int(value)
    if 64 <= v <= 512 and v % 64 == 0:
      n = v
  return n + 32 if n >= 96 else n


def _comm_block(value: Any) -> CommBlock | str | None:
  if value is None or value == "auto" or isinstance(value, CommBlock):
    return value
  if isinstance(value, Mapping):
    _check_keys("comm_block", value, _COMM_KEYS)
    if "threads" not in value:
      raise ValueError(f"{_API}: comm_block needs 'threads'")
    return CommBlock(**value)
  raise TypeError(
    f"{_API}: 'comm_block' must be \"auto\", null or an object with {list(_COMM_KEYS)}, "
    f"got {value!r}"
  )


@dataclasses.dataclass(frozen=True)
class Plan:
  """A validated runtime plan.

  Args:
    version: plan format version; only 1 exists.
    target: GPU catalogue name (``"h100"``, ``"a100"``...) the numbers were
      chosen for; when given, blocks and padding are checked against its limits.
    kernels: :class:`KernelRule` objects or dicts such as
      ``{"match": "gemm_fusion_*", "blocks_per_sm": 2}``; the first match wins.
    regions: mapping of region name to blocks per SM (an int or
      ``{"blocks_per_sm": N}``), for ``jax_overlap.occupancy(name=...)`` regions.
    streams: a :class:`StreamPolicy` or a dict such as ``{"priority": "highest"}``.
    comm_block: the communication block caps make room for: ``"auto"`` (NCCL's
      channel on the running device), a :class:`CommBlock` or dict, or None to apply
      caps as written.
    library_gemms: a :class:`LibraryGemms` or a dict such as ``{"sm_count_target": 100}``:
      cuBLAS's SM-count target on every handle and matmul descriptor; None: none.

  Raises:
    ValueError: for bad values or unknown keys, naming them and the valid ones.
    TypeError: for values of the wrong type.

  Example:
    >>> plan = Plan(target="h100", kernels=[{"match": "gemm_fusion_*", "blocks_per_sm": 2}],
    ...             streams={"priority": "highest"})
    >>> Plan.from_json(plan.to_json()) == plan
    True
  """

  version: int = PLAN_VERSION
  target: str | None = None
  kernels: tuple[KernelRule, ...] = ()
  regions: tuple[RegionRule, ...] = ()
  streams: StreamPolicy = dataclasses.field(default_factory=StreamPolicy)
  comm_block: CommBlock | Literal["auto"] | None = "auto"
  library_gemms: LibraryGemms | None = None

  def __post_init__(self):
    object.__setattr__(self, "comm_block", _comm_block(self.comm_block))
    object.__setattr__(self, "library_gemms", _library_gemms(self.library_gemms))
    if not _is_int(self.version):
      raise TypeError(f"{_API}: 'version' must be an integer, got {self.version!r}")
    if self.version != PLAN_VERSION:
      raise ValueError(
        f"{_API}: unsupported plan version {self.version}; this jax_overlap reads version "
        f"{PLAN_VERSION}"
      )
    if isinstance(self.kernels, (str, bytes, Mapping)) or not isinstance(self.kernels, Iterable):
      raise TypeError(
        f"{_API}: 'kernels' must be a list of rules, got {type(self.kernels).__name__}"
      )
    object.__setattr__(
      self, "kernels", tuple(_kernel_rule(i, r) for i, r in enumerate(self.kernels))
    )
    object.__setattr__(self, "regions", _region_rules(self.regions))
    names = [r.name for r in self.regions]
    if len(set(names)) != len(names):
      raise ValueError(f"{_API}: regions: duplicate region names in {names}")
    seen: dict[int, str] = {}
    for r in self.regions:
      if r.id in seen:
        raise ValueError(
          f"{_API}: regions: {seen[r.id]!r} and {r.name!r} name the same region id {r.id}"
        )
      seen[r.id] = r.name
    if self.streams is None:
      object.__setattr__(self, "streams", StreamPolicy())
    elif isinstance(self.streams, Mapping):
      _check_keys("streams", self.streams, _STREAM_KEYS)
      spec = {k: v for k, v in self.streams.items() if k != "comment"}
      object.__setattr__(self, "streams", StreamPolicy(**spec))
    elif not isinstance(self.streams, StreamPolicy):
      raise TypeError(f"{_API}: 'streams' must be a JSON object, got {type(self.streams).__name__}")
    self.validate()

  def validate(self) -> Plan:
    """Checks the plan against its target's limits; returns the plan.

    Raises:
      ValueError: for an unknown or non-NVIDIA target, or a number above its limits.
    """
    if self.target is None:
      return self
    if not isinstance(self.target, str):
      raise TypeError(f"{_API}: 'target' must be a GPU name string, got {self.target!r}")
    try:
      gpu = targets.get_gpu(self.target)
    except ValueError:
      try:  # a topology such as "h100x8", as analyze and sim take it
        hint = f" ({self.target!r} is a topology: its GPU is {targets.get(self.target).gpu.name!r})"
      except ValueError:
        hint = ""
      raise ValueError(
        f"{_API}: 'target': unknown GPU {self.target!r}{hint}; a plan's target names the GPU, "
        f"one of: {', '.join(targets.names())}"
      ) from None
    if gpu.vendor != "nvidia":
      raise ValueError(
        f"{_API}: 'target' {self.target!r} is not an NVIDIA GPU; the runtime library shapes "
        "CUDA launches only"
      )
    for i, rule in enumerate(self.kernels):
      if rule.blocks_per_sm is not None and rule.blocks_per_sm > gpu.max_blocks_per_sm:
        raise ValueError(
          f"{_API}: kernels[{i}]: 'blocks_per_sm' must be at most {gpu.max_blocks_per_sm} on "
          f"{gpu.name}, got {rule.blocks_per_sm}"
        )
      if rule.padding_bytes is not None and rule.padding_bytes > gpu.smem_per_block_optin:
        raise ValueError(
          f"{_API}: kernels[{i}]: 'padding_bytes' must be at most {gpu.smem_per_block_optin} "
          f"(the opt-in shared memory per block on {gpu.name}), got {rule.padding_bytes}"
        )
    lg = self.library_gemms
    if lg is not None and lg.sm_count_target > gpu.sm_count:
      raise ValueError(
        f"{_API}: library_gemms 'sm_count_target' must be at most {gpu.sm_count} (the SMs "
        f"of {gpu.name}), got {lg.sm_count_target}"
      )
    for r in self.regions:
      if r.blocks_per_sm > gpu.max_blocks_per_sm:
        raise ValueError(
          f"{_API}: regions[{r.name!r}]: 'blocks_per_sm' must be at most "
          f"{gpu.max_blocks_per_sm} on {gpu.name}, got {r.blocks_per_sm}"
        )
    return self

  @property
  def empty(self) -> bool:
    """Whether the plan changes nothing."""
    return (
      not self.kernels
      and not self.regions
      and self.streams.priority == "default"
      and self.library_gemms is None
    )

  def to_dict(self) -> dict[str, Any]:
    out: dict[str, Any] = {"version": self.version}
    if self.target is not None:
      out["target"] = self.target
    out["kernels"] = [r.to_dict() for r in self.kernels]
    out["regions"] = {r.name: {"blocks_per_sm": r.blocks_per_sm} for r in self.regions}
    out["streams"] = self.streams.to_dict()
    cb = self.comm_block
    out["comm_block"] = cb.to_dict() if isinstance(cb, CommBlock) else cb
    if self.library_gemms is not None:
      out["library_gemms"] = self.library_gemms.to_dict()
    return out

  def __getitem__(self, key: str) -> Any:
    # sim.TuneResult.plan was this dict: ``plan["streams"]`` still reads it for one release.
    data = self.to_dict()
    if key not in data:
      raise KeyError(f"{_API}: its JSON form has no key {key!r}; it has {', '.join(data)}")
    deprecations.warn(
      _API,
      f"plan[{key!r}] reads the plan's JSON form and is deprecated: use plan.{key} "
      f"or plan.to_dict()[{key!r}]",
    )
    return data[key]

  __iter__ = None  # not a mapping: iter(plan) is a TypeError, as before __getitem__

  def to_json(self, path: str | os.PathLike | None = None, *, indent: int = 2) -> str:
    """The plan as JSON text; also written to ``path`` when given."""
    text = json.dumps(self.to_dict(), indent=indent) + "\n"
    if path is not None:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text

  @classmethod
  def from_json(cls, source: str | os.PathLike | Mapping[str, Any]) -> Plan:
    """Reads a plan from a file path, JSON text or an already parsed dict.

    Raises:
      ValueError: for malformed JSON, a missing or unsupported version, unknown
        keys or bad values.
      TypeError: for values of the wrong type.
      FileNotFoundError: for a missing file.
    """
    where = "plan"
    if isinstance(source, Mapping):
      data: Any = source
    else:
      text = os.fspath(source)
      if isinstance(text, str) and text.lstrip().startswith("{"):
        raw = text
      else:
        where = str(text)
        try:
          with open(text, encoding="utf-8") as f:
            raw = f.read()
        except FileNotFoundError:
          raise FileNotFoundError(f"{_API}.from_json: no plan file {where!r}") from None
      try:
        data = json.loads(raw)
      except json.JSONDecodeError as e:
        raise ValueError(f"{_API}.from_json: malformed JSON in {where}: {e}") from None
    if not isinstance(data, Mapping):
      raise TypeError(
        f"{_API}.from_json: a plan must be a JSON object, got {type(data).__name__} in {where}"
      )
    _check_keys("plan", data, _TOP_KEYS)
    if "version" not in data:
      raise ValueError(f"{_API}: missing key 'version' (expected {PLAN_VERSION}) in {where}")
    return cls(
      version=data["version"],
      target=data.get("target"),
      kernels=data.get("kernels", ()),
      regions=data.get("regions", {}),
      streams=data.get("streams", None),
      comm_block=data.get("comm_block", "auto"),
      library_gemms=data.get("library_gemms"),
    )

  def to_rules(self) -> str:
    """The compact rules text the runtime library reads (JAX_OVERLAP_RT_RULES)."""
    lines = [f"version\t{self.version}"]
    for r in self.kernels:
      kind = "glob" if r.match is not None else "regex"
      what = (
        ("blocks_per_sm", r.blocks_per_sm)
        if r.blocks_per_sm is not None
        else (
          "padding_bytes",
          r.padding_bytes,
        )
      )
      lines.append(f"kernel\t{kind}\t{r.pattern}\t{what[0]}\t{what[1]}")
    for r in self.regions:
      lines.append(f"region\t{r.id}\tblocks_per_sm\t{r.blocks_per_sm}")
    lines.append(f"streams\tpriority\t{self.streams.priority}")
    lines.append(f"streams\tpromote_requested\t{int(self.streams.promotes_requested)}")
    if self.streams.create_order:
      lines.append("streams\tcreate_order\t" + ",".join(map(str, self.streams.create_order)))
    cb = self.comm_block
    if isinstance(cb, CommBlock):
      lines.append(f"comm_block\t{cb.threads}\t{cb.regs_per_thread}\t{cb.smem_bytes}")
    else:
      lines.append(f"comm_block\t{'none' if cb is None else 'auto'}")
    if self.library_gemms is not None:
      lines.append(f"library_gemms\tsm_count_target\t{self.library_gemms.sm_count_target}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Checking a plan against a compiled step, before launch.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlanCheck:
  """Which kernel rules of a plan select kernels of a compiled step.

  Attributes:
    matched: rule pattern -> the kernel names (as the driver reports them) it selects.
    unmatched: patterns that select no kernel of the step: they would shape nothing.
    unnamed: report kernels without a launch name (library calls such as cuBLAS
      GEMMs, whose kernels carry the library's names): no rule can select them.
    library_gemms: the step's cuBLAS GEMMs the plan's ``library_gemms`` SM-count target
      reaches (empty without one).
  """

  matched: dict[str, tuple[str, ...]]
  unmatched: tuple[str, ...]
  unnamed: tuple[str, ...]
  library_gemms: tuple[str, ...] = ()
  sm_count_target: int = 0

  @property
  def ok(self) -> bool:
    return not self.unmatched

  def __str__(self) -> str:
    n = len(self.matched) + len(self.unmatched)
    lines = [
      f"{n} kernel rule(s): {len(self.matched)} select kernels of the step, "
      f"{len(self.unmatched)} select none"
    ]
    lines += [f"  matches nothing: {p}" for p in self.unmatched]
    if self.unnamed:
      lines.append(
        f"  {len(self.unnamed)} kernel(s) of the step launch no kernel of XLA's own (device "
        "copies, library calls such as cuBLAS): no rule can select them by name"
      )
    if self.sm_count_target:
      lines.append(
        f"  library_gemms: SM-count target {self.sm_count_target} on the step's "
        f"{len(self.library_gemms)} cuBLAS GEMM(s)"
        + ("" if self.library_gemms else ": the step has none, the target changes nothing")
      )
    return "\n".join(lines)


def _rule_selects(rule: KernelRule, name: str) -> bool:
  # The runtime library uses fnmatch(3) with no flags and ECMAScript regex_search.
  if rule.match is not None:
    return fnmatch.fnmatchcase(name, rule.match)
  return re.search(rule.regex, name) is not None


def check_plan(plan: Plan | Mapping[str, Any] | str | os.PathLike, report: Any) -> PlanCheck:
  """Says, before launch, which kernel rules of ``plan`` select kernels of ``report``'s step.

  The runtime library matches rules against the names the driver reports for
  each kernel function; the analysis reads the same names from XLA's thunk
  listing (``report.kernels[i].launch_name``).

  Args:
    plan: a :class:`Plan`, its dict form, or a path to its JSON file.
    report: a :func:`jax_overlap.analyze` report of the step, compiled for a GPU target.

  Returns:
    A :class:`PlanCheck`.

  Raises:
    ValueError: if the report has no kernel launch names (not compiled for a GPU).

  Example:
    >>> check = check_plan("plan.json", jax_overlap.analyze(step, *args, target="h100x8"))  # doctest: +SKIP
    >>> check.unmatched  # doctest: +SKIP
    ()
  """
  if not isinstance(plan, Plan):
    plan = Plan.from_json(plan)
  kernels = list(getattr(report, "kernels", ()))
  names = sorted({k.launch_name for k in kernels if getattr(k, "launch_name", "")})
  if not names:
    raise ValueError(
      "jax_overlap.runtime.check_plan: the report has no kernel launch names; analyse the step for a GPU "
      "target (jax_overlap.analyze(..., target='h100x8')) to read XLA's thunk listing"
    )
  matched, unmatched = {}, []
  for rule in plan.kernels:
    hits = tuple(n for n in names if _rule_selects(rule, n))
    if hits:
      matched[rule.pattern] = hits
    else:
      unmatched.append(rule.pattern)
  unnamed = tuple(k.name for k in kernels if not getattr(k, "launch_name", ""))
  target = plan.library_gemms.sm_count_target if plan.library_gemms is not None else 0
  gemms = tuple(k.name for k in kernels if target and getattr(k, "library", False))
  return PlanCheck(matched, tuple(unmatched), unnamed, gemms, target)
