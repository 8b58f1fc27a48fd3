"""Catalogue of the GPUs jax_overlap plans for, and compile-only meshes for them.

(Over 500 lines: most of it is the catalogue's data, each number with its source.)

A :class:`Gpu` holds the per-device numbers the rest of the package needs: the
per-SM (per-CU) residency limits used by the occupancy model and the simulator,
the peak throughputs used by the roofline cost model, and the interconnect used
by the collective cost model. A :class:`Topology` is a number of such GPUs on a
number of hosts ("h100x8" is one host of 8 H100 SXM, "h200x16" two hosts of 8).

NVIDIA topologies can be compiled for on a machine without a GPU: the
jaxlib CUDA plugin builds compile-only devices from a ``GpuTargetConfigProto``
text that :func:`gpu_target_config` generates from the catalogue, and
:func:`compile_only_mesh` returns a :class:`jax.sharding.Mesh` of them.

Sources of the numbers (each entry repeats its source in a comment):
  [A40]   NVIDIA A40 datasheet (2021) and CUDA C Programming Guide, table
          "Technical Specifications per Compute Capability" (cc 8.6).
  [A100]  NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020) and the
          A100 datasheet (40 GB / 80 GB SXM); CUDA Guide cc 8.0.
  [H100]  NVIDIA H100 Tensor Core GPU datasheet (SXM5) and the Hopper
          architecture whitepaper; CUDA Guide cc 9.0.
  [H200]  NVIDIA H200 Tensor Core GPU datasheet (SXM); same GH100 die as H100.
  [MI250X] AMD Instinct MI250X datasheet and the CDNA2 architecture whitepaper;
          one MI250X is two graphics compute dies (GCDs), each seen as a device.
  [NCCL]  NCCL tuning defaults (src/graph/tuning.cc): per-hop latencies of a
          few microseconds on NVLink, more on PCIe and network.
  [XLA]   XLA's GPU spec files (xla/tools/hlo_opt/gpu_specs/*.txtpb) for the
          device-description fields that the compiler reads.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import re
from collections.abc import Sequence
from typing import Literal

__all__ = [
  "Gpu",
  "Topology",
  "from_devices",
  "gpu_of_device_kind",
  "GPUS",
  "get",
  "get_gpu",
  "persistent_gemm_dtype",
  "names",
  "gpu_target_config",
  "compile_only_devices",
  "compile_only_mesh",
]

KB = 1024
GB = 1e9
TB = 1e12


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU model: residency limits, peak rates and interconnect.

  Attributes:
    name: short catalogue key, e.g. ``"h100"``.
    description: the device description string the driver reports.
    vendor: ``"nvidia"`` or ``"amd"``.
    compute_capability: ``(major, minor)`` for NVIDIA; the gfx version for AMD.
    sm_count: streaming multiprocessors (NVIDIA) or compute units (AMD).
    smem_per_sm: shared memory (LDS) per SM in bytes, as configured at maximum carve-out.
    smem_per_block: default static shared-memory limit per block in bytes (48 KB on NVIDIA).
    smem_per_block_optin: largest dynamic shared memory a block may opt in to.
    smem_reserved_per_block: shared memory the hardware reserves per resident block.
    regs_per_sm: 32-bit registers per SM.
    regs_per_block: 32-bit registers one block may use.
    max_threads_per_sm: resident threads per SM.
    max_threads_per_block: threads per block.
    max_blocks_per_sm: resident blocks per SM.
    warp_size: threads per warp (wavefront on AMD).
    reg_alloc_unit: register allocation granularity per warp, in registers.
    clock_ghz: boost clock.
    fpus_per_sm: FP32 lanes per SM (what XLA calls fpus_per_core).
    peak_bf16_flops: dense bf16 tensor-core peak, FLOP/s.
    peak_fp32_flops: dense fp32 (non-tensor) peak, FLOP/s.
    memory_bytes: device memory.
    memory_bandwidth: device memory bandwidth, bytes/s.
    l2_bytes: L2 cache.
    link: intra-node interconnect name.
    link_bandwidth: per-GPU, per-direction intra-node bandwidth, bytes/s.
    link_latency_s: per-hop latency of a collective step within a node.
    network_bandwidth: per-GPU, per-direction inter-node bandwidth, bytes/s.
    network_latency_s: per-hop latency of a collective step across nodes.
    deviceless: whether the installed jaxlib can compile for it without a device.
    smem_alloc_unit: shared-memory allocation granularity per block, in bytes (128 on
      sm_80 and later: CUDA occupancy calculator).
  """

  name: str
  description: str
  vendor: Literal["nvidia", "amd"]
  compute_capability: tuple[int, int]
  sm_count: int
  smem_per_sm: int
  smem_per_block: int
  smem_per_block_optin: int
  smem_reserved_per_block: int
  regs_per_sm: int
  regs_per_block: int
  max_threads_per_sm: int
  max_threads_per_block: int
  max_blocks_per_sm: int
  warp_size: int
  reg_alloc_unit: int
  clock_ghz: float
  fpus_per_sm: int
  peak_bf16_flops: float
  peak_fp32_flops: float
  memory_bytes: int
  memory_bandwidth: float
  l2_bytes: int
  link: str
  link_bandwidth: float
  link_latency_s: float
  network_bandwidth: float
  network_latency_s: float
  deviceless: bool
  smem_alloc_unit: int = 128

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      if value < 0 or (value == 0 and field.name != "smem_reserved_per_block"):
        raise ValueError(f"Gpu({self.name!r}): {field.name} must be positive, got {value!r}")
    if self.smem_per_block_optin > self.smem_per_sm:
      raise ValueError(
        f"Gpu({self.name!r}): smem_per_block_optin ({self.smem_per_block_optin}) exceeds "
        f"smem_per_sm ({self.smem_per_sm})"
      )

  @property
  def persistent_library_gemms(self) -> bool:
    """Whether the vendor library runs large GEMMs as persistent kernels here: one block
    per SM holding the register file for the whole GEMM, taking tiles as it goes (cuBLAS
    on Hopper, sm_90 and later). Measured on an H200 (benchmarks/results/
    runtime_nvidia_h200_2026-12-04.md, item 4): a copy launched behind cuBLAS's 8192^3
    bf16 GEMM waited for all of it at the highest stream priority. The analysis's
    timeline and the simulator both apply it to GEMMs of 16- and 8-bit operands
    (:func:`persistent_gemm_dtype`)."""
    return self.vendor == "nvidia" and self.compute_capability >= (9, 0)

  def peak_flops(self, dtype: str = "bf16") -> float:
    """Peak FLOP/s for a dtype name ("bf16", "f16", "f32", "f64", "f8"...)."""
    d = str(dtype).lower()
    if d in ("f32", "float32", "fp32", "f64", "float64", "fp64"):
      return self.peak_fp32_flops
    if d.startswith(("f8", "float8", "fp8")):
      return (
        2.0 * self.peak_bf16_flops if self.compute_capability >= (8, 9) else self.peak_bf16_flops
      )
    return self.peak_bf16_flops


