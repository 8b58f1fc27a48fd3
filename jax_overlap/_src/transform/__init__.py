"""``@jax_overlap.overlap``: rewrite a sharded step so collectives interleave with compute.

The decorator traces the step to a jaxpr once per input signature and
re-evaluates it with these changes. All but the collective matmuls keep the
arithmetic exactly as written (operations are reordered and annotated, never
changed); a collective matmul computes the same products in row blocks, equal
up to the order of floating-point accumulation:

1. *Prefetch.* Inside each ``shard_map`` body, each parameter all-gather (a gather
   whose input depends only on the body's parameters) is issued by the cost model's
   time, so that it has arrived when it is first used (:mod:`.prefetch`); the first
   one the compute waits for goes in pieces where its first matmul gains
   (:mod:`.first_pieces`), and a row lookup in a sharded table runs where the rows or
   columns are held instead of gathering the table (:mod:`.embedding`).
2. *Per-layer reduce-scatter.* Each ``psum_scatter`` is issued right after
   the operation that produces its input, so gradient reduce-scatters run
   during the rest of the backward pass instead of piling up at its end.
3. *Separate collectives.* The compile gets XLA combine thresholds no larger
   than one layer's collective, so the combiner cannot merge the gathers of
   several layers into one that nothing can hide.
4. *Collective matmuls.* An activation all-gather feeding a matmul, or a
   matmul feeding a reduce-scatter (tensor and sequence parallelism), becomes
   a ppermute ring interleaved with partial matmuls where the cost model says
   it wins (``jax_overlap.collective_matmul``).
5. *Annotations.* Every collective gets frontend attributes naming the layer
   group it belongs to (``_jax_overlap_pair``), its priority class
   (``_jax_overlap_priority``) and occupancy class (``_jax_overlap_occupancy``);
   the matmuls it should hide under carry the same pair id. They reach the
   compiled HLO (combiners join them with commas), where the analysis and the
   runtime controls read them.
6. *Compiler options.* The target's recommended options (``jax_overlap._src.flags``).

7. *Loops.* In a ``lax.scan`` over layers (and the loops autodiff makes of it),
   gathers of each iteration's layer are issued one iteration early and gradient
   reduce-scatters one iteration late, the first and last iterations outside the loop
   where it has iterations to spare (:mod:`.scan_pipeline`).
8. *Batch parts.* A loop body whose activation collectives run along a dimension
   other than the batch (a tensor-parallel layer's) may run in 2 or 4 parts of its batch,
   one part's collectives beside another part's compute (:mod:`.batch_parts`, its
   evaluator :mod:`.parts`); a matmul or sum over the batch adds the parts' partial
   results, so the values are equal up to the order of those additions.

Programs without explicit collectives (GSPMD inserts them during partitioning)
are compiled as written for the target, and the selection chooses among
compiler options for the collectives found there (:mod:`.gspmd`), and among the
variants of the same step converted to shard_map (:mod:`.to_shard_map`, whose
per-primitive layout rules are in :mod:`.layouts`) and rewritten as above.

Layout: :mod:`.planning` reads the jaxpr and plans each ``shard_map`` body (its
collective matmul sites in :mod:`.matmul_sites`, the jaxpr helpers all share in
:mod:`.jaxprs`),
:mod:`.evaluate` re-evaluates the program with the plan, :mod:`.scan_pipeline`
and :mod:`.gspmd` handle loops and partitioned programs, :mod:`.to_shard_map`
converts a partitioned program to shard_map (aiming for the output layouts
:mod:`.out_layouts` reads from the step's jit), :mod:`.decorator` holds
``overlap``, :mod:`.variants` the variants and the choice among them (sized by :mod:`.stats`; :mod:`.compiles`
compiles them; :mod:`.shared_choice` makes the choice once for all the processes of a
multi-process job), :mod:`.explain` what it reports. :mod:`.pipeline` chains the steps a call runs (resolve, trace,
plan, convert, candidates, select, build), passing the records of :mod:`.records`;
:mod:`.measure` times the best variants on the devices (``select="measure"``)."""

from jax_overlap._src.transform.annotations import priority as priority
from jax_overlap._src.transform.decorator import Overlapped as Overlapped
from jax_overlap._src.transform.decorator import overlap as overlap
from jax_overlap._src.transform.explain import Action as Action
from jax_overlap._src.transform.explain import Explanation as Explanation

__all__ = ["overlap", "Overlapped", "Explanation", "Action", "priority"]
