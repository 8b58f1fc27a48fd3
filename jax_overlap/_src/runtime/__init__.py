"""Stage: runtime. Occupancy shaping and stream priority applied at kernel launch.

* ``plan``: runtime plans (kernel and region rules, stream priority), their checks against
  a Report, their JSON and the library's rules text;
* ``residency``: the launch arithmetic the library applies (``xla_patches/runtime/shaping.h``);
* ``regions``: occupancy regions as XLA custom calls around a piece of a program;
* ``library``: building, locating and reading the status of ``libjax_overlap_rt.so``;
* ``launch``: ``jax-overlap launch``, a program run with the library and a plan.

Nothing is imported here, and nothing in ``plan``, ``residency``, ``library`` or ``launch``
imports JAX at module level: the launcher starts without it.
"""