@dataclasses.dataclass(frozen=True)
class Topology:
  """``num_hosts`` hosts of ``gpus_per_host`` identical GPUs."""

  name: str
  gpu: Gpu
  num_hosts: int
  gpus_per_host: int

  def __post_init__(self):
    if self.num_hosts < 1 or self.gpus_per_host < 1:
      raise ValueError(
        f"Topology({self.name!r}): need at least one host and one GPU per host, got "
        f"{self.num_hosts} x {self.gpus_per_host}"
      )

  @property
  def num_devices(self) -> int:
    return self.num_hosts * self.gpus_per_host

  def link_for(self, group_size: int, spans_hosts: bool | None = None) -> tuple[float, float]:
    """(bandwidth bytes/s, per-hop latency s) for a collective over ``group_size`` devices.

    A group that spans hosts is limited by the network; one within a host by the
    intra-node link. Without ``spans_hosts``, groups larger than a host span hosts.
    """
    if spans_hosts is None:
      spans_hosts = group_size > self.gpus_per_host
    if spans_hosts and self.num_hosts > 1:
      return self.gpu.network_bandwidth, self.gpu.network_latency_s
    return self.gpu.link_bandwidth, self.gpu.link_latency_s


# ---------------------------------------------------------------------------
# The catalogue.
# ---------------------------------------------------------------------------

