"""The schedule of a compiled step: kernels and collectives in XLA's order.

(Over 500 lines: the schedule's record types, with their documented fields, and the one
pass over the scheduled HLO that fills them.)

From the scheduled HLO and XLA's thunk listing this module builds the flat
sequence the GPU will execute for one step:

* the entry computation's instructions in schedule order, with while-loop
  bodies repeated by their known trip count (XLA records it in the loop's
  backend config), calls inlined, and the most expensive branch of a
  conditional;
* each kernel with its launch configuration from the thunk listing (grid,
  threads per block, shared memory), its FLOPs and bytes from the HLO, and its
  roofline time from the cost model;
* each collective with its kind, bytes, group size, the stream it runs on,
  whether XLA made it asynchronous (start/done pair) or synchronous, and its
  alpha-beta time.
"""

from __future__ import annotations

import dataclasses
import re

from jax_overlap._src import deprecations, targets
from jax_overlap._src.analysis import cost_model as cm
from jax_overlap._src.analysis import hlo as hlo_lib

__all__ = [
  "KernelInfo",
  "CollectiveInfo",
  "Op",
  "Schedule",
  "build_schedule",
  "launches_by_instruction",
  "parse_clusters",
  "parse_thunk_metadata",
  "parse_thunks",
]

COLLECTIVE_KINDS = {
  "all-gather": "all-gather",
  "all-reduce": "all-reduce",
  "reduce-scatter": "reduce-scatter",
  "all-to-all": "all-to-all",
  "ragged-all-to-all": "all-to-all",
  "collective-permute": "collective-permute",
  "collective-broadcast": "all-gather",
}
_START = {
  "all-gather-start": "all-gather",
  "all-reduce-start": "all-reduce",
  "collective-permute-start": "collective-permute",
}
_DONE = {"all-gather-done", "all-reduce-done", "collective-permute-done", "async-done"}
_FREE = frozenset(
  {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "domain",
    "get-dimension-size",
    "set-dimension-size",
    "copy-start",
    "copy-done",
    "send",
    "send-done",
    "recv",
    "recv-done",
  }
)


@dataclasses.dataclass
class KernelInfo:
  """One compute kernel of the step, in schedule order.

  Attributes:
    name: HLO instruction name (with an ``@i`` suffix for loop iteration i).
    kind: "gemm", "convolution", "reduction", "copy", "custom", "fusion" or "other".
    index: position in the step's kernel sequence.
    grid_blocks: blocks in the grid (from XLA's thunk listing; 0 if unknown).
    threads_per_block: threads per block (0 if unknown).
    smem_bytes: shared memory per block XLA launches with.
    regs_per_thread: registers per thread, when known.
    flops: FLOPs counted from the HLO.
    bytes_accessed: operand plus result bytes.
    time_s: roofline estimate on the target.
    gemm_mnk: (M, N, K) for kernels containing a dot.
    dtype: dtype of the dot operands, else of the result.
    op_name: JAX op name from the HLO metadata.
    annotations: frontend attributes (scheduling groups, priorities...).
    launch_name: the name of the kernel as XLA launches it and the driver reports it
      (``cuFuncGetName``), read from XLA's thunk listing: HLO names with '.' and '-'
      turned into '_', and identical fusions deduplicated into one kernel, so
      ``loop_multiply_fusion.2`` may launch as ``loop_multiply_fusion_7``. "" when
      the thunk listing has no kernel for it (a library call such as a cuBLAS GEMM,
      whose kernels have the library's names, or a compile without a thunk listing).
    library: a library call (a cuBLAS/cuBLASLt GEMM), whose kernels the library picks
      at run time, rather than a kernel XLA emitted.
    persistent: the kernel holds every SM it gets until it ends (a library GEMM on a GPU
      whose library runs them persistent, ``Gpu.persistent_library_gemms``): a collective
      that becomes ready while it runs, or just as it starts, waits for its end.
    cluster: blocks per thread-block cluster XLA launches it with (1: no cluster).
    start_s, end_s: placement on the estimated timeline.
  """

  name: str
  kind: str
  index: int
  grid_blocks: int
  threads_per_block: int
  smem_bytes: int
  regs_per_thread: int | None
  flops: float
  bytes_accessed: float
  time_s: float
  gemm_mnk: tuple[int, int, int] | None
  dtype: str
  op_name: str = ""
  annotations: dict[str, str] = dataclasses.field(default_factory=dict)
  start_s: float = 0.0
  end_s: float = 0.0
  launch_name: str = ""
  library: bool = False
  persistent: bool = False
  cluster: int = 1


