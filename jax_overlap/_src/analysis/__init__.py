"""Stage: analysis. How a compiled step schedules on its target, and what it costs.

* ``hlo``: reading XLA's scheduled HLO, FLOPs and bytes per instruction;
* ``cost_model`` and ``nccl``: kernel times (roofline) and collective times (alpha-beta,
  NCCL's channel counts);
* ``schedule``: the kernels and collectives in XLA's order, with their costs;
* ``timeline``: that schedule placed on the compute and communication streams;
* ``analyze``: ``analyze`` / ``analyze_compiled`` / ``analyze_hlo``, giving a
  :class:`~.report.Report` (``report``: its tables, JSON, pictures, ``compare``);
* ``latency_profile``: the analysis' costs written for XLA's scheduler (fed back to compile);
* ``profile``: the same metrics measured from a real profiler trace;
* ``calibration``: kernel costs fitted to a step measured on a GPU, stored per GPU and
  jaxlib, used by ``analyze`` for that GPU.

Nothing is imported here: each module is imported by name.
"""