GPUS: dict[str, Gpu] = {
  "a40": Gpu(
    name="a40",
    description="NVIDIA A40",
    vendor="nvidia",
    compute_capability=(8, 6),
    sm_count=84,  # [A40] 84 SMs
    smem_per_sm=100 * KB,  # [A40] CUDA Guide cc 8.6: 100 KB per SM
    smem_per_block=48 * KB,
    smem_per_block_optin=99 * KB,  # CUDA Guide cc 8.6: 99 KB opt-in
    smem_reserved_per_block=1 * KB,  # CUDA Guide: 1 KB reserved per block (cc >= 8.0)
    regs_per_sm=65536,
    regs_per_block=65536,
    max_threads_per_sm=1536,  # CUDA Guide cc 8.6
    max_threads_per_block=1024,
    max_blocks_per_sm=16,  # CUDA Guide cc 8.6
    warp_size=32,
    reg_alloc_unit=256,
    clock_ghz=1.74,  # [A40] boost clock
    fpus_per_sm=128,
    peak_bf16_flops=149.7 * TB,  # [A40] dense BF16 tensor
    peak_fp32_flops=37.4 * TB,  # [A40] FP32
    memory_bytes=48 * 1024**3,  # [A40] 48 GB GDDR6
    memory_bandwidth=696 * GB,  # [A40] 696 GB/s
    l2_bytes=6 * 1024**2,
    link="pcie4",
    link_bandwidth=32 * GB,  # PCIe 4.0 x16: 64 GB/s both directions
    link_latency_s=5e-6,  # [NCCL] PCIe hop
    network_bandwidth=25 * GB,  # one 200 Gb/s HDR NIC per GPU
    network_latency_s=8e-6,
    deviceless=True,
  ),
  "a100": Gpu(
    name="a100",
    description="NVIDIA A100-SXM4-80GB",
    vendor="nvidia",
    compute_capability=(8, 0),
    sm_count=108,  # [A100] 108 SMs
    smem_per_sm=164 * KB,  # [A100] 164 KB per SM
    smem_per_block=48 * KB,
    smem_per_block_optin=163 * KB,  # CUDA Guide cc 8.0: 163 KB opt-in
    smem_reserved_per_block=1 * KB,
    regs_per_sm=65536,
    regs_per_block=65536,
    max_threads_per_sm=2048,
    max_threads_per_block=1024,
    max_blocks_per_sm=32,
    warp_size=32,
    reg_alloc_unit=256,
    clock_ghz=1.41,  # [A100] boost clock
    fpus_per_sm=64,
    peak_bf16_flops=312 * TB,  # [A100] dense BF16 tensor
    peak_fp32_flops=19.5 * TB,  # [A100] FP32 (non-tensor)
    memory_bytes=80 * 1024**3,
    memory_bandwidth=2039 * GB,  # [A100] 80 GB SXM: 2,039 GB/s
    l2_bytes=40 * 1024**2,
    link="nvlink3",
    link_bandwidth=300 * GB,  # [A100] NVLink 3: 600 GB/s both directions
    link_latency_s=3e-6,  # [NCCL]
    network_bandwidth=25 * GB,  # DGX A100: one 200 Gb/s HDR NIC per GPU
    network_latency_s=8e-6,
    deviceless=True,
  ),
  "h100": Gpu(
    name="h100",
    description="NVIDIA H100 80GB HBM3",
    vendor="nvidia",
    compute_capability=(9, 0),
    sm_count=132,  # [H100] SXM5: 132 SMs
    smem_per_sm=228 * KB,  # [H100] 228 KB per SM
    smem_per_block=48 * KB,
    smem_per_block_optin=227 * KB,  # CUDA Guide cc 9.0: 227 KB opt-in
    smem_reserved_per_block=1 * KB,
    regs_per_sm=65536,
    regs_per_block=65536,
    max_threads_per_sm=2048,
    max_threads_per_block=1024,
    max_blocks_per_sm=32,
    warp_size=32,
    reg_alloc_unit=256,
    clock_ghz=1.98,  # [H100] boost clock; [XLA] h100_sxm spec
    fpus_per_sm=128,
    peak_bf16_flops=989.4 * TB,  # [H100] SXM dense BF16 tensor
    peak_fp32_flops=66.9 * TB,  # [H100] SXM FP32
    memory_bytes=80 * 1024**3,
    memory_bandwidth=3352 * GB,  # [H100] 3.35 TB/s HBM3
    l2_bytes=50 * 1024**2,
    link="nvlink4",
    link_bandwidth=450 * GB,  # [H100] NVLink 4: 900 GB/s both directions
    link_latency_s=2.5e-6,  # [NCCL]
    network_bandwidth=50 * GB,  # DGX H100: one 400 Gb/s NDR NIC per GPU
    network_latency_s=6e-6,
    deviceless=True,
  ),
  "mi250x": Gpu(
    name="mi250x",
    description="AMD Instinct MI250X (one GCD)",
    vendor="amd",
    compute_capability=(9, 0),  # gfx90a
    sm_count=110,  # [MI250X] 220 CUs in two GCDs
    smem_per_sm=64 * KB,  # [MI250X] 64 KB LDS per CU
    smem_per_block=64 * KB,
    smem_per_block_optin=64 * KB,
    smem_reserved_per_block=0,  # LDS has no per-workgroup reservation
    regs_per_sm=4 * 512 * 64,  # [MI250X] 4 SIMDs x 512 VGPRs x 64 lanes
    regs_per_block=512 * 64 * 4,
    max_threads_per_sm=2048,  # 8 waves per SIMD x 4 SIMDs x 64 lanes
    max_threads_per_block=1024,
    max_blocks_per_sm=32,
    warp_size=64,
    reg_alloc_unit=512,  # VGPRs are granted in blocks of 8 per lane
    clock_ghz=1.7,  # [MI250X] peak engine clock
    fpus_per_sm=64,
    peak_bf16_flops=191.5 * TB,  # [MI250X] 383 TF per package, half per GCD
    peak_fp32_flops=23.95 * TB,  # [MI250X] 47.9 TF vector per package
    memory_bytes=64 * 1024**3,  # [MI250X] 128 GB per package
    memory_bandwidth=1638 * GB,  # [MI250X] 3.2768 TB/s per package
    l2_bytes=8 * 1024**2,
    link="infinity-fabric",
    link_bandwidth=100 * GB,  # [MI250X] Infinity Fabric links, 50 GB/s each way, 2 per peer
    link_latency_s=4e-6,
    network_bandwidth=25 * GB,  # Slingshot 200 Gb/s per GCD pair
    network_latency_s=8e-6,
    deviceless=False,  # no deviceless compile for ROCm in jaxlib
  ),
}