@dataclasses.dataclass
class CollectiveInfo:
  """One collective of the step.

  Attributes:
    name: HLO name of the start (or synchronous) instruction.
    kind: "all-gather", "reduce-scatter", "all-reduce", "all-to-all" or "collective-permute".
    bytes: the larger of operand and result bytes per device.
    group_size: devices per replica group.
    start_index: issued just before kernels[start_index].
    done_index: must finish before kernels[done_index] starts.
    time_s: alpha-beta estimate.
    synchronous: runs on the compute stream, blocking it.
    stream: communication stream index (-1 for synchronous).
    start_s, end_s: placement on the estimated timeline.
    exposed_s: compute-stream time spent waiting for it.
    overlapped_kernels: kernels that ran while it was in flight.
    annotations: frontend attributes.
    held_by: the persistent kernel it waited behind ("" if none): it became ready while
      that kernel held every SM, and started when it ended.
  """

  name: str
  kind: str
  bytes: int
  group_size: int
  start_index: int
  done_index: int
  time_s: float
  synchronous: bool
  stream: int = 0
  op_name: str = ""
  annotations: dict[str, str] = dataclasses.field(default_factory=dict)
  start_s: float = 0.0
  end_s: float = 0.0
  exposed_s: float = 0.0
  overlapped_kernels: int = 0
  held_by: str = ""


@dataclasses.dataclass(frozen=True)
class LoopInfo(deprecations.ReadAsDict):
  """One while loop of the step, unrolled into the schedule ``trip_count`` times.

  Attributes:
    name: HLO name of the while instruction.
    trip_count: XLA's known trip count (1 when XLA does not know it; a note says so).
    body: name of the loop's body computation.
  """

  name: str
  trip_count: int
  body: str

  _was_dict = "Report.loops"


@dataclasses.dataclass
class Op:
  """One step of the flat schedule."""

  kind: str  # "kernel", "start", "done", "sync"
  kernel: KernelInfo | None = None
  collective: CollectiveInfo | None = None
  start_name: str | None = None  # for "done": the start it completes


@dataclasses.dataclass
class Schedule:
  """The step's operations in order. ``uncounted``: the cost (s) of each kernel and
  collective in a conditional's branches the step does not count (all but the most
  expensive), by instruction name: XLA schedules them too (a latency profile names them)."""

  ops: list[Op]
  kernels: list[KernelInfo]
  collectives: list[CollectiveInfo]
  notes: list[str]
  loops: list[LoopInfo]
  uncounted: dict[str, float] = dataclasses.field(default_factory=dict)


# A kernel thunk's name and launch configuration, as XLA up to 0.12.0 lists it ("name grid:
# [x, y, z] threads: [x, y, z]  shared_memory: N bytes") and from 0.12.1 on ("kernel=name,
# profile_annotation=..., launch dimensions=blocks: {x, y, z}, threads/block: {x, y, z},
# cluster_dim=..., shmem_bytes=N").
_THUNK_KERNEL = re.compile(
  r"(\S+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s*threads:\s*\[(\d+),\s*(\d+),\s*(\d+)\]"
  r"\s*shared_memory:\s*(\d+)"
  r"|kernel=([^,\s]+),.*?blocks:\s*\{(\d+),\s*(\d+),\s*(\d+)\},\s*threads/block:\s*"
  r"\{(\d+),\s*(\d+),\s*(\d+)\}.*?shmem_bytes=(\d+)"
)
# A kernel thunk's cluster dimensions (0.12.1 on: "cluster_dim=nullopt" without a cluster;
# with one, the three numbers that follow, braced or named, are read).
_THUNK_CLUSTER = re.compile(r"cluster_dim=[^,\d{]*\{?\s*(\d+),\s*(\d+),\s*(\d+)")
_THUNK_ASYNC = re.compile(r"kAsyncStart.*stream=communication_stream\[(\d+)\]")
_THUNK_ID = re.compile(r"^\s*(\d+):")
_METADATA = re.compile(r'profile_annotation:\s*"([^"]*)"\s*(?:thunk_id:\s*(\d+))?')


