"""Reading XLA's scheduled HLO text and counting its FLOPs and bytes.

(Over 500 lines: the counts are methods of the parsed :class:`Module`, following XLA's
``HloCostAnalysis`` op by op; parser and counts change together when XLA's text does.)

The optimised module XLA dumps (``*after_optimizations.txt``) is printed in
schedule order when ``is_scheduled=true``. This module parses it into
computations of instructions, with result shapes, operands, called
computations and attributes, and counts per instruction:

* FLOPs, following XLA's ``HloCostAnalysis`` conventions: a dot costs
  ``2 * |output| * prod(contracting dims)``; a convolution
  ``2 * |output| * |kernel| / output_features``; an elementwise arithmetic op
  costs one FLOP per output element (transcendental ops are counted apart, as
  XLA does); a reduce costs ``(|input| - |output|)`` times the ops of its
  reducer; a fusion costs the sum of its fused instructions.
* bytes accessed at the kernel boundary: the bytes of the operands plus the
  bytes of the result (what a roofline needs for a fused kernel).

Deviceless GPU executables return no cost analysis in jaxlib 0.10, so these
counts are what the analysis uses for GPU targets; tests check them against
``compiled.cost_analysis()`` on CPU compiles of the same programs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from functools import cache, cached_property

__all__ = [
  "Instruction",
  "Computation",
  "Module",
  "parse_module",
  "shape_bytes",
  "shape_elements",
  "array_shapes",
  "group_size",
  "is_cublas_gemm",
]

_BITS = {
  "pred": 8,
  "token": 0,
  "opaque": 0,
  "c64": 64,
  "c128": 128,
}


def _bits(dtype: str) -> int:
  if dtype in _BITS:
    return _BITS[dtype]
  m = re.search(r"(\d+)", dtype)
  if dtype.startswith(("f8", "float8")):
    return 8
  if dtype.startswith(("f4", "float4")):
    return 4
  return int(m.group(1)) if m else 0


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, dims) of each array in an HLO shape string (tuples flattened)."""
  s = _COMMENT.sub("", shape)
  out = []
  for dtype, dims in _ARRAY.findall(s):
    if dtype in ("T", "S"):  # layout tiling / memory space annotations
      continue
    dd = tuple(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
    out.append((dtype, dd))
  return out


def shape_bytes(shape: str) -> int:
  """Total bytes of an HLO shape string."""
  total = 0
  for dtype, dims in array_shapes(shape):
    total += (math.prod(dims) * _bits(dtype) + 7) // 8
  return total


def shape_elements(shape: str) -> int:
  """Total elements of an HLO shape string."""
  return sum(math.prod(d) for _, d in array_shapes(shape))


@cache
def _split_pattern(sep: str) -> re.Pattern:
  return re.compile("[" + re.escape('\\"{}[]()' + sep) + "]")


def _split_top(text: str, sep: str = ",") -> list[str]:
  """Splits at ``sep`` outside brackets and quotes (a backslash escapes the next character
  in a quote). Visits only the characters that matter, so long attribute lists are quick."""
  parts, depth, quote, start, skip = [], 0, False, 0, -1
  for m in _split_pattern(sep).finditer(text):
    j = m.start()
    if j == skip:
      continue
    ch = text[j]
    if quote:
      if ch == "\\":
        skip = j + 1
      elif ch == '"':
        quote = False
    elif ch == '"':
      quote = True
    elif ch in "{[(":
      depth += 1
    elif ch in "}])":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append(text[start:j].strip())
      start = j + 1
  tail = text[start:].strip()
  if tail:
    parts.append(tail)
  return parts


def _matching(text: str, start: int) -> int:
  """Index just past the bracket matching the one at ``start``."""
  open_ch = text[start]
  close_ch = {"(": ")", "{": "}", "[": "]"}[open_ch]
  depth, quote = 0, False
  for i in range(start, len(text)):
    ch = text[i]
    if quote:
      if ch == '"' and text[i - 1] != "\\":
        quote = False
      continue
    if ch == '"':
      quote = True
    elif ch == open_ch:
      depth += 1
    elif ch == close_ch:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


@dataclasses.dataclass
class Instruction:
  """One HLO instruction.

  Attributes:
    name: instruction name without ``%``.
    opcode: e.g. ``fusion``, ``all-gather-start``, ``while``.
    shape: result shape text.
    operands: operand instruction names.
    attrs: attribute text by key (``calls``, ``replica_groups``, ``backend_config``...).
    is_root: whether it is the computation's root.
    computation: name of the computation holding it.
  """

  name: str
  opcode: str
  shape: str
  operands: list[str]
  attrs: dict[str, str]
  is_root: bool = False
  computation: str = ""

  @cached_property
  def backend_config(self) -> dict:
    text = self.attrs.get("backend_config")
    if not text:
      return {}
    try:
      return json.loads(text)
    except ValueError:
      return {}

  @cached_property
  def metadata(self) -> dict[str, str]:
    return _kv_braced(self.attrs.get("metadata", ""))

  @cached_property
  def frontend_attributes(self) -> dict[str, str]:
    return _kv_braced(self.attrs.get("frontend_attributes", ""))

  @property
  def called(self) -> list[str]:
    out = []
    for key in ("calls", "to_apply", "body", "condition", "true_computation", "false_computation"):
      if key in self.attrs:
        out.extend(re.findall(r"%?([\w.\-]+)", self.attrs[key]))
    if "branch_computations" in self.attrs:
      out.extend(re.findall(r"%([\w.\-]+)", self.attrs["branch_computations"]))
    return out

  @property
  def bytes_out(self) -> int:
    return shape_bytes(self.shape)

  @property
  def kernel_name(self) -> str:
    """The name XLA gives this instruction's kernel (deduplicated kernels share one)."""
    return self.metadata.get("deduplicated_name", self.name).replace(".", "_").replace("-", "_")


def _kv_braced(text: str) -> dict[str, str]:
  text = text.strip()
  if text.startswith("{") and text.endswith("}"):
    text = text[1:-1]
  out = {}
  for part in _split_top(text, " "):
    if "=" in part:
      k, v = part.split("=", 1)
      out[k.strip()] = v.strip().strip('"')
  for part in _split_top(text, ","):
    if "=" in part:
      k, v = part.split("=", 1)
      k = k.strip()
      if " " not in k:
        out.setdefault(k, v.strip().strip('"'))
  return out


@dataclasses.dataclass
class Computation:
  name: str
  instructions: list[Instruction]
  is_entry: bool = False

  @cached_property
  def by_name(self) -> dict[str, Instruction]:
    return {i.name: i for i in self.instructions}

  @property
  def root(self) -> Instruction | None:
    for i in self.instructions:
      if i.is_root:
        return i
    return self.instructions[-1] if self.instructions else None


# An operand is an instruction's name, or since XLA 0.11 an element of its tuple result
# (``%param.3#1``: what a get-tuple-element of index 1 gave before).
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)*)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _parse_instruction(line: str, comp: str) -> Instruction | None:
  m = _INSTR.match(line)
  if not m:
    return None
  is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
  rest = rest.strip()
  # Result shape: a tuple in parentheses or a single token.
  if rest.startswith("("):
    end = _matching(rest, 0)
    shape, rest = rest[:end], rest[end:].strip()
  else:
    sp = rest.find(" ")
    shape, rest = rest[:sp], rest[sp + 1 :].strip()
  p = rest.find("(")
  if p < 0:
    return None
  opcode = rest[:p].strip()
  end = _matching(rest, p)
  operand_text = rest[p + 1 : end - 1]
  attr_text = rest[end:].strip().lstrip(",").strip()
  operands = _OPERAND.findall(operand_text)
  if not operands and operand_text and opcode not in ("constant", "parameter", "iota"):
    operands = [t.strip().split(" ")[-1] for t in _split_top(operand_text) if t.strip()]
  attrs: dict[str, str] = {}
  for part in _split_top(attr_text):
    if "=" in part:
      k, v = part.split("=", 1)
      attrs[k.strip()] = v.strip()
  if opcode == "parameter":
    attrs["parameter_number"] = operand_text.strip()
  return Instruction(name, opcode, shape, operands, attrs, is_root, comp)