# Same dies as their siblings; only memory differs.
GPUS["a100-40"] = dataclasses.replace(
  GPUS["a100"],
  name="a100-40",
  description="NVIDIA A100-SXM4-40GB",
  memory_bytes=40 * 1024**3,
  memory_bandwidth=1555 * GB,  # [A100] 40 GB SXM: 1,555 GB/s
)
GPUS["h200"] = dataclasses.replace(
  GPUS["h100"],  # [H200] same GH100 configuration as H100 SXM: SMs, limits, NVLink 4
  name="h200",
  description="NVIDIA H200",
  memory_bytes=141 * 10**9,  # [H200] 141 GB HBM3e
  memory_bandwidth=4800 * GB,  # [H200] 4.8 TB/s
)

_ALIASES = {
  "a100-80": "a100",
  "a100_80": "a100",
  "a100_40": "a100-40",
  "h100-sxm": "h100",
  "h100_sxm": "h100",
  "mi250": "mi250x",
}

_TOPOLOGY_RE = re.compile(r"^(?P<gpu>[a-z0-9_\-]+?)(?:x(?P<count>\d+))?$")


def names() -> list[str]:
  """Catalogue keys of every GPU."""
  return sorted(GPUS)


def catalogue_gpu(description) -> str | None:
  """The catalogue GPU a driver's device name describes ("NVIDIA H200" -> "h200"), or
  None."""
  if not isinstance(description, str):
    return None
  low = description.lower()
  for g in GPUS.values():
    if g.description.lower() == low:
      return g.name
  for key in ("h200", "h100", "a100", "a40"):
    if key in low:
      return key
  return None