def _launch(m: re.Match) -> tuple[str, tuple[int, int, int]]:
  """Kernel name and (grid blocks, threads per block, shared memory) of a kernel thunk."""
  g = m.groups()
  name, *n = g[:8] if g[0] is not None else g[8:]
  grid = int(n[0]) * int(n[1]) * int(n[2])
  threads = int(n[3]) * int(n[4]) * int(n[5])
  return name, (grid, threads, int(n[6]))


def parse_thunks(text: str) -> tuple[dict[str, tuple[int, int, int]], list[int]]:
  """Kernel launch configurations by kernel name, and async collective streams in order."""
  kernels: dict[str, tuple[int, int, int]] = {}
  streams: list[int] = []
  lines = text.splitlines()
  for i, line in enumerate(lines):
    m = _THUNK_KERNEL.search(line)
    if m:
      name, config = _launch(m)
      kernels.setdefault(name, config)
      continue
    a = _THUNK_ASYNC.search(line)
    if a:
      nxt = lines[i + 1] if i + 1 < len(lines) else ""
      if re.search(r"k(AllGather|AllReduce|ReduceScatter|AllToAll|CollectivePermute|Ragged)", nxt):
        streams.append(int(a.group(1)))
  return kernels, streams


def parse_clusters(text: str) -> dict[str, int]:
  """Blocks per thread-block cluster of each kernel the thunk listing launches as a
  cluster, by kernel name (XLA 0.12.1 on lists ``cluster_dim``; earlier listings none)."""
  out: dict[str, int] = {}
  for line in text.splitlines():
    m, c = _THUNK_KERNEL.search(line), _THUNK_CLUSTER.search(line)
    if m and c:
      size = int(c.group(1)) * int(c.group(2)) * int(c.group(3))
      if size > 1:
        out.setdefault(_launch(m)[0], size)
  return out


def parse_thunk_metadata(text: str) -> dict[int, str]:
  """The HLO instruction each thunk runs, by thunk id, from XLA's thunk metadata listing."""
  return {int(m.group(2) or 0): m.group(1) for m in _METADATA.finditer(text)}


def launches_by_instruction(
  thunk_text: str, metadata_text: str
) -> dict[str, list[tuple[str, tuple[int, int, int]]]]:
  """The kernels (name and launch configuration, in listing order, each once) that each
  HLO instruction launches, joining the thunk listing to the metadata by thunk id; {}
  without metadata."""
  instr_of = parse_thunk_metadata(metadata_text)
  if not instr_of:
    return {}
  out: dict[str, list[tuple[str, tuple[int, int, int]]]] = {}
  for line in thunk_text.splitlines():
    m, i = _THUNK_KERNEL.search(line), _THUNK_ID.match(line)
    if not m or not i or int(i.group(1)) not in instr_of:
      continue
    launch = _launch(m)
    kernels = out.setdefault(instr_of[int(i.group(1))], [])
    if launch not in kernels:
      kernels.append(launch)
  return out


def _calibrated(t: float, kind: str, model: cm.CostModel) -> float:
  """A roofline time with the calibration's factor for ``kind`` on its body."""
  f = model.kernel_factor(kind)
  return t if f == 1.0 else model.kernel_overhead_s + (t - model.kernel_overhead_s) * f


