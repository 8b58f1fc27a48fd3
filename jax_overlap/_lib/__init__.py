"""Native libraries of jax_overlap: where they are built and from what.

``setup.py`` builds them here (``libjax_overlap_rt.so``, ``libjax_overlap_ffi.so``);
when they are missing or older than their sources, :mod:`jax_overlap._src.runtime.library`
builds them on first use into a cache directory. Both read the recipe below, and
a test keeps the top-level Bazel ``BUILD`` file in step with it. Paths are
relative to the repository root.
"""

RUNTIME_LIBRARY = "libjax_overlap_rt.so"
FFI_LIBRARY = "libjax_overlap_ffi.so"

LIBRARIES = {
  RUNTIME_LIBRARY: {
    # LD_PRELOAD launch interposer: occupancy shaping, stream priority, counters.
    "sources": tuple(
      f"xla_patches/runtime/{name}.cc"
      for name in (
        "exports",
        "rules",
        "symbols",
        "driver_info",
        "regions",
        "decide",
        "hooks",
        "procaddr",
        "log",
        "shaping",
        "library_gemms",
      )
    ),
    "headers": tuple(
      f"xla_patches/runtime/{name}.h"
      for name in (
        "cuda_types",
        "decide",
        "dispatch",
        "driver_info",
        "hooks",
        "init",
        "library_gemms",
        "log",
        "regions",
        "rules",
        "shaping",
        "symbols",
      )
    ),
    "cflags": ("-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall"),
    # The C++ runtime linked in: a preloaded library must not pull the system
    # libstdc++ into every child process (it could shadow the program's own).
    "ldflags": ("-shared", "-static-libstdc++", "-static-libgcc", "-ldl", "-lpthread"),
    "ffi_headers": False,
  },
  FFI_LIBRARY: {
    # XLA FFI handlers for occupancy regions (CPU and CUDA platforms).
    "sources": ("xla_patches/regions/regions_ffi.cc",),
    "headers": (),
    "cflags": ("-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall"),
    "ldflags": ("-shared", "-ldl"),
    "ffi_headers": True,
  },
}
