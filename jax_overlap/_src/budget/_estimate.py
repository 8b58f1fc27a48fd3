"""A roofline step-time estimate from a compiled executable's optimized HLO.

Used by :func:`jax_overlap.budget.memory.plan` when ``jax_overlap.analyze`` is
not installed. For each instruction of the scheduled entry computation:
compute time ``max(dot FLOPs / peak FLOP/s, 2 * output bytes / HBM bandwidth)``
(dot FLOPs = 2 x output elements x contracted elements, summed over fusion
bodies); a collective costs ``bytes * (n-1)/n / link bandwidth + (n-1) * hop
latency``; a synchronous one is fully exposed, an asynchronous one only for
the part not covered by compute scheduled between its start and done. Loop
bodies count once (the estimate is for unrolled steps).
"""

from __future__ import annotations

import math
import re

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}
_ARRAY_RE = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"[\s)\]}]([a-z][a-z0-9\-_]*)\(")


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY_RE.findall(shape)]


def _bytes(shape: str) -> int:
  return sum(_DTYPE_BYTES.get(d, 4) * math.prod(dims) for d, dims in _arrays(shape))


def _parse(text: str):
  comps: dict[str, list[tuple[str, str, str, str]]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    m = _COMP_RE.match(line) if line[:1] not in (" ", "\t", "") else None
    if m:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
      continue
    if current is None:
      continue
    m = _INSTR_RE.match(line)
    if not m:
      continue
    rest = " " + m.group(2)
    op = _OPCODE_RE.search(rest)
    if not op:
      continue
    shape = rest[: op.start() + 1].strip()
    comps[current].append((m.group(1), shape, op.group(1), rest[op.end() :]))
  return comps, entry


def _dot_flops(shape: str, args: str, table: dict[str, str], custom: bool) -> tuple[float, str]:
  out = _arrays(shape)
  if not out:
    return 0.0, "f32"
  operands = re.findall(r"%([^\s,)]+)", args.split(")")[0])
  lhs = _arrays(table.get(operands[0], "")) if operands else []
  if custom:
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', args)
  else:
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", args)
  if not lhs or not m:
    return 0.0, out[0][0]
  dims = [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip('" ')]
  contracted = math.prod(lhs[0][1][d] for d in dims if d < len(lhs[0][1]))
  return 2.0 * math.prod(out[0][1]) * contracted, lhs[0][0]


def estimate_step_time(hlo_text: str, target) -> float:
  """Seconds for one step of the scheduled HLO on ``target`` (a Topology or its name)."""
  from jax_overlap._src import targets as _targets

  topo = _targets.get(target)
  gpu = topo.gpu
  n = topo.num_devices
  comps, entry = _parse(hlo_text)
  tables = {c: {name: shape for name, shape, _, _ in instrs} for c, instrs in comps.items()}
  flops_cache: dict[str, tuple[float, float]] = {}

  def comp_cost(c: str) -> tuple[float, float]:
    """(dot seconds, FLOPs) of a computation, through its callees."""
    if c in flops_cache:
      return flops_cache[c]
    flops_cache[c] = (0.0, 0.0)
    secs = fl = 0.0
    for _, shape, opcode, args in comps.get(c, []):
      if opcode == "dot" or (opcode == "custom-call" and "gemm" in args):
        f, dtype = _dot_flops(shape, args, tables[c], opcode == "custom-call")
        secs += f / gpu.peak_flops(dtype)
        fl += f
      for callee in re.findall(r"(?:calls|to_apply|body)=%?([^\s,}]+)", args):
        s2, f2 = comp_cost(callee)
        secs, fl = secs + s2, fl + f2
    flops_cache[c] = (secs, fl)
    return secs, fl

  def comm_time(shape: str, opcode: str) -> float:
    nbytes = _bytes(shape)
    bw, lat = topo.link_for(n)
    factor = 2.0 if opcode.startswith("all-reduce") else 1.0
    return factor * nbytes * (n - 1) / n / bw + (n - 1) * lat

  clock = 0.0
  pending: dict[str, tuple[float, float]] = {}
  for name, shape, opcode, args in comps.get(entry, []):
    if opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
      continue
    base = opcode.replace("-start", "").replace("-done", "")
    is_coll = base in (
      "all-gather",
      "reduce-scatter",
      "all-reduce",
      "all-to-all",
      "collective-permute",
    ) or opcode in ("async-start", "async-done")
    if opcode.endswith("-start") or opcode == "async-start":
      if opcode == "async-start":
        callee = re.search(r"calls=%?([^\s,}]+)", args)
        inner = comps.get(callee.group(1), []) if callee else []
        kinds = [o for _, _, o, _ in inner if o not in ("parameter",)]
        if not any(k.startswith(("all-", "reduce-scatter", "collective")) for k in kinds):
          clock += comp_cost(callee.group(1))[0] if callee else 0.0
          continue
        shape = inner[-1][1] if inner else shape
        base = kinds[-1] if kinds else "all-reduce"
      pending[name] = (clock, comm_time(shape, base))
      continue
    if opcode.endswith("-done") or opcode == "async-done":
      src = re.findall(r"%([^\s,)]+)", args)
      start = pending.pop(src[0], None) if src else None
      if start is not None:
        began, cost = start
        clock = max(clock, began + cost)
      continue
    if is_coll:
      clock += comm_time(shape, base)
      continue
    secs, _ = comp_cost_of_instr(opcode, args, shape, tables[entry], comp_cost, gpu)
    clock += secs
  for began, cost in pending.values():
    clock = max(clock, began + cost)
  return clock


def comp_cost_of_instr(opcode, args, shape, table, comp_cost, gpu) -> tuple[float, float]:
  """(seconds, FLOPs) of one entry instruction: dot time vs. memory time, whichever binds."""
  secs = fl = 0.0
  if opcode == "dot" or (opcode == "custom-call" and "gemm" in args):
    f, dtype = _dot_flops(shape, args, table, opcode == "custom-call")
    secs, fl = f / gpu.peak_flops(dtype), f
  for callee in re.findall(r"(?:calls|to_apply|body)=%?([^\s,}]+)", args):
    s2, f2 = comp_cost(callee)
    secs, fl = secs + s2, fl + f2
  mem = 2.0 * _bytes(shape) / gpu.memory_bandwidth
  return max(secs, mem), fl


def roofline_estimator(fn, *args, target="h100x8") -> float:
  """Step seconds of ``fn(*args)`` compiled for ``target`` (see the module docstring)."""
  import jax

  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return estimate_step_time(jitted.lower(*args).compile().as_text(), target)
