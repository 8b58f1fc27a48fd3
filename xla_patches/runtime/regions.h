// Occupancy regions: per-thread frames opened by jor_region_begin(_on_stream)
// (XLA's region custom calls) and closed by jor_region_end. A launch inside a
// region is capped at the region's blocks per SM unless a kernel rule selects it.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_REGIONS_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_REGIONS_H_

#include <stdint.h>

#include "cuda_types.h"

namespace jor {

// The cap of the innermost open region that applies to a launch on `stream`
// (`known_stream` false for a launch whose stream is not known, such as a graph
// node: only regions opened for every stream apply); 0 outside regions.
int64_t CurrentRegionBlocks(CUstream stream, bool known_stream);

// Opens a region on this thread: for every launch of the thread (`any_stream`)
// or for launches on `stream`. The cap is the plan's entry for `region_id`,
// else `blocks_per_sm` (0: none). Returns the new depth.
int RegionBegin(int64_t region_id, int64_t blocks_per_sm, bool any_stream, CUstream stream);

// Closes the innermost open frame of `region_id`; the new depth, or -1 when
// no region is open.
int RegionEnd(int64_t region_id);

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_REGIONS_H_