def _kernel_kind(module: hlo_lib.Module, instr: hlo_lib.Instruction) -> str:
  if instr.opcode == "custom-call":
    return "gemm" if hlo_lib.is_cublas_gemm(instr) else "custom"
  dot = module.dot_in(instr)
  if dot is not None:
    return "gemm" if dot.opcode == "dot" else "convolution"
  name = instr.name
  if instr.opcode in ("copy", "dynamic-slice", "dynamic-update-slice", "transpose", "slice") or any(
    s in name for s in ("copy", "dynamic_update_slice", "dynamic_slice", "transpose", "slice")
  ):
    return "copy"
  if instr.opcode in ("reduce", "reduce-window") or "reduce" in name:
    return "reduction"
  return "fusion" if instr.opcode == "fusion" else "other"


def _dtype(module: hlo_lib.Module, instr: hlo_lib.Instruction) -> str:
  """The dtype a kernel computes in: a dot's (or a cuBLAS GEMM's) operands', else its
  result's (a bfloat16 GEMM writing float32 runs at the bfloat16 rate)."""
  dot = module.dot_in(instr)
  if dot is None and hlo_lib.is_cublas_gemm(instr):
    dot = instr
  if dot is not None and dot.operands:
    comp = module.computations[dot.computation]
    lhs = comp.by_name.get(dot.operands[0])
    if lhs is not None:
      shapes = hlo_lib.array_shapes(lhs.shape)
      if shapes:
        return shapes[0][0]
  shapes = hlo_lib.array_shapes(instr.shape)
  return shapes[0][0] if shapes else "f32"


def _async_collective_kind(module: hlo_lib.Module, instr: hlo_lib.Instruction) -> str | None:
  if instr.opcode in _START:
    return _START[instr.opcode]
  if instr.opcode == "async-start":
    for c in instr.called:
      comp = module.computations.get(c)
      if comp is None:
        continue
      for i in comp.instructions:
        if i.opcode in COLLECTIVE_KINDS:
          return COLLECTIVE_KINDS[i.opcode]
  return None


def _wrapped(
  module: hlo_lib.Module, start: hlo_lib.Instruction
) -> tuple[hlo_lib.Instruction, hlo_lib.Computation] | None:
  """The instruction a non-collective ``async-start`` runs (its computation's root) and that
  computation; None when it cannot be found."""
  for name in start.called:
    comp = module.computations.get(name)
    root = comp.root if comp is not None else None
    if root is not None and root.opcode not in _FREE:
      return root, comp
  return None


def _is_sync(instr: hlo_lib.Instruction) -> bool:
  return bool(instr.backend_config.get("collective_backend_config", {}).get("is_sync", False))


def _operand_bytes(comp: hlo_lib.Computation, instr: hlo_lib.Instruction) -> int:
  total = 0
  for n in instr.operands:
    o = comp.by_name.get(n)
    if o is not None:
      total += o.bytes_out
  return total


