// The plan's decisions: how much dynamic shared memory one launch gets (kernel
// rules, occupancy regions, room for a communication block, the driver's
// occupancy check), and which created streams get the highest priority.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_DECIDE_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_DECIDE_H_

#include <stdint.h>

#include "cuda_types.h"

namespace jor {

enum Decision { kPass, kShape, kFallback };

// Decides the dynamic shared memory of one launch: kShape with *new_dyn set,
// kPass to launch unchanged, kFallback when the driver could not answer.
// `skip` marks launches that must keep their configuration (cooperative,
// clusters); `known_stream` is false for graph nodes. With kShape, *launch_f is
// the function to launch: `f`, or for a context-less kernel handle its function
// in the current context (driver_info.h, Launchable), whose attributes were raised.
Decision Decide(CUfunction f, CUstream stream, bool known_stream, unsigned threads, unsigned dyn,
                bool skip, unsigned* new_dyn, CUfunction* launch_f);

// The index of the next stream the program creates (0, 1, ...).
int64_t NextStreamIndex();

// Whether the plan puts the index-th created stream at the highest priority.
bool PromoteStream(int64_t index, bool requested_priority);

// Creates the stream at the context's highest priority.
CUresult CreatePromoted(CUstream* ph, unsigned flags, int64_t index);

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_DECIDE_H_
