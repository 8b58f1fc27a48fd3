"""Builds jax_overlap: the Python package and its native libraries.

The runtime library (``libjax_overlap_rt.so``, an LD_PRELOAD launch interposer)
and the XLA FFI handler library (``libjax_overlap_ffi.so``) are compiled with the
system C++ compiler into ``jax_overlap/_lib`` (also under ``pip install -e .``).
Neither needs a CUDA toolkit. The FFI library needs jax's FFI headers; when jax
is not importable at build time (isolated builds) it is skipped here and built
on first use instead (``jax_overlap._src.runtime.library.library_path``). A failed build
never fails the install: the Python side builds on first use and says why if
it cannot. The recipe lives in ``jax_overlap/_lib/__init__.py``; the Bazel
``BUILD`` file lists the same sources.
"""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


def _recipe():
  spec = importlib.util.spec_from_file_location(
    "_jax_overlap_lib", ROOT / "jax_overlap/_lib/__init__.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.LIBRARIES


LIBRARIES = _recipe()


def _ffi_include_dir():
  try:
    import jax.ffi
  except ImportError:
    return None
  return jax.ffi.include_dir()


def _compiler():
  for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if candidate and shutil.which(candidate):
      return candidate
  return None


class BuildNative(build_ext):
  """Compiles the native libraries with the system C++ compiler (no Python extension)."""

  def run(self):
    # Leave out what cannot be built here, so nothing later expects its file.
    keep = []
    for ext in self.extensions:
      name = ext.name.split(".")[-1] + ".so"
      if _compiler() is None:
        self.warn(f"no C++ compiler found: {name} will be built on first use")
      elif LIBRARIES[name]["ffi_headers"] and _ffi_include_dir() is None:
        self.warn(f"jax is not importable at build time: {name} will be built on first use")
      else:
        keep.append(ext)
    self.extensions = keep
    super().run()

  def copy_extensions_to_source(self):
    # A library whose build failed is built on first use instead.
    self.extensions = [e for e in self.extensions if os.path.exists(self.get_ext_fullpath(e.name))]
    super().copy_extensions_to_source()

  def get_outputs(self):
    return [p for p in super().get_outputs() if os.path.exists(p)]

  def get_ext_filename(self, fullname):
    # Plain library names, not Python extension names (no ABI suffix).
    parts = fullname.split(".")
    return os.path.join(*parts[:-1], parts[-1] + ".so")

  def build_extension(self, ext):
    name = ext.name.split(".")[-1] + ".so"
    recipe = LIBRARIES[name]
    inplace = self.inplace or getattr(self, "editable_mode", False)
    out = (
      ROOT / "jax_overlap" / "_lib" / name
      if inplace
      else pathlib.Path(self.get_ext_fullpath(ext.name))
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = _compiler()
    if cxx is None:
      self.warn(f"no C++ compiler found: {name} will be built on first use")
      return
    cmd = [cxx, *recipe["cflags"]]
    if recipe["ffi_headers"]:
      include = _ffi_include_dir()
      if include is None:
        self.warn(f"jax is not importable at build time: {name} will be built on first use")
        return
      cmd += ["-isystem", include]
    cmd += [str(ROOT / s) for s in recipe["sources"]]
    cmd += ["-o", str(out), *recipe["ldflags"]]
    print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      self.warn(f"building {name} failed; it will be built on first use:\n{proc.stderr[-2000:]}")
      if out.exists():
        out.unlink()
    elif inplace and not self.inplace:
      # Editable installs also expect the file at the build location.
      target = pathlib.Path(self.get_ext_fullpath(ext.name))
      if target != out:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, target)


setup(
  ext_modules=[
    Extension(f"jax_overlap._lib.{name[:-3]}", sources=list(recipe["sources"]))
    for name, recipe in LIBRARIES.items()
  ],
  cmdclass={"build_ext": BuildNative},
)