@dataclasses.dataclass
class Module:
  """A parsed HLO module."""

  name: str
  computations: dict[str, Computation]
  entry: str
  attrs: str = ""

  @property
  def entry_computation(self) -> Computation:
    return self.computations[self.entry]

  @property
  def is_scheduled(self) -> bool:
    return "is_scheduled=true" in self.attrs

  @cached_property
  def num_partitions(self) -> int:
    m = re.search(r"num_partitions=(\d+)", self.attrs)
    return int(m.group(1)) if m else 1

  # ---- FLOPs --------------------------------------------------------------

  def instruction_flops(self, instr: Instruction, comp: Computation | None = None) -> float:
    """FLOPs of one instruction (fusions and calls include their bodies, loops excluded)."""
    return self._flops(instr, comp or self.computations[instr.computation])[0]

  def instruction_transcendentals(self, instr: Instruction) -> float:
    return self._flops(instr, self.computations[instr.computation])[1]

  def _flops(self, instr: Instruction, comp: Computation) -> tuple[float, float]:
    op = instr.opcode
    out_elems = shape_elements(instr.shape)
    if op in ("fusion", "call", "async-start"):
      f = t = 0.0
      for c in instr.called:
        if c in self.computations:
          cf, ct = self.computation_flops(c)
          f += cf
          t += ct
      return f, t
    if op == "dot":
      lhs = comp.by_name.get(instr.operands[0]) if instr.operands else None
      dims = _dims_attr(instr.attrs.get("lhs_contracting_dims", "{}"))
      k = 1
      if lhs is not None:
        shapes = array_shapes(lhs.shape)
        if shapes:
          lhs_dims = shapes[0][1]
          k = math.prod(lhs_dims[d] for d in dims if d < len(lhs_dims))
      return 2.0 * out_elems * k, 0.0
    if op == "convolution":
      rhs = comp.by_name.get(instr.operands[1]) if len(instr.operands) > 1 else None
      if rhs is None:
        return 0.0, 0.0
      rdims = array_shapes(rhs.shape)[0][1]
      labels = instr.attrs.get("dim_labels", "")
      kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
      out_feat = rdims[kernel_labels.index("o")] if "o" in kernel_labels else 1
      groups = int(instr.attrs.get("feature_group_count", "1"))
      return 2.0 * out_elems * math.prod(rdims) / max(out_feat, 1) / max(groups, 1) * groups, 0.0
    if op in _TRANSCENDENTAL:
      return 0.0, float(out_elems)
    if op in _ELEMENTWISE:
      return float(out_elems), 0.0
    if op in ("reduce", "reduce-window", "all-reduce", "reduce-scatter", "all-reduce-start"):
      if op in ("all-reduce", "reduce-scatter", "all-reduce-start"):
        return 0.0, 0.0
      in_elems = 0
      n_inputs = max(1, len(instr.operands) // 2)
      for name in instr.operands[:n_inputs]:
        o = comp.by_name.get(name)
        if o is not None:
          in_elems += shape_elements(o.shape)
      reducer = instr.called[0] if instr.called else None
      per = 1.0
      if reducer and reducer in self.computations:
        per = max(1.0, self.computation_flops(reducer)[0])
      if op == "reduce-window":
        window = _window_size(instr.attrs.get("window", ""))
        return float(out_elems) * max(window - 1, 0) * per, 0.0
      return float(max(in_elems - out_elems, 0)) / n_inputs * per, 0.0
    return 0.0, 0.0

  def computation_flops(self, name: str) -> tuple[float, float]:
    cache = self.__dict__.setdefault("_comp_flops", {})
    if name not in cache:
      cache[name] = (0.0, 0.0)  # guards against recursion
      comp = self.computations[name]
      f = t = 0.0
      for instr in comp.instructions:
        a, b = self._flops(instr, comp)
        f += a
        t += b
      cache[name] = (f, t)
    return cache[name]

  def instruction_bytes(self, instr: Instruction, comp: Computation | None = None) -> int:
    """Bytes read and written at the kernel boundary: operands plus result.

    Accesses are counted as XLA runs them: a fused kernel computes only the
    elements its result needs, so each fusion parameter costs the share of it
    that the fused computation reads (:func:`_parameter_reads`: slices keep
    their share of their operand, whatever sits between the parameter and the
    slice); a dynamic-update-slice (alone or as a fusion root) reads and writes
    only the updated slice of the buffer it updates in place.
    """
    comp = comp or self.computations[instr.computation]
    sizes = []
    for name in instr.operands:
      o = comp.by_name.get(name)
      sizes.append(o.bytes_out if o is not None else 0)
    out = instr.bytes_out
    if is_cublas_gemm(instr) and instr.shape.startswith("("):
      # (result, workspace): the scratch workspace is not data the GEMM moves.
      out = shape_bytes(_split_top(instr.shape[1:-1], ",")[0])
    fused = (
      self.computations.get(instr.called[0]) if instr.opcode == "fusion" and instr.called else None
    )
    scope = fused if fused is not None else None
    roots = [instr] if fused is None else _roots_of(fused)
    # In-place updates: the result aliases operand 0 of the update.
    for r in roots:
      if r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
        k = 0 if scope is None else _param_index(scope, r.operands[0])
        u = (scope or comp).by_name.get(r.operands[1])
        if k is not None and k < len(sizes):
          out -= sizes[k]
          sizes[k] = 0
          out += u.bytes_out if u is not None else 0
    # Operands read in part.
    if scope is not None:
      for k, share in _parameter_reads(scope).items():
        if k < len(sizes) and sizes[k]:
          sizes[k] = int(round(sizes[k] * share))
    elif instr.opcode in ("dynamic-slice", "slice") and sizes:
      sizes[0] = min(sizes[0], instr.bytes_out)
    return int(max(out, 0) + sum(sizes))

  def dot_in(self, instr: Instruction) -> Instruction | None:
    """The dot (or convolution) inside a fusion, or the instruction itself."""
    if instr.opcode in ("dot", "convolution"):
      return instr
    for c in instr.called:
      comp = self.computations.get(c)
      if comp is None:
        continue
      for i in comp.instructions:
        found = self.dot_in(i) if i.opcode in ("dot", "convolution", "fusion") else None
        if found is not None:
          return found
    return None

  def gemm_mnk(self, instr: Instruction) -> tuple[int, int, int] | None:
    """(M, N, K) of the dot in an instruction, batch folded into M."""
    dot = self.dot_in(instr)
    if dot is None or dot.opcode != "dot":
      if is_cublas_gemm(instr):
        return _cublas_mnk(instr, self.computations[instr.computation])
      return None
    comp = self.computations[dot.computation]
    lhs = comp.by_name.get(dot.operands[0])
    rhs = comp.by_name.get(dot.operands[1]) if len(dot.operands) > 1 else None
    if lhs is None or rhs is None:
      return None
    ld = array_shapes(lhs.shape)[0][1]
    rd = array_shapes(rhs.shape)[0][1]
    lc = _dims_attr(dot.attrs.get("lhs_contracting_dims", "{}"))
    lb = _dims_attr(dot.attrs.get("lhs_batch_dims", "{}"))
    rc = _dims_attr(dot.attrs.get("rhs_contracting_dims", "{}"))
    rb = _dims_attr(dot.attrs.get("rhs_batch_dims", "{}"))
    k = math.prod(ld[d] for d in lc)
    batch = math.prod(ld[d] for d in lb)
    m = math.prod(s for d, s in enumerate(ld) if d not in lc and d not in lb) * batch
    n = math.prod(s for d, s in enumerate(rd) if d not in rc and d not in rb)
    return int(m), int(n), int(k)


def _roots_of(fused: Computation) -> list[Instruction]:
  root = fused.root
  if root is None:
    return []
  if root.opcode == "tuple":
    return [fused.by_name[n] for n in root.operands if n in fused.by_name]
  return [root]


_PASS_THROUGH = ("bitcast", "reshape", "copy")


def _param_index(fused: Computation, name: str) -> int | None:
  p = fused.by_name.get(name)
  while p is not None and p.opcode in _PASS_THROUGH and p.operands:
    p = fused.by_name.get(p.operands[0])
  if p is not None and p.opcode == "parameter":
    try:
      return int(p.attrs.get("parameter_number", ""))
    except ValueError:
      return None
  return None


def _parameter_reads(fused: Computation) -> dict[int, float]:
  """Share (0..1) of each fusion parameter that the fused kernel reads.

  XLA's loop and input emitters compute the result element by element, reading
  only the operand elements those elements need. Starting from the roots (whose
  results are needed whole), each instruction passes the share of its result
  that is needed on to its operands: a (dynamic-)slice or gather scales it by
  its result's size over its operand's; a dynamic-update-slice needs the same
  share of its update and the remainder of its buffer (none of it when the
  update happens in place at the root); elementwise, layout and reduction ops
  pass it unchanged; anything else needs all of its operands. Shares from
  several users add up, at most 1: a read of the same element twice is served
  from cache. Only parameters read below their full size are returned.
  """
  roots = {r.name for r in _roots_of(fused)}
  share: dict[str, float] = dict.fromkeys(roots, 1.0)
  for i in reversed(fused.instructions):
    u = min(share.get(i.name, 0.0), 1.0)
    if u <= 0.0 or i.opcode == "parameter":
      continue
    ops = [fused.by_name.get(n) for n in i.operands]
    first = ops[0] if ops else None
    if i.opcode in ("slice", "dynamic-slice", "gather") and first is not None:
      # The slice's share of its operand; indices are read whole.
      ratio = shape_elements(i.shape) / max(shape_elements(first.shape), 1)
      amounts = [u * ratio] + [u] * (len(ops) - 1)
    elif i.opcode == "dynamic-update-slice" and len(ops) > 1 and ops[1] is not None:
      # The update, and what it leaves of the buffer (nothing read when updated in place).
      covered = shape_elements(ops[1].shape) / max(shape_elements(i.shape), 1)
      rest = 0.0 if i.name in roots else u * max(1.0 - covered, 0.0)
      amounts = [rest] + [u] * (len(ops) - 1)
    elif i.opcode in _SAME_SHARE:
      amounts = [u] * len(ops)
    else:
      amounts = [1.0] * len(ops)
    for o, amount in zip(ops, amounts):
      if o is not None:
        share[o.name] = share.get(o.name, 0.0) + amount
  out: dict[int, float] = {}
  for i in fused.instructions:
    if i.opcode != "parameter":
      continue
    try:
      k = int(i.attrs.get("parameter_number", ""))
    except ValueError:
      continue
    read = min(share.get(i.name, 0.0), 1.0)
    if read < 1.0:
      out[k] = read
  return out


def _cublas_mnk(instr: Instruction, comp: Computation) -> tuple[int, int, int] | None:
  cfg = instr.backend_config.get("gemm_backend_config", {})
  dn = cfg.get("dot_dimension_numbers", {})
  if len(instr.operands) < 2:
    return None
  lhs, rhs = comp.by_name.get(instr.operands[0]), comp.by_name.get(instr.operands[1])
  if lhs is None or rhs is None:
    return None
  ld, rd = array_shapes(lhs.shape)[0][1], array_shapes(rhs.shape)[0][1]
  lc = [int(x) for x in dn.get("lhs_contracting_dimensions", [])]
  lb = [int(x) for x in dn.get("lhs_batch_dimensions", [])]
  rc = [int(x) for x in dn.get("rhs_contracting_dimensions", [])]
  rb = [int(x) for x in dn.get("rhs_batch_dimensions", [])]
  k = math.prod(ld[d] for d in lc)
  batch = math.prod(ld[d] for d in lb)
  m = math.prod(s for d, s in enumerate(ld) if d not in lc and d not in lb) * batch
  n = math.prod(s for d, s in enumerate(rd) if d not in rc and d not in rb)
  return int(m), int(n), int(k)


def is_cublas_gemm(instr: Instruction) -> bool:
  """A GEMM XLA hands to cuBLAS (``__cublas$gemm``, ``__cublas$lt$matmul``, its fp8 form)."""
  if instr.opcode != "custom-call":
    return False
  target = instr.attrs.get("custom_call_target", "").strip('"')
  return target.startswith("__cublas$") and ("gemm" in target or "matmul" in target)


def cublas_flops(module: Module, instr: Instruction) -> float:
  mnk = _cublas_mnk(instr, module.computations[instr.computation])
  return 0.0 if mnk is None else 2.0 * mnk[0] * mnk[1] * mnk[2]


def _dims_attr(text: str) -> list[int]:
  return [int(x) for x in re.findall(r"\d+", text)]


def _window_size(text: str) -> int:
  m = re.search(r"size=([\dx]+)", text)
  if not m:
    return 1
  return math.prod(int(x) for x in m.group(1).split("x"))


_TRANSCENDENTAL = frozenset(
  {
    "exponential",
    "exponential-minus-one",
    "log",
    "log-plus-one",
    "tanh",
    "logistic",
    "sine",
    "cosine",
    "tan",
    "power",
    "sqrt",
    "rsqrt",
    "cbrt",
    "atan2",
    "erf",
  }
)

_ELEMENTWISE = frozenset(
  {
    "add",
    "subtract",
    "multiply",
    "divide",
    "remainder",
    "maximum",
    "minimum",
    "negate",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round-nearest-afz",
    "round-nearest-even",
    "compare",
    "select",
    "clamp",
    "and",
    "or",
    "xor",
    "not",
    "shift-left",
    "shift-right-arithmetic",
    "shift-right-logical",
    "convert",
    "is-finite",
    "real",
    "imag",
    "complex",
    "popcnt",
    "count-leading-zeros",
    "stochastic-convert",
    "reduce-precision",
  }
)


# Ops whose operand elements are read in the same share as their result's elements
# are needed (elementwise, layout and reduction ops: a reduce needs whole rows of its
# input for the rows of its result it computes). Any other op (dots, sorts, scatters,
# windows) reads all of its operands as soon as any of its result is needed.
_SAME_SHARE = (
  frozenset(_PASS_THROUGH)
  | _ELEMENTWISE
  | _TRANSCENDENTAL
  | {
    "broadcast",
    "transpose",
    "reduce",
    "concatenate",
    "pad",
    "bitcast-convert",
    "iota",
    "constant",
    "parameter",
  }
)


def tuple_elements(shape: str) -> list[str]:
  """The element shapes of a tuple shape text (``(f32[2], (s32[], u8[4]))``), each as text;
  ``[shape]`` for an array shape."""
  s = _COMMENT.sub("", shape).strip()
  if not s.startswith("("):
    return [s]
  return _split_top(s[1 : _matching(s, 0) - 1])


def _with_tuple_elements(comp: Computation) -> Computation:
  """``comp`` with a get-tuple-element instruction for each ``name#k`` operand (XLA 0.11's
  text for an element of a tuple result), placed after what it reads from, so that every
  reader of operands finds the element's shape as it found a get-tuple-element's."""
  known = {i.name: i for i in comp.instructions}
  added: dict[str, list[Instruction]] = {}

  def element(ref: str) -> None:
    if ref in known or "#" not in ref:
      return
    base, k = ref.rsplit("#", 1)
    element(base)
    src = known.get(base)
    if src is None:
      return
    parts = tuple_elements(src.shape)
    shape = parts[int(k)] if int(k) < len(parts) else ""
    gte = Instruction(ref, "get-tuple-element", shape, [base], {"index": k}, False, comp.name)
    known[ref] = gte
    added.setdefault(base, []).append(gte)

  for instr in comp.instructions:
    for ref in instr.operands:
      element(ref)
  if not added:
    return comp
  ordered: list[Instruction] = []
  for instr in comp.instructions:
    ordered.append(instr)
    stack = list(added.get(instr.name, ()))
    while stack:
      gte = stack.pop(0)
      ordered.append(gte)
      stack[:0] = added.get(gte.name, ())
  return Computation(comp.name, ordered, comp.is_entry)


def parse_module(text: str) -> Module:
  """Parses HLO module text (as dumped by XLA) into a :class:`Module`.

  Raises:
    ValueError: if the text holds no HLO module.
  """
  lines = text.splitlines()
  name, attrs = "", ""
  comps: dict[str, Computation] = {}
  entry = None
  cur: Computation | None = None
  for line in lines:
    if line.startswith("HloModule"):
      parts = line.split(",", 1)
      name = parts[0].split()[1] if len(parts[0].split()) > 1 else ""
      attrs = line
      continue
    if cur is None:
      m = _HEADER.match(line)
      if m:
        cur = Computation(m.group(2), [], is_entry=bool(m.group(1)))
        if cur.is_entry:
          entry = cur.name
      continue
    if line.strip() == "}":
      comps[cur.name] = _with_tuple_elements(cur)
      cur = None
      continue
    instr = _parse_instruction(line, cur.name)
    if instr is not None:
      cur.instructions.append(instr)
  if entry is None:
    raise ValueError("parse_module: no ENTRY computation found in the HLO text")
  return Module(name, comps, entry, attrs)


def group_size(instr: Instruction, num_partitions: int = 1) -> int:
  """Devices per replica group of a collective, from any of XLA's group formats."""
  rg = instr.attrs.get("replica_groups")
  if rg:
    rg = rg.strip()
    # Iota form: [num_groups,group_size]<=[...]
    m = re.match(r"\[(\d+),(\d+)\]<=", rg)
    if m:
      return int(m.group(2))
    # Mesh form: mesh['a'=8,'b'=1] {'a'}  -> product of the listed axes.
    m = re.match(r"mesh\[(.*?)\]\s*\{(.*?)\}", rg)
    if m:
      sizes = dict((k.strip("' "), int(v)) for k, v in re.findall(r"('?[\w]+'?)=(\d+)", m.group(1)))
      axes = [a.strip("' ") for a in m.group(2).split(",") if a.strip()]
      return math.prod(sizes.get(a, 1) for a in axes) if axes else math.prod(sizes.values())
    groups = re.findall(r"\{([\d,\s]*)\}", rg[1:-1] if rg.startswith("{") else rg)
    groups = [g for g in groups if g.strip()]
    if groups:
      return len([x for x in groups[0].split(",") if x.strip()])
    return max(num_partitions, 1)
  pairs = instr.attrs.get("source_target_pairs")
  if pairs:
    devs = set(int(x) for x in re.findall(r"\d+", pairs))
    return max(len(devs), 1)
  return max(num_partitions, 1)