def persistent_gemm_dtype(dtype: str) -> bool:
  """Whether a library GEMM of ``dtype`` operands runs persistent where the library runs
  GEMMs so (:attr:`Gpu.persistent_library_gemms`): 16- and 8-bit types (cuBLAS's
  ``nvjet_sm90_*`` kernels). Measured on an H200: a copy launched behind the 8192^3 bf16 GEMM
  waited for all of it at the highest priority, behind the fp32 one (2.73 ms, TF32 tensor
  cores) 1.0 ms: its kernel lets a prioritised copy in before it ends."""
  d = str(dtype).lower()
  return d.startswith(("bf16", "f16", "fp16", "float16", "bfloat16", "f8", "fp8", "float8"))


def get_gpu(name: str | Gpu) -> Gpu:
  """Looks up a GPU by catalogue name ("h100", "a100", "a40", "h200", "mi250x").

  Raises:
    ValueError: naming the unknown GPU and the valid choices.
  """
  if isinstance(name, Gpu):
    return name
  if not isinstance(name, str):
    raise TypeError(f"targets.get_gpu: expected a GPU name string, got {type(name).__name__}")
  key = name.strip().lower()
  key = _ALIASES.get(key, key)
  if key not in GPUS:
    raise ValueError(f"unknown GPU {name!r}; valid choices: {', '.join(names())}")
  return GPUS[key]


