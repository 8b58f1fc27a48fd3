"""The GPUs jax_overlap plans for, and compile-only meshes for them."""

from jax_overlap._src.targets import GPUS as GPUS
from jax_overlap._src.targets import Gpu as Gpu
from jax_overlap._src.targets import Topology as Topology
from jax_overlap._src.targets import compile_only_devices as compile_only_devices
from jax_overlap._src.targets import compile_only_mesh as compile_only_mesh
from jax_overlap._src.targets import from_devices as from_devices
from jax_overlap._src.targets import get as get
from jax_overlap._src.targets import get_gpu as get_gpu
from jax_overlap._src.targets import gpu_of_device_kind as gpu_of_device_kind
from jax_overlap._src.targets import gpu_target_config as gpu_target_config
from jax_overlap._src.targets import names as names

__all__ = [
  "GPUS",
  "Gpu",
  "Topology",
  "compile_only_devices",
  "compile_only_mesh",
  "from_devices",
  "get",
  "get_gpu",
  "gpu_of_device_kind",
  "gpu_target_config",
  "names",
]
