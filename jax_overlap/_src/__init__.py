"""jax_overlap's implementation, one package per stage of the data flow

  program -> transform -> compile -> analysis -> simulation / plan -> runtime

(the public modules under ``jax_overlap/`` re-export from here; each package's
``__init__`` lists its modules):

* ``transform/``: ``@overlap`` (planning, evaluation, the conversion of GSPMD steps to
  shard_map, the variants, their selection and its on-disk memory); with
  ``collective_matmul/`` (rings and pieces, their cost) and ``fsdp/`` (``scan_layers``);
* ``flags/``: XLA options per GPU and workload, checked against the installed jaxlib;
* ``compile/``: the program moved onto a target's compile-only mesh, compiled (deviceless for
  NVIDIA targets) with XLA's artefacts kept, in memory and on disk;
* ``analysis/``: XLA's scheduled HLO read, costed and placed on streams (``analyze``, the
  Report, latency profiles for XLA's scheduler, measured overlap from traces);
* ``sim/``: the SM-level simulator (constants, policies, tuner, the realization of a Report,
  ``jax-overlap simulate``); ``budget/``: memory, compute and data budgets;
* ``runtime/``: runtime plans and their residency arithmetic, occupancy regions (custom
  calls), the runtime library and ``jax-overlap launch``;
* shared by every stage: ``targets`` (the GPU catalogue, compile-only meshes), ``errors``,
  ``deprecations``, ``cache`` (where files are kept), ``lazy_names``.
"""
