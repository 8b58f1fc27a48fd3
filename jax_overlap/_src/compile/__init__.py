"""Stage: compile. A user's step compiled for a GPU target, with XLA's artefacts kept.

* ``retarget``: the program moved onto a target's compile-only mesh (argument shardings and
  the meshes captured in its jaxpr);
* ``compiler``: ``compile_for_target`` (deviceless for NVIDIA targets), XLA's dumps read
  back into a :class:`~.compiler.CompiledStep`, the in-process memo of compiles;
* ``dumps``: the dump settings of those compiles, set per compile over ``XLA_FLAGS``'s;
* ``store``: those artefacts on disk, for other processes;
* ``kernel_cache``: XLA's kernel cache shared by the compiles of one selection's variants;
* ``gemm_configs``: the tiles XLA's config assigner chose for their Triton GEMM fusions,
  shared through XLA's per-fusion cache;
* ``ptx``: registers and shared memory of each kernel, from ``ptxas`` on XLA's PTX.

Nothing is imported here: each module is imported by name.
"""
