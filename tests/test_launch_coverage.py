"""Every driver entry point through which the installed jaxlib can create, update or launch a
kernel is hooked by the runtime library, or listed as deliberately left alone with a reason.

The entry points are read from the installed CUDA plugin itself (the names it can resolve
through dlsym/cuGetProcAddress are strings in its binary), so a jaxlib that starts using a
new launch path fails this test until the library handles it.
"""

import importlib.util
import pathlib
import re

import pytest

from jax_overlap._src.runtime import library as runtime

# Names of entry points that create, update or launch kernels (or capture launches).
KERNEL_PATH = re.compile(
  r"cu(Launch\w*|Graph\w*KernelNode\w*|GraphAddNode\w*|Graph(Exec)?NodeSetParams|"
  r"KernelGetFunction|LibraryGetKernel|StreamBeginCapture\w*|StreamEndCapture\w*)"
)
# The entry points the plugin is known to reach kernels through (BACKGROUND.md section 3).
MUST_SEE = {
  "cuLaunchKernel",
  "cuLaunchKernelEx",
  "cuGraphAddKernelNode",
  "cuGraphExecKernelNodeSetParams",
  "cuGraphAddNode",
}


def _plugin_binaries() -> list[pathlib.Path]:
  for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
      root = pathlib.Path(list(spec.submodule_search_locations)[0])
      return sorted(root.glob("*.so"))
  return []


def _driver_names(path: pathlib.Path) -> set[str]:
  data = path.read_bytes()
  return {m.decode() for m in re.findall(rb"(?<=\x00)(cu[A-Z][A-Za-z0-9_]{2,80})(?=\x00)", data)}


@pytest.fixture(scope="module")
def plugin_names() -> set[str]:
  binaries = _plugin_binaries()
  if not binaries:
    pytest.skip("the jaxlib CUDA plugin is not installed (make installs it)")
  names: set[str] = set()
  for b in binaries:
    names |= _driver_names(b)
  return names


@pytest.fixture(scope="module")
def library():
  return runtime.load_library(runtime.library_path(runtime.RUNTIME_LIBRARY))


def test_plugin_names_are_read(plugin_names):
  assert MUST_SEE <= plugin_names, MUST_SEE - plugin_names


def test_every_kernel_path_is_hooked_or_left_alone_with_a_reason(plugin_names, library):
  paths = sorted(n for n in plugin_names if KERNEL_PATH.fullmatch(n))
  assert len(paths) >= 20
  hooked = [n for n in paths if hasattr(library, n)]
  unaccounted = [n for n in paths if n not in hooked and n not in runtime.UNHOOKED_LAUNCH_PATHS]
  assert unaccounted == []
  # The kernel-creating paths XLA's command buffers use are among the hooked ones.
  for name in (
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx",
    "cuLaunchKernelEx_ptsz",
    "cuLaunchCooperativeKernel",
    "cuGraphAddKernelNode",
    "cuGraphAddKernelNode_v2",
    "cuGraphAddNode",
    "cuGraphAddNode_v2",
    "cuGraphKernelNodeSetParams",
    "cuGraphKernelNodeSetParams_v2",
    "cuGraphExecKernelNodeSetParams",
    "cuGraphExecKernelNodeSetParams_v2",
    "cuGraphNodeSetParams",
    "cuGraphExecNodeSetParams",
  ):
    assert name in hooked or name not in paths, name


def test_left_alone_list_is_not_stale(library):
  for name, reason in runtime.UNHOOKED_LAUNCH_PATHS.items():
    assert len(reason) > 20, name
    assert not hasattr(library, name), f"{name} is hooked but listed as left alone"
