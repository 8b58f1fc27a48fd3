"""Stage: simulation. Compute and communication kernels placed on a GPU's SMs, block by
block, under stream priority and occupancy shaping (the public API is ``jax_overlap.sim``).

* ``model`` and ``constants``: kernels, collectives and workloads; each GPU's constants,
  with the source or range of each; ``gemm``: library GEMMs' launch configurations;
* ``collectives``: a collective as NCCL's channels, one CTA each, sharing the link;
* ``engine`` (with ``dispatch_state`` and ``results``): the event loop that places blocks
  and its results; ``steady``: its fast path for the repeated waves of a kernel alone;
* ``policies``: sequential, concurrent, priority, shaping and their mixes, ``simulate`` and
  ``compare``; ``tune``: the search over priority and per-kernel caps; ``plans``: a choice
  as a runtime plan;
* ``workloads``: synthetic workloads; ``realize``: a Report's kernels and collectives as a
  workload, simulated; ``critical_path``: the same sequence without contention, by the
  analysis's rules;
* ``measurements`` and ``calibrate``: measurement records and the fit of the constants
  to them; ``paper``: the paper table and its sensitivity to the assumed constants;
* ``plot`` and ``cli``: SM-occupancy pictures and ``jax-overlap simulate``.

Nothing is imported here: each module is imported by name.
"""