def build_schedule(
  module: hlo_lib.Module,
  thunk_text: str,
  topology,
  gpu,
  model: cm.CostModel | None = None,
  max_ops: int = 2_000_000,
  thunk_metadata: str = "",
  kernel_names: bool = True,
) -> Schedule:
  """Flattens the module into the sequence of kernels and collectives of one step.

  Args:
    module: the parsed, scheduled HLO module.
    thunk_text: XLA's thunk listing ("" when not available, e.g. on CPU).
    topology: a targets.Topology (or the host model) for collective costs.
    gpu: a targets.Gpu (or the host model) for kernel costs.
    model: efficiency factors.
    max_ops: refuse to expand loops past this many operations.
    thunk_metadata: XLA's thunk metadata listing; where given, each kernel's launch is
      found by its HLO instruction rather than by kernel name.
    kernel_names: False when the listing's kernel names are not those the driver will
      report (a compile that took kernels from a kernel cache): launch names are left
      unknown, and launches are found only through the metadata.

  Returns:
    A :class:`Schedule`.
  """
  model = model or cm.CostModel()
  launch, async_streams = parse_thunks(thunk_text)
  by_instr = launches_by_instruction(thunk_text, thunk_metadata)
  clusters = parse_clusters(thunk_text)
  persistent_gemms = bool(getattr(gpu, "persistent_library_gemms", False))
  if not kernel_names:
    launch = {}
  notes: list[str] = []
  loops: list[LoopInfo] = []
  ops: list[Op] = []
  kernels: list[KernelInfo] = []
  collectives: list[CollectiveInfo] = []
  stream_iter = iter(async_streams)
  stream_of_start: dict[str, int] = {}
  # Assign streams to async collective starts in thunk-emission order (each
  # computation once, loop bodies at the loop's position), as XLA lists them.
  seen_comps: set[str] = set()

  def assign_streams(comp_name: str) -> None:
    if comp_name in seen_comps:
      return
    seen_comps.add(comp_name)
    comp = module.computations[comp_name]
    for instr in comp.instructions:
      if _async_collective_kind(module, instr) is not None and not _is_sync(instr):
        stream_of_start[f"{comp_name}/{instr.name}"] = next(stream_iter, 0)
      elif instr.opcode == "while":
        assign_streams(instr.attrs.get("condition", "").lstrip("%"))
        assign_streams(instr.attrs.get("body", "").lstrip("%"))
      elif instr.opcode in ("call", "conditional"):
        for c in instr.called:
          if c in module.computations:
            assign_streams(c)

  assign_streams(module.entry)
  if len(async_streams) != len(stream_of_start) and async_streams:
    notes.append(
      "the thunk listing and the HLO disagree on the number of async collectives; all are "
      "placed on communication stream 0"
    )
    stream_of_start = {k: 0 for k in stream_of_start}

  # Deduplicated kernels: XLA emits one kernel per group of identical fusions and
  # names it after one member; find the member that the thunk listing names.
  groups: dict[str, list[str]] = {}
  for comp_ in module.computations.values():
    for i in comp_.instructions:
      if "deduplicated_name" in i.metadata:
        groups.setdefault(i.kernel_name, []).append(i.name.replace(".", "_").replace("-", "_"))

  def _launch_of(instr: hlo_lib.Instruction) -> tuple[str, tuple[int, int, int]]:
    """The launched kernel's name and (grid, threads, shared memory); ("", zeros) if none."""
    names = [instr.kernel_name, instr.name.replace(".", "_").replace("-", "_")]
    if instr.name in by_instr:
      # The kernel named after the instruction, else (an instruction launching several,
      # e.g. an initialisation and the work) the one with the most threads.
      found = by_instr[instr.name]
      named = [k for k in found if kernel_names and k[0] in names]
      name, config = (named or sorted(found, key=lambda k: -k[1][0] * k[1][1]))[0]
      return (name if kernel_names else ""), config
    for key in names + groups.get(instr.kernel_name, []):
      if key in launch:
        return key, launch[key]
    return "", (0, 0, 0)

  def add_kernel(instr: hlo_lib.Instruction, comp: hlo_lib.Computation, suffix: str) -> None:
    flops = module.instruction_flops(instr, comp)
    if hlo_lib.is_cublas_gemm(instr):
      flops = hlo_lib.cublas_flops(module, instr)
    nbytes = module.instruction_bytes(instr, comp)
    kind = _kernel_kind(module, instr)
    dtype = _dtype(module, instr)
    launch_name, (grid, threads, smem) = _launch_of(instr)
    library = hlo_lib.is_cublas_gemm(instr)
    k = KernelInfo(
      name=instr.name + suffix,
      kind=kind,
      index=len(kernels),
      grid_blocks=grid,
      threads_per_block=threads,
      smem_bytes=smem,
      regs_per_thread=None,
      flops=flops,
      bytes_accessed=float(nbytes),
      time_s=_calibrated(
        cm.kernel_time(
          flops, nbytes, gpu, dtype=dtype, is_dot=kind in ("gemm", "convolution"), cost_model=model
        ),
        kind,
        model,
      ),
      gemm_mnk=module.gemm_mnk(instr) if kind == "gemm" else None,
      dtype=dtype,
      op_name=instr.metadata.get("op_name", ""),
      annotations=dict(instr.frontend_attributes),
      launch_name=launch_name,
      library=library,
      persistent=library and persistent_gemms and targets.persistent_gemm_dtype(dtype),
      cluster=clusters.get(launch_name, 1),
    )
    kernels.append(k)
    ops.append(Op("kernel", kernel=k))

  def add_collective(
    instr: hlo_lib.Instruction,
    comp: hlo_lib.Computation,
    kind: str,
    suffix: str,
    synchronous: bool,
    result_bytes: int,
  ) -> CollectiveInfo:
    nbytes = max(_operand_bytes(comp, instr), result_bytes)
    p = hlo_lib.group_size(instr, module.num_partitions)
    c = CollectiveInfo(
      name=instr.name + suffix,
      kind=kind,
      bytes=int(nbytes),
      group_size=p,
      start_index=len(kernels),
      done_index=len(kernels),
      time_s=cm.collective_time(kind, nbytes, p, topology, cost_model=model),
      synchronous=synchronous,
      stream=-1 if synchronous else stream_of_start.get(f"{comp.name}/{instr.name}", 0),
      op_name=instr.metadata.get("op_name", ""),
      annotations=dict(instr.frontend_attributes),
    )
    collectives.append(c)
    return c

  def done_result_bytes(comp: hlo_lib.Computation, start: hlo_lib.Instruction) -> int:
    for i in comp.instructions:
      if i.opcode in _DONE and start.name in i.operands:
        return i.bytes_out
    # Pipelined across loop iterations: the done is elsewhere; use the start's result.
    return hlo_lib.shape_bytes(start.shape) // 2

  def walk(comp_name: str, suffix: str, depth: int) -> None:
    if depth > 32:
      raise ValueError("schedule: computations nest deeper than 32 levels")
    comp = module.computations[comp_name]
    for instr in comp.instructions:
      if len(ops) > max_ops:
        raise ValueError(
          f"schedule: the step expands to more than {max_ops} operations; analyse a smaller "
          "configuration or fewer loop iterations"
        )
      op = instr.opcode
      if op in _FREE:
        continue
      if op == "while":
        body = instr.attrs.get("body", "").lstrip("%")
        cond = instr.attrs.get("condition", "").lstrip("%")
        n = instr.backend_config.get("known_trip_count", {}).get("n")
        if n is None:
          trips = 1
          notes.append(f"while loop {instr.name} has no known trip count; counted once")
        else:
          trips = int(n)
        loops.append(LoopInfo(instr.name, trips, body))
        for it in range(trips):
          walk(cond, f"{suffix}@{it}" if trips > 1 else suffix, depth + 1)
          walk(body, f"{suffix}@{it}" if trips > 1 else suffix, depth + 1)
        walk(cond, suffix, depth + 1)
        continue
      if op == "call":
        for c in instr.called:
          if c in module.computations:
            walk(c, suffix, depth + 1)
        continue
      if op == "conditional":
        branches = [c for c in instr.called if c in module.computations]
        if branches:
          best = max(branches, key=lambda c: module.computation_flops(c)[0])
          if len(branches) > 1:
            notes.append(f"conditional {instr.name}: the most expensive branch ({best}) is counted")
          for other in branches:
            if other != best:
              walk_uncounted(other, suffix, depth + 1)
          walk(best, suffix, depth + 1)
        continue
      kind = _async_collective_kind(module, instr)
      if kind is not None:
        sync = _is_sync(instr)
        if sync:
          sync_starts.add(instr.name + suffix)
        c = add_collective(instr, comp, kind, suffix, sync, done_result_bytes(comp, instr))
        ops.append(Op("sync" if sync else "start", collective=c))
        continue
      if op in _DONE:
        start = instr.operands[0] if instr.operands else None
        if start is not None and start + suffix in sync_starts:
          continue  # a synchronous collective's done: it already ran on the compute stream
        ops.append(Op("done", start_name=(start + suffix) if start else None))
        continue
      if op == "async-start":
        # An async computation that is not a collective (XLA 0.11 issues some fusions so,
        # e.g. a scan's in-place dynamic-update-slice): the kernel is what it wraps, costed
        # as that instruction; the start's own shape also holds the operands and context.
        wrapped = _wrapped(module, instr)
        if wrapped is not None:
          add_kernel(*wrapped, suffix)
        else:
          add_kernel(instr, comp, suffix)
        continue
      if op == "async-update":
        continue  # the wrapped kernel was counted at the start
      if op in COLLECTIVE_KINDS:
        c = add_collective(instr, comp, COLLECTIVE_KINDS[op], suffix, True, instr.bytes_out)
        ops.append(Op("sync", collective=c))
        continue
      add_kernel(instr, comp, suffix)

  uncounted: dict[str, float] = {}

  def walk_uncounted(comp_name: str, suffix: str, depth: int) -> None:
    """A branch the step does not count: its kernels' and collectives' costs are kept in
    ``uncounted``, and nothing of it stays in the step."""
    marks = len(ops), len(kernels), len(collectives), len(notes), len(loops)
    walk(comp_name, suffix, depth)
    for item in [*kernels[marks[1] :], *collectives[marks[2] :]]:
      uncounted.setdefault(item.name.split("@")[0], item.time_s)
    del ops[marks[0] :], kernels[marks[1] :], collectives[marks[2] :]
    del notes[marks[3] :], loops[marks[4] :]

  sync_starts: set[str] = set()
  walk(module.entry, "", 0)
  return Schedule(ops, kernels, collectives, notes, loops, uncounted)