def get(name: str | Topology | Gpu) -> Topology:
  """Looks up a topology by name: "<gpu>x<count>", e.g. "h100x8", "a100x8", "h200x16".

  A bare GPU name ("h100") means one host of 8. Counts above 8 are hosts of 8.

  Raises:
    ValueError: for an unknown GPU, a count of zero, or a count that is not a
      whole number of 8-GPU hosts above 8.
  """
  if isinstance(name, Topology):
    return name
  if isinstance(name, Gpu):
    return Topology(f"{name.name}x8", name, 1, 8)
  if not isinstance(name, str):
    raise TypeError(
      f"targets.get: expected a topology name such as 'h100x8', got {type(name).__name__}"
    )
  key = name.strip().lower()
  m = _TOPOLOGY_RE.match(key)
  if not m:
    raise ValueError(
      f"unknown target {name!r}; expected '<gpu>x<count>' with gpu one of {', '.join(names())}"
    )
  gpu_name, count = m.group("gpu"), m.group("count")
  if (gpu_name.rstrip("_-")) not in GPUS and gpu_name not in _ALIASES:
    raise ValueError(
      f"unknown target {name!r}; expected '<gpu>x<count>' with gpu one of {', '.join(names())}"
    )
  gpu = get_gpu(gpu_name.rstrip("_-"))
  n = 8 if count is None else int(count)
  if n < 1:
    raise ValueError(f"target {name!r}: the GPU count must be at least 1, got {n}")
  if n <= 8:
    return Topology(f"{gpu.name}x{n}", gpu, 1, n)
  if n % 8:
    raise ValueError(
      f"target {name!r}: counts above 8 must be whole hosts of 8 GPUs (16, 24, ...), got {n}"
    )
  return Topology(f"{gpu.name}x{n}", gpu, n // 8, 8)


# Words of a device's ``device_kind`` (lower case) -> catalogue GPU, most specific first.
_DEVICE_KINDS = (
  ("h200", "h200"),
  ("h100", "h100"),
  ("a100-sxm4-40gb", "a100-40"),
  ("a100-pcie-40gb", "a100-40"),
  ("a100", "a100"),
  ("a40", "a40"),
  ("mi250", "mi250x"),
)


def gpu_of_device_kind(kind: str) -> Gpu:
  """The catalogue GPU of a JAX device's ``device_kind`` ("NVIDIA H100 80GB HBM3" -> h100).

  Raises:
    ValueError: naming the kind and the catalogue when no GPU of the catalogue matches.
  """
  k = str(kind).lower()
  for word, name in _DEVICE_KINDS:
    if word in k:
      return GPUS[name]
  raise ValueError(
    f"targets: the device kind {kind!r} is not in the GPU catalogue ({', '.join(names())}); "
    "pass target= naming the closest one"
  )


def from_devices(devices: Sequence) -> Topology:
  """The topology of the GPU devices a step runs on: the GPU from their ``device_kind``,
  the hosts from their ``process_index``, the devices per host from the two.

  Raises:
    ValueError: for no devices, devices that are not GPUs (or not in the catalogue), mixed
      GPU kinds, or hosts with different numbers of devices.
  """
  devices = list(devices)
  if not devices:
    raise ValueError("targets.from_devices: no devices")
  platforms = {d.platform for d in devices}
  if not platforms <= {"gpu", "cuda", "rocm"}:
    raise ValueError(
      f"targets.from_devices: the devices are {', '.join(sorted(platforms))}, not GPUs; pass "
      "target= naming the GPU topology to compile for"
    )
  gpus = {gpu_of_device_kind(d.device_kind).name for d in devices}
  if len(gpus) != 1:
    raise ValueError(f"targets.from_devices: mixed GPU kinds {sorted(gpus)}; pass target=")
  per_host: dict[int, int] = {}
  for d in devices:
    per_host[d.process_index] = per_host.get(d.process_index, 0) + 1
  counts = set(per_host.values())
  if len(counts) != 1:
    raise ValueError(
      f"targets.from_devices: hosts hold different numbers of devices ({sorted(counts)}); "
      "pass target="
    )
  gpu = GPUS[gpus.pop()]
  n = len(devices)
  return Topology(f"{gpu.name}x{n}", gpu, len(per_host), counts.pop())


def gpu_target_config(gpu: str | Gpu) -> str:
  """The ``GpuTargetConfigProto`` text XLA needs to compile for ``gpu`` without one."""
  g = get_gpu(gpu)
  if g.vendor != "nvidia":
    raise ValueError(
      f"{g.name}: deviceless compilation is only available for NVIDIA targets in jaxlib; "
      "use the catalogue numbers with the simulator instead"
    )
  major, minor = g.compute_capability
  return f"""gpu_device_info {{
  threads_per_block_limit: {g.max_threads_per_block}
  threads_per_warp: {g.warp_size}
  shared_memory_per_block: {g.smem_per_block}
  shared_memory_per_core: {g.smem_per_sm}
  threads_per_core_limit: {g.max_threads_per_sm}
  core_count: {g.sm_count}
  fpus_per_core: {g.fpus_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g.memory_bandwidth)}
  l2_cache_size: {g.l2_bytes}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {g.memory_bytes}
  shared_memory_per_block_optin: {g.smem_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: {g.regs_per_sm}
  registers_per_block_limit: {g.regs_per_block}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{g.description}"
"""


def _check_cuda_plugin() -> None:
  """Raises ImportError naming the extra when the CUDA plugin is missing or mismatched."""
  import jaxlib

  try:
    plugin = importlib.metadata.version("jax-cuda13-plugin")
  except importlib.metadata.PackageNotFoundError:
    raise ImportError(
      "deviceless GPU compilation needs the CUDA plugin: pip install "
      f"'jax-cuda13-plugin=={jaxlib.__version__}' 'jax-cuda13-pjrt=={jaxlib.__version__}' "
      "(or: pip install 'jax_overlap[cuda]')"
    ) from None
  if plugin != jaxlib.__version__:
    raise ImportError(
      f"jax-cuda13-plugin {plugin} does not match jaxlib {jaxlib.__version__}; install "
      f"'jax-cuda13-plugin=={jaxlib.__version__}' 'jax-cuda13-pjrt=={jaxlib.__version__}'"
    )


@functools.cache
def _compile_only_devices(gpu_name: str, num_hosts: int, gpus_per_host: int) -> tuple:
  from jax.experimental import topologies as jtop

  gpu = get_gpu(gpu_name)
  topo = Topology(f"{gpu.name}x{num_hosts * gpus_per_host}", gpu, num_hosts, gpus_per_host)
  _check_cuda_plugin()

  def describe():
    return jtop.get_topology_desc(
      topo.gpu.name,
      platform="cuda",
      topology=f"{topo.num_hosts}x1x{topo.gpus_per_host}",
      target_config=gpu_target_config(topo.gpu),
    )

  try:
    desc = describe()
  except NotImplementedError:
    _register_cuda_plugin(topo.name)
    desc = describe()
  return tuple(desc.devices)


def _register_cuda_plugin(target: str) -> None:
  """Registers the CUDA plugin when its start-up check failed on a machine without a GPU.

  The plugin registers its compile-only topologies when it initializes, and
  it stops before that when its CUDA/cuDNN version check fails, which it runs
  unless ``JAX_PLATFORMS`` leaves CUDA out. The check is about running
  kernels, which a deviceless compile never does, so the plugin is
  initialized again with the check skipped (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``,
  for that call only).

  Raises:
    ConfigError: with the one setting that fixes it, if that fails too.
  """
  from jax_overlap._src.errors import ConfigError

  fix = (
    "set JAX_PLATFORMS=cpu in the environment before jax starts (deviceless compiles need no "
    "GPU; the variable stops the CUDA plugin from checking for one)"
  )
  plugin = None
  for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
      plugin = importlib.import_module(name)
      break
    except ImportError:
      continue
  if plugin is None:
    raise ConfigError(f"targets: no CUDA plugin to compile for {target}; {fix}")
  saved = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  try:
    plugin.initialize()
  except Exception as e:  # noqa: BLE001 - the plugin raises several error types
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(
      f"targets: compiling for {target} needs the CUDA plugin's compile-only topology, and the "
      f"plugin did not start ({first}); {fix}"
    ) from None
  finally:
    if saved is None:
      os.environ.pop("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", None)
    else:
      os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = saved


def compile_only_devices(target: str | Topology) -> list:
  """Compile-only JAX devices for an NVIDIA topology (no GPU needed)."""
  topo = get(target)
  if not topo.gpu.deviceless:
    raise ValueError(
      f"{topo.name}: deviceless compilation is only available for NVIDIA targets; "
      f"choose one of {', '.join(n for n in names() if GPUS[n].deviceless)}"
    )
  return list(_compile_only_devices(topo.gpu.name, topo.num_hosts, topo.gpus_per_host))


def compile_only_mesh(
  target: str | Topology,
  axes: Sequence[str] | dict[str, int] = ("fsdp",),
  shape: Sequence[int] | None = None,
):
  """A :class:`jax.sharding.Mesh` of compile-only devices for ``target``.

  Args:
    target: topology name such as ``"h100x8"`` or a :class:`Topology`.
    axes: axis names, or a mapping of axis name to size.
    shape: axis sizes when ``axes`` is a sequence; by default the first axis
      takes every device and the others have size 1.

  Returns:
    A Mesh whose devices are the target's compile-only devices; jit programs
    with shardings on it compile for the target on this machine.

  Raises:
    ValueError: if the axis sizes do not multiply to the device count, or two axes
      share a name.
    TypeError: if ``axes`` is a string (one axis is ``("fsdp",)``).

  Example:
    >>> mesh = compile_only_mesh("h100x8", {"fsdp": 4, "tensor": 2})  # doctest: +SKIP
  """
  import numpy as np
  from jax.sharding import Mesh

  topo = get(target)
  if isinstance(axes, str):
    raise TypeError(
      f"compile_only_mesh: axes must be a sequence of axis names or a mapping of name to "
      f"size, got the string {axes!r}; write ({axes!r},)"
    )
  if isinstance(axes, dict):
    names_, sizes = tuple(axes), tuple(int(v) for v in axes.values())
  else:
    names_ = tuple(axes)
    if shape is None:
      sizes = (topo.num_devices,) + (1,) * (len(names_) - 1)
    else:
      sizes = tuple(int(s) for s in shape)
  if not names_ or len(names_) != len(sizes):
    raise ValueError(
      f"compile_only_mesh: need one size per axis name, got axes={names_} shape={sizes}"
    )
  if len(set(names_)) != len(names_):
    raise ValueError(f"compile_only_mesh: axis names must differ, got {names_}")
  if int(np.prod(sizes)) != topo.num_devices:
    raise ValueError(
      f"compile_only_mesh: mesh shape {dict(zip(names_, sizes))} has {int(np.prod(sizes))} "
      f"devices but {topo.name} has {topo.num_devices}"
    )
  devices = np.array(compile_only_devices(topo), dtype=object).reshape(sizes)
  return Mesh(devices, names_)
