"""jax_overlap's implementation, by stage of the data flow

  program -> transform -> compile -> analysis -> simulation / plan -> runtime

(the public modules under ``jax_overlap/`` re-export from here):

* program and GPU targets: ``targets`` (the GPU catalogue, compile-only meshes), ``flags``
  (XLA options checked against the installed jaxlib), ``errors``, ``deprecations``;
* transform: ``transform/`` (``@overlap``: planning, evaluation, the conversion of GSPMD
  steps to shard_map, variants and their selection), ``collective_matmul/`` (rings and
  pieces, their cost), ``fsdp/`` (``scan_layers``), ``regions`` (occupancy regions as custom
  calls), ``selection_cache``, ``latency_profile``;
* compile: ``retarget`` (the program moved onto a target's compile-only mesh), ``compile``
  (deviceless compiles with XLA's dumps kept), ``compile_store`` (their artefacts on disk
  for other processes), ``kernel_cache`` (XLA's kernel cache shared by one selection's
  variants), ``ptx`` (registers and shared memory from ``ptxas``);
* analysis: ``hlo`` (reading the scheduled HLO, FLOPs and bytes), ``cost_model`` and
  ``nccl`` (kernel and collective times), ``schedule`` and ``timeline`` (XLA's order on
  streams), ``analysis`` and ``report`` (``analyze`` and its Report), ``profile``
  (measured overlap from a trace);
* simulation and plans: ``sim/`` (the SM-level simulator, its constants, policies, tuner and
  the realization of a Report), ``residency`` (the launch arithmetic the runtime library
  applies), ``plan`` (runtime plans and their checks against a Report), ``budget/`` (memory,
  compute and data budgets);
* runtime: ``runtime`` (building and locating ``libjax_overlap_rt.so``), ``launch``
  (``jax-overlap launch``), ``sim_cli`` (``jax-overlap simulate``), ``cache``.
"""
