"""FSDP layers under ``lax.scan`` with the next layer's all-gather issued early.

MaxText and similar codebases stack the parameters of their identical layers
(every leaf has a leading layer dimension ``L``) and run the layers with
``lax.scan``. Under fully sharded data parallelism each leaf is also sharded
along a mesh axis, so the loop body all-gathers the layer's parameters before
using them, and the backward pass reduce-scatters the parameter cotangents.
Written naively, each gather sits in the same iteration as the compute that
needs it and each reduce-scatter in the same iteration as the compute that
produces its operand: the latency-hiding scheduler cannot overlap them with
anything, and the collectives serialise with the layer's matmuls.

:func:`scan_layers` software-pipelines that loop:

* forward: iteration ``i`` computes layer ``i`` with parameters gathered in an
  earlier iteration (held in the loop carry) and issues the gather of layer
  ``i + prefetch``, so the gather and layer ``i``'s compute are independent;
* backward (a ``custom_vjp``): the layers are rematerialised in reverse order
  with the same prefetching of gathers, and the full-size parameter cotangent
  of layer ``i`` is carried into the iteration of layer ``i - 1``, which
  issues its reduce-scatter next to its own compute and writes the scattered
  result out.

Memory: at most ``prefetch`` gathered layers live in the carry (plus the one
being computed), and with ``prefetch > 0`` one unscattered layer cotangent in
the backward loop. The forward saves only the input carry of every layer (the
same as ``lax.scan`` over a ``jax.checkpoint``-ed layer with the
``nothing_saveable`` policy); ``remat_policy`` lets the forward save more.

Layout: :mod:`.api` (the entry point), :mod:`.checks` (argument checks), :mod:`.layers`
(the per-device loop and its VJP), :mod:`.pipeline` (the pipelined loop).
"""

from jax_overlap._src.fsdp.api import scan_layers as scan_layers

__all__ = ["scan_layers"]