@dataclasses.dataclass(frozen=True)
class Bracket:
  """What an async collective's start and done bracket in a computation's schedule.

  Attributes:
    name: the start instruction.
    kind: "all-gather", "reduce-scatter", "all-reduce", "all-to-all" or "collective-permute".
    gemms: matmul kernels (dot fusions, cuBLAS calls) scheduled between start and done.
    synchronous: XLA made the collective synchronous (``is_sync``).
  """

  name: str
  kind: str
  gemms: int
  synchronous: bool


def _is_gemm(module: hlo_lib.Module, instr: hlo_lib.Instruction) -> bool:
  if instr.opcode == "custom-call":
    return hlo_lib.is_cublas_gemm(instr)
  return instr.opcode == "fusion" and module.dot_in(instr) is not None


def collective_brackets(module: hlo_lib.Module, computation: str | None = None) -> list[Bracket]:
  """Each collective of ``computation`` (default: the entry) with the GEMMs it brackets.

  A start whose done is not in the same computation (pipelined across loop
  iterations) brackets everything after it. A collective XLA issues as a plain
  (not async) instruction, as XLA 0.11 does with one that has nothing beside it,
  is synchronous and brackets nothing, as an async pair marked synchronous.
  """
  comp = module.computations[computation or module.entry]
  instrs = comp.instructions
  done_at = {
    instr.operands[0]: i
    for i, instr in enumerate(instrs)
    if instr.opcode in _DONE and instr.operands
  }
  out = []
  for i, instr in enumerate(instrs):
    kind = _async_collective_kind(module, instr)
    if kind is None:
      if instr.opcode in COLLECTIVE_KINDS:
        out.append(Bracket(instr.name, COLLECTIVE_KINDS[instr.opcode], 0, True))
      continue
    j = done_at.get(instr.name, len(instrs))
    gemms = sum(_is_gemm(module, x) for x in instrs[i + 1 : j])
    out.append(Bracket(instr.name, kind, gemms, _is_sync(instr)))
  return out


def while_bodies(module: hlo_lib.Module) -> list[str]:
  """Names of the while-loop body computations, in the order the loops appear."""
  names = []
  for comp in module.computations.values():
    for instr in comp.instructions:
      if instr.opcode == "while":
        body = instr.attrs.get("body", "").lstrip("%")
        if body in module.computations and body not in names:
          names.append(body)
  return names
